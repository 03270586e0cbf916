"""RoPE as transformers 5 configures it: `rope_parameters` of every type in transformers' table, computed as
transformers' Llama computes them; a checkpoint saved with a top-level `rope_theta` loads to the same logits; a
missing or bad parameter is refused naming `rope_parameters`.

The conversions from Llama and Mixtral (test_llama_conversion.py, test_mixtral_conversion.py) compare whole models of
every type with transformers'; here: linear scaling's closed form, each stack's own head size, what loading restores.

Run: python -m pytest -q tests/test_rope.py
"""

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import CONFIG_ERRORS, tiny_config
from test_llama_conversion import ORIGINAL_CONTEXT, ROPE_TYPES, long_batch, rope_case, tiny_llama
from transformers import AutoConfig, LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hf_vanilla_transformer import (
    VanillaTransformerConfig,
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    convert_llama_to_vanilla_transformer,
)
from hf_vanilla_transformer.ctranslate2_vanilla_transformer import check_exportable
from hf_vanilla_transformer.modeling_vanilla_transformer import RotaryEmbedding

# A tiny RoPE causal LM saved by this package before it read `rope_parameters` (commit 0a81db0): its config.json has
# a top-level "rope_theta": 321.0; expected.json holds its input ids and the logits that code computed.
SAVED_WITH_ROPE_THETA = Path(__file__).parent / "fixtures" / "causal-lm-rope-saved-with-rope-theta"


def rope_model(**overrides) -> VanillaTransformerForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(position_embedding_type="rope", is_encoder_decoder=False, is_decoder=True, **overrides)
    return VanillaTransformerForCausalLM(config).eval()


def test_linear_scaling_is_plain_rope_at_the_positions_divided_by_the_factor() -> None:
    """Linear scaling (Chen et al. 2023, position interpolation) divides every frequency by the factor."""
    head_dim, positions = 8, torch.arange(3 * ORIGINAL_CONTEXT)
    linear = RotaryEmbedding(tiny_config(rope_parameters={"rope_type": "linear", "factor": 2.0}), head_dim)
    plain = RotaryEmbedding(tiny_config(), head_dim)
    inputs_embeds = torch.zeros(1, len(positions), 32)
    for scaled, unscaled in zip(linear(inputs_embeds, 2 * positions)[1], plain(inputs_embeds, positions)[1]):
        torch.testing.assert_close(scaled, unscaled, atol=1e-6, rtol=0)


def test_a_model_loaded_with_linear_scaling_computes_transformers_function(tmp_path) -> None:
    """A plain-RoPE checkpoint loaded with `rope_parameters` linear, factor 2: other logits than before, those of
    transformers' Llama with the same weights and settings."""
    convert_llama_to_vanilla_transformer(tiny_llama()).save_pretrained(tmp_path)
    linear = {"rope_type": "linear", "factor": 2.0}
    model = VanillaTransformerForCausalLM.from_pretrained(tmp_path, rope_parameters=linear).eval()
    plain = VanillaTransformerForCausalLM.from_pretrained(tmp_path).eval()
    assert model.config.rope_parameters == {**linear, "rope_theta": 500.0}  # the saved theta stays
    input_ids = long_batch()
    with torch.no_grad():
        logits = model(input_ids).logits
        reference = tiny_llama(rope_parameters={**linear, "rope_theta": 500.0})(input_ids).logits
        assert not torch.allclose(logits, plain(input_ids).logits, atol=1e-3)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)


def llama_rotary_table(rope_parameters: dict, head_dim: int, positions: torch.Tensor):
    """transformers' Llama `(cos, sin)` for heads of `head_dim` (4 heads of that size)."""
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        rope_parameters=dict(rope_parameters),
        max_position_embeddings=4 * ORIGINAL_CONTEXT,
    )
    return LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])


def test_each_stack_rotates_heads_of_its_own_size() -> None:
    """Encoder heads of 8 dimensions, decoder heads of 16: each stack's table is Llama's for that head size."""
    rope_parameters = rope_case("yarn")["rope_parameters"]
    config = tiny_config(
        position_embedding_type="rope",
        rope_parameters=rope_parameters,
        encoder_attention_heads=4,
        decoder_attention_heads=2,
        max_position_embeddings=4 * ORIGINAL_CONTEXT,
    )
    model = VanillaTransformerForConditionalGeneration(config).model
    positions = torch.arange(3 * ORIGINAL_CONTEXT)
    for stack, head_dim in [(model.encoder, 8), (model.decoder, 16)]:
        cos, sin = stack.embed_positions(torch.zeros(1, len(positions), 32), positions)[1]
        expected_cos, expected_sin = llama_rotary_table(rope_parameters, head_dim, positions)
        assert cos.shape == (1, len(positions), head_dim)
        torch.testing.assert_close(cos, expected_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, expected_sin, atol=1e-6, rtol=0)


def test_a_checkpoint_saved_with_rope_theta_loads_to_the_same_logits(tmp_path) -> None:
    case = json.loads((SAVED_WITH_ROPE_THETA / "expected.json").read_text())
    input_ids = torch.tensor(case["input_ids"])
    model = VanillaTransformerForCausalLM.from_pretrained(SAVED_WITH_ROPE_THETA).eval()
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 321.0}
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, torch.tensor(case["logits"]))

    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"] == {"rope_type": "default", "rope_theta": 321.0}
    reloaded = VanillaTransformerForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, torch.tensor(case["logits"]))


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_every_rope_type_saves_and_loads_to_the_same_logits(rope_type: str, tmp_path) -> None:
    """`from_pretrained` builds on the meta device: the frequencies, which are not saved, are computed again."""
    model = rope_model(**rope_case(rope_type))
    model.save_pretrained(tmp_path)
    reloaded = VanillaTransformerForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    input_ids = long_batch()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids).logits, model(input_ids).logits)


BAD_ROPE_PARAMETERS = [
    ({"rope_type": "yarn"}, "factor"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}, "low_freq_factor"),
    ({"rope_type": "longrope", "original_max_position_embeddings": 16, "long_factor": [1.0] * 4}, "short_factor"),
    ({"rope_type": "nonsense"}, "rope_type"),
    ({"rope_type": "linear", "factor": math.nan}, "factor"),
    ({"rope_type": "dynamic", "factor": 0}, "factor"),
    ({"rope_type": "linear", "factor": "2"}, "factor"),
    ({"rope_type": "default", "rope_theta": 0.5}, "rope_theta"),
    ("linear", "rope_parameters"),
]


@pytest.mark.parametrize("rope_parameters, key", BAD_ROPE_PARAMETERS, ids=lambda value: str(value)[:40])
def test_a_missing_or_bad_rope_parameter_is_refused_naming_it(rope_parameters, key, tmp_path) -> None:
    """At construction, from a config.json, and as a `from_pretrained` override."""
    with pytest.raises(CONFIG_ERRORS, match=rf"rope_parameters(.|\n)*{key}"):
        VanillaTransformerConfig(rope_parameters=rope_parameters)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "vanilla_transformer", "rope_parameters": rope_parameters})
    )
    with pytest.raises(CONFIG_ERRORS, match=rf"rope_parameters(.|\n)*{key}"):
        AutoConfig.from_pretrained(tmp_path)
    VanillaTransformerConfig().save_pretrained(tmp_path)
    with pytest.raises(CONFIG_ERRORS, match=rf"rope_parameters(.|\n)*{key}"):
        VanillaTransformerConfig.from_pretrained(tmp_path, rope_parameters=rope_parameters)


def test_a_rotation_of_part_of_each_head_is_refused_when_the_model_is_built() -> None:
    rope_parameters = {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}
    config = tiny_config(position_embedding_type="rope", rope_parameters=rope_parameters)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        VanillaTransformerForConditionalGeneration(config)


def test_the_ctranslate2_export_refuses_scaled_rope() -> None:
    """CTranslate2 gets plain RoPE's base only: a scaled type would export another function."""
    check_exportable(tiny_config(position_embedding_type="rope", rope_theta=500.0))
    scaled = tiny_config(position_embedding_type="rope", rope_parameters={"rope_type": "linear", "factor": 2})
    with pytest.raises(ValueError, match="rope_parameters"):
        check_exportable(scaled)


def test_dynamic_rope_needs_a_head_size_above_two():
    """transformers' dynamic (NTK) scaling divides by head size - 2: refused by name at construction."""
    with pytest.raises(CONFIG_ERRORS, match="rope_parameters rope_type='dynamic' needs a head size above 2"):
        VanillaTransformerConfig(
            d_model=8, encoder_attention_heads=4, decoder_attention_heads=4, position_embedding_type="rope",
            rope_parameters={"rope_type": "dynamic", "factor": 2.0},
        )
