"""Speed and memory of hf_vanilla_transformer against transformers' own models, side by side in one process.

    python benchmarks/run_benchmarks.py            # full run (about 10 minutes on 2 CPU cores)
    python benchmarks/run_benchmarks.py --quick    # smaller shapes and fewer repetitions, for a smoke run

Every comparison times our model and the reference in alternating rounds (median of >= 5) and reports ours/reference:
  * training: tokens/s of forward + backward + AdamW step, against `MarianMTModel` with the same dimensions and the
    same weights (a small size and the paper's transformer-base), on full rows and on a padded batch (ours gets the
    same sentences from its padding-free collator, collated inside its timed step; on a CPU ours runs
    `optimize_for_cpu_training`, as the training scripts do, and is timed against itself without it), plus MFU = model
    FLOPs/s of the real tokens over the FLOP/s of one big matmul measured in the same run, and peak training memory;
  * decoding: greedy and beam-4 new tokens/s at batch 1 and 8 through `generate()`;
  * CPU decoding (`--sections cpu_decode`): HF Marian, ours through `optimize_for_cpu_inference` (float32, bfloat16,
    int8) and CTranslate2 (float32, int8) on the same transformer-base weights, 1 thread CPU clock and 2 threads wall
    clock, with the measured memory bandwidth and the weight-read limit of a decoding step (cpu_decoding.py);
  * MoE: our sparse MoE layer against HF `MixtralSparseMoeBlock` (eager and grouped_mm experts) and against a dense
    FFN with the same active parameters.
fp32 on CPU; bf16 with sdpa on a GPU when one is present. Prints a table and writes JSON to benchmarks/results/.
"""

import argparse
import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from cpu_decoding import cpu_decoding_section, print_cpu_decoding
from marian_twin import SIZES, build_pair, training_flops
from measure import (
    environment,
    matmul_peak_flops,
    optimizer_state_bytes,
    peak_memory_bytes,
    tensor_bytes,
    time_alternating,
    write_results,
)
from moe_layer import moe_section

from hf_vanilla_transformer import DataCollatorForSeq2SeqWithFlattening, optimize_for_cpu_training


@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    attn_implementation: str
    repeats: int
    quick: bool
    clock: str = "wall"


def settings_from(args: argparse.Namespace) -> Settings:
    on_gpu = torch.cuda.is_available() and not args.cpu
    return Settings(
        device=torch.device("cuda" if on_gpu else "cpu"),
        dtype=torch.bfloat16 if on_gpu else torch.float32,
        attn_implementation="sdpa",
        repeats=args.repeats or (5 if args.quick else 7),
        quick=args.quick,
        clock=args.clock,
    )


def random_batch(vocab_size: int, batch: int, length: int, device: torch.device, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (batch, length), generator=generator).to(device)  # 0-2 are special ids


def check_same_function(ours, marian, settings: Settings) -> float:
    """Max |logit difference| of the two models on one batch: both must compute the same function."""
    source = random_batch(ours.config.vocab_size, 2, 12, settings.device, seed=1)
    target = random_batch(ours.config.vocab_size, 2, 9, settings.device, seed=2)
    ours.eval(), marian.eval()
    with torch.no_grad():
        difference = (
            (
                ours(input_ids=source, decoder_input_ids=target).logits.float()
                - marian(input_ids=source, decoder_input_ids=target).logits.float()
            )
            .abs()
            .max()
            .item()
        )
    tolerance = 1e-3 if settings.dtype == torch.float32 else 0.5
    if difference > tolerance:
        raise RuntimeError(f"Our model and its Marian twin disagree (max |logit diff| = {difference:.3g}).")
    return difference


def random_lengths(batch: int, length: int, padded: bool, seed: int) -> torch.Tensor:
    """Every row full, or lengths uniform in [length/8, length] with the longest one full: a randomly drawn batch
    (transformers' Trainer default, `group_by_length=False`) padded to its longest row, about 45 % padding."""
    if not padded:
        return torch.full((batch,), length)
    lengths = torch.randint(max(1, length // 8), length + 1, (batch,), generator=torch.Generator().manual_seed(seed))
    lengths[0] = length
    return lengths


def padded_to(tensor: torch.Tensor, lengths: torch.Tensor, value: int) -> torch.Tensor:
    positions = torch.arange(tensor.shape[1], device=tensor.device)
    return tensor.masked_fill(positions >= lengths.to(tensor.device)[:, None], value)


def training_section(size: str, batch: int, length: int, padded: bool, settings: Settings, peak_flops: float) -> dict:
    """Tokens/s, MFU and peak memory of one full training step (dropout on), ours vs Marian, on full rows or on a
    padded batch (source and target lengths drawn independently; the collator's -100 on padded labels)."""
    ours, marian = build_pair(size, 0.1, settings.dtype, settings.device, settings.attn_implementation)
    logit_difference = check_same_function(ours, marian, settings)
    source_lengths = random_lengths(batch, length, padded, seed=6)
    target_lengths = random_lengths(batch, length, padded, seed=7)
    pad = ours.config.pad_token_id
    source = padded_to(
        random_batch(ours.config.vocab_size, batch, length, settings.device, seed=3), source_lengths, pad
    )
    labels = padded_to(
        random_batch(ours.config.vocab_size, batch, length, settings.device, seed=4), target_lengths, -100
    )
    attention_mask = (source != pad).long()
    # Ours trains on the same sentences laid end to end by its collator (padding-free), collated inside its timed
    # step, as a data loader without workers would; Marian gets the padded tensors ready-made.
    features = [
        {"input_ids": row[:length].tolist(), "labels": target[:target_length].tolist()}
        for row, length, target, target_length in zip(source.cpu(), source_lengths, labels.cpu(), target_lengths)
    ]
    collator = DataCollatorForSeq2SeqWithFlattening(ours)
    # The same sentences packed into rows as long as the batch's (attention per row, no gathers).
    rows_collator = DataCollatorForSeq2SeqWithFlattening(ours, row_length=length)

    def our_batch(collate=collator) -> dict:
        batch = collate(features)
        return {key: value.to(settings.device) if torch.is_tensor(value) else value for key, value in batch.items()}

    def marian_batch() -> dict:
        return dict(input_ids=source, attention_mask=attention_mask, labels=labels)

    def make_step(model, batch_of):
        model.train()
        # fused AdamW: one kernel over all parameters, what a speed-conscious user picks (same for both models).
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step():
            loss = model(**batch_of()).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step, optimizer

    # On a CPU ours trains as the training scripts train it, with `optimize_for_cpu_training`; the model without it
    # (the same weights) is timed against it, for what the opt-in gains.
    plain = copy.deepcopy(ours) if settings.device.type == "cpu" else None
    if plain is not None:
        optimize_for_cpu_training(ours)
    step_ours, optimizer_ours = make_step(ours, our_batch)
    step_marian, optimizer_marian = make_step(marian, marian_batch)
    timing = time_alternating(step_ours, step_marian, settings.repeats, settings.device, settings.clock)
    opt_in_timing = None
    if plain is not None:
        step_plain, _ = make_step(plain, our_batch)
        opt_in_timing = time_alternating(step_ours, step_plain, settings.repeats, settings.device, settings.clock)
    rows_timing = None
    if padded:
        step_rows, _ = make_step(ours, lambda: our_batch(rows_collator))
        rows_timing = time_alternating(step_rows, step_marian, settings.repeats, settings.device, settings.clock)

    def peak(model, step, optimizer):  # after the timed steps, so the optimizer state exists
        persistent = tensor_bytes(model.state_dict(keep_vars=True).values()) + optimizer_state_bytes(optimizer)
        return peak_memory_bytes(step, persistent, settings.device)

    peak_ours = peak(ours, step_ours, optimizer_ours)
    peak_marian = peak(marian, step_marian, optimizer_marian)
    # Model FLOPs of the real tokens, row by row: padding is not useful work, whoever computes it.
    flops = sum(training_flops(ours.config, 1, s, t) for s, t in zip(source_lengths.tolist(), target_lengths.tolist()))
    tokens = int(target_lengths.sum())  # real target tokens (fairseq's words/s)
    return {
        "size": size,
        "batch": batch,
        "length": length,
        "padded": padded,
        "padding_fraction": 1 - (int(source_lengths.sum()) + tokens) / (2 * batch * length),
        "logit_max_abs_diff": logit_difference,
        "ours_tokens_per_s": tokens / timing.median_a,
        "marian_tokens_per_s": tokens / timing.median_b,
        "speed_ratio": timing.ratio,
        "cpu_opt_in_gain": opt_in_timing.ratio if opt_in_timing else None,
        "rows_speed_ratio": rows_timing.ratio if rows_timing else None,
        "seconds_ours_rows": rows_timing.seconds_a if rows_timing else None,
        "ours_mfu": flops / timing.median_a / peak_flops,
        "marian_mfu": flops / timing.median_b / peak_flops,
        "ours_peak_memory_mb": peak_ours / 2**20,
        "marian_peak_memory_mb": peak_marian / 2**20,
        "memory_ratio": peak_ours / peak_marian,
        "seconds_ours": timing.seconds_a,
        "seconds_marian": timing.seconds_b,
    }


def decoding_section(size: str, batch: int, num_beams: int, source_len: int, new_tokens: int, settings: Settings):
    """New tokens/s of `generate()` (greedy or beam search), ours vs Marian, each with its default settings."""
    ours, marian = build_pair(size, 0.0, settings.dtype, settings.device, settings.attn_implementation)
    ours.eval(), marian.eval()
    source = random_batch(ours.config.vocab_size, batch, source_len, settings.device, seed=5)
    # min_new_tokens = max_new_tokens: both decode exactly `new_tokens` steps whatever the random weights predict.
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, num_beams=num_beams, do_sample=False)

    def generate(model):
        @torch.inference_mode()
        def run():
            return model.generate(input_ids=source, attention_mask=torch.ones_like(source), **options)

        return run

    same_tokens = bool(torch.equal(generate(ours)(), generate(marian)()))
    timing = time_alternating(generate(ours), generate(marian), settings.repeats, settings.device, settings.clock)
    tokens = batch * new_tokens
    return {
        "size": size,
        "batch": batch,
        "num_beams": num_beams,
        "source_len": source_len,
        "new_tokens": new_tokens,
        "same_tokens_as_marian": same_tokens,
        "ours_tokens_per_s": tokens / timing.median_a,
        "marian_tokens_per_s": tokens / timing.median_b,
        "speed_ratio": timing.ratio,
        "seconds_ours": timing.seconds_a,
        "seconds_marian": timing.seconds_b,
    }


def run(settings: Settings, sections: set[str], sizes: list[str] | None = None) -> dict:
    results = {
        "environment": environment(settings.device),
        "dtype": str(settings.dtype),
        "quick": settings.quick,
        "clock": settings.clock,
        "repeats": settings.repeats,
    }
    matmul_size = 2048 if settings.quick else 4096
    results["peak_matmul_flops"] = matmul_peak_flops(
        matmul_size, settings.dtype, settings.device, settings.repeats, settings.clock
    )
    sizes = sizes or (["small"] if settings.quick else list(SIZES))
    if "train" in sections:
        shapes = {"small": (16, 32), "transformer-base": (8, 32)}
        results["training"] = [
            training_section(size, *shapes[size], padded, settings, results["peak_matmul_flops"])
            for padded in (False, True)
            for size in sizes
        ]
        # The matmul peak again after training: the higher of the two is the MFU denominator (a shared machine only
        # ever makes it look lower).
        peak_again = matmul_peak_flops(matmul_size, settings.dtype, settings.device, settings.repeats, settings.clock)
        if peak_again > results["peak_matmul_flops"]:
            for row in results["training"]:
                row["ours_mfu"] *= results["peak_matmul_flops"] / peak_again
                row["marian_mfu"] *= results["peak_matmul_flops"] / peak_again
            results["peak_matmul_flops"] = peak_again
    if "decode" in sections:
        new_tokens = 16 if settings.quick else 32
        results["decoding"] = [
            decoding_section(size, batch, beams, 24, new_tokens, settings)
            for size in sizes
            for batch in (1, 8)
            for beams in (1, 4)
        ]
    if "cpu_decode" in sections:
        results["cpu_decoding"] = cpu_decoding_section(
            settings.repeats, new_tokens=32 if settings.quick else 64, quick=settings.quick
        )
    if "moe" in sections:
        results["moe"] = moe_section(settings, tokens=1024 if settings.quick else 4096)
    return results


def print_table(results: dict) -> None:
    env = results["environment"]
    hardware = env.get("gpu") or f"{env['cpu']} ({env['threads']} threads)"
    print(f"\n{hardware} | torch {env['torch']} | transformers {env['transformers']} | {results['dtype']}")
    print(f"peak matmul: {results['peak_matmul_flops'] / 1e9:.1f} GFLOP/s\n")
    rows = [("benchmark", "ours", "Marian", "ours/Marian")]
    for row in results.get("training", []):
        name = f"train {row['size']} b{row['batch']}x{row['length']}"
        if row["padded"]:
            name += f" {row['padding_fraction']:.0%} pad"
        rows.append(
            (
                f"{name} tok/s",
                f"{row['ours_tokens_per_s']:.0f}",
                f"{row['marian_tokens_per_s']:.0f}",
                f"{row['speed_ratio']:.2f}x",
            )
        )
        if row["cpu_opt_in_gain"] is not None:
            rows.append((f"{name} optimize_for_cpu_training gain", "", "", f"{row['cpu_opt_in_gain']:.2f}x"))
        if row["rows_speed_ratio"] is not None:
            rows.append((f"{name} packed rows, vs Marian", "", "", f"{row['rows_speed_ratio']:.2f}x"))
        rows.append((f"{name} MFU", f"{row['ours_mfu']:.1%}", f"{row['marian_mfu']:.1%}", ""))
        rows.append(
            (
                f"{name} peak MiB",
                f"{row['ours_peak_memory_mb']:.0f}",
                f"{row['marian_peak_memory_mb']:.0f}",
                f"{row['memory_ratio']:.2f}x",
            )
        )
    for row in results.get("decoding", []):
        mode = "greedy" if row["num_beams"] == 1 else f"beam{row['num_beams']}"
        name = f"{mode} {row['size']} b{row['batch']} tok/s"
        rows.append(
            (name, f"{row['ours_tokens_per_s']:.1f}", f"{row['marian_tokens_per_s']:.1f}", f"{row['speed_ratio']:.2f}x")
        )
    for row in results.get("moe", []):
        rows.append(
            (
                row["name"],
                f"{row['ours_tokens_per_s']:.0f}",
                f"{row['reference_tokens_per_s']:.0f}",
                f"{row['speed_ratio']:.2f}x",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))))
    if "cpu_decoding" in results:
        print_cpu_decoding(results["cpu_decoding"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model only, fewer steps (a smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per comparison (default 7; quick 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or process CPU time (steadier on a busy machine with --threads 1)",
    )
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU even when a GPU is present")
    parser.add_argument(
        "--sections", default="train,decode,moe", help="comma-separated subset of train,decode,cpu_decode,moe"
    )
    parser.add_argument("--sizes", default=None, help=f"comma-separated subset of {','.join(SIZES)} (default: all)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = settings_from(args)
    if settings.repeats < 5:
        sys.exit("--repeats must be at least 5: the reported numbers are medians.")
    results = run(settings, set(args.sections.split(",")), args.sizes.split(",") if args.sizes else None)
    print_table(results)
    write_results(results, args.output, settings.device.type)


if __name__ == "__main__":
    main()
