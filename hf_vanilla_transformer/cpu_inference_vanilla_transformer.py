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
  absmax/127.5) and run through oneDNN's int8 product (`Int8Linear`), each call's activations quantized to 8 bits
  (7 without VNNI) over their own absolute maximum. A quarter of the fp32 bytes per step.
* ``"bfloat16"``: the Linear weights are rounded to bfloat16 and their products run in bfloat16 on the prepacked copy
  (avx512_bf16 where the CPU has it; faster than `F.linear` in bfloat16 at every row count); norms, softmax and the
  residual stream stay float32. Half of the fp32 bytes per step.

Each path is kept because it decodes more than 10 % faster than the best public route to the same precision on a CPU
(`torch.compile` with inductor's freezing, the model cast to bfloat16, torchao's int8 through transformers'
`TorchAoConfig`; `benchmarks/cpu_inference_routes.py`, docs/deployment.md). torch offers these oneDNN ops under
`torch.ops.mkldnn` and `torch.ops.onednn` for its own compiler only, so the module checks at import that each exists
with the schema it calls (`ops_available`); where one does not, it warns once and those layers multiply with
`F.linear`. None of torch's deprecated quantized tensors (`torch.ao` dynamic quantization) is used.

`torch.compile` (e.g. `generate(cache_implementation="static", compile_config=...)`) reads the row-major copies and
int8's dequantized weights, as inductor lowers oneDNN's packed weights only from its own constant folding.

The model is put in eval mode and its parameters stop requiring gradients: the result is for inference only (train
from the original checkpoint). Saving it is not supported; save before optimizing.
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


# oneDNN's int8 Linear (uint8 activations x int8 weights, int32 sums, float32 out), which inductor lowers quantized
# Linear layers to on x86; plain int8 tensors in and out, none of torch's deprecated quantized tensors.
ONEDNN_INT8_LINEAR_SCHEMAS = {
    "qlinear_prepack": "onednn::qlinear_prepack(Tensor weight, int[]? x_shape) -> Tensor",
    "qlinear_pointwise.tensor": "onednn::qlinear_pointwise.tensor(Tensor qx, Tensor x_scale, Tensor x_zero_point, "
    "Tensor qw, Tensor w_scale, Tensor w_zero_point, Tensor? bias, float output_scale, int output_zero_point, "
    "ScalarType? output_dtype, str post_op_name, Scalar?[] post_op_args, str post_op_algorithm) -> Tensor",
}


def ops_with_other_schemas(namespace: str, schemas: dict[str, str]) -> list[str]:
    """The ops ("name" or "name.overload") of `schemas` that `torch.ops.<namespace>` lacks or declares with another
    schema than the one given."""
    others = []
    for op, expected in schemas.items():
        name, _, overload = op.partition(".")
        try:
            schema = str(getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")._schema)
        except (AttributeError, RuntimeError):  # torch.ops raises either for a name it does not know
            schema = None
        if schema != expected:
            others.append(op)
    return others


def ops_available(namespace: str, schemas: dict[str, str], fallback: str) -> bool:
    """Whether this torch has the ops of `schemas` as declared there; warns once, naming them and `fallback`, if not."""
    missing = ops_with_other_schemas(namespace, schemas)
    if missing:
        warnings.warn(
            f"torch {torch.__version__} lacks torch.ops.{namespace}.{', '.join(missing)} with the schemas "
            f"optimize_for_cpu_inference calls: {fallback}",
            stacklevel=2,
        )
    return not missing


ONEDNN_LINEAR = ops_available(
    "mkldnn",
    ONEDNN_LINEAR_SCHEMAS,
    "float32 and bfloat16 Linear layers fall back to F.linear on the (in, out) row-major weight (slower from 8 rows "
    "on, same results).",
)
ONEDNN_INT8_LINEAR = ops_available(
    "onednn",
    ONEDNN_INT8_LINEAR_SCHEMAS,
    'precision="int8" falls back to F.linear on its int8 weights dequantized at each call (the same weights, '
    "float32 products: slower than float32's own path).",
)


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


class Int8Linear(nn.Module):
    """`nn.Linear` on int8 weights, one float32 scale per output channel (symmetric: absmax/127.5 rounded into
    [-128, 127]), through oneDNN's int8 product: each call quantizes its input to 8 bits over its own absolute
    maximum (one scale for the call, computed on the tensor, no host sync), sums in int32 and returns float32.

    CPUs without VNNI sum pairs of uint8 x int8 products in int16, which full-range activations can saturate: there
    the activations take 7 bits (torch's `reduce_range`). Under `torch.compile`, and on a torch without oneDNN's int8
    ops, the layer multiplies its int8 weights dequantized at each call with `F.linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.5
        int8_weight = (weight / scale[:, None]).round().clamp(-128, 127).to(torch.int8)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("int8_weight", int8_weight)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)
        packed = torch.ops.onednn.qlinear_prepack(int8_weight, None) if ONEDNN_INT8_LINEAR else None
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("weight_zero_point", torch.zeros_like(scale, dtype=torch.int64), persistent=False)
        self.register_buffer("activation_zero_point", torch.tensor(128), persistent=False)
        # Activations as uint8 around 128: 1 + 2 * levels values over [-absmax, absmax].
        self.activation_levels = 127.0 if cpu_has_vnni() else 63.0
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # inductor lowers oneDNN's int8 product only on weights it packed itself (its quantization passes, freezing).
        if self.packed_weight is None or torch.compiler.is_compiling():
            dequantized = self.int8_weight.to(input.dtype) * self.weight_scale[:, None].to(input.dtype)
            return nn.functional.linear(input, dequantized, self.bias)
        rows = input.float()
        scale = torch.linalg.vector_norm(rows, float("inf")).clamp_min(torch.finfo(torch.float32).tiny)
        scale = scale / self.activation_levels
        # rows / scale lies in [-levels, levels]: + 128.5 and truncation round it to the nearest uint8 in [1, 255].
        quantized = (rows / scale + 128.5).to(torch.uint8)
        output = torch.ops.onednn.qlinear_pointwise.tensor(
            quantized, scale, self.activation_zero_point,
            self.packed_weight, self.weight_scale, self.weight_zero_point,
            self.bias, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        return output.to(input.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# float32 reads the (in, out) copy below 8 rows (greedy or beam decoding of one sentence) and the packed copy from
# 8 rows on; bfloat16 always reads the packed copy, which is the faster at every row count.
LINEAR_FOR_PRECISION = {
    "float32": functools.partial(PrepackedLinear, dtype=torch.float32, many_rows=8),
    "bfloat16": functools.partial(PrepackedLinear, dtype=torch.bfloat16, many_rows=1),
    "int8": Int8Linear,
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
