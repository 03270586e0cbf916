"""Faster CPU decoding from the model itself: one opt-in switch before `generate()`.

```python
model = optimize_for_cpu_inference(model)                     # float32: same tokens, logits within 1e-5
model = optimize_for_cpu_inference(model, precision="int8")   # int8 weights (per-output-channel scales)
model = optimize_for_cpu_inference(model, precision="bfloat16")
```

Decoding one token multiplies a few rows against every weight matrix, so a step's time is set by how fast the
weights stream from memory. torch's `F.linear` keeps a weight as (out, in) and for a handful of rows (batch x beams)
reads it below the memory bandwidth; against an (in, out) row-major weight the same product streams it faster
(measured in docs/benchmarks.md). So:

* ``"float32"``: every `nn.Linear` keeps its weight values in two memory orders (`PrepackedLinear`), and each call
  takes the one that streams fastest for its number of rows. Below 8 rows (greedy or beam decoding of one sentence)
  `F.linear` multiplies by the weight stored (in, out) row-major. From 8 rows on (a batch of sentences) oneDNN's
  product on its prepacked copy is faster, because it does not repack the weight on every call. The same arithmetic
  in another order; the Linear weights take
  twice their memory. The tied output projection gets its own copies, so that the embedding lookups keep their
  row-contiguous table.
* ``"int8"``: the weights of the Linear layers become int8 with one float scale per output channel (symmetric,
  absmax/127.5) and run through torch's dynamic int8 Linear (fbgemm, VNNI where present), which quantizes each
  call's activations to 8 bits over their own range. A quarter of the fp32 bytes per step.
* ``"bfloat16"``: the Linear weights are rounded to bfloat16 and their products run in bfloat16 on the prepacked copy
  (avx512_bf16 where the CPU has it; faster than `F.linear` in bfloat16 at every row count); norms, softmax and the
  residual stream stay float32. Half of the fp32 bytes per step.

`torch.compile` (e.g. `generate(cache_implementation="static", compile_config=...)`) reads the row-major copies, as
its lowering takes oneDNN's packed weights only from its own constant folding; int8's Linear layers run outside the
compiled graph (torch keeps their weights in a TorchScript object).

The model is put in eval mode and its parameters stop requiring gradients: the result is for inference only (train
from the original checkpoint). Saving it is not supported; save before optimizing. torch marks its eager dynamic
quantization (used for int8) deprecated in favour of torchao and warns about it; it is still the fastest int8 path
for few-row products in torch on CPU.
"""

import functools
import math
import warnings
from typing import Literal, get_args

import torch
from torch import nn
from transformers import PreTrainedModel

Precision = Literal["float32", "bfloat16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)


class Int8DynamicLinear(torch.ao.nn.quantized.dynamic.Linear):
    """torch's dynamic int8 Linear (fbgemm/x86): int8 weights with one scale per output channel, activations quantized
    per call to 8 bits over their own range; bias and output stay float32.

    torch's module quantizes activations to 7 bits (`reduce_range`) so that the pairwise int16 sums of CPUs without
    VNNI cannot saturate; VNNI accumulates in int32, so there the full 8 bits are used (on the demo model: BLEU
    within 0.1 of float32 instead of 1.2 below it)."""

    reduce_range = True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(input, self._packed_params._packed_params, self.reduce_range)


def int8_linear(linear: nn.Linear) -> Int8DynamicLinear:
    linear.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
    quantized = Int8DynamicLinear.from_float(linear)
    quantized.reduce_range = not cpu_has_vnni()
    return quantized


@functools.cache
def cpu_has_vnni() -> bool:
    """Whether the CPU has int8 dot products into int32 (AVX512-VNNI or AVX-VNNI), read from /proc/cpuinfo; False
    where that cannot be read, which keeps torch's safe 7-bit activations."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    return "avx512_vnni" in flags or "avx_vnni" in flags


def transposed_layout(weight: torch.Tensor) -> torch.Tensor:
    """The same (out, in) values, stored (in, out) row-major: `F.linear` then multiplies by the contiguous
    transpose, the layout in which a product with few rows streams the weight at memory speed."""
    return weight.t().contiguous().t()


# oneDNN's prepacked Linear, which torch's inductor lowers to and which torch does not offer as a public API. The
# schemas are those of torch 2.11-2.14; a torch without them, or with other ones, gets `F.linear` (and a warning).
ONEDNN_LINEAR_SCHEMAS = {
    "_reorder_linear_weight": "mkldnn::_reorder_linear_weight(Tensor self, int? batch_size=None) -> Tensor Y",
    "_linear_pointwise": "mkldnn::_linear_pointwise(Tensor X, Tensor W, Tensor? B, str attr, Scalar?[] scalars, "
    "str? algorithm) -> Tensor Y",
    "_is_mkldnn_bf16_supported": "mkldnn::_is_mkldnn_bf16_supported() -> bool _0",
}


def ops_with_other_schemas(namespace: str, schemas: dict[str, str]) -> list[str]:
    """The ops of `schemas` that `torch.ops.<namespace>` lacks or declares with another schema than the one given."""
    others = []
    for name, expected in schemas.items():
        try:
            schema = str(getattr(getattr(torch.ops, namespace), name).default._schema)
        except (AttributeError, RuntimeError):  # torch.ops raises either for a name it does not know
            schema = None
        if schema != expected:
            others.append(name)
    return others


def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's prepacked Linear with the schemas `PrepackedLinear` calls; warns once if not."""
    missing = ops_with_other_schemas("mkldnn", ONEDNN_LINEAR_SCHEMAS)
    if missing:
        warnings.warn(
            f"torch {torch.__version__} lacks torch.ops.mkldnn.{', '.join(missing)} with the schemas "
            "optimize_for_cpu_inference calls: its float32 and bfloat16 Linear layers fall back to F.linear on the "
            "(in, out) row-major weight (slower from 8 rows on, same results).",
            stacklevel=2,
        )
    return not missing


ONEDNN_LINEAR = onednn_linear_available()


class PrepackedLinear(nn.Module):
    """`nn.Linear` whose product runs in `dtype` (float32, or bfloat16 with avx512_bf16 where the CPU has it) on the
    same weight in two memory orders: (in, out) row-major for products of fewer than `many_rows` rows, oneDNN's
    prepacked blocks for larger ones. Takes and returns float32, so norms, softmax and the residual stream around it
    stay float32. The weight is exposed as the usual (out, in) parameter, a transposed view of the row-major copy. On
    a CPU where oneDNN has no bfloat16 path (no avx512bw/vl/dq or avx_ne_convert), bfloat16 products all read the
    row-major copy, and so do all products on a torch without the oneDNN ops (`ONEDNN_LINEAR`)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, many_rows: int):
        super().__init__()
        weight = linear.weight.detach().to(dtype)
        self.weight = nn.Parameter(transposed_layout(weight), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        packs = ONEDNN_LINEAR and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
        packed = torch.ops.mkldnn._reorder_linear_weight(weight) if packs else None
        self.register_buffer("packed_weight", packed, persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.many_rows = many_rows if packs else math.inf

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows = input.to(self.weight.dtype)
        # torch.compile's lowering takes oneDNN's packed weights only from its own constant folding (`freezing`).
        if input.numel() < self.many_rows * self.in_features or torch.compiler.is_compiling():
            output = nn.functional.linear(rows, self.weight, self.bias)
        else:
            output = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return output.to(input.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"dtype={self.weight.dtype}, many_rows={self.many_rows}"
        )


# float32 reads the (in, out) copy below 8 rows (greedy or beam decoding of one sentence) and the packed copy from
# 8 rows on; bfloat16 always reads the packed copy, which is the faster at every row count.
LINEAR_FOR_PRECISION = {
    "float32": functools.partial(PrepackedLinear, dtype=torch.float32, many_rows=8),
    "bfloat16": functools.partial(PrepackedLinear, dtype=torch.bfloat16, many_rows=1),
    "int8": int8_linear,
}


def optimize_for_cpu_inference(model: PreTrainedModel, precision: Precision = "float32") -> PreTrainedModel:
    """Prepare `model` for fast `generate()` on the CPU, in place, and return it (in eval mode, inference only).

    `precision="float32"` keeps every weight value and changes only their memory layout: the same tokens, logits equal
    up to float32 rounding of the reordered sums. `"int8"` and `"bfloat16"` round the weights of the Linear layers
    (embeddings, norms and attention arithmetic stay float32): faster, within a measured quality loss.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {PRECISIONS}.")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
    parameter = next(model.parameters(), None)
    if parameter is not None and (parameter.device.type != "cpu" or parameter.dtype != torch.float32):
        raise ValueError(
            f"model must hold float32 weights on the CPU, got {parameter.dtype} on {parameter.device.type}."
        )
    model.eval().requires_grad_(False)
    make_linear = LINEAR_FOR_PRECISION[precision]
    linears = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear]
    for name, linear in linears:
        model.set_submodule(name, make_linear(linear))
    return model
