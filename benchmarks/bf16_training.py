"""bfloat16 training on CPU against float32: the speed-up, and where a step's time goes.

    OMP_NUM_THREADS=1 python benchmarks/bf16_training.py             # about 5 minutes on 1 thread

`--bf16` in the Trainer runs the forward under `torch.autocast("cpu", dtype=torch.bfloat16)`: matmuls (and
attention) in bfloat16, weights, gradients and the optimizer in float32. This measures, in one process on 1 thread
with process CPU time, one training step (forward, backward, fused AdamW) of ours and of HF Marian with the same
weights (`marian_twin.py`), in float32 and under bfloat16 autocast, on `run_benchmarks.py`'s padded batch, in
rotating rounds; beside them the matmul peak of this CPU in both dtypes (the physical limit of the speed-up) and its
bfloat16 flags. Then the profiler's self CPU time of our two steps by kind of op: the matmuls are what bfloat16 can
speed up; casts are what autocast adds; attention, element-wise ops, norms, dropout and the optimizer it leaves as
they are. Results go to benchmarks/results/.
"""

import argparse
import statistics
from pathlib import Path

import torch
from marian_twin import build_pair
from measure import environment, matmul_peak_flops, time_round_robin, write_results
from run_benchmarks import padded_to, random_batch, random_lengths
from torch.profiler import ProfilerActivity, profile

# (batch, length) of run_benchmarks.py's training section.
SHAPES = {"small": (16, 32), "transformer-base": (8, 32)}
# Kinds of op, by the first pattern their profiler name contains (in this order); the rest is "other".
KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn_linear", "aten::_weight"),
    "attention": ("scaled_dot_product", "flash_attention"),
    "dtype casts": ("aten::copy_", "aten::_to_copy"),
    "optimizer": ("adam", "Optimizer"),
    "dropout": ("bernoulli", "dropout"),
    "norms": ("layer_norm", "rms_norm"),
    "softmax and loss": ("softmax", "nll_loss", "cross_entropy"),
}


def kind_of(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, patterns in KINDS.items() if any(p.lower() in lowered for p in patterns)), "other")


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], bf16: bool):
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_by_kind(step, repeats: int = 3) -> dict[str, float]:
    """Self CPU seconds per step by kind of op (profiler), with the total."""
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            step()
    seconds: dict[str, float] = dict.fromkeys([*KINDS, "other"], 0.0)
    for event in prof.key_averages():
        seconds[kind_of(event.key)] += event.self_cpu_time_total / 1e6 / repeats
    return seconds | {"total": sum(seconds.values())}


def size_section(size: str, repeats: int) -> dict:
    batch_size, length = SHAPES[size]
    ours, marian = build_pair(size, 0.1, torch.float32, torch.device("cpu"), "sdpa")
    pad = ours.config.pad_token_id
    source = padded_to(
        random_batch(ours.config.vocab_size, batch_size, length, "cpu", 3),
        random_lengths(batch_size, length, True, 6),
        pad,
    )
    labels = padded_to(
        random_batch(ours.config.vocab_size, batch_size, length, "cpu", 4),
        random_lengths(batch_size, length, True, 7),
        -100,
    )
    batch = {"input_ids": source, "attention_mask": (source != pad).long(), "labels": labels}
    steps = {
        f"{name} {precision}": training_step(model, batch, precision == "bf16")
        for name, model in (("ours", ours), ("marian", marian))
        for precision in ("fp32", "bf16")
    }
    seconds = time_round_robin(steps, repeats, clock="cpu")
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    tokens = int((labels != -100).sum())
    return {
        "size": size,
        "batch": batch_size,
        "length": length,
        "tokens_per_s": {name: tokens / value for name, value in medians.items()},
        "bf16_over_fp32": {name: medians[f"{name} fp32"] / medians[f"{name} bf16"] for name in ("ours", "marian")},
        "ours_bf16_over_marian_bf16": medians["marian bf16"] / medians["ours bf16"],
        "ours_step_seconds_by_kind": {
            precision: time_by_kind(steps[f"ours {precision}"]) for precision in ("fp32", "bf16")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="transformer-base,small", help="comma-separated: transformer-base,small")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (the reported figures are medians)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    results = {
        "environment": environment(cpu),
        "matmul_peak_flops": {
            str(dtype): matmul_peak_flops(2048, dtype, cpu, args.repeats, clock="cpu")
            for dtype in (torch.float32, torch.bfloat16)
        },
        "sizes": [size_section(size, args.repeats) for size in args.sizes.split(",")],
    }
    peaks, cpu = results["matmul_peak_flops"], results["environment"]
    print(
        f"{cpu['cpu']} {cpu['bf16_flags']}: matmul 2048^3 fp32 {peaks['torch.float32'] / 1e9:.0f} GFLOP/s, "
        f"bf16 {peaks['torch.bfloat16'] / 1e9:.0f} GFLOP/s"
    )
    for section in results["sizes"]:
        speedups = ", ".join(f"{name} {value:.2f}x" for name, value in section["bf16_over_fp32"].items())
        print(
            f"{section['size']}: bf16/fp32 {speedups}; ours bf16 / Marian bf16 "
            f"{section['ours_bf16_over_marian_bf16']:.2f}x"
        )
        for precision, kinds in section["ours_step_seconds_by_kind"].items():
            print(f"  ours {precision}: " + ", ".join(f"{kind} {1e3 * value:.0f} ms" for kind, value in kinds.items()))
    write_results(results, args.output, "bf16-training")


if __name__ == "__main__":
    main()
