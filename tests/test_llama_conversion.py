"""A random tiny HF LlamaForCausalLM converted with convert_llama_to_vanilla_transformer computes the same function.

Run: python -m pytest -q tests/test_llama_conversion.py
"""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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


# The context a model was trained on (`original_max_position_embeddings`; for "dynamic", `max_position_embeddings`),
# and inputs that run well past it, where the scaled types differ from plain RoPE and from each other.
ORIGINAL_CONTEXT = 16
LONG_INPUT_LENGTH = 40

# One setting per RoPE type of transformers (plain RoPE and each entry of `ROPE_INIT_FUNCTIONS`) for a head of 8
# dimensions, and Llama's `max_position_embeddings` with it.
ROPE_CASES = {
    "default": ({"rope_type": "default", "rope_theta": 500.0}, ORIGINAL_CONTEXT),
    "linear": ({"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, ORIGINAL_CONTEXT),
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0}, ORIGINAL_CONTEXT),
    "yarn": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL_CONTEXT, "rope_theta": 500.0},
        4 * ORIGINAL_CONTEXT,
    ),
    "longrope": (
        {
            "rope_type": "longrope",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "short_factor": [1.0, 1.1, 1.3, 1.6],
            "long_factor": [1.5, 2.0, 3.0, 4.0],
            "rope_theta": 500.0,
        },
        4 * ORIGINAL_CONTEXT,
    ),
    "llama3": (
        {
            "rope_type": "llama3",
            "factor": 4.0,
            "original_max_position_embeddings": ORIGINAL_CONTEXT,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "rope_theta": 500.0,
        },
        4 * ORIGINAL_CONTEXT,
    ),
    # Half of each head's frequencies rotate, the rest stay at angle 0: the whole head still takes part.
    "proportional": (
        {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 500.0},
        ORIGINAL_CONTEXT,
    ),
}
ROPE_TYPES = ["default", *ROPE_INIT_FUNCTIONS]


def rope_case(rope_type: str) -> dict:
    """Llama's settings for `rope_type`: its `rope_parameters` and `max_position_embeddings`."""
    assert rope_type in ROPE_CASES, f"transformers has a new RoPE type {rope_type!r}: add a case to ROPE_CASES"
    rope_parameters, max_position_embeddings = ROPE_CASES[rope_type]
    return dict(rope_parameters=dict(rope_parameters), max_position_embeddings=max_position_embeddings)


def long_batch(vocab_size: int = 64) -> torch.Tensor:
    return torch.randint(3, vocab_size, (2, LONG_INPUT_LENGTH), generator=torch.Generator().manual_seed(2))


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
    assert (config.position_embedding_type, config.norm_eps) == ("rope", 1e-6)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
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


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_every_rope_type_converts_to_the_same_logits_past_the_original_context(rope_type: str) -> None:
    llama = tiny_llama(**rope_case(rope_type))
    converted = convert_llama_to_vanilla_transformer(llama)
    assert converted.config.rope_parameters == llama.config.rope_parameters
    input_ids = long_batch()
    with torch.no_grad():
        expected = llama(input_ids).logits
        actual = converted(input_ids).logits
        plain = tiny_llama(max_position_embeddings=llama.config.max_position_embeddings)(input_ids).logits
    assert input_ids.shape[1] > ORIGINAL_CONTEXT
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    # The same weights with plain RoPE: past the original context every scaled type computes another function.
    assert (rope_type == "default") == torch.allclose(expected[:, ORIGINAL_CONTEXT:], plain[:, ORIGINAL_CONTEXT:])


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_every_rope_type_generates_the_same_tokens_and_scores_past_the_original_context(rope_type: str) -> None:
    """Step by step with the cache: "dynamic" and "longrope" recompute their frequencies as the positions grow."""
    llama = tiny_llama(**rope_case(rope_type))
    converted = convert_llama_to_vanilla_transformer(llama)
    input_ids = long_batch()[:, :10]
    settings = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False)
    settings.update(output_logits=True, return_dict_in_generate=True)
    expected = llama.generate(input_ids, **settings)
    actual = converted.generate(input_ids, **settings)
    assert expected.sequences.shape[1] > ORIGINAL_CONTEXT
    assert torch.equal(actual.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(actual.logits), torch.stack(expected.logits), atol=1e-5, rtol=0)


def test_a_bfloat16_llama_converts_with_rope_frequencies_in_float32(tmp_path) -> None:
    """transformers keeps RoPE's frequencies in float32 in a bfloat16 model, and so does the converted one: rounded to
    bfloat16, they would turn the angles at position 4000 by radians."""
    tiny_llama(**rope_case("llama3")).save_pretrained(tmp_path)
    llama = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    converted = convert_llama_to_vanilla_transformer(llama)
    assert converted.dtype == torch.bfloat16
    positions = torch.arange(4000)[None]
    expected = llama.model.rotary_emb(torch.zeros(1, dtype=torch.bfloat16), positions)
    actual = converted.model.embed_positions(torch.zeros(1, 4000, 32, dtype=torch.bfloat16), positions)[1]
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(actual, expected, strict=True))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(head_dim=16), "head_dim"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="tanh"), "hidden_act"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}), "partial"),
    ],
    ids=["head-dim", "mixed-bias", "activation", "partial-rotary"],
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
