"""GPU benchmark in one command: our model against its HF Marian twin (same weights) where a GPU trains and decodes.

    python benchmarks/gpu_benchmark.py                           # one H100/H200: the default sections, < 5 minutes
    python benchmarks/gpu_benchmark.py --sections trainer,decoding
    python benchmarks/gpu_benchmark.py --quick --cpu             # every section on tiny shapes: a CPU smoke run

Both models are transformer-base with a 32,000-token vocabulary, ours made from a MarianMTModel twin; every section
first checks that the two compute the same loss (or greedy tokens), then times them. Training runs in the Trainer's
`--bf16` precision (float32 weights under bfloat16 autocast, fused AdamW) with dropout 0.1. The sentence pairs are
random ids, source lengths uniform in 8-64 and each target within 25 % of its source's length, so a randomly drawn
batch of 128 pairs is about 45 % padding when padded. Sections, the most important first (a GPU run's seconds in
brackets, compiles included, estimated from the H100 timings of the earlier benchmark):
  * trainer [45]: both models in transformers' Seq2SeqTrainer as the training scripts run them (label smoothing 0.1,
    the Trainer's default fused AdamW, 128 pairs a batch), each with its own collator inside the timed steps: Marian
    with `DataCollatorForSeq2Seq`, ours with `seq2seq_training_collator` (the layout it chose is recorded). Random
    batches, then `train_sampling_strategy="group_by_length"`; ms/step from the end of step 10 to the end of step 70;
  * training_step [10]: one step on a batch of about 32k target tokens collated outside the step, eager: ours
    flattened, ours padded, Marian padded; tokens/s, MFU against a bfloat16 matmul peak measured in this run, peak
    memory, and each collator's CPU time per batch;
  * decoding [60]: greedy generate() at batch 1, 64 new tokens, in bfloat16: both models with the dynamic cache
    (eager), and ours with a static cache and `CompileConfig(fullgraph=True)`;
  * full_rows_compiled [120]: a training step on 256 x 128 full rows (no padding, no mask), both models
    torch.compile'd (about 50 s of compiling each);
  * moe, multi30k_recipe (optional: run with --sections): the MoE experts functions at transformer-base sizes
    (8 experts, top 2; a refused one is recorded as such), and the Multi30k recipe's model at its batch.
Then the issue's targets, each ratio beside its target with pass/fail. The JSON (benchmarks/results/) is rewritten
after every section, so a run cut short by its time limit keeps what it measured; a section that fails is recorded
with its error and the run goes on (exit status 1 at the end).
"""

import argparse
import inspect
import math
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from marian_twin import build_pair, training_flops
from measure import (
    ABTiming,
    environment,
    matmul_peak_flops,
    optimizer_state_bytes,
    peak_memory_bytes,
    synchronize,
    tensor_bytes,
    time_alternating,
    time_round_robin,
    write_results,
)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import (
    CompileConfig,
    DataCollatorForSeq2Seq,
    PreTrainedTokenizerFast,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    TrainerCallback,
)

from hf_vanilla_transformer import (
    DataCollatorForSeq2SeqWithFlattening,
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerModel,
    seq2seq_training_collator,
)
from hf_vanilla_transformer.moe_kernels_vanilla_transformer import SORTED_GROUPED_MM
from hf_vanilla_transformer.packing_vanilla_transformer import varlen_kernel

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from run_common import ModelLossMixin, label_smoothed_loss  # noqa: E402  (after the sys.path entry above)

# Training of our model as the Trainer runs it (run_common.ModelLossMixin): loss only, no logits returned.
OURS_TRAINING_KWARGS = {"skip_logits": True}
LABEL_SMOOTHING = 0.1  # the recipe's (paper §5.4)
EXPERTS_IMPLEMENTATIONS = (SORTED_GROUPED_MM, "grouped_mm", "eager", "batched_mm")
# The recipe's model: transformer-base with these overrides and its 8k BPE (multi30k.sh), batch 64.
RECIPE_OVERRIDES = dict(
    vocab_size=8000,
    d_model=256,
    encoder_layers=3,
    decoder_layers=3,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=1024,
    decoder_ffn_dim=1024,
    dropout=0.1,
)
# Multi30k sentence lengths in the recipe's 8k BPE tokens, roughly (captions of 5-40 words): drawn uniformly.
RECIPE_LENGTHS = (8, 40)
# The smoke run's recipe model: the tiny marian_twin size.
QUICK_RECIPE_OVERRIDES = RECIPE_OVERRIDES | dict(
    vocab_size=512, d_model=64, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=128, decoder_ffn_dim=128
)


@dataclass
class Shapes:
    size: str  # marian_twin size of the ours/Marian pair
    lengths: tuple[int, int]  # source lengths of the random sentence pairs, uniform in [low, high]
    trainer_batch: int  # sentence pairs per Trainer step
    trainer_steps: tuple[int, int]  # (warm-up, timed) Trainer steps
    token_budget: int  # target tokens of the training_step batch
    full: tuple[int, int]  # (batch, length) of the full-rows training batch
    source_len: int  # of the decoded sentence
    new_tokens: int
    moe_tokens: int
    moe_dims: tuple[int, int]  # (d_model, expert FFN size)
    matmul_size: int
    recipe: tuple[dict, int]  # (config overrides of transformer-base, batch) of the Multi30k recipe's model


GPU_SHAPES = Shapes(
    "transformer-base-32k", (8, 64), 128, (10, 60), 32768, (256, 128), 32, 64, 128 * 64, (512, 2048), 8192,
    (RECIPE_OVERRIDES, 64),
)  # fmt: skip
QUICK_SHAPES = Shapes(
    "tiny", (2, 16), 8, (2, 4), 128, (4, 16), 8, 4, 64, (64, 128), 256, (QUICK_RECIPE_OVERRIDES, 8)
)  # fmt: skip


@dataclass
class Settings:
    device: torch.device
    shapes: Shapes
    repeats: int
    compile_backend: str  # inductor on a GPU; eager on a CPU smoke run (dynamo traces the same graph, no codegen)
    quick: bool
    autocast_dtype: torch.dtype = torch.bfloat16
    # Decoding and the MoE layer run in bfloat16 weights on a GPU; float32 on a CPU (its smoke run checks code paths).
    inference_dtype: torch.dtype = torch.bfloat16


def settings_from(args: argparse.Namespace) -> Settings:
    on_gpu = torch.cuda.is_available() and not args.cpu
    return Settings(
        device=torch.device("cuda" if on_gpu else "cpu"),
        shapes=QUICK_SHAPES if args.quick else GPU_SHAPES,
        repeats=args.repeats or (2 if args.quick else 10),
        compile_backend="inductor" if on_gpu else "eager",
        quick=args.quick,
        inference_dtype=torch.bfloat16 if on_gpu else torch.float32,
    )


# --- batches -------------------------------------------------------------------------------------------------------


def sentence_pairs(vocab_size: int, count: int, lengths: tuple[int, int], seed: int) -> list[dict]:
    """`count` sentence pairs as a tokenized dataset holds them: random ids (0-2 are special) ending with eos (2).
    Source lengths are uniform in `lengths`; each target's is its source's times a factor uniform in [0.8, 1.25]
    (kept in `lengths`), since a translation's length follows its source's: `group_by_length`, which sorts by the
    source alone, then groups the targets too, as it does on real data."""
    generator = torch.Generator().manual_seed(seed)
    low, high = lengths
    sources = torch.randint(low, high + 1, (count,), generator=generator)
    factors = 0.8 + 0.45 * torch.rand(count, generator=generator)
    targets = (sources * factors).round().long().clamp(low, high)

    def sentence(length: int) -> list[int]:
        return torch.randint(3, vocab_size, (length - 1,), generator=generator).tolist() + [2]

    return [{"input_ids": sentence(s), "labels": sentence(t)} for s, t in zip(sources.tolist(), targets.tolist())]


def padding_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory, for `DataCollatorForSeq2Seq`, which pads through a tokenizer."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab_size)}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="</s>"
    )


def marian_collator(marian, tokenizer: PreTrainedTokenizerFast) -> DataCollatorForSeq2Seq:
    """What the training scripts give an HF model: transformers' padding collator."""
    return DataCollatorForSeq2Seq(tokenizer, model=marian, pad_to_multiple_of=8, return_tensors="pt")


def ours_collator(ours, tokenizer: PreTrainedTokenizerFast, settings: Settings):
    """What the training scripts give our model by default (flattened where a variable-length kernel runs). Every
    step here runs under bfloat16 autocast (the Trainer's --bf16), a CPU smoke run's too."""
    return seq2seq_training_collator(ours, tokenizer, device=settings.device, half_precision=True)


def layout_of(batch: dict) -> str:
    return "flattened" if "cu_seq_lens_q" in batch else "padded"


def collate_timed(collate: Callable[[list[dict]], dict], features: list[dict], repeats: int) -> tuple[dict, float]:
    """The collated batch and the collator's median CPU seconds per batch (what a data loader worker spends)."""
    seconds = []
    for _ in range(repeats + 1):  # the first call warms up
        start = time.process_time()
        batch = collate(features)
        seconds.append(time.process_time() - start)
    return dict(batch), statistics.median(seconds[1:])


def to_device(batch: dict, device: torch.device) -> dict:
    """Tensors to the device once; Python ints (the flattened batch's max lengths) stay as they are."""
    return {key: value.to(device) if torch.is_tensor(value) else value for key, value in batch.items()}


# --- training: shared parts ----------------------------------------------------------------------------------------


def loss_of(model, batch: dict, settings: Settings) -> float:
    """Loss with dropout off, under the timed steps' autocast."""
    model.eval()
    with torch.no_grad(), torch.autocast(settings.device.type, dtype=settings.autocast_dtype):
        loss = model(**batch).loss.float().item()
    model.train()
    return loss


def check_losses(ours, marian, ours_batch: dict, marian_batch: dict, settings: Settings) -> dict:
    """Our loss equals Marian's on the same sentences; where ours got its own batch, also ours on it equals ours on
    Marian's padded one (on a flattened batch: the varlen kernels against the padded computation, on this device).
    Raises past the tolerance."""
    tolerance = 2e-2 if settings.device.type == "cuda" else 1e-2  # bfloat16 matmuls either way, ~10.5 nats
    loss_ours = loss_of(ours, ours_batch, settings)
    check = {"loss_ours": loss_ours, "loss_marian": loss_of(marian, marian_batch, settings)}
    check["loss_abs_diff"] = abs(loss_ours - check["loss_marian"])
    same_batch = ours_batch is marian_batch
    check["ours_layout_abs_diff"] = None if same_batch else abs(loss_ours - loss_of(ours, marian_batch, settings))
    check["tolerance"] = tolerance
    worst = max(value for key, value in check.items() if key.endswith("abs_diff") and value is not None)
    if not math.isfinite(worst) or worst > tolerance:
        raise RuntimeError(f"Losses disagree beyond {tolerance}: {check}")
    return check


def gradient_difference(model, batch: dict, reference: dict, settings: Settings) -> float:
    """How far the gradients of `batch` lie from those of `reference` (the same sentences in another layout), dropout
    off, under the timed steps' autocast: the largest difference over the largest reference gradient. On a GPU this
    checks the variable-length kernel's backward against the padded computation's."""

    def gradients(inputs: dict) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with torch.autocast(settings.device.type, dtype=settings.autocast_dtype):
            model(**inputs).loss.backward()
        return [parameter.grad.float() for parameter in model.parameters() if parameter.grad is not None]

    model.eval()
    computed, expected = gradients(batch), gradients(reference)
    model.zero_grad(set_to_none=True)
    model.train()
    difference = max((a - b).abs().max().item() for a, b in zip(computed, expected))
    scale = max(b.abs().max().item() for b in expected)
    if not math.isfinite(difference):
        raise RuntimeError(f"Gradients of the flattened batch are not finite: {difference}")
    return difference / scale


def training_step(forward: Callable, batch: dict, optimizer: torch.optim.Optimizer, settings: Settings, **kwargs):
    """One step as the Trainer takes it with --bf16: forward under autocast, backward, fused AdamW."""

    def step():
        with torch.autocast(settings.device.type, dtype=settings.autocast_dtype):
            loss = forward(**batch, **kwargs).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def fused_adamw(model) -> torch.optim.AdamW:
    """One kernel over all parameters: the Trainer's default `adamw_torch_fused`."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def first_call_seconds(run: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call: of the first call of a compiled function, mostly its compile."""
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


@dataclass
class Candidate:
    """One timed training step and the model and optimizer it updates (their tensors count in its peak memory)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[], None]


def compare_training(
    candidates: dict[str, Candidate], tokens: int, flops: float, peak_flops: float, settings: Settings
) -> dict:
    """Steps timed in rotating rounds, each candidate's tokens/s, MFU, peak memory and speed against "marian"."""
    seconds = time_round_robin(
        {name: candidate.step for name, candidate in candidates.items()}, settings.repeats, device=settings.device
    )
    rows = {}
    for name, candidate in candidates.items():
        median = statistics.median(seconds[name])
        persistent = tensor_bytes(candidate.model.state_dict(keep_vars=True).values())
        persistent += optimizer_state_bytes(candidate.optimizer)
        peak = peak_memory_bytes(candidate.step, persistent, settings.device)
        rows[name] = {
            "ms_per_step": 1e3 * median,
            "tokens_per_s": tokens / median,
            "mfu": flops / median / peak_flops,
            "peak_memory_mb": peak / 2**20,
            "speed_vs_marian": ABTiming(seconds[name], seconds["marian"]).ratio,
            "seconds": seconds[name],
        }
    return rows


# --- training in the Seq2SeqTrainer --------------------------------------------------------------------------------


class ScriptsTrainer(ModelLossMixin, Seq2SeqTrainer):
    """transformers' Seq2SeqTrainer with the training scripts' loss: ours computes its label-smoothed loss inside the
    model without logits; Marian keeps the Trainer's `LabelSmoother` on its logits (run_common.ModelLossMixin)."""


class StepClock(TrainerCallback):
    """Wall time from the end of step `first` to the end of the last: the Trainer's own loop, its data loader and
    collator included. The device is synchronized at those two steps only, so that collating a batch overlaps the
    previous step's kernels as it does in training."""

    def __init__(self, first: int, device: torch.device):
        self.first, self.device, self.times = first, device, []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step in (self.first, args.max_steps):
            synchronize(self.device)
            self.times.append(time.perf_counter())

    def seconds_per_step(self, last: int) -> float:
        return (self.times[1] - self.times[0]) / (last - self.first)


def trainer_run(model, collator, tokenizer, dataset: list[dict], sampling: str, settings: Settings) -> dict:
    """Trains `model` for warm-up + timed steps on one pass over `dataset`; ms per timed step and the loss."""
    warmup, timed = settings.shapes.trainer_steps
    clock = StepClock(warmup, settings.device)
    with tempfile.TemporaryDirectory() as output_dir:
        args = Seq2SeqTrainingArguments(
            output_dir=output_dir,
            max_steps=warmup + timed,
            per_device_train_batch_size=settings.shapes.trainer_batch,
            bf16=True,
            label_smoothing_factor=LABEL_SMOOTHING,
            train_sampling_strategy=sampling,
            use_cpu=settings.device.type == "cpu",
            save_strategy="no",
            logging_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,  # the same order of batches for both models
        )
        trainer = ScriptsTrainer(
            model=model,
            args=args,
            train_dataset=dataset,
            data_collator=collator,
            processing_class=tokenizer,  # group_by_length reads its model_input_names
            callbacks=[clock],
        )
        loss = trainer.train().training_loss
    return {"ms_per_step": 1e3 * clock.seconds_per_step(warmup + timed), "train_loss": loss, "optimizer": args.optim}


def trainer_section(settings: Settings) -> dict:
    """Ours and Marian in the Seq2SeqTrainer with their collators: random batches, then length-grouped ones."""
    shapes = settings.shapes
    ours, marian = build_pair(shapes.size, 0.1, torch.float32, settings.device, "sdpa")
    tokenizer = padding_tokenizer(ours.config.vocab_size)
    collators = {"ours": ours_collator(ours, tokenizer, settings), "marian": marian_collator(marian, tokenizer)}
    steps = sum(shapes.trainer_steps)
    dataset = sentence_pairs(ours.config.vocab_size, steps * shapes.trainer_batch, shapes.lengths, seed=3)
    first_batch = dataset[: shapes.trainer_batch]
    first = {name: to_device(dict(collate(first_batch)), settings.device) for name, collate in collators.items()}
    result = {
        "ours_collator": f"{seq2seq_training_collator.__module__}: {type(collators['ours']).__name__}",
        "ours_layout": layout_of(first["ours"]),
        "batch": shapes.trainer_batch,
        "warmup_steps": shapes.trainer_steps[0],
        "timed_steps": shapes.trainer_steps[1],
        "label_smoothing": LABEL_SMOOTHING,
        # The loss each model trains on, as the training scripts run them (run_common.ModelLossMixin).
        "loss_paths": {
            "ours": "the model's label-smoothed loss over the labels, no logits returned (skip_logits)",
            "marian": "the Trainer's LabelSmoother over the returned logits",
        },
        "check": check_losses(ours, marian, first["ours"], first["marian"], settings),
        "sampling": {},
    }
    order = ["ours", "marian"]
    for sampling in ("random", "group_by_length"):
        # Fresh weights for each sampling, the same ones (one seed), so that no run starts from another's training.
        torch.manual_seed(0)
        models = dict(zip(("ours", "marian"), build_pair(shapes.size, 0.1, torch.float32, settings.device, "sdpa")))
        runs = {
            name: trainer_run(models[name], collators[name], tokenizer, dataset, sampling, settings) for name in order
        }
        speed = runs["marian"]["ms_per_step"] / runs["ours"]["ms_per_step"]
        result["sampling"][sampling] = runs | {"speed_ratio": speed}
        # The other model first next: the first to see a batch shape can pay for it (oneDNN primitives on a CPU).
        order.reverse()
    return result


# --- one training step at a token budget ---------------------------------------------------------------------------


def training_step_section(settings: Settings, peak_flops: float) -> dict:
    """One eager step on a batch of about `token_budget` target tokens: ours flattened (no padding computed), ours
    and Marian padded (transformers' collator). Collated once, outside the timed loop."""
    shapes = settings.shapes
    ours, marian = build_pair(shapes.size, 0.1, torch.float32, settings.device, "sdpa")
    count = round(shapes.token_budget / statistics.mean(shapes.lengths))
    features = sentence_pairs(ours.config.vocab_size, count, shapes.lengths, seed=4)
    padded, padded_seconds = collate_timed(
        marian_collator(marian, padding_tokenizer(marian.config.vocab_size)), features, settings.repeats
    )
    flattened, flattened_seconds = collate_timed(DataCollatorForSeq2SeqWithFlattening(ours), features, settings.repeats)
    # Packed rows as long as the longest sentence: the layout for a GPU without a variable-length kernel.
    rows_collator = DataCollatorForSeq2SeqWithFlattening(ours, row_length=max(shapes.lengths))
    rows, rows_seconds = collate_timed(rows_collator, features, settings.repeats)
    padded, flattened, rows = (to_device(batch, settings.device) for batch in (padded, flattened, rows))
    check = check_losses(ours, marian, flattened, padded, settings)
    check["ours_gradient_relative_difference"] = gradient_difference(ours, flattened, padded, settings)
    check["ours_rows_loss_abs_diff"] = abs(loss_of(ours, rows, settings) - check["loss_ours"])
    optimizers = {model: fused_adamw(model) for model in (ours, marian)}

    def candidate(model, batch: dict, **kwargs) -> Candidate:
        return Candidate(model, optimizers[model], training_step(model, batch, optimizers[model], settings, **kwargs))

    candidates = {
        "ours_flattened": candidate(ours, flattened, **OURS_TRAINING_KWARGS),
        "ours_padded": candidate(ours, padded, **OURS_TRAINING_KWARGS),
        "ours_rows": candidate(ours, rows, **OURS_TRAINING_KWARGS),
        "marian": candidate(marian, padded),
    }
    source_lengths = [len(f["input_ids"]) for f in features]
    target_lengths = [len(f["labels"]) for f in features]
    flops = sum(training_flops(ours.config, 1, s, t) for s, t in zip(source_lengths, target_lengths))
    tokens = sum(target_lengths)  # real target tokens (fairseq's words/s)
    return {
        "sentence_pairs": count,
        "target_tokens": tokens,
        "source_tokens": sum(source_lengths),
        "padding_fraction": 1 - (sum(source_lengths) + tokens) / sum(padded[key].numel() for key in features[0]),
        "mode": "eager",
        "check": check,
        "collator_cpu_seconds_per_batch": {
            "ours_flattened": flattened_seconds,
            "ours_rows": rows_seconds,
            "marian": padded_seconds,
        },
        "rows_shape": list(rows["input_ids"].shape),
        "candidates": compare_training(candidates, tokens, flops, peak_flops, settings),
    }


# --- full rows, compiled -------------------------------------------------------------------------------------------


def full_rows_compiled_section(settings: Settings, peak_flops: float) -> dict:
    """A training step on (batch, length) rows without padding or mask, both models torch.compile'd."""
    batch_size, length = settings.shapes.full
    ours, marian = build_pair(settings.shapes.size, 0.1, torch.float32, settings.device, "sdpa")
    features = sentence_pairs(ours.config.vocab_size, batch_size, (length, length), seed=5)
    batch = {key: torch.tensor([f[key] for f in features], device=settings.device) for key in features[0]}
    check = check_losses(ours, marian, batch, batch, settings)
    torch._dynamo.reset()
    candidates = {}
    for name, model, kwargs in (("ours", ours, OURS_TRAINING_KWARGS), ("marian", marian, {})):
        optimizer = fused_adamw(model)
        compiled = torch.compile(model, backend=settings.compile_backend)
        candidates[name] = Candidate(model, optimizer, training_step(compiled, batch, optimizer, settings, **kwargs))
    compile_seconds = {name: first_call_seconds(c.step, settings.device) for name, c in candidates.items()}
    tokens = batch_size * length
    return {
        "batch": batch_size,
        "length": length,
        "check": check,
        "compile_backend": settings.compile_backend,
        "compile_seconds": compile_seconds,  # the first step of each, compiling included
        "candidates": compare_training(
            candidates, tokens, training_flops(ours.config, batch_size, length, length), peak_flops, settings
        ),
    }


# --- decoding ------------------------------------------------------------------------------------------------------


def greedy_options(settings: Settings, static_compiled: bool = False) -> dict:
    """generate() settings: exactly `new_tokens` greedy steps; a static cache compiles the decoding step with
    fullgraph=True (generate does that itself on a GPU; on a CPU only when asked with `_compile_all_devices`)."""
    new_tokens = settings.shapes.new_tokens
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=1, do_sample=False)
    if static_compiled:
        compile_config = CompileConfig(fullgraph=True, backend=settings.compile_backend)
        compile_config._compile_all_devices = True
        options |= dict(cache_implementation="static", compile_config=compile_config)
    return options


def generator_of(model, source: torch.Tensor, options: dict) -> Callable[[], torch.Tensor]:
    @torch.inference_mode()
    def run():
        return model.generate(input_ids=source, attention_mask=torch.ones_like(source), **options)

    return run


def check_greedy_tokens(ours, marian, settings: Settings) -> None:
    """Greedy tokens equal in float32 (bfloat16 rounding flips near-ties of random weights: not a disagreement)."""
    source = torch.randint(
        3, ours.config.vocab_size, (2, settings.shapes.source_len), generator=torch.Generator().manual_seed(8)
    )
    options = greedy_options(settings) | dict(max_new_tokens=8, min_new_tokens=8)
    tokens = [generator_of(model, source.to(settings.device), options)() for model in (ours, marian)]
    if not torch.equal(*tokens):
        raise RuntimeError(f"Greedy tokens differ between ours and Marian in float32: {tokens}")


def decoding_section(settings: Settings) -> dict:
    """New tokens/s of greedy generate() at batch 1: ours and Marian eager (dynamic cache), then ours with a static
    cache, compiled."""
    shapes = settings.shapes
    ours, marian = build_pair(shapes.size, 0.0, torch.float32, settings.device, "sdpa")
    ours.eval(), marian.eval()
    check_greedy_tokens(ours, marian, settings)
    ours, marian = ours.to(settings.inference_dtype), marian.to(settings.inference_dtype)
    generator = torch.Generator().manual_seed(5)
    source = torch.randint(3, ours.config.vocab_size, (1, shapes.source_len), generator=generator).to(settings.device)
    run_ours, run_marian = (generator_of(model, source, greedy_options(settings)) for model in (ours, marian))
    eager_tokens = run_ours()
    same_tokens = bool(torch.equal(eager_tokens, run_marian()))
    eager = time_alternating(run_ours, run_marian, settings.repeats, settings.device)
    torch._dynamo.reset()
    run_static = generator_of(ours, source, greedy_options(settings, static_compiled=True))
    compile_seconds = first_call_seconds(run_static, settings.device)
    static_same_tokens = bool(torch.equal(run_static(), eager_tokens))
    # CUDA graphs are recorded on the calls after the compile: a second warm-up call.
    static = time_round_robin({"ours": run_static}, settings.repeats, warmup=2, device=settings.device)["ours"]
    return {
        "batch": 1,
        "source_len": shapes.source_len,
        "new_tokens": shapes.new_tokens,
        "dtype": str(settings.inference_dtype),
        # In the timed dtype: informative only (see check_greedy_tokens).
        "same_tokens_as_marian": same_tokens,
        "static_same_tokens_as_eager": static_same_tokens,
        "static_compiled": hasattr(ours, "_compiled_call"),
        "static_compile_seconds": compile_seconds,  # the first call, compiling included
        "ours_eager_tokens_per_s": shapes.new_tokens / eager.median_a,
        "marian_eager_tokens_per_s": shapes.new_tokens / eager.median_b,
        "eager_speed_ratio": eager.ratio,
        "ours_static_compiled_tokens_per_s": shapes.new_tokens / statistics.median(static),
        "static_compiled_over_marian_eager": eager.median_b / statistics.median(static),
        "seconds": {"ours_eager": eager.seconds_a, "marian_eager": eager.seconds_b, "ours_static_compiled": static},
    }


# --- MoE experts functions -----------------------------------------------------------------------------------------


def moe_block(settings: Settings) -> torch.nn.Module:
    """The MoE FFN of one layer of transformer-base (ReLU experts of the dense FFN's size, 8 experts, top 2)."""
    d_model, expert_dim = settings.shapes.moe_dims
    config = VanillaTransformerConfig(
        vocab_size=16,
        d_model=d_model,
        encoder_layers=1,
        decoder_layers=0,
        is_encoder_decoder=False,
        encoder_ffn_dim=expert_dim,
        decoder_ffn_dim=expert_dim,
        num_experts=8,
        num_experts_per_tok=2,
        dropout=0.0,
    )
    block = VanillaTransformerModel(config).encoder.layers[0].mlp
    return block.to(device=settings.device, dtype=settings.inference_dtype).train()


def moe_forward_backward(block: torch.nn.Module, hidden_states: torch.Tensor, implementation: str):
    def run():
        block.experts.config._experts_implementation = implementation
        block.zero_grad(set_to_none=True)
        output = block(hidden_states)
        output.float().sum().backward()
        return output.detach()

    return run


def moe_section(settings: Settings) -> dict:
    """Forward + backward of one MoE block per experts function; a function that raises (refused shape, out of
    memory) is recorded with its error instead of timed."""
    block = moe_block(settings)
    generator = torch.Generator().manual_seed(0)
    d_model = settings.shapes.moe_dims[0]
    hidden_states = torch.randn(settings.shapes.moe_tokens, d_model, generator=generator)
    hidden_states = hidden_states.to(settings.device, settings.inference_dtype)
    runs = {name: moe_forward_backward(block, hidden_states, name) for name in EXPERTS_IMPLEMENTATIONS}
    reference = runs["eager"]().float()
    rows, timed = {}, {}
    for name, run in runs.items():
        try:
            difference = (run().float() - reference).abs().max().item() / reference.abs().max().item()
        except (torch.OutOfMemoryError, RuntimeError, NotImplementedError, ValueError) as error:
            rows[name] = {"refused": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
            torch.cuda.empty_cache() if settings.device.type == "cuda" else None
            continue
        rows[name] = {"max_rel_diff_vs_eager": difference}
        timed[name] = run
    seconds = time_round_robin(timed, settings.repeats, device=settings.device)
    tokens = settings.shapes.moe_tokens
    for name, values in seconds.items():
        rows[name] |= {"tokens_per_s": tokens / statistics.median(values), "seconds": values}
    for name in seconds:
        rows[name]["speed_vs_eager"] = rows[name]["tokens_per_s"] / rows["eager"]["tokens_per_s"]
    tolerance = 5e-2 if settings.inference_dtype == torch.bfloat16 else 1e-4
    if any(row.get("max_rel_diff_vs_eager", 0) > tolerance for row in rows.values()):
        raise RuntimeError(f"An experts function disagrees with eager beyond {tolerance}: {rows}")
    return {
        "tokens": tokens,
        "d_model": d_model,
        "expert_dim": settings.shapes.moe_dims[1],
        "num_experts": 8,
        "top_k": 2,
        "dtype": str(settings.inference_dtype),
        "implementations": rows,
    }


# --- the Multi30k recipe's model -----------------------------------------------------------------------------------


def recipe_section(settings: Settings) -> dict:
    """Training steps/s of the recipe's model at its batch (64 sentence pairs; quick: a tiny model, batch 8), as the
    Trainer steps it on a GPU: bf16 autocast, fused AdamW, label-smoothed loss inside the model (ModelLossMixin),
    the batch from the training scripts' collator."""
    overrides, batch_size = settings.shapes.recipe
    config = VanillaTransformerConfig.from_preset("transformer-base", **overrides)
    model = VanillaTransformerForConditionalGeneration(config).to(settings.device).train()
    model.loss_function = label_smoothed_loss(LABEL_SMOOTHING)
    features = sentence_pairs(config.vocab_size, batch_size, RECIPE_LENGTHS, seed=13)
    batch = ours_collator(model, padding_tokenizer(config.vocab_size), settings)(features)
    batch = to_device(dict(batch), settings.device)
    step = training_step(model, batch, fused_adamw(model), settings, **OURS_TRAINING_KWARGS)
    seconds = time_round_robin({"step": step}, settings.repeats, device=settings.device)["step"]
    target_tokens = sum(len(f["labels"]) for f in features)
    return {
        "config_overrides": overrides,
        "batch": batch_size,
        "layout": layout_of(batch),
        "target_tokens": target_tokens,
        "steps_per_s": 1 / statistics.median(seconds),
        "tokens_per_s": target_tokens / statistics.median(seconds),
        "seconds": seconds,
    }


# --- sections, targets and the run ---------------------------------------------------------------------------------

# name -> compute(settings, peak matmul FLOP/s), the most important first.
SECTIONS: dict[str, Callable[[Settings, float], dict]] = {
    "trainer": lambda settings, peak_flops: trainer_section(settings),
    "training_step": training_step_section,
    "decoding": lambda settings, peak_flops: decoding_section(settings),
    "full_rows_compiled": full_rows_compiled_section,
    "moe": lambda settings, peak_flops: moe_section(settings),
    "multi30k_recipe": lambda settings, peak_flops: recipe_section(settings),
}
# The targets need these; moe and multi30k_recipe run when asked (with them a GPU run passes 5 minutes).
DEFAULT_SECTIONS = ("trainer", "training_step", "decoding", "full_rows_compiled")

# (section, target name, the measured value, target): the GPU bfloat16 targets.
TARGETS: list[tuple[str, str, Callable[[dict], float], float]] = [
    ("trainer", "Seq2SeqTrainer, random batches: ours/Marian steps/s",
     lambda r: r["sampling"]["random"]["speed_ratio"], 1.5),
    ("trainer", "Seq2SeqTrainer, group_by_length: ours/Marian steps/s",
     lambda r: r["sampling"]["group_by_length"]["speed_ratio"], 1.2),
    ("training_step", "train ~32k target tokens, flattened, eager: ours MFU",
     lambda r: r["candidates"]["ours_flattened"]["mfu"], 0.30),
    ("decoding", "decode greedy batch 1, eager: ours/Marian tokens/s", lambda r: r["eager_speed_ratio"], 1.0),
    ("decoding", "decode greedy batch 1: ours static cache compiled / Marian eager",
     lambda r: r["static_compiled_over_marian_eager"], 3.0),
    ("full_rows_compiled", "train full rows, compiled: ours/Marian tokens/s",
     lambda r: r["candidates"]["ours"]["speed_vs_marian"], 1.1),
]  # fmt: skip


def targets(results: dict) -> list[dict]:
    """The targets of the sections that ran (a failed section's are left out: its error is in the JSON)."""
    found = []
    for section, name, value, target in TARGETS:
        if section in results and "error" not in results[section]:
            measured = value(results[section])
            found.append({"name": name, "value": measured, "target": target, "passed": measured >= target})
    return found


def attention_kernel_facts() -> dict:
    """Which attention a flattened batch runs here: torch's `varlen_attn` (its keywords changed across releases:
    `is_causal` in torch 2.10/2.11, `scale`, `window_size` and `enable_gqa` from 2.12; see
    `packing_vanilla_transformer.VARLEN_SIGNATURE`) and whether our model calls it on CUDA in bfloat16."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        signature = str(inspect.signature(varlen_attn))
    except ImportError:
        signature = None
    runs = varlen_kernel("sdpa", "cuda", torch.bfloat16) is not None
    return {"varlen_attn_signature": signature, "varlen_kernel_runs_cuda_bf16": runs}


def run_section(results: dict, name: str, compute: Callable[[], object], output: Path) -> None:
    """Runs one section into `results[name]` (or its error), then rewrites the JSON: a run cut short keeps it all."""
    start = time.perf_counter()
    print(f"\n== {name}", flush=True)
    try:
        results[name] = compute()
    except Exception as error:  # one failed section must not lose the device time of the others
        traceback.print_exc()
        results[name] = {"error": f"{type(error).__name__}: {error}"}
    results["section_seconds"][name] = time.perf_counter() - start
    write_results(results, output, "gpu")


def run(settings: Settings, sections: tuple[str, ...], output: Path) -> dict:
    results = {
        "environment": environment(settings.device) | attention_kernel_facts(),
        "quick": settings.quick,
        "sections": list(sections),
        "repeats": settings.repeats,
        "model_size": settings.shapes.size,
        "training_precision": "float32 weights, bfloat16 autocast, fused AdamW, dropout 0.1",
        "inference_dtype": str(settings.inference_dtype),
        "compile_backend": settings.compile_backend,
        "section_seconds": {},
    }
    # The MFU denominator: about a second, so measured whatever the sections.
    size, repeats = settings.shapes.matmul_size, max(3, settings.repeats)
    run_section(
        results, "peak_matmul_flops", partial(matmul_peak_flops, size, torch.bfloat16, settings.device, repeats), output
    )
    peak_flops = results["peak_matmul_flops"] if isinstance(results["peak_matmul_flops"], float) else math.nan
    for name in sections:
        run_section(results, name, partial(SECTIONS[name], settings, peak_flops), output)
    results["targets"] = targets(results)
    write_results(results, output, "gpu")
    return results


def print_summary(results: dict) -> None:
    env = results["environment"]
    print(f"\n{env.get('gpu') or env.get('cpu')} | torch {env['torch']} | transformers {env['transformers']}")
    print(f"varlen_attn{env['varlen_attn_signature']}; our model runs it: {env['varlen_kernel_runs_cuda_bf16']}")
    if isinstance(results.get("peak_matmul_flops"), float):
        print(f"bf16 matmul peak: {results['peak_matmul_flops'] / 1e12:.2f} TFLOP/s")
    trainer = results.get("trainer", {})
    for sampling, r in trainer.get("sampling", {}).items():
        print(
            f"Seq2SeqTrainer {sampling:15} ms/step ours ({trainer['ours_layout']}) {r['ours']['ms_per_step']:.1f} "
            f"Marian {r['marian']['ms_per_step']:.1f} = {r['speed_ratio']:.2f}x (fresh weights each; ours: "
            f"{trainer['loss_paths']['ours']}; Marian: {trainer['loss_paths']['marian']})"
        )
    for section in ("training_step", "full_rows_compiled"):
        for name, r in results.get(section, {}).get("candidates", {}).items():
            print(
                f"{section} {name:15} {r['ms_per_step']:.1f} ms, {r['tokens_per_s']:.0f} tok/s = "
                f"{r['speed_vs_marian']:.2f}x Marian | MFU {r['mfu']:.1%} | peak {r['peak_memory_mb']:.0f} MiB"
            )
    decoding = results.get("decoding", {})
    if "eager_speed_ratio" in decoding:
        print(
            f"decode greedy b1 tok/s: eager ours {decoding['ours_eager_tokens_per_s']:.1f} Marian "
            f"{decoding['marian_eager_tokens_per_s']:.1f}; ours static compiled "
            f"{decoding['ours_static_compiled_tokens_per_s']:.1f}"
        )
    for name, r in results.get("moe", {}).get("implementations", {}).items():
        print(f"MoE {name:17} " + (f"refused: {r['refused']}" if "refused" in r else f"{r['tokens_per_s']:.0f} tok/s"))
    recipe = results.get("multi30k_recipe", {})
    if "steps_per_s" in recipe:
        print(f"Multi30k recipe model, batch {recipe['batch']}: {recipe['steps_per_s']:.2f} steps/s")
    errors = [name for name, value in results.items() if isinstance(value, dict) and "error" in value]
    print("\nTargets (issue items 6-7, GPU bfloat16)" + (f"; failed sections: {errors}" if errors else ""))
    for t in results["targets"]:
        print(f"  {'PASS' if t['passed'] else 'FAIL'}  {t['name']}: {t['value']:.3g} (target >= {t['target']})")


def section_list(text: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in text.split(","))
    unknown = [name for name in names if name not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, 2 repeats, every section: a CPU smoke run")
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is present")
    parser.add_argument(
        "--sections",
        type=section_list,
        default=None,
        help=f"comma-separated, from {', '.join(SECTIONS)} (default: {', '.join(DEFAULT_SECTIONS)}; quick: all)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per comparison (default 10; quick 2)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()
    settings = settings_from(args)
    sections = args.sections or (tuple(SECTIONS) if args.quick else DEFAULT_SECTIONS)
    if settings.quick and settings.device.type == "cpu":
        # A smoke run's timings mean nothing; one thread keeps it from stalling in OpenMP spin-waits when other
        # processes share the cores (see multi30k.sh).
        torch.set_num_threads(1)
    output = args.output or Path(__file__).parent / "results" / time.strftime("gpu-%Y%m%d-%H%M%S.json", time.gmtime())
    results = run(settings, sections, output)
    print_summary(results)
    sys.exit(any(isinstance(value, dict) and "error" in value for value in results.values()))


if __name__ == "__main__":
    main()
