"""Does bfloat16 training cost BLEU? The Multi30k recipe in bfloat16 and in float32 for the same steps, over seeds.

    python benchmarks/multi30k_bf16_bleu.py DATA_DIR WORK_DIR --seeds 2 3 --jobs 2   # about 1 hour per seed

For each seed, two runs of `training/recipes/multi30k.sh` that differ only in precision: WORK_DIR/bf16-seedN
(bfloat16 autocast) and WORK_DIR/fp32-seedN, each stopped after a fixed number of steps (4,385 by default: what the
recipe made in the time-to-BLEU benchmark's 41.25 training minutes), not minutes, so that the two see the same batches
and dropout draws whatever their speed and the machine's load; a checkpoint every 225 steps, the last 5 averaged where
the validation set prefers them, then test2016 decoded with beam 4, as the recipe ends. `--jobs 2` runs the two runs
of a seed side by side, one core and one thread each. A run whose folder already holds `all_results.json` is not run
again (and an interrupted one resumes, as the recipe does).

Reported: each run's validation BLEU (kept and last weights), test2016 sacreBLEU cased and lowercased, chrF and
training loss; per seed the difference bf16 - fp32 and sacreBLEU's paired approximate-randomization p-value on
test2016 (is that one difference larger than the test set's sampling noise?); over seeds the mean difference and its
standard deviation (training noise: two runs of the same recipe differ by about one BLEU). Written to
benchmarks/results/.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from measure import environment, write_results
from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

REPOSITORY = Path(__file__).resolve().parent.parent
RECIPE = REPOSITORY / "training" / "recipes" / "multi30k.sh"
PRECISION_FLAGS = {"bf16": "--bf16 true --use_cpu true", "fp32": "--bf16 false"}
REPORTED = ("eval_bleu", "eval_bleu_last", "test_bleu", "test_bleu_lowercase", "test_chrf", "train_loss")


def start_recipe(data_dir: Path, out_dir: Path, precision: str, seed: int, steps: int, core: int | None):
    """One run of the recipe at a fixed number of steps; None if a finished run is already in `out_dir`."""
    if (out_dir / "all_results.json").exists():
        print(f"{out_dir} holds a finished run: not run again")
        return None
    fixed_steps = (
        f"--max_steps {steps} --max_train_minutes 100000 --save_every_minutes 100000 --save_steps 225 "
        f"--eval_every_minutes 100000 --seed {seed}"
    )
    env = os.environ | {"EXTRA_ARGS": f"{PRECISION_FLAGS[precision]} {fixed_steps}", "PYTHON": sys.executable}
    command = ["bash", str(RECIPE), str(data_dir), str(out_dir)]
    if core is None:
        return subprocess.Popen(command, env=env)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(command, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def wait_for(running: list[subprocess.Popen]) -> None:
    """Wait for the started runs, in order; stop at the first that failed (its output says why)."""
    while running:
        process = running.pop(0)
        if process.wait() != 0:
            raise SystemExit(f"a recipe run failed (exit {process.returncode}): {' '.join(process.args)}")


def paired_p_value(data_dir: Path, run_dirs: dict[str, Path]) -> float:
    """sacreBLEU's paired approximate randomization on test2016: p-value of bf16's BLEU differing from fp32's."""
    with open(data_dir / "test2016.jsonl") as lines:
        references = [json.loads(line)["translation"]["de"] for line in lines]
    systems = [
        (precision, (run_dirs[precision] / "test_generations.txt").read_text().splitlines())
        for precision in ("fp32", "bf16")  # the first is the baseline
    ]
    _, scores = PairedTest(systems, {"BLEU": BLEU()}, [references], test_type="ar", n_samples=10000)()
    return scores["BLEU"][1].p_value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path, help="Multi30k laid out as ../shared/data/multi30k (the recipe's)")
    parser.add_argument("work_dir", type=Path, help="the runs go to WORK_DIR/bf16-seedN and WORK_DIR/fp32-seedN")
    parser.add_argument("--seeds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--steps", type=int, default=4385, help="training steps of every run")
    parser.add_argument("--jobs", type=int, choices=(1, 2), default=1, help="2: a seed's two runs side by side")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()
    data_dir = args.data_dir.resolve()

    runs: dict[int, dict[str, Path]] = {}
    running: list[subprocess.Popen] = []
    for seed in args.seeds:
        runs[seed] = {precision: args.work_dir / f"{precision}-seed{seed}" for precision in PRECISION_FLAGS}
        for core, (precision, run_dir) in enumerate(runs[seed].items()):
            process = start_recipe(data_dir, run_dir, precision, seed, args.steps, core if args.jobs == 2 else None)
            if process is not None:
                running.append(process)
            if args.jobs == 1:
                wait_for(running)
        wait_for(running)

    threads_per_run = 1 if args.jobs == 2 else torch.get_num_threads()
    summary: dict = {"steps": args.steps, "jobs": args.jobs, "threads_per_run": threads_per_run, "seeds": {}}
    differences: dict[str, list[float]] = {name: [] for name in REPORTED}
    for seed, run_dirs in runs.items():
        results = {p: json.loads((d / "all_results.json").read_text()) for p, d in run_dirs.items()}
        seed_summary = {p: {name: results[p][name] for name in REPORTED} for p in run_dirs}
        for name in REPORTED:
            differences[name].append(results["bf16"][name] - results["fp32"][name])
        seed_summary["bf16_minus_fp32"] = {name: differences[name][-1] for name in REPORTED}
        seed_summary["test_bleu_paired_ar_p_value"] = paired_p_value(data_dir, run_dirs)
        summary["seeds"][seed] = seed_summary
        print(
            f"seed {seed}: "
            + ", ".join(f"{name} {results['bf16'][name]:.2f} / {results['fp32'][name]:.2f}" for name in REPORTED)
            + " (bf16 / fp32)"
        )
    summary["mean_bf16_minus_fp32"] = {name: statistics.mean(values) for name, values in differences.items()}
    if len(runs) > 1:
        summary["stdev_bf16_minus_fp32"] = {name: statistics.stdev(values) for name, values in differences.items()}
    write_results(
        {"environment": environment(torch.device("cpu")), "multi30k_bf16_against_fp32": summary},
        args.output,
        "multi30k-bf16-bleu",
    )
    print(json.dumps({key: summary[key] for key in summary if key.startswith(("mean", "stdev"))}, indent=2))


if __name__ == "__main__":
    main()
