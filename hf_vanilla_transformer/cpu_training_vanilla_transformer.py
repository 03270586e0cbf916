"""Faster training on a CPU: one opt-in switch before the Trainer runs, as `optimize_for_cpu_inference` is for decoding.

```python
model = optimize_for_cpu_training(model)  # the same model and checkpoints; a cheaper dropout mask, SDPA's faster kernel
```

The model itself uses `nn.Dropout` and transformers' attention functions, as Bart does. Two of PyTorch's CPU choices
cost a small model's training step more than they need to, and this switch changes them:

* **Dropout masks** (§5.4 of the paper). PyTorch draws a CPU dropout mask with MKL's vectorised Bernoulli sampler only
  on Intel CPUs. On every other CPU (AMD, Arm) it takes one Mersenne-Twister draw and one comparison in double
  precision per element, serially. There `CpuDropout` splits each 64-bit draw of the same generator into two uniform
  32-bit integers and keeps an element where its integer clears the threshold: the same Bernoulli(1 - p) mask at
  2^-32 resolution, scaled by 1 / (1 - p) as PyTorch scales it. Elsewhere (Intel with MKL, an accelerator, a tensor
  subclass, under torch.compile, which generates its own masks) it is `nn.Dropout` itself.
* **Half-precision attention** at short sequences. In bfloat16 or float16 with gradients, PyTorch's SDPA picks its
  flash kernel on a CPU, up to 2.9x slower than its math kernel at sequences up to `SHORT_SEQUENCE_ON_CPU`. The switch
  registers transformers' SDPA function under the name `CPU_TRAINING_ATTENTION`, restricted to the math kernel there,
  and sets it on the model (`set_attn_implementation`), with SDPA's masks.

What it gains on a training step is measured in docs/benchmarks.md ("CPU training: the opt-in"). Saving and loading
are unchanged: the modules' names and weights are the model's, and the attention implementation is not saved.
"""

import functools
import math
import platform

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_torchdynamo_compiling, logging

logger = logging.get_logger(__name__)

# The longest sequence at which PyTorch's math SDPA kernel is the faster one for bfloat16/float16 training on a CPU
# (docs/benchmarks.md, "Figures quoted in the package's docstrings").
SHORT_SEQUENCE_ON_CPU = 128

# The attention implementation `optimize_for_cpu_training` registers with transformers and sets on the model.
CPU_TRAINING_ATTENTION = "sdpa_cpu_training"


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


class CpuDropout(nn.Dropout):
    """`nn.Dropout`, drawing its mask with `keep_mask` when training on a CPU tensor."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        dropped_per_2_32 = round(self.p * 2**32)
        if (
            not self.training
            or self.inplace
            or not 0 < dropped_per_2_32 < 2**32
            or type(input) is not torch.Tensor  # DTensor and other subclasses keep their own dropout
            or input.device.type != "cpu"
            or is_torchdynamo_compiling()
        ):
            return super().forward(input)
        # As PyTorch's own CPU dropout: input times a noise tensor of 0 and 1 / (1 - p), kept for the backward.
        noise = keep_mask(input.shape, dropped_per_2_32).to(input.dtype).div_(1.0 - self.p)
        return input * noise


def sdpa_cpu_training_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention, under PyTorch's math kernel where that is the faster one: bfloat16/float16 with
    gradients on a CPU, at sequences (the lengths the kernel sees) up to `SHORT_SEQUENCE_ON_CPU`, outside
    torch.compile."""
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    short_half_precision_training = (
        not is_torchdynamo_compiling()  # torch.compile lowers attention its own way
        and query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and max(query.shape[2], key.shape[2]) <= SHORT_SEQUENCE_ON_CPU
    )
    if not short_half_precision_training:
        return sdpa(module, query, key, value, attention_mask, **kwargs)
    with sdpa_kernel(SDPBackend.MATH):
        return sdpa(module, query, key, value, attention_mask, **kwargs)


def optimize_for_cpu_training(model: PreTrainedModel) -> PreTrainedModel:
    """`model`, changed in place for training on a CPU: `CpuDropout` for every `nn.Dropout` where the CPU samples
    dropout per element, and `sdpa_cpu_training_attention` where the model runs SDPA. Returns the model."""
    if cpu_samples_dropout_per_element():
        for module in model.modules():
            if type(module) is nn.Dropout:
                module.__class__ = CpuDropout  # the same module and state; only its forward changes
    if model.config._attn_implementation == "sdpa":
        AttentionInterface.register(CPU_TRAINING_ATTENTION, sdpa_cpu_training_attention)
        AttentionMaskInterface.register(CPU_TRAINING_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        model.set_attn_implementation(CPU_TRAINING_ATTENTION)
    logger.info(
        "optimize_for_cpu_training: dropout masks %s, attention %s",
        "cheaper (CpuDropout)" if cpu_samples_dropout_per_element() else "PyTorch's (MKL's sampler)",
        model.config._attn_implementation,
    )
    return model


__all__ = [
    "CPU_TRAINING_ATTENTION",
    "CpuDropout",
    "SHORT_SEQUENCE_ON_CPU",
    "keep_mask",
    "optimize_for_cpu_training",
    "sdpa_cpu_training_attention",
]
