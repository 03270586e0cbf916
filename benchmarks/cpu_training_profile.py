"""Where a CPU training step's time goes, ours against HF Marian: torch.profiler's table of aten ops by self CPU time.

    python benchmarks/cpu_training_profile.py --size small --batch 16

The same weights and sentences as run_benchmarks.py's training section (lengths drawn in [length/8, length]): ours
flattened by its collator after `optimize_for_cpu_training` (`--plain` without it: attention under the block mask),
Marian padded; forward and backward, 1 thread, after two warm-up steps; prints ms a step (process CPU time over 5
steps) and the top ops of 3 profiled steps for each.
"""

import argparse
import time

import torch
from marian_twin import SIZES, build_pair
from run_benchmarks import padded_to, random_batch, random_lengths
from torch.profiler import profile

from hf_vanilla_transformer import DataCollatorForSeq2SeqWithFlattening, optimize_for_cpu_training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="small", choices=list(SIZES))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--plain", action="store_true", help="ours without optimize_for_cpu_training")
    parser.add_argument("--rows", type=int, default=18, help="ops listed for each model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    ours, marian = build_pair(args.size, 0.1, torch.float32, cpu, "sdpa")
    pad = ours.config.pad_token_id
    source_lengths, target_lengths = (random_lengths(args.batch, args.length, True, seed) for seed in (6, 7))
    source = padded_to(random_batch(ours.config.vocab_size, args.batch, args.length, cpu, seed=3), source_lengths, pad)
    labels = padded_to(random_batch(ours.config.vocab_size, args.batch, args.length, cpu, seed=4), target_lengths, -100)
    features = [
        {"input_ids": row[:s].tolist(), "labels": target[:t].tolist()}
        for row, s, target, t in zip(source, source_lengths, labels, target_lengths)
    ]
    collator = DataCollatorForSeq2SeqWithFlattening(ours)
    if not args.plain:
        optimize_for_cpu_training(ours)
    ours.train()
    marian.train()
    steps = {
        "ours, flattened": lambda: ours(**collator(features)).loss.backward(),
        "HF Marian, padded": lambda: marian(
            input_ids=source, attention_mask=(source != pad).long(), labels=labels
        ).loss.backward(),
    }
    for name, step in steps.items():
        step(), step()  # warm-up
        started = time.process_time()
        for _ in range(5):
            step()
        print(f"{name}: {(time.process_time() - started) / 5 * 1e3:.1f} ms a step (forward and backward)")
        with profile() as profiler:
            for _ in range(3):
                step()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
