"""Smoke test of benchmarks/init_study.py: its --quick CPU run trains every task with every candidate (and the
Marian reference on translation), writes one JSON line per run and a summary with a finite metric in every row; a
second call resumes: it repeats no run and writes the same summary from the work dir."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "init_study.py"
CANDIDATES = ["normal-0.02", "xavier", "scaled-0.4", "scaled-0.6"]
METRICS = {
    "translation": ("exact_match", "validation_loss"),
    "masked-lm": ("mlm_loss", "mlm_accuracy", "probe_accuracy"),
    "image": ("accuracy",),
}


def run(*flags: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *flags], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_quick_run_scores_every_task_and_candidate(tmp_path):
    work_dir, output = tmp_path / "work", tmp_path / "summary.json"
    flags = ["--quick", "--device", "cpu", "--workers", "1", "--work_dir", str(work_dir), "--output", str(output)]
    run(*flags)
    report = json.loads(output.read_text())
    assert report["runs"] == 3 * len(CANDIDATES) + 1
    for task, metrics in METRICS.items():
        rows = report["tasks"][task]["64"]
        assert sorted(rows) == sorted(CANDIDATES + (["marian"] if task == "translation" else []))
        for row in rows.values():
            for metric in metrics:
                assert row[metric]["per_seed"] and all(math.isfinite(v) for v in row[metric]["per_seed"])
                assert math.isfinite(row[metric]["mean"]) and math.isfinite(row[metric]["median"])

    lines = (work_dir / "runs.jsonl").read_text().splitlines()
    output.unlink()
    assert "13 runs done before, 0 to go" in run(*flags)  # a rerun resumes: the summary comes from runs.jsonl
    assert (work_dir / "runs.jsonl").read_text().splitlines() == lines
    assert json.loads(output.read_text())["tasks"] == report["tasks"]
