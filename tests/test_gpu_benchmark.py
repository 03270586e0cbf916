"""Smoke test of benchmarks/gpu_benchmark.py: its --quick CPU run exercises every section (training eager and
compiled, generate with dynamic and compiled static caches, the MoE experts functions, the recipe's model) and
writes JSON with every section measured. The default layout feeds our model the flattened padded batch of
`DataCollatorForSeq2SeqWithFlattening`."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("peak_matmul_flops", "training", "decoding", "moe", "multi30k_recipe", "targets")


def numbers(value):
    """Every number in a JSON value (None marks a check that does not apply)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return
    if isinstance(value, (int, float)):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from numbers(item)
    else:
        for item in value:
            yield from numbers(item)


def test_quick_run_measures_every_section(tmp_path):
    output = tmp_path / "gpu.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "gpu_benchmark.py"),
        "--quick",
        "--cpu",
        "--output",
        str(output),
    ]
    # The script runs from benchmarks/: the checkout's package must win over an installed one.
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads(output.read_text())
    assert all(section in results for section in SECTIONS)
    errors = {name: value["error"] for name, value in results.items() if isinstance(value, dict) and "error" in value}
    assert not errors
    assert all(math.isfinite(number) for number in numbers(results))
    padded = [row for row in results["training"] if row["rows"] == "padded"]
    assert {row["mode"] for row in padded} == {"eager", "compiled"}
    assert all(row["collator_cpu_seconds_per_batch"]["marian"] > 0 for row in padded)
    # Ours has a collator of its own, and a flattened batch checked against the padded one.
    assert padded[0]["collator_cpu_seconds_per_batch"]["ours"] > 0
    assert padded[0]["check"]["ours_flattened_vs_padded_abs_diff"] < 1e-4
    assert {(row["cache"], row["num_beams"]) for row in results["decoding"]} == {
        (cache, beams) for cache in ("dynamic", "static_compiled") for beams in (1, 4)
    }
    assert all(row["compiled"]["ours"] for row in results["decoding"] if row["cache"] == "static_compiled")
    implementations = results["moe"]["implementations"]
    assert {"sorted_grouped_mm", "grouped_mm", "eager", "batched_mm"} <= set(implementations)
    assert results["multi30k_recipe"]["steps_per_s"] > 0
    assert len(results["targets"]) == 7
