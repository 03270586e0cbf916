"""Position-wise feed-forward networks (§3.3) and the GLU family (Shazeer 2020, "GLU Variants Improve Transformer").

Ungated:  FFN(x) = act(x W1 + b1) W2 + b2                 (fc1, fc2; the paper uses ReLU)
Gated:    FFN(x) = (act(x W_gate) * (x W_up)) W_down      (gate_proj, up_proj, down_proj)
"""

import torch
from torch import nn
from transformers.activations import ACT2FN

from .configuration_vanilla_transformer import GATED_FFN_TYPES, VanillaTransformerConfig
from .dropout_vanilla_transformer import Dropout

# ffn_type -> activation (ACT2FN key). For gated types it is applied to the gate; "bilinear" has none.
FFN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "swish": "silu",
    "glu": "sigmoid",
    "bilinear": "linear",
    "reglu": "relu",
    "geglu": "gelu",
    "swiglu": "silu",
}


def ffn_activation(config: VanillaTransformerConfig) -> nn.Module:
    """The activation of `config.ffn_type` (on the gate for gated types), from transformers' ACT2FN."""
    return ACT2FN[FFN_ACTIVATIONS[config.ffn_type]]


class FeedForward(nn.Module):
    """The paper's FFN: two linear maps with an activation between them."""

    def __init__(self, config: VanillaTransformerConfig, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, ffn_dim, bias=config.use_bias)
        self.fc2 = nn.Linear(ffn_dim, config.d_model, bias=config.use_bias)
        self.act_fn = ffn_activation(config)
        self.activation_dropout = Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """Any shape (..., d_model): each position on its own (§3.3), so the token layout that the layer's keyword
        arguments carry for attention does not concern it."""
        return self.fc2(self.activation_dropout(self.act_fn(self.fc1(hidden_states))))


class GatedFeedForward(nn.Module):
    """A GLU-variant FFN: the activated gate multiplies a second linear projection."""

    def __init__(self, config: VanillaTransformerConfig, ffn_dim: int):
        super().__init__()
        hidden = config.gated_hidden_size(ffn_dim)
        self.gate_proj = nn.Linear(config.d_model, hidden, bias=config.use_bias)
        self.up_proj = nn.Linear(config.d_model, hidden, bias=config.use_bias)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=config.use_bias)
        self.act_fn = ffn_activation(config)
        self.activation_dropout = Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        """Any shape (..., d_model), each position on its own (see `FeedForward.forward`)."""
        gated = self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states)
        return self.down_proj(self.activation_dropout(gated))


def build_feed_forward(config: VanillaTransformerConfig, ffn_dim: int) -> nn.Module:
    """The FFN of `config.ffn_type`; gated types get 2/3 of `ffn_dim` (see `config.gated_hidden_size`)."""
    return GatedFeedForward(config, ffn_dim) if config.ffn_type in GATED_FFN_TYPES else FeedForward(config, ffn_dim)


__all__ = ["FeedForward", "GatedFeedForward", "build_feed_forward", "ffn_activation", "FFN_ACTIVATIONS"]
