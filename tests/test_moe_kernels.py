"""MoE kernels (moe_kernels_vanilla_transformer.py): the gated activation's in-place backward.

Run: python -m pytest -q tests/test_moe_kernels.py
"""

import pytest
import torch
from conftest import tiny_config

from hf_vanilla_transformer.feed_forward_vanilla_transformer import ffn_activation
from hf_vanilla_transformer.moe_kernels_vanilla_transformer import gated_activation


def moe_config(**overrides):
    return tiny_config(**{"num_experts": 4, "num_experts_per_tok": 2, **overrides})


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
