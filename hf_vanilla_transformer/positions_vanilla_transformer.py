"""Position information (§3.5 and its successors).

Every position module maps `(inputs_embeds, position_ids, past_length, positions_below)` to `(hidden_states,
rotary)` (`positions_below`: a bound on `position_ids` the caller knows, which only a table lookup needs): additive
encodings return the embeddings with positions added and no rotary table; RoPE returns the embeddings unchanged and
the `(cos, sin)` table that self-attention applies to queries and keys. Without `position_ids` the positions are
`past_length`, `past_length + 1`, ... (after a cache).
"""

import torch
from torch import nn

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .inputs_vanilla_transformer import raises_value_error, require

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


def default_positions(inputs_embeds: torch.Tensor, past_length: int | torch.Tensor) -> torch.Tensor:
    return torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_length


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoids added to the embeddings; they extrapolate to any length (§3.5).

    The first `max_position_embeddings` rows are kept as a table (not saved: `_init_weights` recomputes it), so the
    usual positions 0, 1, ... cost one slice instead of a dozen small kernels; other positions are computed."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__()
        self.dim = config.d_model
        self.layout = config.sinusoidal_layout
        self.register_buffer("table", self.encoding(torch.arange(config.max_position_embeddings)), persistent=False)

    def encoding(self, position_ids: torch.Tensor) -> torch.Tensor:
        return sinusoidal_position_encoding(position_ids, self.dim, self.layout)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        """`positions_below`: a bound the caller knows `position_ids` keep to (a flattened batch's longest sequence),
        so that they can be looked up in the table."""
        length = inputs_embeds.shape[1]
        if position_ids is None and isinstance(past_length, int) and past_length + length <= len(self.table):
            encoding = self.table[past_length : past_length + length]
        elif position_ids is not None and positions_below is not None and positions_below <= len(self.table):
            with raises_value_error(IndexError, f"position_ids hold a position past max_length ({positions_below})"):
                encoding = nn.functional.embedding(position_ids, self.table)
        else:
            positions = default_positions(inputs_embeds, past_length) if position_ids is None else position_ids
            encoding = self.encoding(positions)
        return inputs_embeds + encoding.to(inputs_embeds.dtype), None


class LearnedPositionalEmbedding(nn.Embedding):
    """A learned table of `max_position_embeddings` rows (the paper's §3.5 alternative, BERT/GPT-2 style)."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__(config.max_position_embeddings, config.d_model)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        position_ids = default_positions(inputs_embeds, past_length) if position_ids is None else position_ids
        require(
            (position_ids < self.num_embeddings).all(),
            f"A position is past max_position_embeddings={self.num_embeddings} (position_embedding_type='learned'): "
            "shorten the input or raise max_position_embeddings.",
        )
        return inputs_embeds + super().forward(position_ids), None


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021) in the rotate-half layout of GPT-NeoX/Llama: a `(cos, sin)` table per position."""

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.theta = config.rope_theta

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        position_ids = default_positions(inputs_embeds, past_length) if position_ids is None else position_ids
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

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
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
