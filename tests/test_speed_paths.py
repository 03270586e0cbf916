"""Checks for the shortcuts taken for speed (benchmarks/): each must leave results unchanged.

python -m pytest -q tests/test_speed_paths.py
"""

import torch
from conftest import tiny_config

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration


def test_post_norm_residual_is_layernorm_of_sum():
    """norm_position='post' is LayerNorm(x + sublayer(x)) (§3.1), with no residual scaling."""
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    connection = model.model.encoder.layers[0].mlp_connection
    x = torch.randn(2, 5, 32)
    expected = torch.nn.functional.layer_norm(x + 2 * x, (32,), connection.norm.weight, connection.norm.bias, 1e-5)
    torch.testing.assert_close(connection(x, lambda h: 2 * h), expected)
