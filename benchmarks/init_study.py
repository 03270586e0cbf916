"""Which weight initialization learns best: `initialization="xavier"` (Xavier-uniform linears, N(0, 1/d_model)
embeddings: torch's nn.Transformer, fairseq) against `"normal"` (N(0, 0.02) everywhere: BERT, GPT-2, Marian, Llama).
The paper fixes neither.

Each run is `training/train_seq2seq.py` with the demo's settings (demo-small, 600 steps, batch 64, warm-up 200, a
1000-token BPE), one per task, initialization and seed, scored on 500 held-out sentences with beam 4: exact match
(the share of outputs equal to the reference), sacreBLEU and the validation loss. Two tasks of the built-in data:
English -> German number sentences (the demo) and the reverse direction, German -> English, whose compound numbers
("dreihundertzweiundvierzig") must be parsed rather than spelled. Runs go `--workers` at a time, one thread each.

    python benchmarks/init_study.py --work_dir /tmp/init_study   # 20 runs, ~25 minutes on 2 cores
"""

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from measure import environment

ROOT = Path(__file__).parents[1]
TASKS = {"en-de": ("en", "de"), "de-en": ("de", "en")}
DEMO_ARGS = (
    "--preset demo-small --do_train --do_eval --max_steps 600 --per_device_train_batch_size 64 --warmup_steps 200 "
    "--tokenizer_vocab_size 1000 --max_eval_samples 500 --per_device_eval_batch_size 50 --logging_steps 100 "
    "--save_steps 1000000 --report_to none --disable_tqdm true"
).split()
METRICS = ("eval_exact_match", "eval_bleu", "eval_loss")


def train(work_dir: Path, task: str, initialization: str, seed: int) -> dict[str, float]:
    output_dir = work_dir / f"{task}-{initialization}-seed{seed}"
    results_file = output_dir / "all_results.json"
    if not results_file.exists():  # a finished run is kept: an interrupted study resumes
        source, target = TASKS[task]
        command = [sys.executable, str(ROOT / "training" / "train_seq2seq.py"), "--output_dir", str(output_dir)]
        command += [*DEMO_ARGS, "--seed", str(seed), "--source_lang", source, "--target_lang", target]
        command += ["--config_overrides", f"initialization={initialization}"]
        log = (work_dir / f"{output_dir.name}.log").open("w")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
        subprocess.run(command, check=True, stdout=log, stderr=subprocess.STDOUT, env=env)
    results = json.loads(results_file.read_text())
    return {name: results[name] for name in METRICS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--initializations", nargs="+", default=["xavier", "normal"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "init-study.json")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)

    runs = list(itertools.product(args.tasks, args.seeds, args.initializations))
    with ThreadPoolExecutor(args.workers) as pool:
        scores = list(pool.map(lambda run: train(args.work_dir, run[0], run[2], run[1]), runs))
    by_run = {run: score for run, score in zip(runs, scores)}

    report = {
        "environment": environment(torch.device("cpu")),
        "threads_per_run": 1,
        "settings": " ".join(DEMO_ARGS),
        "seeds": args.seeds,
        "tasks": {},
    }
    for task in args.tasks:
        rows = {}
        for initialization in args.initializations:
            per_seed = [by_run[task, seed, initialization] for seed in args.seeds]
            rows[initialization] = {
                **{f"median_{name}": statistics.median(s[name] for s in per_seed) for name in METRICS},
                "per_seed": per_seed,
            }
            print(
                f"{task} {initialization:<7} exact match "
                + " ".join(f"{s['eval_exact_match']:5.1f}" for s in per_seed)
                + f"  median {rows[initialization]['median_eval_exact_match']:5.1f}"
                + f"  BLEU median {rows[initialization]['median_eval_bleu']:5.2f}"
                + f"  loss median {rows[initialization]['median_eval_loss']:.3f}"
            )
        report["tasks"][task] = rows
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
