"""PyTorch's CPU attention kernels in training: SDPA's flash kernel against its math kernel, forward and backward.

    python benchmarks/cpu_attention_kernels.py            # the threads torch picks (all cores)

The numbers behind `SHORT_SEQUENCE_ON_CPU` (cpu_training_vanilla_transformer, `optimize_for_cpu_training`): training in
bfloat16 or float16 on a CPU, short sequences take the math kernel, because the flash kernel's backward is the slower
one there. Each row times one
forward + backward of SDPA on (batch, 8 heads, length, 64) with a padding mask (or causal), batch x length = 4096
tokens, the two kernels alternating (`time_alternating`, median per-round ratio).
"""

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from measure import environment, time_alternating, write_results
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM, TOKENS = 8, 64, 4096


def forward_backward(backend: SDPBackend, dtype: torch.dtype, length: int, causal: bool):
    """One SDPA forward and backward under `backend`, on fixed random inputs with rows padded to random lengths."""
    generator = torch.Generator().manual_seed(0)
    batch = TOKENS // length
    query, key, value = (
        torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator, dtype=dtype).requires_grad_() for _ in range(3)
    )
    lengths = torch.randint(length // 3 + 1, length + 1, (batch,), generator=generator)
    mask = None if causal else (torch.arange(length) < lengths[:, None])[:, None, None, :]
    upstream = torch.randn(batch, HEADS, length, HEAD_DIM, generator=generator, dtype=dtype)

    def run():
        with sdpa_kernel(backend):
            F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal).backward(upstream)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()

    rows = []
    print(f"{'dtype':9s} {'length':>6s} {'mask':7s} {'flash ms':>9s} {'math ms':>8s} {'flash / math':>12s}")
    for dtype in (torch.bfloat16, torch.float32):
        for length in args.lengths:
            for causal in (False, True):
                flash, math = (
                    forward_backward(backend, dtype, length, causal)
                    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)
                )
                timing = time_alternating(flash, math, args.repeats, torch.device("cpu"))
                row = dict(
                    dtype=str(dtype).removeprefix("torch."),
                    length=length,
                    mask="causal" if causal else "padding",
                    flash_ms=timing.median_a * 1e3,
                    math_ms=timing.median_b * 1e3,
                    flash_over_math=statistics.median(f / m for f, m in zip(timing.seconds_a, timing.seconds_b)),
                )
                rows.append(row)
                print(
                    f"{row['dtype']:9s} {length:6d} {row['mask']:7s} {row['flash_ms']:9.2f} {row['math_ms']:8.2f} "
                    f"{row['flash_over_math']:12.2f}",
                    flush=True,
                )
    write_results({"environment": environment(torch.device("cpu")), "rows": rows}, args.output, "cpu-attention")


if __name__ == "__main__":
    main()
