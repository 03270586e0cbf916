"""MoE kernels (moe_kernels_vanilla_transformer.py): the gated activation's in-place backward, the experts functions
under bf16 autocast, the fp32 router, batched_mm's memory limit, no host-device sync and one compiled graph.

Run: python -m pytest -q tests/test_moe_kernels.py
"""

import contextlib
from unittest.mock import patch

import pytest
import torch
from conftest import padded_batch
from test_moe import block, moe_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForSeq2SeqLM
from transformers.activations import ACT2FN

from hf_vanilla_transformer import VanillaTransformerConfig
from hf_vanilla_transformer import moe_kernels_vanilla_transformer as kernels
from hf_vanilla_transformer.modeling_vanilla_transformer import (
    VanillaTransformerExperts,
    VanillaTransformerRouter,
    expert_activation,
    ffn_activation,
)
from hf_vanilla_transformer import moe_kernels_vanilla_transformer as moe_kernels
from hf_vanilla_transformer.moe_kernels_vanilla_transformer import (
    SORTED_GROUPED_MM,
    batched_mm_gathered_bytes,
    gated_activation,
    sorted_grouped_mm_experts_forward,
)

aten = torch.ops.aten
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm", SORTED_GROUPED_MM)


def forward_backward(function, inputs: torch.Tensor, parameters: dict) -> tuple[torch.Tensor, dict]:
    """function(inputs) and the gradients of its sum of squares (a loss that weighs every output) w.r.t. `inputs`
    and `parameters`."""
    inputs = inputs.detach().requires_grad_()
    output = function(inputs)
    grads = torch.autograd.grad(output.float().pow(2).sum(), [inputs, *parameters.values()])
    return output, dict(zip(["inputs", *parameters], grads))


def assert_same_grads(actual: dict, expected: dict, assert_close=torch.testing.assert_close, **tolerances) -> None:
    assert actual.keys() == expected.keys() and len(expected) > 1
    for name, grad in expected.items():
        assert_close(actual[name], grad, msg=name, **tolerances)


def assert_close_in_bf16(actual: torch.Tensor, expected: torch.Tensor, msg: str = "") -> None:
    """Equal up to a few bf16 roundings (2^-8 each) of the tensor's largest values: matmuls in bf16 against fp32
    differ by that much wherever the result is small after cancellation."""
    torch.testing.assert_close(actual, expected, rtol=0, atol=2e-2 * expected.abs().max().item(), msg=msg)


# ------------------------------------------------------------------------------------- gated activation


@pytest.mark.parametrize("ffn_type", ["swiglu", "geglu", "reglu", "glu", "bilinear"])
def test_gated_activation_gradient_is_autograds_bit_for_bit(ffn_type):
    """The experts' gated activation writes its gradient into the projection output, in row blocks."""
    activation = ffn_activation(moe_config(ffn_type=ffn_type))
    x, grad_hidden = torch.randn(1500, 8), torch.randn(1500, 1000)  # more rows than one backward block
    weight = torch.randn(2000, 8, requires_grad=True)

    def gradient(gated):
        weight.grad = None
        hidden = gated(x @ weight.T)
        hidden.backward(grad_hidden)
        return hidden, weight.grad

    def autograd_gate(gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return activation(gate) * up

    expected_hidden, expected_grad = gradient(autograd_gate)
    hidden, grad = gradient(lambda gate_up: gated_activation(gate_up, activation))
    assert torch.equal(hidden, expected_hidden) and torch.equal(grad, expected_grad)


def test_gated_activation_refuses_a_second_backward_instead_of_reading_its_overwritten_input():
    hidden = gated_activation(torch.randn(3, 8, requires_grad=True) * 1.0, ffn_activation(moe_config()))
    hidden.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        hidden.sum().backward()


class DispatchedOps(TorchDispatchMode):
    """Records the aten overloads dispatched inside, by name."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("activation", [ACT2FN["silu"], torch.nn.SiLU()], ids=["ACT2FN-silu", "nn.SiLU"])
def test_swiglu_gate_gradient_is_written_in_place(activation):
    """SwiGLU's gate is ACT2FN["silu"], transformers' own SiLU class: its backward takes the in-place SiLU
    derivative (aten's `silu_backward` into the gate's rows), not a fresh autograd graph per block."""
    gate_up = torch.randn(6, 8, requires_grad=True) * 1.0
    hidden = gated_activation(gate_up, activation)
    with DispatchedOps() as ops:
        hidden.sum().backward()
    assert "aten::silu_backward.grad_input" in ops.names and "aten::silu_backward" not in ops.names


# ------------------------------------------------------------------------------------- bf16 autocast


def seq2seq(experts_implementation: str, **overrides):
    torch.manual_seed(0)
    config = moe_config(ffn_type="swiglu", **overrides)
    return AutoModelForSeq2SeqLM.from_config(config, experts_implementation=experts_implementation).train()


def autocast_training_step(model) -> tuple[torch.Tensor, dict]:
    """Logits and the experts' and routers' gradients of one training forward and backward under CPU bf16 autocast."""
    input_ids, attention_mask = padded_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if ".experts." in name or ".gate." in name}
    return out.logits, grads


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS[1:])
def test_experts_implementations_agree_in_training_under_cpu_bf16_autocast(implementation):
    """eager's loop (which used to fail in index_add_ on a bf16 accumulator and fp32 outputs) and the batched and
    grouped functions train the same model alike under autocast, within bf16's rounding: eager's matmuls run in bf16,
    the grouped kernels, which autocast does not cover, in the weights' fp32."""
    eager_logits, eager_grads = autocast_training_step(seq2seq("eager"))
    logits, grads = autocast_training_step(seq2seq(implementation))
    assert eager_logits.dtype == torch.bfloat16  # the LM head ran under autocast
    assert_close_in_bf16(logits, eager_logits)
    assert_same_grads(grads, eager_grads, assert_close_in_bf16)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS[1:])
def test_eager_experts_take_bf16_routing_weights_and_fp32_biases_under_autocast(implementation):
    """Called directly with bf16 routing weights (transformers' functions take them), eager's bf16 matmuls, some
    promoted to fp32 by the biases, are summed in fp32 as the other functions sum theirs."""
    moe = block(ffn_type="swiglu").train()
    hidden = torch.randn(24, 32)
    _, top_k_weights, top_k_index = moe.gate(hidden)
    top_k_weights = top_k_weights.detach().bfloat16()
    parameters = dict(moe.experts.named_parameters())
    results = {}
    for name in ("eager", implementation):
        moe.experts.config._experts_implementation = name
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[name] = forward_backward(lambda x: moe.experts(x, top_k_index, top_k_weights), hidden, parameters)
    (eager, eager_grads), (output, grads) = results["eager"], results[implementation]
    assert_close_in_bf16(output, eager)
    assert_same_grads(grads, eager_grads, assert_close_in_bf16)


def test_router_is_fp32_under_cpu_bf16_autocast():
    """Under autocast the router's linear map, softmax and top-k still run in fp32 (autocast would run F.linear in
    bf16): its outputs are the fp32 computation's, which bf16 logits are not."""
    router = VanillaTransformerRouter(moe_config(num_experts=8))
    torch.nn.init.normal_(router.weight)
    hidden = torch.randn(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, top_k_weights, top_k_index = router(hidden)
        autocast_logits = torch.nn.functional.linear(hidden, router.weight)
    expected_logits, expected_weights, expected_index = router(hidden)
    assert logits.dtype == top_k_weights.dtype == torch.float32
    torch.testing.assert_close(logits, expected_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(top_k_weights, expected_weights, rtol=1e-6, atol=1e-6)
    assert torch.equal(top_k_index, expected_index)
    # Control: what autocast alone would have given is measurably different.
    assert autocast_logits.dtype == torch.bfloat16 and not torch.allclose(autocast_logits.float(), expected_logits)


# ------------------------------------------------------------------------------------- batched_mm's memory


def test_batched_mm_counts_one_weight_copy_per_routed_row_twice_under_autograd():
    """Closed form: T * k rows, each a copy of its expert's [gate; up] (2I, H) and down (H, I) matrices in fp32."""
    moe = block(ffn_type="swiglu")
    intermediate = moe.experts.down_proj.shape[2]
    top_k_index = torch.zeros(10, 2, dtype=torch.long)
    per_row = (2 * intermediate * 32 + 32 * intermediate) * 4
    with torch.no_grad():
        assert batched_mm_gathered_bytes(moe.experts, top_k_index) == 20 * per_row
    assert batched_mm_gathered_bytes(moe.experts, top_k_index) == 2 * 20 * per_row


def test_batched_mm_runs_a_small_batch_as_eager():
    moe = block("batched_mm").train()
    hidden = torch.randn(2, 7, 32)
    parameters = dict(moe.named_parameters())
    output, grads = forward_backward(moe, hidden, parameters)
    moe.experts.config._experts_implementation = "eager"
    eager, eager_grads = forward_backward(moe, hidden, parameters)
    torch.testing.assert_close(output, eager, rtol=1e-5, atol=1e-5)
    assert_same_grads(grads, eager_grads, rtol=1e-4, atol=1e-5)


def test_batched_mm_is_refused_at_a_transformer_base_training_batch_without_allocating():
    """transformer-base sizes, 8 experts top-2, a batch of 128 x 64 tokens (which ran out of memory on an H200): the
    experts refuse batched_mm from the shapes alone, naming the functions to use. On the meta device nothing is
    allocated, and with the limit lifted the same call runs there: the refusal is the limit's."""
    config = VanillaTransformerConfig.from_preset("transformer-base", vocab_size=64, num_experts=8)
    config._experts_implementation = "batched_mm"
    with torch.device("meta"):
        experts = VanillaTransformerExperts(
            config, config.num_experts, config.encoder_ffn_dim, *expert_activation(config)
        )
        hidden = torch.empty(128 * 64, config.d_model)
        top_k_index = torch.empty(128 * 64, 2, dtype=torch.long)
        top_k_weights = torch.empty(128 * 64, 2)
    with pytest.raises(ValueError, match=f'"{SORTED_GROUPED_MM}" \\(the default\\) or "grouped_mm"') as refusal:
        experts(hidden, top_k_index, top_k_weights)
    assert "256.0 GiB" in str(refusal.value)  # 16384 rows * 8 MiB, twice under autograd
    with patch.object(kernels, "BATCHED_MM_MAX_GATHERED_BYTES", float("inf")):
        assert experts(hidden, top_k_index, top_k_weights).shape == hidden.shape


def test_batched_mm_limit_applies_to_the_models_experts_in_training_only_past_it():
    """The limit sits between this batch's inference and training bytes: `from_config(experts_implementation=
    "batched_mm")` then evaluates it under no_grad and refuses to train on it; the default trains on it."""
    input_ids, attention_mask = padded_batch()
    experts = seq2seq("batched_mm").model.encoder.layers[0].mlp.experts
    rows = input_ids.numel() * 2  # at most every position is routed, top-2
    with torch.no_grad():
        inference_bytes = batched_mm_gathered_bytes(experts, torch.zeros(rows, 1, dtype=torch.long))
    with patch.object(kernels, "BATCHED_MM_MAX_GATHERED_BYTES", inference_bytes):
        for implementation in ("batched_mm", SORTED_GROUPED_MM):
            with torch.no_grad():
                seq2seq(implementation)(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
        with pytest.raises(ValueError, match=f'use "{SORTED_GROUPED_MM}"'):
            seq2seq("batched_mm")(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
        seq2seq(SORTED_GROUPED_MM)(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()


# ------------------------------------------------------------------------------------- no host-device sync

# aten calls that make a CUDA host wait for the device: a scalar read, and outputs whose size depends on the data.
SYNCING_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.unique_dim_consecutive,
    aten.masked_select,
}


def waits_for_the_device(func, args, kwargs) -> bool:
    packet = func.overloadpacket
    if packet in SYNCING_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:  # its output size is the repeats' sum unless given
        return kwargs.get("output_size") is None
    if packet in (aten.index, aten.index_put, aten.index_put_):  # a boolean mask's size is its count of True
        return any(index is not None and index.dtype == torch.bool for index in args[1])
    return False


class HostDeviceSyncs(TorchDispatchMode):
    """Records the aten calls inside that wait for the device (`waits_for_the_device`)."""

    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if waits_for_the_device(func, args, kwargs):
            self.calls.append(func.name())
        return func(*args, **kwargs)


@contextlib.contextmanager
def host_device_syncs():
    """The host-device synchronisations made inside, as a list: the aten calls that wait for the device, and
    `Tensor.tolist`, which on a CPU tensor reads its memory without dispatching any aten call."""
    calls = []
    tolist = torch.Tensor.tolist

    def recorded_tolist(tensor):
        calls.append("Tensor.tolist")
        return tolist(tensor)

    with patch.object(torch.Tensor, "tolist", recorded_tolist), HostDeviceSyncs(calls):
        yield calls


@pytest.mark.parametrize("ffn_type", ["swiglu", "gelu"])
def test_default_experts_and_router_never_wait_for_the_device(ffn_type):
    """One MoE block's training forward and backward (router with jitter, routed and shared experts, biases, no
    capacity) through sorted_grouped_mm: no sync. The same block through the eager loop is the control."""
    syncs = {}
    for implementation in (SORTED_GROUPED_MM, "eager"):
        moe = block(implementation, ffn_type=ffn_type, num_shared_experts=1, router_jitter_noise=0.1).train()
        assert moe.capacity_factor is None
        with host_device_syncs() as calls:
            moe(torch.randn(2, 7, 32, requires_grad=True)).sum().backward()
        syncs[implementation] = calls
    assert syncs[SORTED_GROUPED_MM] == []
    assert {"aten::_unique2", "Tensor.tolist", "aten::nonzero"} <= set(syncs["eager"])


# ------------------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("ffn_type", ["swiglu", "geglu", "gelu"])
def test_router_and_sorted_grouped_mm_compile_into_one_graph(ffn_type):
    """`torch.compile(fullgraph=True)` traces the router and sorted_grouped_mm, forward and backward, without a graph
    break (which fullgraph turns into an error) and computes what they compute uncompiled."""
    moe = block(SORTED_GROUPED_MM, ffn_type=ffn_type).train()

    def routed(tokens: torch.Tensor) -> torch.Tensor:
        _, top_k_weights, top_k_index = moe.gate(tokens)
        return sorted_grouped_mm_experts_forward(moe.experts, tokens, top_k_index, top_k_weights)

    torch._dynamo.reset()
    hidden = torch.randn(14, 32)
    parameters = dict(moe.named_parameters())
    compiled = forward_backward(torch.compile(routed, fullgraph=True, backend="eager"), hidden, parameters)
    expected, expected_grads = forward_backward(routed, hidden, parameters)
    torch.testing.assert_close(compiled[0], expected, rtol=1e-5, atol=1e-5)
    assert_same_grads(compiled[1], expected_grads, rtol=1e-4, atol=1e-5)


def test_batched_mm_limit_compiles_with_the_experts():
    """The limit reads shapes only, so the batched_mm dispatch compiles into one graph as well."""
    moe = block("batched_mm").train()
    torch._dynamo.reset()
    hidden = torch.randn(2, 7, 32)
    compiled = torch.compile(moe.experts, fullgraph=True, backend="eager")
    _, top_k_weights, top_k_index = moe.gate(hidden.reshape(-1, 32))
    expected = moe.experts(hidden.reshape(-1, 32), top_k_index, top_k_weights)
    torch.testing.assert_close(compiled(hidden.reshape(-1, 32), top_k_index, top_k_weights), expected)


def test_sorted_grouped_mm_without_transformers_grouped_linear_computes_the_same(monkeypatch):
    """A transformers release without its private `_grouped_linear` (the package imports it under a guard): the
    experts run transformers' looped fallback kernel instead, with the same outputs and gradients."""
    moe = block(SORTED_GROUPED_MM, ffn_type="swiglu").train()
    hidden = torch.randn(14, 32)
    parameters = dict(moe.experts.named_parameters())

    def routed(tokens: torch.Tensor) -> torch.Tensor:
        _, top_k_weights, top_k_index = moe.gate(tokens)
        return sorted_grouped_mm_experts_forward(moe.experts, tokens, top_k_index, top_k_weights)

    expected, expected_grads = forward_backward(routed, hidden, parameters)
    monkeypatch.setattr(moe_kernels, "_grouped_linear", None)
    looped, looped_grads = forward_backward(routed, hidden, parameters)
    torch.testing.assert_close(looped, expected, rtol=1e-5, atol=1e-5)
    assert_same_grads(looped_grads, expected_grads, rtol=1e-4, atol=1e-5)
