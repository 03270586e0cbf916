"""Normalisation layers and their placement around each sub-layer (the residual connection of §3.1)."""

from collections.abc import Callable

import torch
from torch import nn

from .configuration_vanilla_transformer import Stack, VanillaTransformerConfig
from .dropout_vanilla_transformer import Dropout


def build_norm(config: VanillaTransformerConfig) -> nn.Module:
    """LayerNorm (paper, Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019), with the configured epsilon."""
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)  # eps given: torch's default is finfo(dtype).eps
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.norm_bias)


def deepnorm_constants(config: VanillaTransformerConfig, stack: Stack) -> tuple[float, float]:
    """DeepNet (Wang et al. 2022, Figure 2 / Table 1) residual weight alpha and init gain beta.

    Encoder-decoder with N encoder and M decoder layers:
        encoder  alpha = 0.81 (N^4 M)^(1/16),  beta = 0.87 (N^4 M)^(-1/16)
        decoder  alpha = (3M)^(1/4),           beta = (12M)^(-1/4)
    Encoder-only (N layers) or decoder-only (M layers): alpha = (2L)^(1/4), beta = (8L)^(-1/4).
    """
    n, m = config.encoder_layers, config.decoder_layers
    if not config.is_encoder_decoder:
        depth = n if stack == "encoder" else m
        return (2 * depth) ** 0.25, (8 * depth) ** -0.25
    if stack == "encoder":
        return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
    return (3 * m) ** 0.25, (12 * m) ** -0.25


# DeepNet Figure 2 (pseudocode): these get Xavier-normal with gain beta; queries and keys keep gain 1. Mixture-of-
# Experts FFNs (`experts`, `shared_experts`) are FFN weights too.
DEEPNORM_SCALED_MODULES = ("v_proj", "out_proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj", "experts")


def set_deepnorm_init_gains(layer: nn.Module, config: VanillaTransformerConfig, stack: Stack) -> None:
    """Store the DeepNet init gain on each linear map and expert bank of `layer` as `deepnorm_gain`, for
    `_init_weights` to apply.

    The gain lives on the module itself because transformers initialises module by module and, for custom-code
    models, skips every module without parameters of its own, so a layer could not re-initialise its children.
    """
    if config.norm_position != "deepnorm":
        return
    beta = deepnorm_constants(config, stack)[1]
    for name, module in layer.named_modules():
        kind = name.rsplit(".", 1)[-1].removeprefix("shared_")
        if isinstance(module, nn.Linear) or kind == "experts":
            module.deepnorm_gain = beta if kind in DEEPNORM_SCALED_MODULES else 1.0


class SublayerConnection(nn.Module):
    """The dropout, residual add and norm(s) around one sub-layer (attention or FFN), placed per `norm_position`:

    post      LayerNorm(x + Dropout(f(x)))                 the paper, §3.1 and §5.4
    pre       x + Dropout(f(LayerNorm(x)))                 Xiong et al. 2020; the stack ends with a final norm
    sandwich  x + Dropout(LayerNorm(f(LayerNorm(x))))      Ding et al. 2021 (CogView)
    deepnorm  LayerNorm(alpha * x + Dropout(f(x)))         Wang et al. 2022 (DeepNet)

    A layer calls `sublayer_input(x)`, runs its sub-layer f on the result, then `add_residual(x, f(...))`.
    """

    def __init__(self, config: VanillaTransformerConfig, residual_scale: float = 1.0):
        super().__init__()
        self.norm_position = config.norm_position
        self.norm = build_norm(config)
        self.sandwich_norm = build_norm(config) if config.norm_position == "sandwich" else None
        self.dropout = Dropout(config.dropout)
        self.residual_scale = residual_scale

    def sublayer_input(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """What the sub-layer reads: the normalised stream (pre, sandwich) or the stream itself (post, deepnorm)."""
        return hidden_states if self.norm_position in ("post", "deepnorm") else self.norm(hidden_states)

    def add_residual(self, residual: torch.Tensor, sublayer_output: torch.Tensor) -> torch.Tensor:
        """The stream after the sub-layer: its dropped-out output added to the residual, normalised per placement."""
        if self.sandwich_norm is not None:
            sublayer_output = self.sandwich_norm(sublayer_output)
        if self.norm_position in ("pre", "sandwich"):
            return residual + self.dropout(sublayer_output)
        # alpha = 1 (post-LN) would cost a full-size multiply forward and backward for nothing.
        scaled = residual if self.residual_scale == 1.0 else self.residual_scale * residual
        return self.norm(scaled + self.dropout(sublayer_output))

    def forward(self, hidden_states: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The whole connection around `sublayer`, for a sub-layer that is a plain function of the stream."""
        return self.add_residual(hidden_states, sublayer(self.sublayer_input(hidden_states)))


def has_final_norm(config: VanillaTransformerConfig) -> bool:
    """Pre-norm stacks leave the residual stream un-normalised, so each stack ends with one more norm."""
    return config.norm_position in ("pre", "sandwich")


__all__ = ["SublayerConnection", "build_norm", "deepnorm_constants", "has_final_norm", "set_deepnorm_init_gains"]
