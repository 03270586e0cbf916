"""Checks for the shortcuts taken for speed (benchmarks/): each must leave results unchanged.

python -m pytest -q tests/test_speed_paths.py
"""

import copy
from unittest import mock

import pytest
import torch
from conftest import tiny_config

from hf_vanilla_transformer import (
    DataCollatorForSeq2SeqWithFlattening,
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForMaskedLM,
)
from hf_vanilla_transformer.cpu_training_vanilla_transformer import (
    CPU_TRAINING_ATTENTION,
    SHORT_SEQUENCE_ON_CPU,
    optimize_for_cpu_training,
)


def test_post_norm_layer_is_layernorm_of_sum():
    """norm_position='post' is LayerNorm(x + sublayer(x)) around each sub-layer (§3.1), with no residual scaling:
    an encoder layer, run as the model runs it, equals the two post-norm formulas applied by hand."""
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    layer = model.model.encoder.layers[0]
    for norm in (layer.self_attn_connection.norm, layer.mlp_connection.norm):  # not the identity they start as
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        attention, _ = layer.self_attn(x, None)
        attended = layer.self_attn_connection.norm(x + attention)
        expected = layer.mlp_connection.norm(attended + layer.mlp(attended))
        torch.testing.assert_close(layer(x, None), expected)


def flash_kernel_use_in_a_step(model, batch, dtype: torch.dtype, grad: bool) -> set[bool]:
    """Whether SDPA's flash kernel was allowed at each attention call of a forward (and backward) under autocast."""
    allowed = set()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        allowed.add(torch.backends.cuda.flash_sdp_enabled())  # the switch covers the CPU kernel too
        return sdpa(*args, **kwargs)

    with mock.patch.object(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**batch).loss
        if grad:
            loss.backward()
    return allowed


def test_short_sequences_train_with_the_math_attention_kernel_on_cpu_in_bfloat16_after_the_opt_in(tmp_path):
    """After `optimize_for_cpu_training`, training in bfloat16 on a CPU, sequences up to SHORT_SEQUENCE_ON_CPU tokens
    take SDPA's math kernel (the flash kernel's backward is the slower one there); float32, inference and long
    sequences keep SDPA's choice. The loss and gradients are those of eager attention. Without the opt-in the model
    runs transformers' SDPA as it is, and a saved model loads with SDPA."""
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config(max_position_embeddings=256)).train()
    short = dict(input_ids=torch.randint(3, 64, (2, 9)), labels=torch.randint(3, 64, (2, 7)))
    assert flash_kernel_use_in_a_step(model, short, torch.bfloat16, grad=True) == {True}
    optimize_for_cpu_training(model)
    assert model.config._attn_implementation == CPU_TRAINING_ATTENTION
    model.save_pretrained(tmp_path)
    reloaded = VanillaTransformerForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.config._attn_implementation == "sdpa"
    short = dict(input_ids=torch.randint(3, 64, (2, 9)), labels=torch.randint(3, 64, (2, 7)))
    long = dict(input_ids=torch.randint(3, 64, (2, SHORT_SEQUENCE_ON_CPU + 1)), labels=torch.randint(3, 64, (2, 7)))
    assert flash_kernel_use_in_a_step(model, short, torch.bfloat16, grad=True) == {False}
    assert flash_kernel_use_in_a_step(model, short, torch.float16, grad=True) == {False}
    assert flash_kernel_use_in_a_step(model, short, torch.float32, grad=True) == {True}
    assert flash_kernel_use_in_a_step(model, short, torch.bfloat16, grad=False) == {True}
    assert flash_kernel_use_in_a_step(model, long, torch.bfloat16, grad=True) == {True, False}  # decoder: short
    # A flattened batch: a row longer than SHORT_SEQUENCE_ON_CPU of short sentences, whose lengths the kernel sees.
    features = [{"input_ids": [5] * (20 + i), "labels": [6] * (10 + i)} for i in range(10)]
    flattened = DataCollatorForSeq2SeqWithFlattening(model)(features)
    assert flattened["input_ids"].shape[1] > SHORT_SEQUENCE_ON_CPU
    assert flash_kernel_use_in_a_step(model, flattened, torch.bfloat16, grad=True) == {False}

    model.zero_grad()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    gradients = []
    for implementation in (model, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = implementation(**short).loss
        loss.backward()
        gradients.append([parameter.grad for parameter in implementation.parameters()])
    for sdpa_gradient, eager_gradient in zip(*gradients):
        torch.testing.assert_close(sdpa_gradient, eager_gradient, rtol=0.02, atol=2e-3)


@pytest.mark.parametrize("model_class", [VanillaTransformerForConditionalGeneration, VanillaTransformerForCausalLM])
@pytest.mark.parametrize("num_experts", [0, 4])
def test_skip_logits_returns_the_same_loss_and_gradients_without_logits(model_class, num_experts):
    """`skip_logits=True` (what the training scripts ask for in a training step) leaves the loss and every gradient
    as they are and returns no logits; it needs labels."""
    config = tiny_config(num_experts=num_experts, num_experts_per_tok=2)
    if model_class is VanillaTransformerForCausalLM:
        config = tiny_config(is_encoder_decoder=False, is_decoder=True, num_experts=num_experts, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = model_class(config).train()
    input_ids = torch.randint(3, 64, (3, 8))
    labels = input_ids.clone() if model_class is VanillaTransformerForCausalLM else torch.randint(3, 64, (3, 6))
    labels[1, 4:] = -100
    runs = []
    for skip_logits in (False, True):
        model.zero_grad()
        outputs = model(input_ids=input_ids, labels=labels, skip_logits=skip_logits)
        outputs.loss.backward()
        runs.append((outputs, [parameter.grad.clone() for parameter in model.parameters()]))
    (full, full_gradients), (skipped, skipped_gradients) = runs
    assert full.logits is not None and skipped.logits is None
    assert torch.equal(full.loss, skipped.loss)
    for full_gradient, skipped_gradient in zip(full_gradients, skipped_gradients):
        assert torch.equal(full_gradient, skipped_gradient)
    with pytest.raises(ValueError, match="skip_logits=True .* needs labels"):
        model(input_ids=input_ids, skip_logits=True)


def test_skip_logits_in_the_masked_lm():
    torch.manual_seed(0)
    model = VanillaTransformerForMaskedLM(tiny_config(is_encoder_decoder=False)).train()
    input_ids = torch.randint(3, 64, (2, 8))
    labels = torch.full_like(input_ids, -100)
    labels[:, 2] = input_ids[:, 2]
    full, skipped = (model(input_ids=input_ids, labels=labels, skip_logits=skip) for skip in (False, True))
    assert skipped.logits is None
    torch.testing.assert_close(full.loss, skipped.loss, rtol=0, atol=0)


def test_the_cpu_training_opt_in_compiles_whole():
    """`optimize_for_cpu_training`'s dropout and attention leave torch.compile its own lowering: a bfloat16 training
    step with dropout compiles with `fullgraph=True` (a graph break would raise) and trains; without dropout it gives
    the eager step's loss."""
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config(dropout=0.1)).train()
    optimize_for_cpu_training(model)
    batch = dict(input_ids=torch.randint(3, 64, (2, 7)), labels=torch.randint(3, 64, (2, 5)))
    compiled_model = torch.compile(model, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = compiled_model(**batch).loss
    loss.backward()
    assert loss.isfinite() and all(p.grad is None or p.grad.isfinite().all() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(compiled_model(**batch).loss, model(**batch).loss, rtol=2e-2, atol=2e-2)
