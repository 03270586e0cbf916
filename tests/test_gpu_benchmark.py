"""Smoke test of benchmarks/gpu_benchmark.py: its --quick CPU run exercises every section (both models in the
Seq2SeqTrainer with their collators, one training step at a token budget in both layouts, full rows compiled,
greedy generate with the dynamic cache and a compiled static one, the MoE experts functions, the recipe's model) and
writes JSON with every section measured; --sections runs only the sections named."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("trainer", "training_step", "decoding", "full_rows_compiled", "moe", "multi30k_recipe")


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


def quick_run(tmp_path: Path, *arguments: str) -> dict:
    """The benchmark's --quick CPU run with `arguments`: its JSON, after checking it exited cleanly."""
    output = tmp_path / "gpu.json"
    script = ROOT / "benchmarks" / "gpu_benchmark.py"
    command = [sys.executable, str(script), "--quick", "--cpu", "--output", str(output), *arguments]
    # The script runs from benchmarks/: the checkout's package must win over an installed one.
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(output.read_text())


def test_quick_run_measures_every_section(tmp_path):
    results = quick_run(tmp_path)
    assert results["sections"] == list(SECTIONS)
    assert all(section in results for section in ("peak_matmul_flops", *SECTIONS, "targets"))
    errors = {name: value["error"] for name, value in results.items() if isinstance(value, dict) and "error" in value}
    assert not errors
    assert all(math.isfinite(number) for number in numbers(results))
    assert {"varlen_attn_signature", "varlen_kernel_runs_cuda_bf16"} <= set(results["environment"])

    trainer = results["trainer"]
    assert trainer["ours_layout"] == "flattened"  # the training scripts' choice on a CPU
    assert trainer["check"]["ours_layout_abs_diff"] < 1e-4
    assert set(trainer["sampling"]) == {"random", "group_by_length"}
    for row in trainer["sampling"].values():
        assert row["ours"]["optimizer"] == row["marian"]["optimizer"] == "adamw_torch_fused"
        # The same batches from the same weights: the Trainer's losses agree (dropout differs between the models).
        assert abs(row["ours"]["train_loss"] - row["marian"]["train_loss"]) < 0.1

    step = results["training_step"]
    assert set(step["candidates"]) == {"ours_flattened", "ours_padded", "ours_rows", "marian"}
    assert step["check"]["ours_layout_abs_diff"] < 1e-4  # flattened against padded
    assert step["check"]["ours_rows_loss_abs_diff"] < 1e-4 and step["check"]["ours_gradient_relative_difference"] < 1e-2
    assert 0 < step["padding_fraction"] < 1

    assert results["decoding"]["static_compiled"] and results["decoding"]["static_same_tokens_as_eager"]
    implementations = results["moe"]["implementations"]
    assert {"sorted_grouped_mm", "grouped_mm", "eager", "batched_mm"} <= set(implementations)
    assert len(results["targets"]) == 6


def test_sections_runs_only_those_named(tmp_path):
    results = quick_run(tmp_path, "--sections", "decoding,moe")
    assert results["sections"] == ["decoding", "moe"]
    assert {"decoding", "moe"} <= set(results)
    skipped = set(SECTIONS) - {"decoding", "moe"}
    assert not skipped & set(results)
    assert [target["name"].startswith("decode") for target in results["targets"]] == [True, True]
