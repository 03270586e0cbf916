"""Dropout in training on a CPU: torch's `nn.Dropout` against `CpuDropout` (`optimize_for_cpu_training`), forward and
backward.

    OMP_NUM_THREADS=1 python benchmarks/cpu_dropout.py --clock cpu     # the steady figure on a shared machine
    python benchmarks/cpu_dropout.py                                   # all cores, wall clock

The numbers behind `CpuDropout` (cpu_training_vanilla_transformer): on CPUs where torch samples a dropout mask one
element at a time (not Intel with MKL) it draws two elements per 64-bit draw. Each row times one dropout forward +
backward (p = 0.1) of an activation the size of a training batch of the image demo, the Multi30k recipe and
transformer-base, the two modules alternating (`time_alternating`, median per-round ratio). The last rows time the
mask alone: torch's Bernoulli sampler against `keep_mask`.
"""

import argparse
from pathlib import Path

import torch
from measure import environment, time_alternating, write_results

from hf_vanilla_transformer.cpu_training_vanilla_transformer import (
    CpuDropout,
    cpu_samples_dropout_per_element,
    keep_mask,
)

SHAPES = {
    "image demo (64, 17, 64)": (64, 17, 64),
    "Multi30k recipe (64, 25, 256)": (64, 25, 256),
    "transformer-base FFN (32, 32, 2048)": (32, 32, 2048),
}
P = 0.1


def forward_backward(module: torch.nn.Module, inputs: torch.Tensor, upstream: torch.Tensor):
    def run():
        module(inputs).backward(upstream)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if not cpu_samples_dropout_per_element():
        print("This CPU samples torch's dropout masks with MKL: optimize_for_cpu_training keeps nn.Dropout here.")

    rows = []
    print(f"{'activation':38s} {'dtype':9s} {'torch us':>9s} {'ours us':>8s} {'torch / ours':>12s}")
    for name, shape in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            inputs = torch.randn(shape, dtype=dtype, requires_grad=True)
            upstream = torch.randn(shape, dtype=dtype)
            torch_run, ours_run = (
                forward_backward(module(P).train(), inputs, upstream) for module in (torch.nn.Dropout, CpuDropout)
            )
            rows.append(row(name, str(dtype).removeprefix("torch."), torch_run, ours_run, args))
    mask_shape = SHAPES["Multi30k recipe (64, 25, 256)"]
    noise = torch.empty(mask_shape)
    rows.append(
        row(
            "mask only (64, 25, 256)",
            "bool",
            lambda: noise.bernoulli_(1 - P),
            lambda: keep_mask(noise.shape, round(P * 2**32)),
            args,
        )
    )
    results = dict(environment=environment(torch.device("cpu")), p=P, clock=args.clock, rows=rows)
    results["environment"]["samples_dropout_per_element"] = cpu_samples_dropout_per_element()
    write_results(results, args.output, "cpu-dropout")


def row(name: str, dtype: str, torch_run, ours_run, args: argparse.Namespace) -> dict:
    timing = time_alternating(ours_run, torch_run, args.repeats, torch.device("cpu"), clock=args.clock, warmup=5)
    result = dict(
        activation=name, dtype=dtype, torch_us=timing.median_b * 1e6, ours_us=timing.median_a * 1e6, ratio=timing.ratio
    )
    print(
        f"{name:38s} {dtype:9s} {result['torch_us']:9.1f} {result['ours_us']:8.1f} {result['ratio']:12.2f}", flush=True
    )
    return result


if __name__ == "__main__":
    main()
