"""Time to BLEU on Multi30k English -> German: the recipe with our model and with HF `MarianMTModel`, side by side.

    python benchmarks/multi30k_time_to_bleu.py DATA_DIR WORK_DIR    # two recipe runs: about 45 + 60 minutes

Does our model reach Marian's BLEU in at most 3/4 of Marian's time? Runs `training/recipes/multi30k.sh` twice on
this machine, one leg after the other: WORK_DIR/ours, the recipe as it is but with `--time_fraction` (0.75) of the
training minutes Marian gets; then WORK_DIR/marian, an untrained `MarianMTModel` with the recipe's dimensions
(transformers' own initialisation) and our leg's tokenizer, trained by the same script with the same flags, data,
precision and the whole budget (`INIT_MODEL`). Each leg ends as the recipe does (the last checkpoints averaged where
the validation set prefers them), so the two final scores mean the same thing; the scores during training are of the
last weights, before any averaging. A leg whose folder already holds `all_results.json` is not run again. Both train
with the paper's schedule and decode with beam 4 and length penalty 0.6 (ours GNMT's lp(Y), Marian transformers'
|Y|^0.6). Then: both validation-BLEU-against-training-minutes curves in one plot, the final validation and test2016
BLEU of both, and whether ours, in its share of the time, reached Marian's final validation BLEU; written to
benchmarks/results/.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: the plot only goes to a file
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from marian_twin import marian_config  # noqa: E402
from measure import environment, write_results  # noqa: E402
from transformers import AutoTokenizer, MarianMTModel  # noqa: E402

from hf_vanilla_transformer import VanillaTransformerConfig  # noqa: E402

REPOSITORY = Path(__file__).resolve().parent.parent
RECIPE = REPOSITORY / "training" / "recipes" / "multi30k.sh"
LEGS = ("ours", "marian")


def run_recipe(
    data_dir: Path, out_dir: Path, budget_minutes: float, train_minutes: float, init_model: Path | None = None
) -> None:
    """One leg: the recipe into `out_dir`, unless a finished run is already there."""
    if (out_dir / "all_results.json").exists():
        print(f"{out_dir} holds a finished run: not run again")
        return
    env = os.environ | {
        "BUDGET_MINUTES": str(budget_minutes),
        "TRAIN_MINUTES": str(train_minutes),
        "PYTHON": sys.executable,
    }
    if init_model is not None:
        env["INIT_MODEL"] = str(init_model)
    subprocess.run(["bash", str(RECIPE), str(data_dir), str(out_dir)], env=env, check=True)


def save_untrained_marian(ours_dir: Path, init_dir: Path, seed: int = 1) -> None:
    """Marian with our leg's dimensions, dropout and special token ids, and our leg's tokenizer beside it."""
    torch.manual_seed(seed)
    config = marian_config(VanillaTransformerConfig.from_pretrained(ours_dir))
    MarianMTModel(config).save_pretrained(init_dir)
    AutoTokenizer.from_pretrained(ours_dir).save_pretrained(init_dir)


def bleu_curve(run_dir: Path) -> list[tuple[float, float]]:
    """(training minutes, validation BLEU) of the evaluations during training, then of the weights the run kept."""
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    results = json.loads((run_dir / "all_results.json").read_text())
    points = [(entry["train_minutes"], entry["eval_bleu"]) for entry in history if "eval_bleu" in entry]
    return points + [(results["train_minutes"], results["eval_bleu"])]


def plot_curves(curves: dict[str, list[tuple[float, float]]], tests: dict[str, float], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(6.5, 4))
    for index, (leg, curve) in enumerate(curves.items()):
        label = {"ours": "hf_vanilla_transformer", "marian": "HF MarianMTModel"}[leg]
        axis.plot(*zip(*curve), "o-", color=f"C{index}", label=f"{label} (test2016 {tests[leg]:.1f})")
        axis.plot(*curve[-1], "*", color=f"C{index}", markersize=14)  # the weights the run kept (averaged or last)
    axis.set_xlabel("training minutes (star: the weights each run kept)")
    axis.set_ylabel("validation sacreBLEU (cased)")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data_dir", type=Path, help="Multi30k laid out as ../shared/data/multi30k (the recipe's)")
    parser.add_argument("work_dir", type=Path, help="the two runs go to WORK_DIR/ours and WORK_DIR/marian")
    parser.add_argument("--budget_minutes", type=float, default=60, help="Marian's whole recipe budget")
    parser.add_argument("--time_fraction", type=float, default=0.75, help="our share of Marian's training minutes")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()

    # The recipe leaves 5 minutes of its budget to everything but training (see the recipe).
    marian_train_minutes = args.budget_minutes - 5
    our_train_minutes = args.time_fraction * marian_train_minutes
    run_recipe(args.data_dir, args.work_dir / "ours", our_train_minutes + 5, our_train_minutes)
    init_dir = args.work_dir / "marian-init"
    if not (args.work_dir / "marian" / "all_results.json").exists():
        save_untrained_marian(args.work_dir / "ours", init_dir)
    run_recipe(args.data_dir, args.work_dir / "marian", args.budget_minutes, marian_train_minutes, init_dir)

    curves = {leg: bleu_curve(args.work_dir / leg) for leg in LEGS}
    results = {leg: json.loads((args.work_dir / leg / "all_results.json").read_text()) for leg in LEGS}
    summary = {
        leg: {
            "validation_curve": curves[leg],
            **{name: results[leg][name] for name in ("eval_bleu", "test_bleu", "test_bleu_lowercase", "train_minutes")},
        }
        for leg in LEGS
    }
    (our_minutes, our_bleu), (marian_minutes, marian_bleu) = curves["ours"][-1], curves["marian"][-1]
    summary["ours_in_a_share_of_marians_time"] = {
        "time_ratio": our_minutes / marian_minutes,
        "our_final_validation_bleu": our_bleu,
        "marian_final_validation_bleu": marian_bleu,
        "reached": our_bleu >= marian_bleu,
    }
    plot_path = Path(__file__).parent / "results" / "multi30k-time-to-bleu.png"
    plot_curves(curves, {leg: results[leg]["test_bleu"] for leg in LEGS}, plot_path)
    write_results(
        {"environment": environment(torch.device("cpu")), "multi30k_time_to_bleu": summary},
        args.output,
        "multi30k-time-to-bleu",
    )
    print(json.dumps(summary["ours_in_a_share_of_marians_time"], indent=2), f"\nplot: {plot_path}")


if __name__ == "__main__":
    main()
