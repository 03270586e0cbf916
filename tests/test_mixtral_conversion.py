"""A random tiny HF MixtralForCausalLM converted with convert_mixtral_to_vanilla_transformer computes the same function.

Run: python -m pytest -q tests/test_mixtral_conversion.py
"""

import pytest
import torch
from test_llama_conversion import ORIGINAL_CONTEXT, ROPE_TYPES, left_padded_batch, long_batch, rope_case
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

from hf_vanilla_transformer import VanillaTransformerForCausalLM, convert_mixtral_to_vanilla_transformer


def tiny_mixtral(**overrides) -> MixtralForCausalLM:
    """4 top-2 SwiGLU experts, GQA, a non-default rope_theta; norm weights moved away from 1 so a dropped norm shows,
    and router weights scaled up so that routing is decisive (a wrong expert choice changes the logits)."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
            elif name.endswith("mlp.gate.weight"):
                parameter.mul_(20.0)
    return model


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_converted_mixtral_gives_the_same_logits_and_routing(experts_implementation):
    mixtral = tiny_mixtral()
    converted = convert_mixtral_to_vanilla_transformer(mixtral)
    converted.set_experts_implementation(experts_implementation)
    assert isinstance(converted, VanillaTransformerForCausalLM)
    config = converted.config
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (4, 2, True)
    assert (config.ffn_type, config.gated_ffn_dim, config.expert_capacity_factor) == ("swiglu", 48, None)
    assert converted.model.layers[1].mlp.experts.gate_up_proj.shape == (4, 96, 32)

    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = mixtral(input_ids, attention_mask=attention_mask, output_router_logits=True)
        actual = converted(input_ids, attention_mask=attention_mask, output_router_logits=True)
    real = attention_mask.bool()  # left-padded positions attend to nothing; their logits are meaningless in both
    torch.testing.assert_close(actual.logits[real], expected.logits[real], atol=1e-4, rtol=0)
    for ours, theirs in zip(actual.router_logits, expected.router_logits, strict=True):
        torch.testing.assert_close(ours[real.reshape(-1)], theirs[real.reshape(-1)].float(), atol=1e-4, rtol=0)
        assert torch.equal(ours[real.reshape(-1)].topk(2).indices, theirs[real.reshape(-1)].topk(2).indices)


def test_converted_mixtral_generates_the_same_greedy_tokens_and_reloads(tmp_path):
    mixtral = tiny_mixtral()
    converted = convert_mixtral_to_vanilla_transformer(mixtral)
    input_ids, attention_mask = left_padded_batch()
    settings = dict(attention_mask=attention_mask, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    expected = mixtral.generate(input_ids, **settings)
    assert torch.equal(converted.generate(input_ids, **settings), expected)
    converted.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.generate(input_ids, **settings), expected)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_every_rope_type_converts_to_the_same_logits_past_the_original_context(rope_type):
    # head_dim given: Mixtral's default None fails in transformers' own dynamic, yarn and longrope functions.
    mixtral = tiny_mixtral(head_dim=8, **rope_case(rope_type))
    converted = convert_mixtral_to_vanilla_transformer(mixtral)
    assert converted.config.rope_parameters == mixtral.config.rope_parameters
    input_ids = long_batch()
    with torch.no_grad():
        expected = mixtral(input_ids).logits
        actual = converted(input_ids).logits
    assert input_ids.shape[1] > ORIGINAL_CONTEXT
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_sliding_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        convert_mixtral_to_vanilla_transformer(tiny_mixtral(sliding_window=4))
