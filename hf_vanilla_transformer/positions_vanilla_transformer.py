"""Position information (§3.5 and its successors).

Every position module maps `(inputs_embeds, position_ids)` to `(hidden_states, rotary)`: additive encodings return the
embeddings with positions added and no rotary table; RoPE returns the embeddings unchanged and the `(cos, sin)` table
that self-attention applies to queries and keys. None of them keeps a buffer, so models built on the `meta` device by
`from_pretrained` need nothing recomputed.
"""

import torch
from torch import nn
from transformers.utils import is_torchdynamo_compiling

from .configuration_vanilla_transformer import VanillaTransformerConfig

PositionOutput = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]


def sinusoidal_position_encoding(position_ids: torch.Tensor, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))  (§3.5), in fp32.

    `layout="concatenated"` puts all sines first and all cosines after them (Marian, tensor2tensor).
    """
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    if layout == "interleaved":
        encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    else:
        encoding = torch.cat((angles.sin(), angles.cos()), dim=-1)
    return encoding[..., :dim]


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoids added to the embeddings; they extrapolate to any length (§3.5)."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__()
        self.dim = config.d_model
        self.layout = config.sinusoidal_layout

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> PositionOutput:
        encoding = sinusoidal_position_encoding(position_ids, self.dim, self.layout)
        return inputs_embeds + encoding.to(inputs_embeds.dtype), None


class LearnedPositionalEmbedding(nn.Embedding):
    """A learned table of `max_position_embeddings` rows (the paper's §3.5 alternative, BERT/GPT-2 style)."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__(config.max_position_embeddings, config.d_model)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> PositionOutput:
        # A data-dependent check (one host sync); skipped while compiling, as for out-of-vocabulary token ids.
        if not is_torchdynamo_compiling() and position_ids.numel() and int(position_ids.max()) >= self.num_embeddings:
            raise ValueError(
                f"Position {int(position_ids.max())} is past max_position_embeddings={self.num_embeddings} "
                "(position_embedding_type='learned'); shorten the input or raise max_position_embeddings."
            )
        return inputs_embeds + super().forward(position_ids), None


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021) in the rotate-half layout of GPT-NeoX/Llama: a `(cos, sin)` table per position."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.theta = config.rope_theta

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> PositionOutput:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device) / self.head_dim
        freqs = position_ids.to(torch.float32)[..., None] * self.theta**-exponents
        angles = torch.cat((freqs, freqs), dim=-1)
        if angles.dim() == 2:  # shared positions -> broadcast over the batch
            angles = angles[None]
        return inputs_embeds, (angles.cos().to(inputs_embeds.dtype), angles.sin().to(inputs_embeds.dtype))


class NoPositionalEmbedding(nn.Module):
    """No position information (the decoder's causal mask still leaks order; Haviv et al. 2022)."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__()

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> PositionOutput:
        return inputs_embeds, None


POSITION_EMBEDDINGS = {
    "sinusoidal": SinusoidalPositionalEmbedding,
    "learned": LearnedPositionalEmbedding,
    "rope": RotaryEmbedding,
    "none": NoPositionalEmbedding,
}


__all__ = [
    "POSITION_EMBEDDINGS",
    "LearnedPositionalEmbedding",
    "NoPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "sinusoidal_position_encoding",
]
