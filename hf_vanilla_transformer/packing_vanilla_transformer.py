"""Padding-free batches: the sequences of a batch laid end to end, with their layout known before the model runs.

In a padded batch every linear map, norm, FFN, dropout and the vocabulary projection also run on the padding. Only
attention (§3.2) mixes positions, so a batch can instead arrive flattened, (1, total tokens), with the offsets at
which its sequences start: then every position-wise layer runs on real tokens only, and attention runs per sequence
over those offsets. Finding the tokens of a padded batch on the device would need `nonzero` (a host-device sync that
stalls an accelerator's queue), so the layout is built on the CPU, once per batch, by the collator:

- single-stack models take what transformers' `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives:
  `input_ids` (1, total), `position_ids` restarting at 0, `cu_seq_lens_q/k` and `max_length_q/k`;
- encoder-decoders take `DataCollatorForSeq2SeqWithFlattening` below: the source with `cu_seq_lens_k`/`max_length_k`,
  the target with `cu_seq_lens_q`/`max_length_q`, as cross-attention reads them (queries from the target, keys from
  the source); encoder self-attention reads the source offsets, decoder self-attention the target ones.

Attention over packed tokens (`packed_attention`): torch's variable-length flash kernel (`varlen_attn`) on CUDA in
half precision; elsewhere the packed queries, keys and values are scattered into (sequences, max_length) for SDPA
and the output gathered back, which gives the same result and keeps the position-wise savings on a CPU.
"""

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from .inputs_vanilla_transformer import IGNORE_INDEX

try:  # torch >= 2.9; CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def takes_our_call(kernel) -> bool:
    """Whether a `varlen_attn` takes the keywords `packed_attention` passes: its grouped-query flag came after its
    first releases (torch 2.11's has none), and without it the call takes the padded path."""
    return kernel is not None and {"scale", "window_size", "enable_gqa"} <= inspect.signature(kernel).parameters.keys()


VARLEN_TAKES_OUR_CALL = takes_our_call(varlen_attn)

# The attention implementations that run packed sequences themselves, from the same keyword arguments.
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclass(frozen=True)
class Sequences:
    """Where the sequences of a flattened batch are: `cu_seq_lens` (sequences + 1,) int32 offsets into its tokens,
    and the longest one's length, a Python int (a shape, so no sync reads it)."""

    cu_seq_lens: torch.Tensor
    max_length: int

    @classmethod
    def of(cls, kwargs: dict[str, Any], side: str) -> "Sequences | None":
        """The sequences of one side ("q": the target or a single stack's, "k": the source) given in `kwargs`."""
        cu_seq_lens = kwargs.get(f"cu_seq_lens_{side}")
        return None if cu_seq_lens is None else cls(cu_seq_lens, int(kwargs[f"max_length_{side}"]))

    @property
    def lengths(self) -> torch.Tensor:
        return (self.cu_seq_lens[1:] - self.cu_seq_lens[:-1]).long()

    def positions(self, num_tokens: int) -> torch.Tensor:
        """(1, tokens): each token's position in its own sequence, 0 at each start."""
        tokens = torch.arange(num_tokens, device=self.cu_seq_lens.device)
        return (tokens - self.cu_seq_lens.long()[self.sequence_of(tokens)])[None]

    def sequence_of(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(self.cu_seq_lens[1:].long(), tokens, right=True)

    def padded_index(self, num_tokens: int) -> torch.Tensor:
        """(tokens,): each token's row in the (sequences * max_length) grid of the padded layout."""
        tokens = torch.arange(num_tokens, device=self.cu_seq_lens.device)
        sequence = self.sequence_of(tokens)
        return sequence * self.max_length + tokens - self.cu_seq_lens.long()[sequence]


def attention_layout(queries: Sequences | None, keys: Sequences | None) -> dict[str, Any]:
    """The keyword arguments that tell an attention call (ours, or transformers' flash-attention integration) the
    sequences of its queries and keys; none for a padded batch."""
    if queries is None:
        return {}
    return dict(
        cu_seq_lens_q=queries.cu_seq_lens,
        cu_seq_lens_k=keys.cu_seq_lens,
        max_length_q=queries.max_length,
        max_length_k=keys.max_length,
    )


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    *,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    max_length_q: int,
    max_length_k: int,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention within each sequence of a flattened batch, with transformers' attention-function signature:
    query (1, heads, tokens, head_dim), key and value (1, kv_heads, tokens, head_dim) -> (1, tokens, heads,
    head_dim). Causal for a module with `is_causal` (each sequence aligned at its start, as §3.2.3's mask)."""
    if runs_varlen_kernel(query, dropout):
        # (tokens, heads, head_dim): the projections' own memory order, so no copy unless RoPE made new tensors.
        output = varlen_attn(
            query[0].transpose(0, 1).contiguous(),
            key[0].transpose(0, 1).contiguous(),
            value[0].transpose(0, 1).contiguous(),
            cu_seq_lens_q,
            cu_seq_lens_k,
            max_length_q,
            max_length_k,
            scale=scaling,
            window_size=(-1, 0) if module.is_causal else (-1, -1),
            enable_gqa=key.shape[1] != query.shape[1],
        )
        return output[None], None
    return padded_attention(
        module, query, key, value, scaling, dropout, Sequences(cu_seq_lens_q, max_length_q),
        Sequences(cu_seq_lens_k, max_length_k), **kwargs,
    )  # fmt: skip


def runs_varlen_kernel(query: torch.Tensor, dropout: float) -> bool:
    return varlen_kernel_runs(query.device, query.dtype, dropout)


def varlen_kernel_runs(device: torch.device | str, dtype: torch.dtype, dropout: float = 0.0) -> bool:
    """Whether attention over a flattened batch runs a variable-length kernel on `device` in `dtype`: on CUDA, in
    half precision, without attention dropout (the kernels have none)."""
    half = dtype in (torch.float16, torch.bfloat16)
    return VARLEN_TAKES_OUR_CALL and torch.device(device).type == "cuda" and half and not dropout


def padded_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    dropout: float,
    queries: Sequences,
    keys: Sequences,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`packed_attention` where no variable-length kernel runs: the packed rows scattered into the padded layout, the
    padding masked, SDPA (or eager attention, which returns the weights), and the real rows gathered back."""
    query_index, key_index = queries.padded_index(query.shape[2]), keys.padded_index(key.shape[2])
    query = scatter_rows(query, query_index, queries)
    key, value = scatter_rows(key, key_index, keys), scatter_rows(value, key_index, keys)
    key_positions = torch.arange(keys.max_length, device=query.device)
    mask = (key_positions < keys.lengths[:, None])[:, None, None, :]
    if module.is_causal:  # position i of a sequence sees its positions <= i
        mask = mask & (key_positions <= torch.arange(queries.max_length, device=query.device)[:, None])
    if module.config._attn_implementation == "eager":
        additive = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
        output, weights = eager_attention_forward(
            module, query, key, value, additive.masked_fill(~mask, torch.finfo(query.dtype).min), scaling, dropout
        )
    else:
        output, weights = sdpa_attention_forward(module, query, key, value, mask, dropout, scaling, is_causal=False)
    return output.flatten(0, 1).index_select(0, query_index)[None], weights


def scatter_rows(packed: torch.Tensor, index: torch.Tensor, sequences: Sequences) -> torch.Tensor:
    """(1, heads, tokens, head_dim) -> (sequences, heads, max_length, head_dim), zeros at the padding."""
    rows = packed[0].transpose(0, 1)
    padded = rows.new_zeros(len(sequences.cu_seq_lens) - 1, sequences.max_length, *rows.shape[1:])
    return padded.flatten(0, 1).index_copy(0, index, rows).unflatten(0, padded.shape[:2]).transpose(1, 2)


def shift_packed_labels(
    labels: torch.Tensor, targets: Sequences, pad_token_id: int, decoder_start_token_id: int
) -> torch.Tensor:
    """Teacher forcing on a flattened target: each sequence's labels shifted right behind the decoder start token,
    -100 replaced by the pad token (what `shift_tokens_right` does to each row of a padded batch)."""
    shifted = labels.roll(1, dims=-1)
    shifted[:, targets.cu_seq_lens[:-1].long()] = decoder_start_token_id
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad_token_id)


__all__ = [
    "Sequences",
    "VARLEN_IMPLEMENTATIONS",
    "attention_layout",
    "packed_attention",
    "varlen_kernel_runs",
    "shift_packed_labels",
]
