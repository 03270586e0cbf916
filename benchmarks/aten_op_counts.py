"""The aten ops of one seq2seq training step (forward with labels, backward), ours against HF Marian, on the CPU.

    python benchmarks/aten_op_counts.py                 # prints the table, writes benchmarks/results/aten-op-counts.json

On an accelerator a model this size is bound by kernel launches, and every aten op that is not a view is one. The
step: 8 sentence pairs of 4-24 tokens, 2+2 layers, d_model 64, 4 heads, dropout 0.1 (torch's `nn.Dropout`, as the
model runs it unless `optimize_for_cpu_training` is asked for), counted with a `TorchDispatchMode` after a warm-up step. Rows:
  * HF Marian, padded (the same sentences as `DataCollatorForSeq2Seq` pads them);
  * ours, padded;
  * ours, flattened by `DataCollatorForSeq2SeqWithFlattening`, under its block masks (CPU: no variable-length kernel);
  * ours, the same sentences packed by it into rows of whole sentences (`row_length`), under block masks;
  * ours, flattened, where torch's `varlen_attn` runs (a GPU's default): here a stand-in custom op, one op forward
    and one backward as the kernel is, that computes attention per sequence on the CPU;
  * ours, flattened, after `optimize_for_cpu_training` (what the training scripts run on a CPU): attention over the
    offsets in a grid of the sequences (`sequence_grid_attention`), and on CPUs that sample dropout per element
    (AMD, Arm) the `CpuDropout` masks.
tests/test_accelerator_path.py asserts the last row's kernel ops against Marian's.
"""

import collections
import contextlib
import json
import sys
from pathlib import Path
from unittest import mock

import torch
from marian_twin import marian_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MarianMTModel

from hf_vanilla_transformer import (
    DataCollatorForSeq2SeqWithFlattening,
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
)
from hf_vanilla_transformer import modeling_vanilla_transformer as modeling
from hf_vanilla_transformer import optimize_for_cpu_training
from hf_vanilla_transformer import packing_vanilla_transformer as packing

IGNORE_INDEX = -100
# Views launch no kernel on an accelerator: they are left out where launches are compared.
VIEW_OPS = {"view", "_unsafe_view", "transpose", "t", "unsqueeze", "squeeze", "expand", "slice", "select", "detach",
            "alias", "permute", "as_strided", "lift_fresh"}  # fmt: skip


class OpNames(TorchDispatchMode):
    """The aten ops dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def training_step_op_names(model: torch.nn.Module, inputs: dict) -> collections.Counter[str]:
    """The ops of one training step after a warm-up step."""
    model.train()
    model(**inputs).loss.backward()
    counter = OpNames()
    with counter:
        model(**inputs).loss.backward()
    return counter.names


def kernel_count(op_names: collections.Counter[str]) -> int:
    return sum(count for name, count in op_names.items() if name not in VIEW_OPS)


def kernel_ops(model: torch.nn.Module, inputs: dict) -> int:
    return kernel_count(training_step_op_names(model, inputs))


def op_count_case() -> tuple[VanillaTransformerForConditionalGeneration, MarianMTModel, dict, dict, dict]:
    """Our model and its Marian twin (same dimensions), and the sentences flattened by our collator, packed by it
    into rows of the longest sentence's length, and padded."""
    torch.manual_seed(0)
    config = VanillaTransformerConfig(
        vocab_size=100, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, dropout=0.1,
        sinusoidal_layout="concatenated",
    )  # fmt: skip
    ours, marian = VanillaTransformerForConditionalGeneration(config), MarianMTModel(marian_config(config))
    generator = torch.Generator().manual_seed(1)

    def sentence() -> torch.Tensor:
        return torch.randint(3, 100, (int(torch.randint(4, 25, (1,), generator=generator)),), generator=generator)

    features = [{"input_ids": sentence(), "labels": sentence()} for _ in range(8)]
    flattened = DataCollatorForSeq2SeqWithFlattening(ours)(features)
    longest = max(len(sentence) for feature in features for sentence in feature.values())
    rows = DataCollatorForSeq2SeqWithFlattening(ours, row_length=longest)(features)
    sources = torch.nn.utils.rnn.pad_sequence([feature["input_ids"] for feature in features], batch_first=True)
    labels = [feature["labels"] for feature in features]
    padded = {
        "input_ids": sources,
        "attention_mask": (sources != config.pad_token_id).long(),
        "labels": torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX),
    }
    return ours, marian, flattened, rows, padded


def per_sequence_attention(query, key, value, cu_seq_q, cu_seq_k, scale: float, causal: bool) -> torch.Tensor:
    """Attention one sequence at a time on (tokens, heads, head_dim) layouts, SDPA on each slice; K/V heads shared by
    groups of query heads."""
    outputs = []
    key, value = (x.repeat_interleave(query.shape[1] // key.shape[1], dim=1) for x in (key, value))
    for start, end, key_start, key_end in zip(cu_seq_q.tolist(), cu_seq_q[1:].tolist(), cu_seq_k, cu_seq_k[1:]):
        q, k, v = (x.transpose(0, 1) for x in (query[start:end], key[key_start:key_end], value[key_start:key_end]))
        if key_end == key_start:  # queries without keys (a row's padding against an empty one): zeros, as flash
            outputs.append(torch.zeros_like(query[start:end]))
            continue
        output = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
        outputs.append(output.transpose(0, 1))
    return torch.cat(outputs)


@torch.library.custom_op("vanilla_transformer_benchmarks::varlen_attn", mutates_args=())
def varlen_kernel(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor,
    scale: float, causal: bool,
) -> torch.Tensor:  # fmt: skip
    """One op, as a GPU's variable-length kernel is one launch (what runs inside is not dispatched to the counter)."""
    return per_sequence_attention(query, key, value, cu_seq_q, cu_seq_k, scale, causal)


@torch.library.custom_op("vanilla_transformer_benchmarks::varlen_attn_backward", mutates_args=())
def varlen_kernel_backward(
    grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor, scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Softmax attention's gradient in closed form, one sequence at a time (autograd does not run inside an op)."""
    grads = [torch.zeros_like(tensor) for tensor in (query, key, value)]
    for start, end, key_start, key_end in zip(cu_seq_q.tolist(), cu_seq_q[1:].tolist(), cu_seq_k, cu_seq_k[1:]):
        q, k, v = (x.transpose(0, 1) for x in (query[start:end], key[key_start:key_end], value[key_start:key_end]))
        scores = q @ k.transpose(1, 2) * scale
        if causal:
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
        weights = scores.softmax(-1)
        grad_output = grad[start:end].transpose(0, 1)
        grad_weights = grad_output @ v.transpose(1, 2)
        grad_scores = weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True))
        grads[0][start:end] = (grad_scores @ k * scale).transpose(0, 1)
        grads[1][key_start:key_end] = (grad_scores.transpose(1, 2) @ q * scale).transpose(0, 1)
        grads[2][key_start:key_end] = (weights.transpose(1, 2) @ grad_output).transpose(0, 1)
    return tuple(grads)


def save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.scale, ctx.causal = inputs[5:]


def backward(ctx, grad):
    return *varlen_kernel_backward(grad, *ctx.saved_tensors, ctx.scale, ctx.causal), None, None, None, None


varlen_kernel.register_autograd(backward, setup_context=save_inputs)


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch's `varlen_attn` in its torch >= 2.12 signature, as the stand-in above."""
    return varlen_kernel(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))


@contextlib.contextmanager
def varlen_kernel_stand_in():
    """The package's packed attention runs torch's variable-length kernel, the stand-in, whatever the device."""
    always_torch = lambda implementation, device, dtype, dropout=0.0: "torch"  # noqa: E731
    with (
        mock.patch.object(packing, "varlen_kernel", always_torch),  # the collator's choice
        mock.patch.object(modeling, "varlen_kernel", always_torch),  # each stack's
        mock.patch.object(packing, "VARLEN_SIGNATURE", "scale"),
        mock.patch.object(packing, "varlen_attn", varlen_attn),
    ):
        yield


def main() -> None:
    ours, marian, flattened, packed_rows, padded = op_count_case()
    rows = {}
    rows["HF Marian, padded"] = training_step_op_names(marian, padded)
    rows["ours, padded"] = training_step_op_names(ours, padded)
    rows["ours, flattened, block mask"] = training_step_op_names(ours, flattened)
    rows["ours, packed rows, block mask"] = training_step_op_names(ours, packed_rows)
    with varlen_kernel_stand_in():
        rows["ours, flattened, varlen kernel"] = training_step_op_names(ours, flattened)
    rows["ours, flattened, CPU opt-in"] = training_step_op_names(optimize_for_cpu_training(ours), flattened)
    results = {
        name: {"aten_ops": sum(names.values()), "kernel_ops": kernel_count(names)} for name, names in rows.items()
    }
    print(f"{'step':34} {'aten ops':>9} {'not views':>10}")
    for name, counts in results.items():
        print(f"{name:34} {counts['aten_ops']:9d} {counts['kernel_ops']:10d}")
    output = Path(__file__).parent / "results" / "aten-op-counts.json"
    output.write_text(json.dumps({"torch": torch.__version__, "rows": results}, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    sys.exit(main())
