"""A random tiny HF LlamaForCausalLM converted with convert_llama_to_vanilla_transformer computes the same function.

Run: python -m pytest -q tests/test_llama_conversion.py
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_vanilla_transformer import VanillaTransformerForCausalLM, convert_llama_to_vanilla_transformer


def tiny_llama(**overrides) -> LlamaForCausalLM:
    """GQA (4 query heads share 2 K/V heads), a non-default rope_theta and RMSNorm eps, an FFN size that is not 2/3 of
    anything, untied head, and norm weights moved away from 1 so that a dropped norm would show."""
    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, 64, (3, 10), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    attention_mask[2, :5] = 0
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


@pytest.mark.parametrize("tie_word_embeddings", [False, True], ids=["untied", "tied"])
def test_converted_llama_gives_the_same_logits(tie_word_embeddings: bool) -> None:
    llama = tiny_llama(tie_word_embeddings=tie_word_embeddings)
    converted = convert_llama_to_vanilla_transformer(llama)
    assert isinstance(converted, VanillaTransformerForCausalLM)
    config = converted.config
    assert (config.norm_type, config.norm_position, config.ffn_type) == ("rmsnorm", "pre", "swiglu")
    assert (config.position_embedding_type, config.rope_theta, config.norm_eps) == ("rope", 500.0, 1e-6)
    assert (config.num_key_value_heads, config.scale_embedding, config.use_bias) == (2, False, False)
    assert converted.model.layers[0].mlp.gate_proj.out_features == 48
    assert (converted.lm_head.weight is converted.model.embed_tokens.weight) == tie_word_embeddings

    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        expected = llama(input_ids, attention_mask=attention_mask).logits
        actual = converted(input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()  # left-padded positions attend to nothing; their logits are meaningless in both
    torch.testing.assert_close(actual[real], expected[real], atol=1e-4, rtol=0)


def test_converted_llama_generates_the_same_greedy_tokens() -> None:
    llama = tiny_llama()
    converted = convert_llama_to_vanilla_transformer(llama)
    input_ids, attention_mask = left_padded_batch()
    # min_new_tokens keeps every row generating: an early EOS would make the comparison trivially equal.
    settings = dict(attention_mask=attention_mask, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    expected = llama.generate(input_ids, **settings)
    actual = converted.generate(input_ids, **settings)
    assert expected.shape == (3, 22)
    assert torch.equal(actual, expected)


def test_converted_llama_survives_save_and_load(tmp_path) -> None:
    converted = convert_llama_to_vanilla_transformer(tiny_llama())
    converted.save_pretrained(tmp_path)
    reloaded = VanillaTransformerForCausalLM.from_pretrained(tmp_path).eval()
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, converted(input_ids).logits)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}), "rope_type"),
        (dict(head_dim=16), "head_dim"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="tanh"), "hidden_act"),
    ],
    ids=["rope-scaling", "head-dim", "mixed-bias", "activation"],
)
def test_unsupported_llama_options_raise(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        convert_llama_to_vanilla_transformer(tiny_llama(**overrides))


def test_llama_with_biases_converts() -> None:
    llama = tiny_llama(attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for name, parameter in llama.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(std=0.1)  # biases start at zero; make them count
    converted = convert_llama_to_vanilla_transformer(llama)
    input_ids, _ = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(converted(input_ids).logits, llama(input_ids).logits, atol=1e-4, rtol=0)
