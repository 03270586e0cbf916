"""Dropout (§5.4), with a cheaper mask on the CPUs where PyTorch samples it one element at a time.

PyTorch draws a CPU dropout mask with MKL's vectorised Bernoulli sampler only on Intel CPUs. On every other CPU (AMD,
Arm) it takes one Mersenne-Twister draw and one comparison in double precision per element, serially, a noticeable
share of a small model's training step. There `Dropout` splits each 64-bit draw of the same generator into two
uniform 32-bit integers and keeps an element where its integer clears the threshold: the same Bernoulli(1 - p) mask at
2^-32 resolution, scaled by 1 / (1 - p) as PyTorch scales it, in about half the time (docs/benchmarks.md, "Figures
quoted in the package's docstrings"). Everywhere else, and under torch.compile (which generates its own masks), it
is `nn.Dropout`.
"""

import functools
import math
import platform

import torch
from torch import nn
from transformers.utils import is_torchdynamo_compiling


@functools.cache
def cpu_samples_dropout_per_element() -> bool:
    """Whether PyTorch's CPU Bernoulli sampler is its element-by-element one: not an MKL build on an Intel CPU."""
    return not (torch.backends.mkl.is_available() and "GenuineIntel" in cpu_vendor())


def cpu_vendor() -> str:
    """The CPU's vendor string: /proc/cpuinfo on Linux, the processor name elsewhere (Windows includes the vendor)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("vendor_id")), "")
    except OSError:
        return platform.processor()


def keep_mask(shape: torch.Size, dropped_per_2_32: int) -> torch.Tensor:
    """A bool mask of `shape`, each element False with probability dropped_per_2_32 / 2^32, independently: two
    uniform 32-bit integers per draw of the CPU generator (every 64 bits of it random), kept where at least the
    threshold."""
    count = math.prod(shape)
    draws = torch.empty((count + 1) // 2, dtype=torch.int64).random_(torch.iinfo(torch.int64).min, None)
    uniform_int32 = draws.view(torch.int32)[:count].view(shape)
    return uniform_int32 >= torch.iinfo(torch.int32).min + dropped_per_2_32


class Dropout(nn.Dropout):
    """`nn.Dropout`, drawing its mask with `keep_mask` when training on a CPU that samples dropout per element."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dropped_per_2_32 = round(self.p * 2**32)
        if (
            not self.training
            or self.inplace
            or not 0 < dropped_per_2_32 < 2**32
            or type(input) is not torch.Tensor  # DTensor and other subclasses keep their own dropout
            or input.device.type != "cpu"
            or is_torchdynamo_compiling()
            or not cpu_samples_dropout_per_element()
        ):
            return super().forward(input)
        # As PyTorch's own CPU dropout: input times a noise tensor of 0 and 1 / (1 - p), kept for the backward.
        noise = keep_mask(input.shape, dropped_per_2_32).to(input.dtype).div_(1.0 - self.p)
        return input * noise


__all__ = ["Dropout", "cpu_samples_dropout_per_element", "keep_mask"]
