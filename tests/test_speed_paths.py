"""Checks for the shortcuts taken for speed (benchmarks/): each must leave results unchanged.

python -m pytest -q tests/test_speed_paths.py
"""

import torch
from conftest import padded_batch, tiny_config
from transformers.cache_utils import EncoderDecoderCache

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration


def full_reorder(past_key_values: EncoderDecoderCache, beam_idx: torch.LongTensor) -> EncoderDecoderCache:
    """transformers' default: reorder self- and cross-attention caches alike."""
    past_key_values.reorder_cache(beam_idx)
    return past_key_values


def test_beam_search_skipping_the_cross_attention_reorder_changes_nothing():
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    input_ids, attention_mask = padded_batch(batch=3)
    kwargs = dict(
        attention_mask=attention_mask,
        num_beams=4,
        num_return_sequences=2,
        max_new_tokens=8,
        output_scores=True,
        return_dict_in_generate=True,
    )
    fast = model.generate(input_ids, **kwargs)
    model._reorder_cache = full_reorder  # instance attribute: the hook transformers looks up
    reference = model.generate(input_ids, **kwargs)
    assert torch.equal(fast.sequences, reference.sequences)
    torch.testing.assert_close(fast.sequences_scores, reference.sequences_scores)


def test_post_norm_residual_is_layernorm_of_sum():
    """norm_position='post' is LayerNorm(x + sublayer(x)) (§3.1), with no residual scaling."""
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    connection = model.model.encoder.layers[0].mlp_connection
    x = torch.randn(2, 5, 32)
    expected = torch.nn.functional.layer_norm(x + 2 * x, (32,), connection.norm.weight, connection.norm.bias, 1e-5)
    torch.testing.assert_close(connection(x, lambda h: 2 * h), expected)
