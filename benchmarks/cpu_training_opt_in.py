"""What `optimize_for_cpu_training` gains on a CPU training step: the same model with and without it, side by side.

    python benchmarks/cpu_training_opt_in.py --threads 1 --clock cpu     # about 4 minutes

One training step (forward with labels, backward, fused AdamW) of the seq2seq model, dropout 0.1, on
run_benchmarks.py's mixed-length batch laid end to end by `DataCollatorForSeq2SeqWithFlattening` (collated outside
the timed step), in float32 and under bfloat16 autocast (the Trainer's `--bf16`), for the sizes of run_benchmarks.py
and the d_model 64 model of the tests' scale. The two copies hold the same weights and alternate rounds
(`time_alternating`, median of the per-round ratios: plain time / opted-in time, > 1 where the opt-in is faster).
Which of its two changes applies is printed: the cheaper dropout mask on CPUs that sample torch's per element (not
Intel with MKL), the math SDPA kernel in half precision at short sequences.
"""

import argparse
import copy
from pathlib import Path

import torch
from bf16_training import training_step
from marian_twin import build_pair
from measure import environment, time_alternating, write_results
from run_benchmarks import padded_to, random_batch, random_lengths

from hf_vanilla_transformer import DataCollatorForSeq2SeqWithFlattening, optimize_for_cpu_training
from hf_vanilla_transformer.cpu_training_vanilla_transformer import cpu_samples_dropout_per_element

# size -> (batch, length), as run_benchmarks.py's training section; "tiny" is d_model 64 (marian_twin's).
SHAPES = {"tiny": (32, 24), "small": (16, 32), "transformer-base": (8, 32)}


def flattened_batch(model, batch: int, length: int) -> dict:
    """Sentences of mixed lengths (about 40 % of a padded batch would be padding), laid end to end."""
    vocab = model.config.vocab_size
    source_lengths, target_lengths = (random_lengths(batch, length, True, seed) for seed in (6, 7))
    sources = padded_to(random_batch(vocab, batch, length, torch.device("cpu"), seed=3), source_lengths, 0)
    targets = padded_to(random_batch(vocab, batch, length, torch.device("cpu"), seed=4), target_lengths, -100)
    features = [
        {"input_ids": source[:s].tolist(), "labels": target[:t].tolist()}
        for source, s, target, t in zip(sources, source_lengths, targets, target_lengths)
    ]
    return DataCollatorForSeq2SeqWithFlattening(model)(features)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"dropout masks per element (the opt-in's CpuDropout applies): {cpu_samples_dropout_per_element()}")
    rows = []
    for size, (batch_size, length) in SHAPES.items():
        plain, _ = build_pair(size, 0.1, torch.float32, torch.device("cpu"), "sdpa")
        opted = optimize_for_cpu_training(copy.deepcopy(plain))
        batch = flattened_batch(plain, batch_size, length)
        for bf16 in (False, True):
            timing = time_alternating(
                training_step(opted, batch, bf16), training_step(plain, batch, bf16), args.repeats,
                torch.device("cpu"), args.clock, warmup=2,
            )  # fmt: skip
            row = dict(size=size, batch=batch_size, length=length, bf16=bf16, gain=timing.ratio,
                       plain_ms=timing.median_b * 1e3, opted_ms=timing.median_a * 1e3)  # fmt: skip
            rows.append(row)
            dtype = "bfloat16" if bf16 else "float32"
            print(f"{size:17s} {dtype:9s} plain {row['plain_ms']:8.1f} ms  opted in {row['opted_ms']:8.1f} ms  "
                  f"gain {row['gain']:.2f}x", flush=True)  # fmt: skip
    environment_info = environment(torch.device("cpu"))
    environment_info["samples_dropout_per_element"] = cpu_samples_dropout_per_element()
    write_results(dict(environment=environment_info, clock=args.clock, rows=rows), args.output, "cpu-training-opt-in")


if __name__ == "__main__":
    main()
