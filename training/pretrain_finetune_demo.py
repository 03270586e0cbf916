"""What pretraining buys, measured: pretrain on unlabelled text, then train a classifier on a small labelled set in
three ways, over several seeds, for both routes of the Transformer's successors: on the frozen pretrained stack's
features (feature-based transfer, as ELMo: only the classifier layer learns), fine-tuning the whole pretrained
network (as GPT and BERT), and from scratch.

- GPT route: a causal LM (train_causal_lm.py) -> a classifier on its causal decoder, pooling the last token;
- BERT route: a masked LM (train_masked_lm.py) -> a classifier on its bidirectional encoder, mean-pooled.

The data is the built-in topic language (demo_text_data.py): labels are sentence topics, which the unlabelled text
reveals through which words occur together, while the few labelled sentences show each word about once. Writes the
table (mean ± std over seeds) and the learning curves into a model card (README.md + PNG).

    python training/pretrain_finetune_demo.py --output_dir out/pretrain-finetune-demo \
        --card_dir model_cards/pretrain-finetune-demo
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import train_causal_lm
import train_classifier
import train_masked_lm
from demo_text_data import TOPICS, WORDS_PER_TOPIC, TopicLanguage, unlabelled_text, word_tokenizer
from run_common import plt

# One small model for every run: pretrained and from-scratch classifiers differ only in their initial weights.
# Xavier init: at d_model 64 the default N(0, 0.02) stalled the causal LM's pretraining (its loss flat at 4.42 from
# step 250 of 600), which left GPT fine-tuning below training from scratch.
MODEL_OVERRIDES = (
    "d_model=64,encoder_layers=2,decoder_layers=2,encoder_ffn_dim=256,decoder_ffn_dim=256,dropout=0.1,"
    "encoder_attention_heads=4,decoder_attention_heads=4,initialization=xavier"
)
ROUTES = {  # route -> (pretraining script, its block/length flag, the classifier's stack when built from scratch)
    "gpt": (train_causal_lm, "--block_size", "decoder"),
    "bert": (train_masked_lm, "--max_seq_length", "encoder"),
}
# The demo's own folders: a run of the demo with other settings replaces the runs of the last one.
COMMON_FLAGS = ["--report_to", "none", "--save_strategy", "no", "--overwrite_output_dir", "true"]
# How each classifier starts: from the pretrained checkpoint with its stack frozen, or fine-tuning all of it, or anew.
INITS = {"frozen": ("pretrained", True), "fine-tuned": ("pretrained", False), "scratch": (None, False)}
COLUMN_TITLES = {"frozen": "Frozen features", "fine-tuned": "Full fine-tuning", "scratch": "From scratch"}


def write_shared_inputs(output_dir: Path, pretrain_size: int) -> tuple[Path, Path]:
    """The unlabelled text as a JSON-lines file and the word-level tokenizer, both routes' inputs."""
    text_file = output_dir / "unlabelled.jsonl"
    unlabelled_text(pretrain_size, 1)["train"].to_json(text_file)
    tokenizer_dir = output_dir / "tokenizer"
    word_tokenizer().save_pretrained(tokenizer_dir)
    return text_file, tokenizer_dir


def pretrain(route: str, text_file: Path, tokenizer_dir: Path, output_dir: Path, steps: int) -> Path:
    script, length_flag, _ = ROUTES[route]
    out = output_dir / f"{route}-pretrained"
    script.main(
        [
            "--output_dir", str(out), "--train_file", str(text_file), "--tokenizer_name", str(tokenizer_dir),
            "--preset", "demo-small", "--config_overrides", MODEL_OVERRIDES, length_flag, "32",
            "--do_train", "--max_steps", str(steps), "--per_device_train_batch_size", "64",
            "--learning_rate", "1.0", "--warmup_steps", str(max(steps // 5, 1)), "--logging_steps", "50",
            "--seed", "0", *COMMON_FLAGS,
        ]
    )  # fmt: skip
    return out


def fine_tune(
    route: str, init: str, checkpoint: Path, tokenizer_dir: Path, output_dir: Path, seed: int, args: argparse.Namespace
) -> dict:
    """One classifier run of initialisation `init` (see INITS); returns its final metrics and its learning curve
    [(step, eval accuracy)]."""
    steps = args.finetune_steps
    start, frozen = INITS[init]
    out = output_dir / f"{route}-{init}-seed{seed}"
    source = ["--model_name_or_path", str(checkpoint)] if start else [
        "--tokenizer_name", str(tokenizer_dir), "--preset", "demo-small", "--config_overrides", MODEL_OVERRIDES,
        "--stack", ROUTES[route][2],
    ]  # fmt: skip
    # A linear layer alone on fixed features takes a larger step than a whole network (linear probing).
    source += ["--freeze_base_model", "--learning_rate", str(args.frozen_learning_rate)] if frozen else [
        "--learning_rate", str(args.learning_rate)]  # fmt: skip
    metrics = train_classifier.main(
        [
            *source, "--output_dir", str(out), "--do_train", "--do_eval", "--max_steps", str(steps),
            "--per_device_train_batch_size", "16", "--eval_strategy", "steps",
            "--eval_steps", str(max(steps // 10, 1)), "--logging_steps", str(max(steps // 10, 1)),
            "--demo_train_size", str(args.labelled_size), "--demo_validation_size", str(args.validation_size),
            "--seed", str(seed), *COMMON_FLAGS,
        ]
    )  # fmt: skip
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    curve = [(0, 1 / TOPICS)] + [(e["step"], e["eval_accuracy"]) for e in history if "eval_accuracy" in e]
    return {"accuracy": metrics["eval_accuracy"], "macro_f1": metrics["eval_macro_f1"], "curve": curve}


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def plot_learning_curves(runs: dict[tuple[str, str], list[dict]], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(7, 4.5))
    routes = list(dict.fromkeys(route for route, _ in runs))
    styles = {"frozen": ":", "fine-tuned": "-", "scratch": "--"}
    for (route, init), results in runs.items():
        steps = [step for step, _ in results[0]["curve"]]
        curves = [[accuracy for _, accuracy in result["curve"]] for result in results]
        means = [statistics.mean(column) for column in zip(*curves)]
        spread = [statistics.pstdev(column) for column in zip(*curves)]
        color = f"C{routes.index(route)}"
        axis.plot(steps, means, styles[init], color=color, label=f"{route.upper()} route, {init}")
        axis.fill_between(steps, [m - s for m, s in zip(means, spread)], [m + s for m, s in zip(means, spread)],
                          color=color, alpha=0.15)  # fmt: skip
    axis.axhline(1 / TOPICS, color="grey", linewidth=0.8, linestyle=":", label="chance")
    axis.set_xlabel("fine-tuning step")
    axis.set_ylabel("validation accuracy")
    axis.set_ylim(0, 1.02)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def results_table(runs: dict[tuple[str, str], list[dict]], metric: str) -> str:
    """One row per route, one column per initialisation (INITS): mean ± std of `metric` over seeds."""
    routes = list(dict.fromkeys(route for route, _ in runs))
    inits = [init for init in INITS if any(key[1] == init for key in runs)]
    header = "| Route | " + " | ".join(COLUMN_TITLES[init] for init in inits) + " |\n|---|" + "---|" * len(inits)
    rows = [
        f"| {route.upper()} | " + " | ".join(mean_std([r[metric] for r in runs[route, init]]) for init in inits) + " |"
        for route in routes
    ]
    return "\n".join([header, *rows])


def card_text(runs: dict[tuple[str, str], list[dict]], settings: dict, plot_name: str, seconds: float) -> str:
    language = TopicLanguage.build()
    return f"""---
library_name: transformers
license: apache-2.0
tags:
- vanilla-transformer
- pretraining
- fine-tuning
---

# Pretrain → fine-tune demo (GPT route and BERT route)

What pretraining on unlabelled text buys a classifier trained on {settings["labelled"]} labelled sentences, used in
two ways: as fixed features for a classifier layer (the pretrained stack frozen, feature-based transfer as ELMo), or
as the starting point of fine-tuning the whole network (GPT, BERT); against the same classifier trained from scratch
({settings["seeds"]} seeds each; mean ± standard deviation; validation set of {settings["validation"]} sentences;
chance = {1 / TOPICS:.2f}).

Accuracy:

{results_table(runs, "accuracy")}

Macro-F1:

{results_table(runs, "macro_f1")}

![Learning curves]({plot_name})

Learning curves: validation accuracy during fine-tuning, mean over seeds with ± one standard deviation shaded.

## Setup

- **Data** (`training/demo_text_data.py`): a synthetic language of {TOPICS} hidden topics with {WORDS_PER_TOPIC}
  made-up content words each, plus {len(language.vocabulary()) - TOPICS * WORDS_PER_TOPIC - 5} function words shared by
  all topics. A sentence ({language.min_length}-{language.max_length} words) is about one topic: its content words
  come from that topic, except {language.off_topic_rate:.0%} drawn from any topic, and
  {language.function_word_rate:.0%} of its words are function words. The label is the topic.
- **Why the comparison is meaningful:** {settings["labelled"]} labelled sentences show each content word about once,
  so a classifier trained from scratch cannot know the topic of most words it meets in a new sentence. The
  {settings["pretrain_size"]:,} unlabelled sentences show which words occur together, which is the topic structure: a
  language model has to learn it to predict a masked or next word.
- **Model** (every run): `{MODEL_OVERRIDES}` on the `demo-small` preset, word-level tokenizer.
- **Pretraining** ({settings["pretrain_steps"]} steps, batch 64, Noam schedule): GPT route
  `training/train_causal_lm.py` (blocks of 32 tokens), BERT route `training/train_masked_lm.py` (15 % of tokens
  masked).
- **Classifier training** (`training/train_classifier.py`, {settings["finetune_steps"]} steps, batch 16, AdamW
  constant rate: {settings["learning_rate"]:g} fine-tuning and from scratch, {settings["frozen_learning_rate"]:g} for
  the classifier layer alone on frozen features, `--freeze_base_model`): GPT route a classifier on the causal
  decoder reading the last real token (from the causal-LM checkpoint, or a new decoder); BERT route a classifier on
  the bidirectional encoder, mean-pooled (from the masked-LM checkpoint, or a new encoder). Frozen, the checkpoint's
  stack leaves training bit for bit unchanged. Seeds change the classifier layer's initialisation (and the whole
  model's from scratch), dropout and the batch order; the labelled set is the same.

Reproduce (about {seconds / 60:.0f} minutes on this machine, 1 thread):

```bash
bash training/run_pretrain_finetune_demo.sh
```
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="out/pretrain-finetune-demo", help="Checkpoints of every run.")
    parser.add_argument("--card_dir", default="model_cards/pretrain-finetune-demo", help="Where the card goes.")
    parser.add_argument("--seeds", type=int, default=3, help="Fine-tuning runs per route and initialisation.")
    parser.add_argument("--pretrain_size", type=int, default=20000, help="Unlabelled sentences.")
    parser.add_argument("--pretrain_steps", type=int, default=600, help="Pretraining steps of each language model.")
    parser.add_argument("--finetune_steps", type=int, default=100, help="Fine-tuning steps of each classifier.")
    parser.add_argument("--learning_rate", type=float, default=5e-4, help="Fine-tuning and from-scratch rate.")
    parser.add_argument(
        "--frozen_learning_rate", type=float, default=5e-3, help="Rate of the classifier layer on frozen features."
    )
    parser.add_argument("--labelled_size", type=int, default=48, help="Labelled training sentences.")
    parser.add_argument("--validation_size", type=int, default=400, help="Labelled validation sentences.")
    parser.add_argument("--routes", nargs="+", choices=list(ROUTES), default=list(ROUTES), help="Routes to run.")
    args = parser.parse_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds must be at least 1, got {args.seeds}")
    started = time.time()
    output_dir, card_dir = Path(args.output_dir), Path(args.card_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    card_dir.mkdir(parents=True, exist_ok=True)
    text_file, tokenizer_dir = write_shared_inputs(output_dir, args.pretrain_size)

    runs: dict[tuple[str, str], list[dict]] = {}
    for route in args.routes:
        checkpoint = pretrain(route, text_file, tokenizer_dir, output_dir, args.pretrain_steps)
        for init in INITS:
            runs[route, init] = [
                fine_tune(route, init, checkpoint, tokenizer_dir, output_dir, seed, args) for seed in range(args.seeds)
            ]
    plot_learning_curves(runs, card_dir / "learning_curves.png")
    settings = dict(
        labelled=args.labelled_size,
        validation=args.validation_size,
        seeds=args.seeds,
        pretrain_size=args.pretrain_size,
        pretrain_steps=args.pretrain_steps,
        finetune_steps=args.finetune_steps,
        learning_rate=args.learning_rate,
        frozen_learning_rate=args.frozen_learning_rate,
    )
    (card_dir / "README.md").write_text(card_text(runs, settings, "learning_curves.png", time.time() - started))
    summary = {f"{route}/{init}": [r["accuracy"] for r in results] for (route, init), results in runs.items()}
    (output_dir / "results.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
