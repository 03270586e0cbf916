"""Mixture of Experts: routing, capacity, losses, fast experts, training and DDP.

Run: python -m pytest -q tests/test_moe.py
"""

import functools
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock, patch

import pytest
import torch
import torch.nn.functional as F
from conftest import padded_batch, tiny_config
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback
from transformers.integrations.moe import (
    ALL_EXPERTS_FUNCTIONS,
    batched_mm_experts_forward,
    grouped_mm_experts_forward,
)

from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForMaskedLM,
    VanillaTransformerForImageClassification,
    VanillaTransformerForSequenceClassification,
)
from hf_vanilla_transformer.modeling_vanilla_transformer import (
    SublayerConnection,
    VanillaTransformerExperts,
    VanillaTransformerRouter,
    VanillaTransformerSparseMoeBlock,
    capacity_slots,
    dropped_token_counts,
    expert_capacity,
    ffn_activation,
    positions_in_experts,
)
from hf_vanilla_transformer.moe_kernels_vanilla_transformer import SORTED_GROUPED_MM, sorted_grouped_mm_experts_forward
from hf_vanilla_transformer.router_losses_vanilla_transformer import load_balancing_loss, router_z_loss


def moe_config(**overrides):
    return tiny_config(**{"num_experts": 4, "num_experts_per_tok": 2, **overrides})


def seq2seq(experts_implementation: str = "eager", **overrides) -> VanillaTransformerForConditionalGeneration:
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(moe_config(**overrides)).eval()
    model.set_experts_implementation(experts_implementation)
    return model


def block(experts_implementation: str = "eager", **overrides) -> VanillaTransformerSparseMoeBlock:
    """A MoE block with initialised weights and non-zero biases (so that bias handling is exercised)."""
    config = moe_config(**overrides)
    config._experts_implementation = experts_implementation
    torch.manual_seed(0)
    moe = VanillaTransformerSparseMoeBlock(config, config.encoder_ffn_dim)
    for parameter in moe.parameters():
        torch.nn.init.normal_(parameter, std=0.3)
    return moe.eval()


def reference_expert(experts: VanillaTransformerExperts, config, expert: int, x: torch.Tensor) -> torch.Tensor:
    """FFN_expert(x) written out from the expert's matrices, as the dense FFN of §3.3 / Shazeer 2020 would be."""
    act = ffn_activation(config)

    def bias(name):
        return getattr(experts, f"{name}_bias")[expert] if config.use_bias else 0.0

    if experts.has_gate:
        gate_up = x @ experts.gate_up_proj[expert].T + bias("gate_up_proj")
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = act(gate) * up
    else:
        hidden = act(x @ experts.up_proj[expert].T + bias("up_proj"))
    return hidden @ experts.down_proj[expert].T + bias("down_proj")


# ------------------------------------------------------------------------------------- experts and routing


def dense_ffn_as_one_expert(state_dict: dict) -> dict:
    """A dense model's state dict in the layout of the same model with one expert per FFN (Mixtral's 3D layout)."""
    converted = {}
    for name, tensor in state_dict.items():
        prefix, _, leaf = name.rpartition(".mlp.")
        if not prefix:
            converted[name] = tensor
            continue
        projection, kind = leaf.split(".")  # e.g. fc1.weight
        target = {"fc1": "up_proj", "fc2": "down_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
        target = target.get(projection, projection)
        key = f"{prefix}.mlp.experts.{target}" + ("_bias" if kind == "bias" else "")
        if projection == "up_proj" and f"{prefix}.mlp.gate_proj.{kind}" in state_dict:  # gated: [gate; up]
            tensor = torch.cat([state_dict[f"{prefix}.mlp.gate_proj.{kind}"], tensor])
        elif projection == "gate_proj":
            continue
        converted[key] = tensor[None]
    return converted


@pytest.mark.parametrize("ffn_type", ["relu", "swiglu"])
@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_one_expert_top1_is_the_dense_ffn(ffn_type, experts_implementation):
    torch.manual_seed(0)
    dense = VanillaTransformerForConditionalGeneration(tiny_config(ffn_type=ffn_type)).eval()
    moe = seq2seq(experts_implementation, ffn_type=ffn_type, num_experts=1, num_experts_per_tok=1)
    missing, unexpected = moe.load_state_dict(dense_ffn_as_one_expert(dense.state_dict()), strict=False)
    assert unexpected == [] and all(name.endswith("mlp.gate.weight") for name in missing)
    input_ids, attention_mask = padded_batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids)
    expected, actual = dense(**inputs).logits, moe(**inputs).logits
    if experts_implementation == "eager" and ffn_type == "relu":
        assert torch.equal(actual, expected)  # the same matmuls in the same order: bit for bit
    else:  # a fused [gate; up] matmul or the grouped kernel sums in another order
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("ffn_type", ["gelu", "swiglu"])
def test_top_k_routing_matches_a_per_token_loop(norm_topk_prob, ffn_type):
    moe = block(ffn_type=ffn_type, norm_topk_prob=norm_topk_prob)
    hidden = torch.randn(2, 5, 32)
    router_logits, top_k_weights, _ = moe.gate(hidden.reshape(-1, 32))
    expected = torch.zeros(10, 32)
    for token, x in enumerate(hidden.reshape(-1, 32)):
        probs = (x @ moe.gate.weight.T).softmax(-1)
        weights, experts = probs.topk(2)
        if norm_topk_prob:
            weights = weights / weights.sum()
        for weight, expert in zip(weights, experts.tolist()):
            expected[token] += weight * reference_expert(moe.experts, moe_config(ffn_type=ffn_type), expert, x)
    torch.testing.assert_close(moe(hidden).reshape(-1, 32), expected, rtol=1e-5, atol=1e-5)
    chosen_probs = router_logits.softmax(-1).topk(2).values
    if norm_topk_prob:
        torch.testing.assert_close(top_k_weights.sum(-1), torch.ones(10))
    else:
        torch.testing.assert_close(top_k_weights, chosen_probs)


def test_shared_experts_see_every_token_with_weight_one():
    moe = block(num_shared_experts=2)
    hidden = torch.randn(1, 6, 32)
    config = moe_config()
    shared = sum(reference_expert(moe.shared_experts, config, e, hidden[0]) for e in range(2))
    _, top_k_weights, top_k_index = moe.gate(hidden[0])
    routed = moe.experts(hidden[0], top_k_index, top_k_weights)
    torch.testing.assert_close(moe(hidden)[0], routed + shared, rtol=1e-5, atol=1e-5)


def test_jitter_only_in_training():
    config = moe_config(router_jitter_noise=0.5)
    torch.manual_seed(0)
    router = VanillaTransformerRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(64, 32)
    router.eval()
    torch.testing.assert_close(router(x)[0], x @ router.weight.T, rtol=0, atol=1e-5)  # no noise at eval
    router.train()
    noisy = router(x)[0]
    assert not torch.allclose(noisy, x @ router.weight.T) and not torch.allclose(noisy, router(x)[0])
    # The experts see the clean hidden states: jitter perturbs the router's input only (Switch Transformer).
    moe = block(router_jitter_noise=0.5).train()
    seen = []
    moe.experts.register_forward_hook(lambda module, args, output: seen.append(args[0]))
    hidden = torch.randn(1, 8, 32)
    moe(hidden)
    assert torch.equal(seen[0], hidden.reshape(-1, 32))


def test_router_runs_in_fp32_in_a_bf16_model():
    model = seq2seq("grouped_mm").to(torch.bfloat16)
    input_ids, attention_mask = padded_batch()
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, output_router_logits=True)
    assert out.logits.dtype == torch.bfloat16
    assert all(logits.dtype == torch.float32 for logits in out.encoder_router_logits + out.decoder_router_logits)
    assert torch.isfinite(out.loss) and out.encoder_aux_loss.dtype == torch.float32


@pytest.mark.parametrize(
    "overrides",
    [
        dict(ffn_type="swiglu"),
        dict(ffn_type="relu", use_bias=False, num_shared_experts=1),
        dict(ffn_type="geglu", expert_capacity_factor=1.0),
    ],
    ids=["swiglu-bias", "relu-shared", "geglu-capacity"],
)
@pytest.mark.parametrize("implementation", ["batched_mm", "grouped_mm", SORTED_GROUPED_MM])
def test_eager_and_grouped_mm_agree(overrides, implementation):
    input_ids, attention_mask = padded_batch()
    results = []
    for experts_implementation in ("eager", implementation):
        model = seq2seq(experts_implementation, **overrides)
        out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
        out.loss.backward()
        grads = {name: p.grad for name, p in model.named_parameters() if "experts" in name or ".gate." in name}
        results.append((out.logits, grads))
    (eager_logits, eager_grads), (grouped_logits, grouped_grads) = results
    torch.testing.assert_close(grouped_logits, eager_logits, rtol=1e-5, atol=1e-5)
    assert eager_grads.keys() == grouped_grads.keys() and len(eager_grads) > 0
    for name in eager_grads:
        torch.testing.assert_close(grouped_grads[name], eager_grads[name], rtol=1e-4, atol=1e-5, msg=name)


EXPERTS_FUNCTIONS = {
    "batched_mm": batched_mm_experts_forward,
    "grouped_mm": grouped_mm_experts_forward,
    SORTED_GROUPED_MM: sorted_grouped_mm_experts_forward,
}


HEADS_WITH_EXPERTS = {
    "seq2seq": lambda: VanillaTransformerForConditionalGeneration(moe_config()),
    "causal LM": lambda: VanillaTransformerForCausalLM(moe_config(is_encoder_decoder=False, is_decoder=True)),
    "masked LM": lambda: VanillaTransformerForMaskedLM(moe_config(is_encoder_decoder=False)),
    "classifier": lambda: VanillaTransformerForSequenceClassification(moe_config(is_encoder_decoder=False)),
    "image classifier": lambda: VanillaTransformerForImageClassification(
        moe_config(is_encoder_decoder=False, image_size=8, patch_size=2, num_labels=3)
    ),
}


@pytest.mark.parametrize("head", list(HEADS_WITH_EXPERTS))
def test_every_head_switches_its_experts_implementation(head):
    """Each head, whatever module defines it, takes another experts implementation by name, as its experts run it."""
    model = HEADS_WITH_EXPERTS[head]()
    for implementation in ("grouped_mm", "eager", SORTED_GROUPED_MM):
        model.set_experts_implementation(implementation)
        assert model.config._experts_implementation == implementation
        assert all(
            module.config._experts_implementation == implementation
            for module in model.modules()
            if isinstance(module, VanillaTransformerExperts)
        )


@pytest.mark.parametrize("implementation", ["eager", *EXPERTS_FUNCTIONS, None])
def test_each_experts_implementation_runs_its_function(tmp_path, implementation):
    """The name given to `from_pretrained` or `set_experts_implementation` runs its function and no other: transformers'
    own under their names (as for Mixtral), ours under its own; none given, ours. The functions are spied on in
    transformers' table, as its common test does."""
    seq2seq().save_pretrained(tmp_path)
    input_ids, attention_mask = padded_batch()
    spies = {name: Mock(wraps=function) for name, function in EXPERTS_FUNCTIONS.items()}
    load_kwargs = {} if implementation is None else {"experts_implementation": implementation}
    with patch.dict(ALL_EXPERTS_FUNCTIONS._global_mapping, spies):
        loaded = VanillaTransformerForConditionalGeneration.from_pretrained(tmp_path, **load_kwargs)
        switched = seq2seq("eager")
        switched.set_experts_implementation(implementation or SORTED_GROUPED_MM)
        for model in (loaded, switched):
            model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids)
            expected = implementation or SORTED_GROUPED_MM
            assert model.config._experts_implementation == expected
            assert {name for name, spy in spies.items() if spy.called} == ({expected} - {"eager"})
            for spy in spies.values():
                spy.reset_mock()


@pytest.mark.parametrize(
    "head", [VanillaTransformerForCausalLM, VanillaTransformerForMaskedLM, VanillaTransformerForSequenceClassification]
)
def test_every_head_runs_the_experts_function_it_is_given(tmp_path, head):
    """The heads are defined outside the module of the experts, where transformers looks for
    `@use_experts_implementation`: each still runs the function named to `from_pretrained` or
    `set_experts_implementation`."""
    torch.manual_seed(0)
    model = head(moe_config()).eval()
    model.save_pretrained(tmp_path)
    input_ids, attention_mask = padded_batch()
    spy = Mock(wraps=grouped_mm_experts_forward)
    with patch.dict(ALL_EXPERTS_FUNCTIONS._global_mapping, {"grouped_mm": spy}):
        loaded = head.from_pretrained(tmp_path, experts_implementation="grouped_mm")
        model.set_experts_implementation("grouped_mm")
        for switched in (loaded, model):
            switched(input_ids=input_ids, attention_mask=attention_mask)
            assert switched.get_experts_implementation()[""] == "grouped_mm" and spy.called
            spy.reset_mock()


def test_sorted_grouped_mm_refuses_what_it_does_not_run():
    """Registered in transformers' table, ours can be chosen for any model's experts: it refuses a post-expert norm
    (which some models' experts have) instead of skipping it."""
    moe = block(SORTED_GROUPED_MM)
    moe.experts.has_post_expert_norm = True
    with pytest.raises(NotImplementedError, match="post-expert norms"):
        moe(torch.randn(4, 32))


@pytest.mark.parametrize("implementation", ["eager", *EXPERTS_FUNCTIONS])
def test_choices_of_another_ranks_experts_add_nothing_under_expert_parallelism(implementation):
    """Under expert parallelism a choice of an expert held by another rank reaches this rank's experts as id
    `num_experts` with weight 0 (transformers' dispatch): every implementation drops it."""
    moe = block(implementation)
    hidden = torch.randn(6, 32)
    _, top_k_weights, top_k_index = moe.gate(hidden)
    top_k_weights = top_k_weights.detach().clone()
    top_k_weights[::2, 1] = 0.0
    with torch.no_grad():
        expected = moe.experts(hidden, top_k_index, top_k_weights)
        moe.experts._is_expert_parallel = True
        top_k_index[::2, 1] = moe.experts.num_experts
        torch.testing.assert_close(moe.experts(hidden, top_k_index, top_k_weights), expected)


def test_unknown_experts_implementation_is_refused_with_the_valid_names():
    with pytest.raises(ValueError, match=f'experts_implementation="{SORTED_GROUPED_MM}"'):  # among the valid names
        seq2seq().set_experts_implementation("sorted_grouped")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ffn_type", ["relu", "swiglu"])
def test_half_precision_eager_experts_round_as_the_grouped_functions(dtype, ffn_type):
    """In bf16 and fp16 the eager loop rounds where the grouped functions do (bias added to the rounded product, the
    k choices summed in fp32 and cast once): switching between them changes no output."""
    moe = block(ffn_type=ffn_type).to(dtype)
    hidden = torch.randn(64, 32, dtype=dtype)
    _, top_k_weights, top_k_index = moe.gate(hidden)
    with torch.no_grad():
        eager = moe.experts(hidden, top_k_index, top_k_weights)
        for function in (grouped_mm_experts_forward, sorted_grouped_mm_experts_forward):
            assert torch.equal(function(moe.experts, hidden, top_k_index, top_k_weights), eager), function.__name__


@pytest.mark.parametrize("ffn_type", ["swiglu", "gelu"])
def test_our_grouped_mm_is_transformers_grouped_mm(ffn_type):
    """Our grouped_mm (sorted once, index_select / index_add) computes transformers' function, biases included."""
    moe = block(SORTED_GROUPED_MM, ffn_type=ffn_type, num_experts_per_tok=3)
    hidden, grad_output = torch.randn(40, 32), torch.randn(40, 32)
    _, top_k_weights, top_k_index = moe.gate(hidden)
    results = []
    for forward in (moe.experts, functools.partial(grouped_mm_experts_forward, moe.experts)):
        moe.zero_grad()
        output = forward(hidden, top_k_index, top_k_weights.detach())
        output.backward(grad_output)
        results.append((output, {name: p.grad for name, p in moe.experts.named_parameters()}))
    (ours, our_grads), (transformers_output, transformers_grads) = results
    torch.testing.assert_close(ours, transformers_output, rtol=1e-6, atol=1e-6)  # k = 3: sums in another order
    for name in our_grads:
        torch.testing.assert_close(our_grads[name], transformers_grads[name], rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, encoder_layers, decoder_layers",
    [(dict(), 2, 2), (dict(moe_stacks="decoder"), 0, 2), (dict(moe_layer_frequency=2, encoder_layers=4), 2, 1)],
)
def test_router_logits_are_recorded_per_moe_layer(overrides, encoder_layers, decoder_layers):
    model = seq2seq(**overrides)
    input_ids, attention_mask = padded_batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :5])
    assert model(**inputs).encoder_router_logits is None  # only on request
    out = model(**inputs, output_router_logits=True)
    assert len(out.encoder_router_logits) == encoder_layers and len(out.decoder_router_logits) == decoder_layers
    assert all(logits.shape == (27, 4) for logits in out.encoder_router_logits)
    assert all(logits.shape == (15, 4) for logits in out.decoder_router_logits)


# ------------------------------------------------------------------------------------- capacity


def gshard_kept(top_k_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which (token, choice) assignments GShard keeps, written out: every token's first choice in token order, then
    every second choice, ..., each kept while its expert has fewer than `capacity` assignments."""
    load = [0] * num_experts
    kept = torch.zeros(top_k_index.shape, dtype=torch.bool)
    for choice in range(top_k_index.shape[1]):
        for token in range(top_k_index.shape[0]):
            expert = int(top_k_index[token, choice])
            kept[token, choice] = load[expert] < capacity
            load[expert] += 1
    return kept


def test_capacity_serves_first_choices_before_second_choices():
    # GShard order: every token's first choice, then second choices. Expert 0 is the first choice of all three
    # tokens and queues them 0, 1, 2: with room for two, token 2 loses it; expert 1 queues the second choices of
    # tokens 0 and 2, which fit.
    top_k_index = torch.tensor([[0, 1], [0, 2], [0, 1]])
    assert positions_in_experts(top_k_index, num_experts=3).tolist() == [[0, 0], [1, 0], [2, 1]]
    _, _, keep = capacity_slots(top_k_index, torch.ones(3, 2), capacity=2, num_experts=3)
    assert keep.tolist() == [[True, True], [True, True], [False, True]]


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_capacity_bounds_each_expert_and_dropped_tokens_keep_their_residual(experts_implementation):
    moe = block(experts_implementation, expert_capacity_factor=0.5, norm_position="pre")
    with torch.no_grad():
        moe.gate.weight[0] += 2.0  # crowd expert 0, so that some tokens overflow
    hidden = torch.randn(2, 12, 32)
    residual = SublayerConnection(moe_config(norm_position="pre"))  # x + MoE(LayerNorm(x))
    normed = residual.norm(hidden)
    processed = []
    moe.experts.register_forward_hook(lambda module, args, output: processed.append(args[1]))
    output = moe(normed).reshape(-1, 32)

    capacity = expert_capacity(24, top_k=2, num_experts=4, capacity_factor=0.5)
    assert capacity == math.ceil(0.5 * 24 * 2 / 4)
    assert torch.bincount(processed[0].flatten(), minlength=4).max() <= capacity

    # Independent count of the dropped assignments: what overflows each expert.
    _, _, top_k_index = moe.gate(normed.reshape(-1, 32))
    overflow = sum(max(0, int((top_k_index == e).sum()) - capacity) for e in range(4))
    assert overflow > 0 and moe.dropped_tokens == overflow
    assert dropped_token_counts(moe) == {"": overflow}

    # Tokens that lost every expert get no FFN output, so the pre-norm residual leaves them unchanged.
    kept = gshard_kept(top_k_index, 4, capacity)
    skipped = ~kept.any(dim=-1)
    assert skipped.sum() > 0
    assert torch.equal(output[skipped], torch.zeros_like(output[skipped]))
    after = residual(hidden, moe).reshape(-1, 32)
    assert torch.equal(after[skipped], hidden.reshape(-1, 32)[skipped])
    # Tokens that kept all their experts get exactly the dropless output.
    dropless = block(experts_implementation, norm_position="pre")
    dropless.load_state_dict(moe.state_dict())
    full = kept.all(dim=-1)
    torch.testing.assert_close(output[full], dropless(normed).reshape(-1, 32)[full], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------- losses


def cyclic_logits(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """Token t prefers experts t, t+1, ..., t+k-1 (mod E): every expert gets the same load and mean probability."""
    logits = torch.zeros(num_tokens, num_experts)
    for t in range(num_tokens):
        for j in range(top_k):
            logits[t, (t + j) % num_experts] = 5.0 - j
    return logits


@pytest.mark.parametrize("top_k", [1, 2])
def test_balancing_loss_closed_form(top_k):
    config = moe_config(num_experts_per_tok=top_k)
    balanced = (cyclic_logits(8, 4, top_k), cyclic_logits(8, 4, top_k))  # two layers, batch 2 x length 4
    assert load_balancing_loss(balanced, config).item() == pytest.approx(top_k, abs=1e-5)  # the minimum, k
    collapsed = torch.zeros(8, 4)
    collapsed[:, :top_k] = 30.0  # every token to the same k experts
    assert load_balancing_loss((collapsed,), config).item() == pytest.approx(4.0, abs=1e-5)  # E
    # Padding rows, however badly routed, do not count.
    padded = torch.cat([cyclic_logits(4, 4, top_k), collapsed[:4]])  # batch 2 x length 4, second row padding
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    assert load_balancing_loss((padded,), config, mask).item() == pytest.approx(top_k, abs=1e-5)


def test_balancing_loss_equals_switch_formula_with_padding():
    config = moe_config(num_experts_per_tok=2)
    torch.manual_seed(0)
    layers = (torch.randn(12, 4), torch.randn(12, 4))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    valid = mask.reshape(-1).bool()
    per_layer = []
    for layer in layers:  # Switch Transformer eq. 4-6, one layer at a time
        probs, chosen = layer.softmax(-1)[valid], layer.topk(2).indices[valid]
        f = torch.stack([(chosen == e).sum() for e in range(4)]).float() / probs.shape[0]  # assignments per token
        per_layer.append(4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(load_balancing_loss(layers, config, mask), sum(per_layer) / 2)
    # Each layer is balanced on its own: two layers collapsed onto different experts are not "balanced overall".
    first, second = torch.zeros(8, 4), torch.zeros(8, 4)
    first[:, :2], second[:, 2:] = 30.0, 30.0
    assert load_balancing_loss((first, second), config).item() == pytest.approx(4.0, abs=1e-5)


def test_z_loss_formula():
    torch.manual_seed(0)
    layers = (torch.randn(6, 4) * 3, torch.randn(6, 4) * 3)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    rows = [layer[i] for layer in layers for i in range(6) if mask.reshape(-1)[i]]
    expected = sum(math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in rows) / len(rows)
    assert router_z_loss(layers, mask).item() == pytest.approx(expected, rel=1e-5)
    assert router_z_loss(layers).item() == pytest.approx(torch.cat(layers).logsumexp(-1).pow(2).mean().item(), rel=1e-6)


def test_seq2seq_output_reports_weighted_router_losses():
    model = seq2seq(router_aux_loss_coef=0.1, router_z_loss_coef=0.01)
    input_ids, attention_mask = padded_batch()
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, output_router_logits=True)
    cross_entropy = F.cross_entropy(out.logits.reshape(-1, 64), input_ids.reshape(-1))
    router = 0.1 * (out.encoder_aux_loss + out.decoder_aux_loss) + 0.01 * (out.encoder_z_loss + out.decoder_z_loss)
    torch.testing.assert_close(out.loss, cross_entropy + router)
    enc = load_balancing_loss(out.encoder_router_logits, model.config, attention_mask)
    torch.testing.assert_close(out.encoder_aux_loss, enc)  # padding of the source excluded


def test_causal_lm_with_experts_returns_aux_and_z_loss():
    torch.manual_seed(0)
    model = VanillaTransformerForCausalLM(moe_config(ffn_type="swiglu")).eval()
    input_ids, attention_mask = padded_batch()
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids, output_router_logits=True)
    assert len(out.router_logits) == 2
    # Every position is routed; the router losses count the tokens of the attention mask, padding left out.
    assert all(logits.shape == (input_ids.numel(), 4) for logits in out.router_logits)
    torch.testing.assert_close(out.aux_loss, load_balancing_loss(out.router_logits, model.config, attention_mask))
    torch.testing.assert_close(out.z_loss, router_z_loss(out.router_logits, attention_mask))
    out.loss.backward()
    assert model.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0


def test_classifier_with_experts_gets_router_losses_in_its_gradient():
    torch.manual_seed(0)
    config = moe_config(num_experts_per_tok=1, norm_topk_prob=True, num_labels=3)  # top-1 weight p/p = 1
    model = VanillaTransformerForSequenceClassification(config).eval()
    input_ids, attention_mask = padded_batch()
    labels = torch.tensor([0, 2, 1])
    out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    F.cross_entropy(out.logits, labels).backward()  # a loss of the user's own, from the logits only
    grads = [layer.mlp.gate.weight.grad for layer in model.model.layers]
    model.zero_grad()
    encoder = model.model(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    aux = load_balancing_loss(encoder.router_logits, config, attention_mask)
    z = router_z_loss(encoder.router_logits, attention_mask)
    router_loss = config.router_aux_loss_coef * aux + config.router_z_loss_coef * z
    router_loss.backward()
    for grad, layer in zip(grads, model.model.layers):  # the router's whole gradient is the router loss's
        assert layer.mlp.gate.weight.grad.abs().max() > 1e-5
        torch.testing.assert_close(grad, layer.mlp.gate.weight.grad, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels) + router_loss.detach())


# ------------------------------------------------------------------------------------- gradient under the Trainer


class RouterGradients(TrainerCallback):
    """Keeps the router weights' gradients of the first optimizer step."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")}


def router_grads_under_label_smoothing(tmp_path, **overrides) -> tuple[dict, dict]:
    """Router gradients of one Seq2SeqTrainer step with label smoothing (the Trainer pops `labels`), and the
    gradients of the model's own router loss on the same batch."""
    # Top-1 with renormalisation gives each token weight p/p = 1: the translation loss cannot reach the router,
    # so whatever gradient the router gets must come from the balancing and z losses.
    model = seq2seq(num_experts_per_tok=1, norm_topk_prob=True, **overrides).train()
    input_ids, attention_mask = padded_batch(batch=4, length=6)
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(input_ids)
    rows = [
        dict(input_ids=i, attention_mask=m, decoder_input_ids=d, labels=i)
        for i, m, d in zip(input_ids, attention_mask, decoder_input_ids)
    ]
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=1,
        label_smoothing_factor=0.1,
        max_grad_norm=0.0,  # no clipping: compare raw gradients
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    callback = RouterGradients()
    expected_model = seq2seq(num_experts_per_tok=1, norm_topk_prob=True, **overrides).train()
    Seq2SeqTrainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()

    out = expected_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        decoder_input_ids=decoder_input_ids,
        output_router_logits=True,  # without labels, the losses are returned only when asked for (as Mixtral)
    )
    router_loss = expected_model.config.router_aux_loss_coef * (out.encoder_aux_loss + out.decoder_aux_loss)
    router_loss = router_loss + expected_model.config.router_z_loss_coef * (out.encoder_z_loss + out.decoder_z_loss)
    router_loss.backward()
    expected = {n: p.grad for n, p in expected_model.named_parameters() if n.endswith("mlp.gate.weight")}
    return callback.grads, expected


def test_router_gets_the_aux_loss_gradient_under_seq2seq_trainer_with_label_smoothing(tmp_path):
    grads, expected = router_grads_under_label_smoothing(tmp_path)
    assert grads.keys() == expected.keys() and len(grads) == 4
    for name in grads:
        assert expected[name].abs().max() > 1e-4
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)  # once, not twice
    # Control: without router losses the router gets (numerically) nothing.
    grads, _ = router_grads_under_label_smoothing(tmp_path, router_aux_loss_coef=0.0, router_z_loss_coef=0.0)
    assert max(g.abs().max() for g in grads.values()) < 1e-6


# ------------------------------------------------------------------------------------- fp16 loss scaling

FP16_LOSS_SCALE = 2.0**16  # GradScaler's initial scale, which the Trainer's fp16 starts from


def router_step(model, scaler: torch.amp.GradScaler | None, backward) -> dict[str, torch.Tensor]:
    """The router weights' gradients of one backward (`backward(loss_to_differentiate)`), unscaled by `scaler` when
    it scaled the loss, as an optimizer step would see them."""
    input_ids, attention_mask = padded_batch(batch=4, length=6)
    batch = dict(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)
    backward(batch)
    if scaler is not None:
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    return {name: p.grad.clone() for name, p in model.named_parameters() if name.endswith("mlp.gate.weight")}


def router_only_model():
    """Top-1 with renormalisation (each token's weight p/p = 1): the translation loss cannot reach the routers, so
    their whole gradient is the router losses' (weighted 1, so that a lost factor shows)."""
    return seq2seq(num_experts_per_tok=1, norm_topk_prob=True, router_aux_loss_coef=1.0, router_z_loss_coef=0.1).train()


@pytest.mark.parametrize("fp16_autocast", [False, True], ids=["float32", "float16-autocast"])
def test_router_gets_the_same_gradient_under_fp16_loss_scaling(fp16_autocast):
    """`torch.amp.GradScaler` in a user's loop multiplies the loss by 2^16 and divides the gradients by it: the router
    losses, which reach the routers through the logits, are scaled with the loss, so after unscaling the routers get
    the float32 gradient (under fp16 autocast too, up to its rounding) instead of 1/65536 of it."""
    model = router_only_model()

    def plain(batch):
        model(**batch).loss.backward()

    expected = router_step(model, None, plain)
    model.zero_grad()
    scaler = torch.amp.GradScaler("cpu", init_scale=FP16_LOSS_SCALE)

    def scaled(batch):
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16_autocast):
            loss = model(**batch).loss
        scaler.scale(loss).backward()

    grads = router_step(model, scaler, scaled)
    tolerance = dict(rtol=1e-3, atol=1e-4) if fp16_autocast else dict(rtol=1e-5, atol=1e-7)
    for name, grad in grads.items():
        assert expected[name].abs().max() > 1e-2
        torch.testing.assert_close(grad, expected[name], **tolerance, msg=name)


def test_router_gets_the_same_gradient_under_the_trainers_fp16():
    """The Trainer's fp16 scales the loss with Accelerate's GradScaler (`accelerator.backward`); on a CPU Accelerate
    runs fp16 without one, so the test gives it one. A training step's router gradients, unscaled, are the float32
    step's."""
    grads = {}
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=FP16_LOSS_SCALE)):
        model = router_only_model()
        args = Seq2SeqTrainingArguments(output_dir="unused", use_cpu=True, report_to=[], fp16=scaler is not None)
        trainer = Seq2SeqTrainer(model=model, args=args)
        trainer.accelerator.scaler = scaler

        def step(batch, trainer=trainer, model=model):  # what `training_step` does with a batch
            trainer.accelerator.backward(trainer.compute_loss(model, batch))

        grads[scaler is None] = router_step(model, scaler, step)
    for name, expected in grads[True].items():
        assert expected.abs().max() > 1e-2
        torch.testing.assert_close(grads[False][name], expected, rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------- training


def expert_loads(router_logits: tuple[torch.Tensor, ...], top_k: int, num_experts: int) -> torch.Tensor:
    """Fraction of top-k assignments per expert, per layer: (layers, E)."""
    return torch.stack([torch.bincount(r.topk(top_k).indices.flatten(), minlength=num_experts) for r in router_logits])


def chain_targets(source: torch.Tensor) -> torch.Tensor:
    """Toy translation: the first target token copies the source's first token (through cross-attention); each
    next one is a fixed permutation of the previous one (t -> 5t mod 13 + 3), a token-to-token map for the FFNs."""
    targets = [source[:, 0]]
    for _ in range(source.shape[1] - 1):
        targets.append((targets[-1] * 5) % 13 + 3)
    return torch.stack(targets, dim=1)


def test_moe_seq2seq_learns_a_toy_task_and_stays_balanced():
    """E=4 top-2 experts in both stacks: the loss falls and every expert keeps a share of the tokens."""
    # Xavier: at d_model 32 the default N(0, 0.02) starts ~9x smaller, too slow for 80 steps at this learning rate.
    model = seq2seq("grouped_mm", vocab_size=16, router_aux_loss_coef=0.1, initialization="xavier").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(80):
        source = torch.randint(3, 16, (16, 6), generator=generator)
        out = model(input_ids=source, labels=chain_targets(source))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    model.eval()
    with torch.no_grad():
        source = torch.randint(3, 16, (64, 6), generator=generator)
        out = model(input_ids=source, labels=chain_targets(source), output_router_logits=True)
    loads = expert_loads(out.encoder_router_logits + out.decoder_router_logits, 2, 4).float()
    ratio = (loads.max(dim=1).values / loads.min(dim=1).values).max().item()
    print(f"loss {losses[0]:.3f} -> {sum(losses[-5:]) / 5:.3f}; assignments per expert and layer {loads.tolist()}")
    assert sum(losses[-5:]) / 5 < 0.5 * losses[0]
    assert ratio < 3.0, f"max/min expert load {ratio:.2f}"


def test_ddp_two_processes_without_unused_parameter_errors(tmp_path):
    script = Path(__file__).with_name("ddp_moe_script.py")
    # The two ranks are started directly, meeting through a file store: torchrun's agent adds nothing to test here
    # and once hung for its 300 s exit barrier after both ranks had finished. No distributed settings are inherited
    # from the caller (a parent torchrun or accelerate launch).
    inherited = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC")
    env = {k: v for k, v in os.environ.items() if not k.startswith(inherited)} | {"OMP_NUM_THREADS": "1"}
    store = f"file://{tmp_path / 'store'}"
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=env | {"RANK": str(rank), "WORLD_SIZE": "2", "INIT_METHOD": store},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [process.communicate(timeout=240) for process in ranks]
    finally:  # a rank that hangs must not outlive the test
        for process in ranks:
            process.kill()
    for process, (stdout, stderr) in zip(ranks, outputs):
        assert process.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert sorted(stdout.strip() for stdout, _ in outputs) == ["DDP OK rank 0", "DDP OK rank 1"]


@pytest.mark.parametrize("seed", range(10))
def test_bfloat16_eager_and_sdpa_route_left_padded_tokens_alike(seed):
    """transformers' common test compares eager and sdpa attention in bf16 with left padding (atol = rtol = 1e-2 on
    CPU). The two kernels round differently; under the default N(0, 0.02) init the encoder outputs and the logits
    still agree within that tolerance. With Xavier's order-1 activations every one of these seeds failed (up to 1.2
    apart: a token sent to other experts)."""
    config = moe_config()
    mask = torch.ones(4, 9, dtype=torch.long)
    mask[1, :3], mask[2, :6], mask[3, :1] = 0, 0, 0  # left padding
    input_ids = torch.randint(3, 64, (4, 9), generator=torch.Generator().manual_seed(seed))
    outputs = {}
    for implementation in ("eager", "sdpa"):
        torch.manual_seed(seed)
        model = VanillaTransformerForConditionalGeneration._from_config(
            config, dtype=torch.bfloat16, attn_implementation=implementation
        ).eval()
        with torch.no_grad():
            output = model(
                input_ids=input_ids, attention_mask=mask, decoder_input_ids=input_ids, decoder_attention_mask=mask
            )
        outputs[implementation] = output.encoder_last_hidden_state[mask.bool()], output.logits[mask.bool()]
    for eager, sdpa in zip(outputs["eager"], outputs["sdpa"]):
        torch.testing.assert_close(sdpa, eager, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("model_class", [VanillaTransformerForConditionalGeneration, VanillaTransformerForMaskedLM])
def test_router_losses_count_every_position_when_the_head_keeps_few_logits(model_class):
    """`logits_to_keep` narrows the vocabulary projection, not the positions the stack routed: the logits kept are
    those of the full projection, and the router losses still count every token of the padding masks."""
    seq2seq = model_class is VanillaTransformerForConditionalGeneration
    torch.manual_seed(0)
    model = model_class(moe_config(is_encoder_decoder=seq2seq)).eval()
    input_ids, attention_mask = padded_batch()
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, output_router_logits=True)
    if seq2seq:
        inputs |= dict(decoder_input_ids=input_ids, decoder_attention_mask=attention_mask)
    with torch.no_grad():
        full, last = model(**inputs), model(**inputs, logits_to_keep=1)
    torch.testing.assert_close(last.logits, full.logits[:, -1:])
    for name in ("encoder_aux_loss", "decoder_aux_loss", "encoder_z_loss", "decoder_z_loss") if seq2seq else ():
        torch.testing.assert_close(getattr(last, name), getattr(full, name))
