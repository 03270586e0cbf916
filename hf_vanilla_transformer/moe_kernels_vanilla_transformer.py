"""The kernels of the MoE experts (`VanillaTransformerExperts`, beside the router and the block that call it in the
Mixture of Experts of modeling_vanilla_transformer.py):

    gated_activation    act(gate) * up whose backward writes its gradient into the fused [gate; up] projection output
    sorted_grouped_mm   our experts function (the default): the (token, expert) rows sorted by expert once, one
                        grouped matmul per projection, registered in transformers' table of experts functions
    EXPERTS_FUNCTIONS   the table the experts dispatch through (`@use_experts_implementation`): transformers', whose
                        batched_mm first checks that its per-row weight copies fit (`check_batched_mm_memory`)

Which paths wait on the device (a host-device sync stops the host from queueing kernels ahead, the cost that bounds a
small model's step on a GPU):
- `gated_activation` and `sorted_grouped_mm` on torch's grouped_mm kernel: none; offsets come from `searchsorted`,
  limits from shapes.
- `sorted_grouped_mm` where torch's grouped_mm cannot run (the expert sizes `grouped_mm_takes` refuses, and under
  torch.compile weights other than bfloat16): transformers' fallback kernel reads the offsets on the host, once per
  projection in the forward and again in the backward.
- the eager path, `VanillaTransformerExperts.forward` (`experts_implementation="eager"`): it reads the experts in
  use (`.unique().tolist()`) and then each one's tokens (`torch.where`), one wait per expert.
"""

import functools
import math

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.integrations.moe import ExpertsInterface
from transformers.utils import is_torchdynamo_compiling, logging

logger = logging.get_logger(__name__)

try:  # transformers' grouped-matmul dispatch (torch's grouped_mm or its fallback), private: 5.20 to 5.24 have it
    from transformers.integrations.moe import _grouped_linear
except ImportError:
    _grouped_linear = None
    logger.warning(
        "This transformers release has no transformers.integrations.moe._grouped_linear: the 'sorted_grouped_mm' "
        "experts run one matmul per expert (transformers' fallback kernel) instead of torch's grouped_mm."
    )

# Rows of the gated activation's backward are processed in blocks of about this many elements (4 MB in fp32): its
# temporaries then stay small enough for the allocator to reuse instead of mapping (and page-faulting) fresh memory.
_GATE_BACKWARD_BLOCK_ELEMENTS = 1 << 20

# The SiLU modules, whose derivative the backward writes in place: ACT2FN's "silu" (the SwiGLU gate) is transformers'
# own class, its "swish" torch's.
_SILU_MODULES = (nn.SiLU, SiLUActivation)


class _GatedActivation(torch.autograd.Function):
    """act(gate) * up of a fused [gate; up] projection output (rows, 2I) -> (rows, I), whose backward writes the
    gradient into that projection output instead of new memory.

    Plain autograd keeps act(gate), computes the two halves' gradients into two new (rows, I) tensors and
    concatenates them into a third, (rows, 2I); on CPU each large fresh tensor costs page faults on top of its
    arithmetic. Here, one block of rows at a time, each half is overwritten with its gradient once it is no longer
    needed, by the same operations autograd runs (the gradients are bit-identical). So the input must be a fresh
    projection output that nothing else reads afterwards (the experts' up projection): a second backward through
    the same graph raises autograd's "modified by an inplace operation" error, and a double backward
    (create_graph=True) raises too.
    """

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, activation: nn.Module) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = activation(gate)
        # The identity (bilinear GLU) hands back the gate view itself, which must not be multiplied in place.
        hidden = hidden * up if hidden is gate else hidden.mul_(up)
        ctx.activation = activation
        ctx.save_for_backward(gate_up)
        return hidden

    @staticmethod
    def backward(ctx, grad_hidden: torch.Tensor) -> tuple[torch.Tensor, None]:
        (gate_up,) = ctx.saved_tensors
        rows_per_block = max(1, _GATE_BACKWARD_BLOCK_ELEMENTS // grad_hidden.shape[-1])
        for start in range(0, gate_up.shape[0], rows_per_block):
            gate, up = gate_up[start : start + rows_per_block].chunk(2, dim=-1)
            _overwrite_with_gradients(ctx.activation, gate, up, grad_hidden[start : start + rows_per_block])
        return gate_up, None


def _overwrite_with_gradients(activation: nn.Module, gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor) -> None:
    """One block of rows of `_GatedActivation.backward`: gate <- grad * up * act'(gate), up <- grad * act(gate)."""
    grad_activated = grad * up
    if isinstance(activation, _SILU_MODULES):  # SwiGLU, the usual MoE expert: aten's SiLU derivative, written in place
        torch.ops.aten.silu.out(gate, out=up)
        up.mul_(grad)
        torch.ops.aten.silu_backward.grad_input(grad_activated, gate, grad_input=gate)
        return
    with torch.enable_grad():  # any other activation: its derivative from its own autograd backward
        gate_input = gate.detach().requires_grad_()
        activated = activation(gate_input)
    (grad_gate,) = torch.autograd.grad(activated, gate_input, grad_activated)
    torch.mul(activated.detach(), grad, out=up)  # after autograd.grad: gate_input shares up's version counter
    gate.copy_(grad_gate)


def gated_activation(gate_up: torch.Tensor, activation: nn.Module) -> torch.Tensor:
    """act(gate) * up (Shazeer 2020) of the experts' fresh [gate; up] projection output, which the backward reuses
    for its gradient (see `_GatedActivation`)."""
    if is_torchdynamo_compiling():
        # A compiled graph plans its own buffers, and dynamo cannot trace the backward's autograd.grad (a graph
        # break, fatal with fullgraph=True): plain autograd, whose gradients the custom backward reproduces bit for bit.
        gate, up = gate_up.chunk(2, dim=-1)
        return activation(gate) * up
    return _GatedActivation.apply(gate_up, activation)


def grouped_mm_takes(weight: torch.Tensor) -> bool:
    """Whether torch's grouped_mm kernels can multiply by these (experts, out, in) matrices: they need every row
    stride of their operands to be a multiple of 16 bytes, the input dimension in the forward and the output
    dimension in the backward (an expert hidden size of 81 in fp32, 36 in bf16, fails)."""
    return all(size * weight.element_size() % 16 == 0 for size in weight.shape[-2:])


def looped_grouped_linear(
    inputs: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, bias: torch.Tensor | None, is_transposed: bool
) -> torch.Tensor:
    """`_grouped_linear` through transformers' fallback kernel (one matmul per expert, differentiable, compilable),
    for the shapes grouped_mm refuses."""
    weight = weight if is_transposed else weight.transpose(-2, -1)  # (experts, in, out)
    output = torch.ops.transformers.grouped_mm_fallback(inputs.to(weight.dtype), weight, offs=offsets)
    return output if bias is None else output + bias


def local_expert_ids(experts: nn.Module, top_k_index: torch.Tensor) -> torch.Tensor:
    """Under expert parallelism `num_experts` counts this rank's experts, and a choice of another rank's expert comes
    as id `num_experts` with weight 0 (transformers' all-reduce dispatch): a local expert runs it and the weight drops
    its output, as in transformers' batched_mm."""
    return top_k_index.clamp(max=experts.num_experts - 1) if experts._is_expert_parallel else top_k_index


SORTED_GROUPED_MM = "sorted_grouped_mm"


def sorted_grouped_mm_experts_forward(
    experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """ "sorted_grouped_mm": transformers' `grouped_mm_experts_forward` (the (token, expert) assignments sorted by
    expert, one grouped matmul per projection through the same `_grouped_linear` kernel dispatch) with fewer passes
    over the (tokens * k, H) rows around the matmuls, and a looped kernel for the shapes torch's grouped_mm refuses.

    The sort order gives each row's token directly: rows are gathered with `index_select` and the weighted expert
    outputs summed back per token with `index_add` (whose backward is again an `index_select`), where transformers
    gathers by advanced indexing (whose backward zero-fills and scatters), un-permutes the outputs through the inverse
    permutation and sums a reshape. As there, the sum is taken in the routing weights' fp32 and cast once.
    Registered in transformers' table, it is selectable for any model's experts: it refuses the post-expert norm
    some have instead of skipping it.
    """
    if experts.has_post_expert_norm:
        raise NotImplementedError(
            f'experts_implementation="{SORTED_GROUPED_MM}" does not run post-expert norms; use "grouped_mm".'
        )
    num_tokens, top_k = top_k_index.shape
    expert_ids, order = local_expert_ids(experts, top_k_index).reshape(-1).sort()
    token = order // top_k  # the token of each row, rows in expert order
    expert_ends = torch.arange(1, experts.num_experts + 1, device=expert_ids.device)
    offsets = torch.searchsorted(expert_ids, expert_ends, out_int32=True)  # rows up to each expert's last, no sync

    def grouped_linear(inputs: torch.Tensor, projection: str) -> torch.Tensor:
        bias = getattr(experts, f"{projection}_bias")[expert_ids] if experts.has_bias else None
        weight = getattr(experts, projection)
        if _grouped_linear is not None and grouped_mm_takes(weight):
            return _grouped_linear(inputs, weight, offsets, bias, experts.is_transposed)
        return looped_grouped_linear(inputs, weight, offsets, bias, experts.is_transposed)

    up_projection, activate = ("gate_up_proj", experts._apply_gate) if experts.has_gate else ("up_proj", experts.act_fn)
    hidden = activate(grouped_linear(hidden_states.index_select(0, token), up_projection))
    weighted = grouped_linear(hidden, "down_proj") * top_k_weights.reshape(-1)[order, None]
    combined = weighted.new_zeros(num_tokens, weighted.shape[-1]).index_add(0, token, weighted)
    return combined.to(hidden_states.dtype)


# Ours, by name, beside transformers' experts functions: `from_pretrained(..., experts_implementation=...)` and
# `set_experts_implementation` accept the names of transformers' global table.
ExpertsInterface.register(SORTED_GROUPED_MM, sorted_grouped_mm_experts_forward)


# ---------------------------------------------------------------------------------------------------- batched_mm

BATCHED_MM = "batched_mm"

# transformers' batched_mm gathers one copy of each projection's (out, in) matrix per routed row (token x choice),
# which autograd keeps for the backward: at transformer-base sizes (ReLU experts, fp32), 8 experts top-2 and 128 x 64
# tokens, 128 GiB per layer, which ran out of memory on an H200. Past this many bytes of copies it is refused. The
# limit is far above a decoding step, which batched_mm is for (the same model, 64 sequences: 1 GiB), and rows past it
# read each expert's weights many times over where the grouped functions read them once.
BATCHED_MM_MAX_GATHERED_BYTES = 4 << 30


def batched_mm_gathered_bytes(experts: nn.Module, top_k_index: torch.Tensor) -> int:
    """Bytes of the weight copies batched_mm gathers for `top_k_index` (T, k): rows * (up + down matrix bytes),
    twice that when autograd records them (kept for the backward, which makes a gradient of every copy). From shapes
    and grad mode only, so the check never waits for the device."""
    up_proj = experts.gate_up_proj if experts.has_gate else experts.up_proj
    weights = (up_proj, experts.down_proj)
    per_row = sum(math.prod(weight.shape[1:]) * weight.element_size() for weight in weights)
    recorded = torch.is_grad_enabled() and any(weight.requires_grad for weight in weights)
    return top_k_index.numel() * per_row * (2 if recorded else 1)


def check_batched_mm_memory(experts: nn.Module, top_k_index: torch.Tensor) -> None:
    """Refuse a batched_mm call whose weight copies would exceed `BATCHED_MM_MAX_GATHERED_BYTES`, naming the
    functions that run such batches."""
    gathered = batched_mm_gathered_bytes(experts, top_k_index)
    if gathered > BATCHED_MM_MAX_GATHERED_BYTES:
        raise ValueError(
            f'experts_implementation="{BATCHED_MM}" would gather {gathered / 2**30:.1f} GiB of expert weights for '
            f"{top_k_index.numel()} routed rows (one copy per row, more than {BATCHED_MM_MAX_GATHERED_BYTES / 2**30:g}"
            f' GiB); use "{SORTED_GROUPED_MM}" (the default) or "grouped_mm" for batches of this size.'
        )


def _memory_checked(
    batched_mm, experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`batched_mm` after `check_batched_mm_memory`."""
    check_batched_mm_memory(experts, top_k_index)
    return batched_mm(experts, hidden_states, top_k_index, top_k_weights)


class VanillaTransformerExpertsInterface(ExpertsInterface):
    """transformers' table of experts functions (the same global mapping: any function registered there, ours
    included, is selectable), whose batched_mm checks its memory first (`check_batched_mm_memory`). The function is
    looked up at each call, so whatever transformers' table holds under that name is what runs."""

    def get_interface(self, experts_implementation: str, default):
        experts_forward = super().get_interface(experts_implementation, default)
        if experts_implementation != BATCHED_MM:
            return experts_forward
        return functools.partial(_memory_checked, experts_forward)


# What `@use_experts_implementation` on our experts (`VanillaTransformerExperts`) dispatches through.
EXPERTS_FUNCTIONS = VanillaTransformerExpertsInterface()


__all__ = [
    "BATCHED_MM_MAX_GATHERED_BYTES",
    "EXPERTS_FUNCTIONS",
    "SORTED_GROUPED_MM",
    "VanillaTransformerExpertsInterface",
    "batched_mm_gathered_bytes",
    "check_batched_mm_memory",
    "gated_activation",
    "grouped_mm_takes",
    "local_expert_ids",
    "looped_grouped_linear",
    "sorted_grouped_mm_experts_forward",
]
