"""A table of finished Multi30k recipe runs (training/recipes/multi30k.sh): per run, its steps and training minutes,
validation BLEU at every evaluation during training, the validation BLEU of the weights kept (last or averaged), and
test2016 sacreBLEU (cased, lowercased) and chrF. Choices are made on the `eval_*` columns only.

    python benchmarks/multi30k_runs.py OUT_DIR [OUT_DIR ...] [--output runs.json]
"""

import argparse
import json
from pathlib import Path


def summary(run_dir: Path) -> dict:
    row: dict = {"run": run_dir.name}
    state_file = run_dir / "trainer_state.json"
    if state_file.exists():
        history = json.loads(state_file.read_text())["log_history"]
        row["validation_bleu_during_training"] = [
            {"step": entry["step"], "minutes": entry.get("train_minutes"), "bleu": round(entry["eval_bleu"], 2)}
            for entry in history
            if "eval_bleu" in entry
        ]
    results_file = run_dir / "all_results.json"
    if results_file.exists():
        results = json.loads(results_file.read_text())
        keys = ("train_steps", "train_minutes", "eval_bleu", "test_bleu", "test_bleu_lowercase", "test_chrf")
        row |= {key: results[key] for key in keys if key in results}
        row["global_step"] = json.loads(state_file.read_text()).get("global_step") if state_file.exists() else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", type=Path, nargs="+")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    rows = [summary(run_dir) for run_dir in args.run_dirs]
    for row in rows:
        during = " ".join(f"{e['bleu']}@{e['step']}" for e in row.get("validation_bleu_during_training", []))
        finals = {k: round(v, 2) for k, v in row.items() if isinstance(v, float)}
        print(f"{row['run']}: steps {row.get('global_step')} {finals} during: {during}")
    if args.output:
        args.output.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
