"""Which default weight initialization learns best, across widths and tasks (the init issue): `normal-0.02`
(N(0, 0.02) for every linear and embedding: BERT, GPT-2, Marian), `xavier` (Xavier-uniform linears, N(0, 1/d_model)
embeddings: torch's nn.Transformer, fairseq) and width-relative normals `scaled-G` (N(0, G / sqrt(d_model))
everywhere; 0.02 is G = 0.16 at d_model 64 and 0.45 at 512), plus HF `MarianMTModel` of the same shape with its own
init (`marian`, translation only) as the reference the package is compared with.

Three tasks of built-in data, each trained by one plain loop, the same for every candidate (AdamW, the paper's
schedule: linear warm-up then inverse-sqrt decay, 800 steps of batch 64, the same batches for every candidate of a
seed):
- translation: English -> German number sentences (training/demo_data.py), a 1000-token shared BPE, the encoder-
  decoder; greedy exact match on held-out sentences and the validation loss;
- masked-LM pretraining: the topic language (training/demo_text_data.py), BERT masking; held-out masked-token loss
  and accuracy, and a linear probe (logistic regression) of the mean-pooled encoder states on the topic labels;
- image classification: scikit-learn's digits (training/demo_image_data.py), 2x2 patches; held-out accuracy.

Shapes: d_model from --widths, d_model / 32 heads (at least 2), FFN 4 d_model, 2 + 2 layers for translation and 2 for
the encoders, dropout 0.1. Runs are spread over --workers processes (one thread each, all on --device); each finished
run is appended to WORK/runs.jsonl at once, so a killed study keeps its runs and the same command resumes it. The
summary (per task, width and candidate: per-seed metrics, mean, median) goes to --output and is printed.

    python benchmarks/init_study.py --device cuda --workers 8 --work_dir WORK

makes 156 runs (4 widths x 3 seeds x (3 tasks x 4 candidates + Marian)); a step takes ~10 ms on a GPU (host-bound),
so a run takes seconds. --deadline_minutes stops starting runs; --summarize rewrites the summary from WORK alone;
--quick is the CPU smoke test (width 64, one seed, 30 steps of batch 16, tiny data).
"""

import argparse
import itertools
import json
import math
import multiprocessing
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "training"), str(Path(__file__).resolve().parent)]

from demo_data import number_translation_dataset  # noqa: E402
from demo_image_data import MAX_GREY_LEVEL, digits_split  # noqa: E402
from demo_text_data import labelled_topics, unlabelled_text, word_tokenizer  # noqa: E402
from marian_twin import marian_config  # noqa: E402
from measure import environment  # noqa: E402
from train_tokenizer import train_bpe_tokenizer  # noqa: E402

from hf_vanilla_transformer import (  # noqa: E402
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForImageClassification,
    VanillaTransformerForMaskedLM,
    image_classification_config,
)

TASKS = ("translation", "masked-lm", "image")
MARIAN = "marian"  # a reference row: transformers' own init, translation only
DEFAULT_CANDIDATES = ["normal-0.02", "xavier", "scaled-0.4", "scaled-0.6", MARIAN]
# Per task: the metric the table shows and whether higher is better.
HEADLINE = {"translation": ("exact_match", True), "masked-lm": ("mlm_loss", False), "image": ("accuracy", True)}


@dataclass(frozen=True)
class Settings:
    """What every run of one study shares; recorded in the summary."""

    steps: int = 800
    batch_size: int = 64
    lr_scale: float = 1.0  # the paper's
    warmup_steps: int = 200  # the demo's (training/run_demo.sh)
    translation_train: int = 20000
    translation_eval: int = 300
    bpe_vocab: int = 1000
    mlm_train: int = 20000
    mlm_eval: int = 500
    probe_train: int = 200
    probe_eval: int = 400


# Tiny data and batches: every code path on one CPU core in well under a minute (the numbers mean nothing).
QUICK = Settings(
    steps=30, batch_size=16, warmup_steps=5, translation_train=500, translation_eval=40, mlm_train=500, mlm_eval=64
)


# ---- candidates and shapes --------------------------------------------------------------------------------------


def init_fields(candidate: str, d_model: int) -> dict:
    """Config fields of a candidate: `xavier`, `normal-STD` (fixed std) or `scaled-G` (std G / sqrt(d_model))."""
    if candidate == "xavier":
        return {"initialization": "xavier"}
    match = re.fullmatch(r"(normal|scaled)-(\d*\.?\d+)", candidate)
    if match is None:
        raise ValueError(f"Unknown candidate {candidate!r}: xavier, normal-STD, scaled-G or {MARIAN}.")
    value = float(match[2])
    return {"initialization": "normal", "initializer_range": value if match[1] == "normal" else value / d_model**0.5}


def shape(d_model: int, encoder_only: bool) -> dict:
    heads = max(2, d_model // 32)
    layers = {"encoder_layers": 2} if encoder_only else {"encoder_layers": 2, "decoder_layers": 2}
    sizes = {"d_model": d_model, "dropout": 0.1, **layers}
    for stack in ("encoder",) if encoder_only else ("encoder", "decoder"):
        sizes |= {f"{stack}_attention_heads": heads, f"{stack}_ffn_dim": 4 * d_model}
    return sizes


# ---- data: built once per process, kept on the device -------------------------------------------------------------


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    # One fixed length for the whole split: the sentences are short, and fixed shapes keep the step free of syncs.
    width = max(map(len, rows))
    return torch.tensor([row + [value] * (width - len(row)) for row in rows])


def translation_data(settings: Settings, device: torch.device) -> dict:
    raw = number_translation_dataset(settings.translation_train, settings.translation_eval)
    pairs = {split: raw[split]["translation"] for split in ("train", "validation")}
    tokenizer = train_bpe_tokenizer((text for pair in pairs["train"] for text in pair.values()), settings.bpe_vocab)

    def encode(split: str) -> dict:
        sources = tokenizer([pair["en"] for pair in pairs[split]])["input_ids"]
        targets = tokenizer([pair["de"] for pair in pairs[split]])["input_ids"]
        input_ids = pad(sources, tokenizer.pad_token_id).to(device)
        return {
            "input_ids": input_ids,
            "attention_mask": input_ids != tokenizer.pad_token_id,
            "labels": pad(targets, -100).to(device),
        }

    references = [pair["de"] for pair in pairs["validation"]]
    return {
        "tokenizer": tokenizer,
        "train": encode("train"),
        "validation": encode("validation"),
        "references": references,
    }


def masked_lm_data(settings: Settings, device: torch.device) -> dict:
    tokenizer = word_tokenizer()
    raw = unlabelled_text(settings.mlm_train, settings.mlm_eval)
    topics = labelled_topics(settings.probe_train, settings.probe_eval)

    def encode(texts: list[str]) -> dict:
        input_ids = pad(tokenizer(texts)["input_ids"], tokenizer.pad_token_id).to(device)
        return {"input_ids": input_ids, "attention_mask": input_ids != tokenizer.pad_token_id}

    validation = encode(list(raw["validation"]["text"]))
    # The held-out tokens to predict are masked once, with a fixed seed: every run is scored on the same positions.
    validation |= mask_tokens(validation, tokenizer, torch.Generator(device).manual_seed(0))
    probe = {
        split: (encode(list(topics[split]["text"])), list(topics[split]["label"])) for split in ("train", "validation")
    }
    return {
        "tokenizer": tokenizer,
        "train": encode(list(raw["train"]["text"])),
        "validation": validation,
        "probe": probe,
    }


def mask_tokens(batch: dict, tokenizer, generator: torch.Generator, probability: float = 0.15) -> dict:
    """BERT's masking (§3.1): `probability` of the words are predicted; of those 80 % become the mask token, 10 % a
    random word, 10 % stay. Special tokens (pad, <s>, </s>) are never picked."""
    input_ids = batch["input_ids"]
    words = input_ids > max(tokenizer.all_special_ids)
    draw = torch.rand(input_ids.shape, device=input_ids.device, generator=generator)
    picked = words & (draw < probability)
    # The same draw decides the replacement: below 80 % of `probability` mask, the next 10 % a random word.
    masked = picked & (draw < 0.8 * probability)
    randomised = picked & ~masked & (draw < 0.9 * probability)
    random_words = torch.randint(
        max(tokenizer.all_special_ids) + 1,
        len(tokenizer),
        input_ids.shape,
        device=input_ids.device,
        generator=generator,
    )
    corrupted = torch.where(masked, tokenizer.mask_token_id, torch.where(randomised, random_words, input_ids))
    return {"input_ids": corrupted, "labels": torch.where(picked, input_ids, -100)}


def image_data(settings: Settings, device: torch.device) -> dict:
    train_images, test_images, train_labels, test_labels = digits_split()

    def pixels(images) -> torch.Tensor:  # 0..16 grey levels -> [-1, 1], one channel
        return (torch.tensor(images, dtype=torch.float32) / MAX_GREY_LEVEL * 2 - 1).unsqueeze(1).to(device)

    return {
        "train": {"pixel_values": pixels(train_images), "labels": torch.tensor(train_labels).to(device)},
        "validation": {"pixel_values": pixels(test_images), "labels": torch.tensor(test_labels).to(device)},
    }


DATA_BUILDERS = {"translation": translation_data, "masked-lm": masked_lm_data, "image": image_data}
_data_cache: dict[str, dict] = {}


def task_data(task: str, settings: Settings, device: torch.device) -> dict:
    if task not in _data_cache:
        _data_cache[task] = DATA_BUILDERS[task](settings, device)
    return _data_cache[task]


# ---- models ---------------------------------------------------------------------------------------------------------


def build_model(task: str, candidate: str, d_model: int, data: dict) -> torch.nn.Module:
    if task == "image":
        # The package's image defaults (paper's post-norm ReLU layers, mean pooling, learned positions), with the
        # candidate's init in place of the `initialization="xavier"` they pin.
        config = image_classification_config(
            **shape(d_model, encoder_only=True), **init_fields(candidate, d_model),
            image_size=8, patch_size=2, num_channels=1, num_labels=10,
        )  # fmt: skip
        return VanillaTransformerForImageClassification(config)
    tokenizer = data["tokenizer"]
    tokens = dict(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if task == "masked-lm":
        fields = {**shape(d_model, encoder_only=True), **tokens, "is_encoder_decoder": False, "is_decoder": False}
        return VanillaTransformerForMaskedLM(VanillaTransformerConfig(**fields, **init_fields(candidate, d_model)))
    fields = {**shape(d_model, encoder_only=False), **tokens, "decoder_start_token_id": tokenizer.bos_token_id}
    if candidate == MARIAN:
        from transformers import MarianMTModel

        return MarianMTModel(marian_config(VanillaTransformerConfig(**fields)))
    return VanillaTransformerForConditionalGeneration(
        VanillaTransformerConfig(**fields, **init_fields(candidate, d_model))
    )


# ---- the training loop ----------------------------------------------------------------------------------------------


def train(model: torch.nn.Module, task: str, data: dict, settings: Settings, d_model: int, seed: int) -> None:
    """AdamW with the paper's schedule and betas (§5.3): lr = lr_scale * d_model^-0.5 * min(step^-0.5, step *
    warmup^-1.5), linear warm-up then inverse-sqrt decay, as the project's training scripts and demo train."""
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr_scale, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.01
    )
    warmup = settings.warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: d_model**-0.5 * min((step + 1) ** -0.5, (step + 1) * warmup**-1.5)
    )
    train_split = data["train"]
    size = len(next(iter(train_split.values())))
    device = next(model.parameters()).device
    # The batches of a seed, drawn up front and the same for every candidate: a paired comparison.
    generator = torch.Generator().manual_seed(seed)
    order = torch.randint(size, (settings.steps, settings.batch_size), generator=generator).to(device)
    masking = torch.Generator(device).manual_seed(seed)
    model.train()
    for step in range(settings.steps):
        batch = {name: tensor[order[step]] for name, tensor in train_split.items()}
        if task == "masked-lm":
            batch |= mask_tokens(batch, data["tokenizer"], masking)
        elif task == "image":
            batch["pixel_values"] = augment(batch["pixel_values"])
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)


def augment(pixel_values: torch.Tensor) -> torch.Tensor:
    """Small random shifts and rotations (as the image demo), without which 1,437 training digits are memorised."""
    from train_image_classifier import random_affine

    moved = random_affine(pixel_values.cpu(), degrees=10.0, scale_jitter=0.1, translate=0.1, horizontal_flip=False)
    return moved.to(pixel_values.device)  # its random grid is drawn on the CPU


@torch.no_grad()
def evaluate(model: torch.nn.Module, task: str, data: dict) -> dict[str, float]:
    model.eval()
    validation = data["validation"]
    if task == "image":
        logits = model(pixel_values=validation["pixel_values"]).logits
        return {"accuracy": (logits.argmax(-1) == validation["labels"]).float().mean().item()}
    if task == "masked-lm":
        output = model(**validation)
        picked = validation["labels"] != -100
        correct = output.logits.argmax(-1)[picked] == validation["labels"][picked]
        return {"mlm_loss": output.loss.item(), "mlm_accuracy": correct.float().mean().item(), **probe(model, data)}
    loss = model(**validation).loss.item()
    generated = model.generate(
        input_ids=validation["input_ids"],
        attention_mask=validation["attention_mask"],
        num_beams=1,
        do_sample=False,
        max_new_tokens=validation["labels"].shape[1] + 8,
    )
    hypotheses = data["tokenizer"].batch_decode(generated, skip_special_tokens=True)
    matches = [hypothesis.strip() == reference for hypothesis, reference in zip(hypotheses, data["references"])]
    return {"exact_match": 100 * sum(matches) / len(matches), "validation_loss": loss}


def probe(model: VanillaTransformerForMaskedLM, data: dict) -> dict[str, float]:
    """Topic accuracy of a logistic regression on the frozen encoder's mean-pooled states: how much of the topic
    structure pretraining put into the representations."""
    from sklearn.linear_model import LogisticRegression

    features = {}
    for split, (batch, labels) in data["probe"].items():
        states = model.model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1)
        features[split] = ((states * mask).sum(1) / mask.sum(1)).float().cpu().numpy(), labels
    classifier = LogisticRegression(max_iter=2000).fit(*features["train"])
    return {"probe_accuracy": classifier.score(*features["validation"])}


# ---- runs, workers, resume ------------------------------------------------------------------------------------------


def run_key(run: dict) -> tuple:
    return run["task"], run["d_model"], run["candidate"], run["seed"]


def planned_runs(args: argparse.Namespace) -> list[dict]:
    """Widths small first; within a width seed by seed, and within a seed every task and candidate: a study cut
    short still has every (task, width) row with the same seeds for all candidates."""
    runs = []
    for d_model, seed, task, candidate in itertools.product(args.widths, args.seeds, args.tasks, args.candidates):
        if candidate != MARIAN or task == "translation":
            runs.append({"task": task, "d_model": d_model, "candidate": candidate, "seed": seed})
    return runs


def execute(run: dict, settings: Settings, device: str, deadline: float) -> dict | None:
    """One run, or None past the deadline; the model's seed is the run's seed, whatever ran before in the process."""
    if time.time() > deadline:
        return None
    device = torch.device(device)
    data = task_data(run["task"], settings, device)
    torch.manual_seed(run["seed"])
    model = build_model(run["task"], run["candidate"], run["d_model"], data).to(device)
    start = time.perf_counter()
    train(model, run["task"], data, settings, run["d_model"], run["seed"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    metrics = evaluate(model, run["task"], data)
    return {**run, **metrics, "train_seconds": round(seconds, 3), "seconds_per_step": seconds / settings.steps}


def worker_setup() -> None:
    torch.set_num_threads(1)


def execute_packed(packed: tuple) -> dict | None:
    return execute(*packed)


def run_study(args: argparse.Namespace, settings: Settings) -> None:
    runs_file = args.work_dir / "runs.jsonl"
    done = {run_key(run) for run in read_runs(runs_file)}
    todo = [run for run in planned_runs(args) if run_key(run) not in done]
    print(f"{len(done)} runs done before, {len(todo)} to go on {args.workers} worker(s)", flush=True)
    deadline = time.time() + 60 * args.deadline_minutes
    jobs = [(run, settings, args.device, deadline) for run in todo]
    if args.workers == 1:  # in this process: no start-up cost (the CPU smoke test)
        worker_setup()
        results = map(execute_packed, jobs)
        record(results, runs_file)
        return
    # spawn: CUDA cannot be used in forked children. Each worker keeps its data between runs.
    with multiprocessing.get_context("spawn").Pool(args.workers, initializer=worker_setup) as pool:
        record(pool.imap_unordered(execute_packed, jobs), runs_file)


def record(results, runs_file: Path) -> None:
    with runs_file.open("a") as out:
        for result in results:
            if result is None:
                continue
            out.write(json.dumps(result) + "\n")
            out.flush()  # a killed study keeps every finished run
            headline = HEADLINE[result["task"]][0]
            print(
                f"{result['task']:<12} d{result['d_model']:<4} {result['candidate']:<12} seed {result['seed']}  "
                f"{headline} {result[headline]:.4f}  {result['train_seconds']:.1f} s",
                flush=True,
            )


def read_runs(runs_file: Path) -> list[dict]:
    if not runs_file.exists():
        return []
    return [json.loads(line) for line in runs_file.read_text().splitlines() if line.strip()]


# ---- summary ------------------------------------------------------------------------------------------------------


def summarize(args: argparse.Namespace, settings: Settings) -> dict:
    runs = [run for run in read_runs(args.work_dir / "runs.jsonl") if run["d_model"] in args.widths]
    tasks: dict = {}
    for run in sorted(runs, key=lambda run: run["seed"]):
        row = tasks.setdefault(run["task"], {}).setdefault(str(run["d_model"]), {}).setdefault(run["candidate"], {})
        row.setdefault("seeds", []).append(run["seed"])
        for name, value in run.items():
            if name not in ("task", "d_model", "candidate", "seed"):
                row.setdefault(name, {"per_seed": []})["per_seed"].append(value)
    for row in (row for widths in tasks.values() for rows in widths.values() for row in rows.values()):
        for metric in (value for value in row.values() if isinstance(value, dict)):
            metric["mean"] = statistics.fmean(metric["per_seed"])
            metric["median"] = statistics.median(metric["per_seed"])
    device = torch.device(args.device)
    return {
        "environment": environment(device),
        "threads_per_run": 1,
        "workers": args.workers,
        "settings": {**asdict(settings), "quick": args.quick, "shapes": "heads d/32 (>= 2), FFN 4d, 2+2 / 2 layers"},
        "widths": args.widths,
        "seeds": args.seeds,
        "candidates": args.candidates,
        "runs": len(runs),
        "tasks": tasks,
    }


def print_table(report: dict) -> None:
    for task, widths in report["tasks"].items():
        metric, higher_is_better = HEADLINE[task]
        print(f"\n{task}: {metric} (median over seeds; {'higher' if higher_is_better else 'lower'} is better)")
        candidates = [c for c in report["candidates"] if any(c in rows for rows in widths.values())]
        print(f"{'d_model':>8} " + " ".join(f"{candidate:>12}" for candidate in candidates))
        for width, rows in sorted(widths.items(), key=lambda item: int(item[0])):
            cells = []
            for candidate in candidates:
                values = rows.get(candidate, {}).get(metric)
                cells.append(f"{values['median']:8.3f} ({len(values['per_seed'])})" if values else " " * 12)
            print(f"{width:>8} " + " ".join(f"{cell:>12}" for cell in cells))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work_dir", type=Path, required=True, help="runs.jsonl goes here; a rerun resumes.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--workers", type=int, default=1, help="Processes, one thread each, all on --device.")
    parser.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument(
        "--candidates", nargs="+", default=DEFAULT_CANDIDATES, help="xavier, normal-STD, scaled-G, marian"
    )
    parser.add_argument(
        "--steps", type=int, help="Training steps per run (default 800, warm-up a quarter of them; --quick: 30)."
    )
    parser.add_argument("--warmup_steps", type=int, help="Warm-up steps of the schedule (default 200, or --steps/4).")
    parser.add_argument(
        "--lr_scale", type=float, help="Scale of the paper's schedule (default 1.0): peak lr_scale d^-0.5 warmup^-0.5."
    )
    parser.add_argument("--deadline_minutes", type=float, default=math.inf, help="No new run starts after this.")
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: width 64, one seed, 30 steps, tiny data.")
    parser.add_argument("--summarize", action="store_true", help="Only summarise the runs in --work_dir.")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "init-study-widths.json")
    args = parser.parse_args(argv)
    for candidate in args.candidates:
        if candidate != MARIAN:
            init_fields(candidate, 64)  # an unknown name fails now, not in a worker
    if args.quick:
        args.widths, args.seeds = [64], args.seeds[:1]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    settings = QUICK if args.quick else Settings()
    if args.steps is not None:
        settings = Settings(**{**asdict(settings), "steps": args.steps, "warmup_steps": max(1, args.steps // 4)})
    schedule = {"warmup_steps": args.warmup_steps, "lr_scale": args.lr_scale}
    settings = Settings(**{**asdict(settings), **{name: value for name, value in schedule.items() if value}})
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by spawned workers before they import torch
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if not args.summarize:
        run_study(args, settings)
    report = summarize(args, settings)
    print_table(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.output}")
    return report


if __name__ == "__main__":
    main()
