"""Image classification on scikit-learn's handwritten digits, side by side in one run (issue 21):

- ours: `VanillaTransformerForImageClassification` as `training/train_image_classifier.py` builds it (ViT's pre-norm
  and GELU, mean pooling, the package's init);
- ours, ViT's function: the same class converted (`convert_vit_to_vanilla_transformer`) from the initial weights of
  the HF ViT below, so both start from the same network and differ only in their code;
- HF ViT: transformers' `ViTForImageClassification` of the same size ([class] token, its own init);
- SVM: scikit-learn's RBF support-vector classifier on the raw 64 pixels, the classical reference (its digits
  example), on the same test images.

Each transformer trains with the same flags of `training/train_image_classifier.py` (same data, augmentation,
optimizer, schedule and steps); runs alternate between the models seed by seed, so that a shared machine's drifts hit
all alike. Reported: test accuracy and macro-F1 (mean and spread over seeds), training time per run, and a paired
A/B timing of one training step (forward, backward, AdamW) of ours against HF ViT with equal weights.

    OMP_NUM_THREADS=1 python benchmarks/image_classification.py --seeds 3
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from measure import environment, time_alternating, write_results
from sklearn.svm import SVC
from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import train_image_classifier  # noqa: E402
from demo_image_data import MAX_GREY_LEVEL, digits_split  # noqa: E402
from train_classifier import classification_metrics, confusion_matrix  # noqa: E402

from hf_vanilla_transformer import convert_vit_to_vanilla_transformer  # noqa: E402

# The training script's demo model, in ViT's names.
SIZE = train_image_classifier.DEMO_IMAGE_MODEL
VIT_SIZE = dict(
    hidden_size=SIZE["d_model"],
    num_hidden_layers=SIZE["encoder_layers"],
    num_attention_heads=SIZE["encoder_attention_heads"],
    intermediate_size=SIZE["encoder_ffn_dim"],
    hidden_dropout_prob=SIZE["dropout"],
    image_size=SIZE["image_size"],
    patch_size=SIZE["patch_size"],
    layer_norm_eps=1e-5,  # ours by default (ViT: 1e-12); the same function either way
)
LABELS = dict(id2label={i: str(i) for i in range(10)}, label2id={str(i): i for i in range(10)})
MODELS = ("ours", "ours (ViT converted)", "HF ViT")


def recipe_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--do_train", "--do_eval", "--max_steps", str(args.max_steps), "--per_device_train_batch_size", "64",
        "--per_device_eval_batch_size", "120", "--learning_rate", str(args.learning_rate), "--lr_scheduler_type",
        "cosine", "--warmup_steps", "0.05", "--weight_decay", "0.05", "--logging_steps", "100", "--save_strategy",
        "no", "--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false",
    ]  # fmt: skip


def initial_checkpoints(seed: int, work_dir: Path) -> dict[str, Path]:
    """HF ViT's random initial weights, and ours converted from them, each saved with the demo's image processor."""
    torch.manual_seed(seed)
    vit = ViTForImageClassification(ViTConfig(**VIT_SIZE, **LABELS))
    processor = ViTImageProcessorPil(size={"height": SIZE["image_size"], "width": SIZE["image_size"]})
    folders = {"HF ViT": work_dir / f"seed{seed}-vit-init", "ours (ViT converted)": work_dir / f"seed{seed}-ours-init"}
    for name, model in [("HF ViT", vit), ("ours (ViT converted)", convert_vit_to_vanilla_transformer(vit))]:
        model.save_pretrained(folders[name])
        processor.save_pretrained(folders[name])
    return folders


def train(name: str, seed: int, init: Path | None, args: argparse.Namespace) -> dict:
    source = ["--model_name_or_path", str(init)] if init else []
    output_dir = args.work_dir / f"seed{seed}-{name.replace(' ', '-').replace('(', '').replace(')', '')}"
    metrics = train_image_classifier.main(
        [*source, "--output_dir", str(output_dir), "--seed", str(seed), *recipe_flags(args)]
    )
    return {key: metrics[key] for key in ("eval_accuracy", "eval_macro_f1", "train_runtime")}


def svm_reference() -> dict:
    """scikit-learn's digits example: an RBF SVC, gamma = 0.001, on the raw 0..16 pixels."""
    train_images, test_images, train_labels, test_labels = digits_split()
    start = time.perf_counter()
    classifier = SVC(gamma=0.001).fit(train_images.reshape(len(train_images), -1), train_labels)
    seconds = time.perf_counter() - start
    predicted = classifier.predict(test_images.reshape(len(test_images), -1))
    metrics = classification_metrics(confusion_matrix(test_labels, predicted, 10))
    return {"eval_accuracy": metrics["accuracy"], "eval_macro_f1": metrics["macro_f1"], "train_runtime": seconds}


def step_timing(repeats: int) -> dict:
    """Seconds of one training step on a batch of 64 digits, ours against HF ViT with the same weights, alternating."""
    torch.manual_seed(0)
    vit = ViTForImageClassification(ViTConfig(**VIT_SIZE, **LABELS)).train()
    ours = convert_vit_to_vanilla_transformer(vit).train()
    train_images, _, train_labels, _ = digits_split()
    pixels = torch.tensor(train_images[:64], dtype=torch.float32) / MAX_GREY_LEVEL * 2 - 1
    pixels = pixels[:, None].expand(-1, 3, -1, -1).contiguous()
    labels = torch.tensor(train_labels[:64])

    def step_of(model: torch.nn.Module):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step():
            optimizer.zero_grad()
            model(pixels, labels=labels).loss.backward()
            optimizer.step()

        return step

    timing = time_alternating(step_of(ours), step_of(vit), repeats, torch.device("cpu"), clock="cpu", warmup=3)
    return {"ours_s": timing.median_a, "hf_vit_s": timing.median_b, "speedup_ours_over_hf": timing.ratio}


def summary(runs: list[dict]) -> dict:
    def spread(key: str) -> dict:
        values = [run[key] for run in runs]
        return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0}

    return {key: spread(key) for key in ("eval_accuracy", "eval_macro_f1", "train_runtime")} | {"runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3, help="Training runs per model.")
    parser.add_argument("--max_steps", type=int, default=1500, help="Training steps of every run (batch 64).")
    parser.add_argument("--learning_rate", type=float, default=3e-3, help="Peak rate of the cosine schedule.")
    parser.add_argument("--step_repeats", type=int, default=30, help="Rounds of the paired step timing.")
    parser.add_argument("--work_dir", type=Path, default=Path("out/image-benchmark"), help="Checkpoints of the runs.")
    parser.add_argument("--output", type=Path, default=None, help="Results JSON (default: benchmarks/results/).")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {name: [] for name in MODELS}
    for seed in range(args.seeds):
        initial = initial_checkpoints(seed, args.work_dir)
        for name in MODELS:
            runs[name].append(train(name, seed, initial.get(name), args))
    results = {
        "task": "scikit-learn digits, 1437 train / 360 test images (8x8), demo split of training/demo_image_data.py",
        "recipe": " ".join(recipe_flags(args)) + f"; model {SIZE}",
        "environment": environment(torch.device("cpu")),
        "models": {name: summary(model_runs) for name, model_runs in runs.items()} | {"SVM": svm_reference()},
        "training_step": step_timing(args.step_repeats),
    }
    print(json.dumps({name: value for name, value in results.items() if name != "models"}, indent=2))
    for name, model in results["models"].items():
        accuracy = model["eval_accuracy"]
        print(f"{name:>22}: accuracy {accuracy['mean'] if isinstance(accuracy, dict) else accuracy:.4f}")
    write_results(results, args.output, "image-classification-digits")


if __name__ == "__main__":
    main()
