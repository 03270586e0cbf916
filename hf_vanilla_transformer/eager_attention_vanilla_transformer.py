"""Rotary embeddings and the eager attention function, written here as each of transformers' modeling files writes its
own (Llama's, in transformers 5.21 to 5.24): another model's module is no API, and a release may change it for that
model's sake alone."""

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The two halves of the last dimension swapped, the first negated: (x1, x2) -> (-x2, x1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys (batch, heads, length, head_dim) rotated by the position's angles, `cos`/`sin` (batch, length,
    head_dim) broadcast over the heads (`unsqueeze_dim`)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Each key/value head repeated for the `n_rep` query heads of its group: (batch, kv_heads, length, head_dim) ->
    (batch, kv_heads * n_rep, length, head_dim), as `torch.repeat_interleave(x, n_rep, dim=1)`."""
    if n_rep == 1:
        return hidden_states
    batch, kv_heads, length, head_dim = hidden_states.shape
    hidden_states = hidden_states[:, :, None].expand(batch, kv_heads, n_rep, length, head_dim)
    return hidden_states.reshape(batch, kv_heads * n_rep, length, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q K^T * scaling + mask) V (§3.2.1) with the softmax in float32, the signature of transformers'
    attention functions: (output (batch, length, heads, head_dim), weights (batch, heads, length, key length))."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


__all__ = ["apply_rotary_pos_emb", "eager_attention_forward"]
