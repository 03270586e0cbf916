"""Faster training on a CPU: one opt-in switch before the Trainer runs, as `optimize_for_cpu_inference` is for decoding.

```python
model = optimize_for_cpu_training(model)  # the same model and checkpoints; cheaper dropout masks and attention
```

The model itself uses `nn.Dropout` and transformers' attention functions, as Bart does. Three things cost a small
model's training step on a CPU more than they need to, and this switch changes them:

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
* **Attention over flattened batches** (the training scripts' layout on a CPU, packing_vanilla_transformer). No
  variable-length kernel runs on a CPU, so the model's stacks run attention under a block mask over every pair of a
  row's tokens: for a batch of many short sentences, most of the scores are masked out, and attention became a fifth
  of the step. The same registered function is a variable-length kernel (`sequence_grid_attention`): it takes the
  offsets and runs each sequence in a row of a padded grid, at the cost of the sequences' own lengths.

What it gains on a training step is measured in docs/benchmarks.md ("What `optimize_for_cpu_training` gains").
Saving and loading are unchanged: the modules' names and weights are the model's, and the attention implementation
is not saved.
"""

import contextlib
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
    """transformers' SDPA attention, sequence by sequence over a flattened batch (`sequence_grid_attention`, given
    the offsets), under PyTorch's math kernel where that is the faster one (`faster_sdpa_kernel`)."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return sequence_grid_attention(module, query, key, value, **kwargs)
    with faster_sdpa_kernel(query, key):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def faster_sdpa_kernel(query: torch.Tensor, key: torch.Tensor) -> contextlib.AbstractContextManager:
    """PyTorch's math SDPA kernel for bfloat16/float16 with gradients on a CPU at sequences (the lengths the kernel
    sees) up to `SHORT_SEQUENCE_ON_CPU`, outside torch.compile (which lowers attention its own way); elsewhere SDPA's
    own choice."""
    math_is_faster = (
        not is_torchdynamo_compiling()
        and query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and max(query.shape[2], key.shape[2]) <= SHORT_SEQUENCE_ON_CPU
    )
    return sdpa_kernel(SDPBackend.MATH) if math_is_faster else contextlib.nullcontext()


def sequence_grid_attention(
    module, query, key, value, dropout=0.0, scaling=None, *, cu_seq_lens_q, cu_seq_lens_k,
    max_length_q, max_length_k, **kwargs
) -> tuple[torch.Tensor, None]:
    """Attention over a flattened batch without a variable-length kernel, at the cost of its sequences: each
    sequence's queries, keys and values gathered into a row of a (sequences, longest) grid, SDPA over the grid under
    its padding mask (causal too for a module with `is_causal`, each sequence aligned at its start as §3.2.3's mask),
    and the outputs gathered back to their tokens. It scores the sum of the squared sequence lengths per head, where
    the model's block mask scores every pair of a row's tokens: on a CPU, where no kernel takes the offsets, this is
    the variable-length kernel. query (rows, heads, row_length, head_dim), key and value (rows, kv_heads,
    source_row_length, head_dim) -> (rows, row_length, heads, head_dim), as transformers' SDPA returns it."""
    rows, row_length = query.shape[0], query.shape[2]
    query_places, query_seen = sequence_grid(cu_seq_lens_q, max_length_q, rows * row_length)
    if cu_seq_lens_k is cu_seq_lens_q:  # self-attention: the keys are the queries' own tokens
        key_places, key_seen = query_places, query_seen
    else:
        key_places, key_seen = sequence_grid(cu_seq_lens_k, max_length_k, key.shape[0] * key.shape[2])
    visible = key_seen[:, None, :].expand(-1, max_length_q, -1)
    if module.is_causal:
        visible = visible.tril()
    # A query that sees no key (a grid place past its sequence's end, an empty sequence) sees all of them instead:
    # its output is never read, and a softmax over no key would be NaN, and so would every gradient through it.
    visible = visible | ~visible.any(-1, keepdim=True)

    def on_grid(tensor: torch.Tensor, places: torch.Tensor) -> torch.Tensor:  # (sequences, heads, longest, head_dim)
        return tensor.transpose(0, 1).flatten(1, 2)[:, places].transpose(0, 1)

    query, key, value = on_grid(query, query_places), on_grid(key, key_places), on_grid(value, key_places)
    with faster_sdpa_kernel(query, key):
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, visible[:, None], dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        )
    # Back to the tokens, each from its place in the grid (its sequence's row, its position in the sequence).
    tokens = torch.arange(rows * row_length, dtype=cu_seq_lens_q.dtype, device=cu_seq_lens_q.device)
    sequence_of_token = torch.searchsorted(cu_seq_lens_q[1:], tokens, right=True, out_int32=True)
    grid_place = sequence_of_token * max_length_q + tokens - cu_seq_lens_q[sequence_of_token]
    output = output.transpose(1, 2).flatten(0, 1)[grid_place]
    return output.view(rows, row_length, *output.shape[1:]), None


def sequence_grid(cu_seq_lens: torch.Tensor, longest: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences, longest) grids over a side's flattened tokens, from its offsets: each place's token index (places
    past a sequence's end repeat a valid token) and whether the place holds one of the sequence's tokens. In the
    offsets' dtype (the collators' int32), which indexing takes as it is."""
    starts, lengths = cu_seq_lens[:-1], cu_seq_lens[1:] - cu_seq_lens[:-1]
    positions = torch.arange(longest, dtype=cu_seq_lens.dtype, device=cu_seq_lens.device)
    return (starts[:, None] + positions).clamp(max=tokens - 1), positions < lengths[:, None]


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
    "sequence_grid_attention",
]
