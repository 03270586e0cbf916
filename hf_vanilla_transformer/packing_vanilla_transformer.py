"""Padding-free batches: the sequences of a batch laid end to end, with their layout known before the model runs.

In a padded batch every linear map, norm, FFN, dropout and the vocabulary projection also run on the padding. Only
attention (§3.2) mixes positions, so a batch can instead arrive flattened, (1, total tokens), or packed into rows of
whole sequences, (rows, row_length), with the offsets at which its sequences start: then every position-wise layer
runs on real tokens only, and attention keeps each sequence to itself. Finding the tokens of a padded batch on the
device would need `nonzero` (a host-device sync that stalls an accelerator's queue), so the offsets are built on the
CPU, once per batch, by a collator, and travel as transformers passes them, in the forward's keyword arguments:

- single-stack models take what transformers' `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives:
  `input_ids` (1, total), `position_ids` restarting at 0, `cu_seq_lens_q/k` and `max_length_q/k`;
- encoder-decoders take `DataCollatorForSeq2SeqWithFlattening` (collators_vanilla_transformer): the source with
  `cu_seq_lens_k`/`max_length_k`, the target with `cu_seq_lens_q`/`max_length_q`, as cross-attention reads them
  (queries from the target, keys from the source).

Each stack decides once per forward how its attention runs over them (`varlen_kernel`): where a
variable-length kernel runs, the offsets go on in the keyword arguments to the attention function, which is
transformers' flash integration (`attn_implementation="flash_attention_2"` and later), torch's `varlen_attn`
(`varlen_attention`, for an "sdpa" model on CUDA in half precision) or, on a CPU after `optimize_for_cpu_training`,
its sequence grid (cpu_training_vanilla_transformer); elsewhere the stack builds one block mask per
kind of attention (`block_attention_masks`: a key is visible to the queries of its own sequence), and the config's
attention function runs under it as over a padded batch's rows.
"""

import inspect

import torch

from .cpu_training_vanilla_transformer import CPU_TRAINING_ATTENTION
from .inputs_vanilla_transformer import IGNORE_INDEX

try:  # torch >= 2.9; CUDA only
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None


def varlen_signature(kernel) -> str | None:
    """Which call `varlen_attn` takes: "scale" (torch >= 2.12: `scale`, `window_size`, `enable_gqa`), "is_causal"
    (torch 2.9-2.11: the default 1/sqrt(head_dim) scale, as many K/V heads as query heads), or None (no kernel)."""
    if kernel is None:
        return None
    parameters = inspect.signature(kernel).parameters.keys()
    if {"scale", "window_size", "enable_gqa"} <= parameters:
        return "scale"
    return "is_causal" if "is_causal" in parameters else None


VARLEN_SIGNATURE = varlen_signature(varlen_attn)

# The attention implementations that run packed sequences themselves, from the offsets: transformers' flash
# integration, and the sequence grid that `optimize_for_cpu_training` registers.
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4", CPU_TRAINING_ATTENTION)


def varlen_kernel(
    attn_implementation: str | None, device: torch.device | str, dtype: torch.dtype, dropout: float = 0.0
) -> str | None:
    """What runs attention over a flattened batch, for a model of `attn_implementation` on `device` in `dtype` with
    attention dropout `dropout`: the implementation where it is one of `VARLEN_IMPLEMENTATIONS`, else "torch"
    (`varlen_attn`: CUDA, half precision, no dropout), or None where none does (CPU, float32, attention dropout): the
    block mask. The one place that decides: each stack asks it once per forward, the collator to choose the layout."""
    if attn_implementation in VARLEN_IMPLEMENTATIONS:
        return attn_implementation
    on_cuda_in_half = torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
    return "torch" if on_cuda_in_half and VARLEN_SIGNATURE is not None and not dropout else None


def positions_in_sequences(cu_seq_lens: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """`shape`: each token's position in its own sequence, 0 at each start (where the batch gives no position ids)."""
    tokens = torch.arange(shape[0] * shape[1], device=cu_seq_lens.device)
    starts = cu_seq_lens.long()
    return (tokens - starts[torch.searchsorted(starts[1:], tokens, right=True)]).view(shape)


def block_attention_masks(
    offsets: dict, shape: tuple[int, int], source_shape: tuple[int, int] | None, causal: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stack's attention masks over a flattened batch where no variable-length kernel runs, built once per forward:
    (self-attention's, cross-attention's or None). Each is additive, (rows, 1, query_length, key_length): a key is
    visible to the queries of its own sequence and, in causal self-attention, at or before them (§3.2.3; a row holds
    whole sequences in order, so the row's order is each sequence's). The stack's own sequences are the "q" side,
    laid out in `shape`; with a `source_shape`, cross-attention reads the source's, the "k" side. Additive, as eager
    attention adds it and as SDPA would convert a boolean one at every call."""
    layouts = {"q": shape} if source_shape is None else {"q": shape, "k": source_shape}
    sequence_of_token = {  # each token's sequence, from the offsets over all the tokens of its side
        side: torch.searchsorted(
            offsets[f"cu_seq_lens_{side}"][1:],
            torch.arange(rows * length, dtype=torch.int32, device=offsets[f"cu_seq_lens_{side}"].device),
            right=True,
        ).view(rows, length)
        for side, (rows, length) in layouts.items()
    }
    queries = sequence_of_token["q"]
    visible = {side: queries[:, :, None] == keys[:, None, :] for side, keys in sequence_of_token.items()}
    if causal:
        visible["q"] = visible["q"].tril()
    masks = {
        side: torch.full(seen.shape, torch.finfo(dtype).min, dtype=dtype, device=seen.device).masked_fill_(seen, 0.0)
        for side, seen in visible.items()
    }
    return masks["q"][:, None], masks["k"][:, None] if "k" in masks else None


def varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, cu_seq_lens_q, cu_seq_lens_k,
    max_length_q, max_length_k, **kwargs
) -> tuple[torch.Tensor, None]:
    """torch's `varlen_attn` on (tokens, heads, head_dim) views, the projections' own memory order: query (rows,
    heads, row_length, head_dim), key and value (rows, kv_heads, row_length, head_dim) -> (rows, row_length, heads,
    head_dim). Causal for a module with `is_causal` (each sequence aligned at its start, as §3.2.3's mask)."""
    rows, row_length = query.shape[0], query.shape[2]
    query, key, value = (tensor.transpose(1, 2).flatten(0, 1) for tensor in (query, key, value))
    offsets = (cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k)
    if VARLEN_SIGNATURE == "scale":
        window = (-1, 0) if module.is_causal else (-1, -1)
        output = varlen_attn(
            query, key, value, *offsets, scale=scaling, window_size=window, enable_gqa=key.shape[1] != query.shape[1]
        )
    else:
        # The older call scales by 1/sqrt(head_dim) and wants one K/V head per query head.
        default_scaling = query.shape[-1] ** -0.5
        if scaling != default_scaling:
            query = query * (scaling / default_scaling)
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key = key.repeat_interleave(groups, dim=1, output_size=query.shape[1])
            value = value.repeat_interleave(groups, dim=1, output_size=query.shape[1])
        output = varlen_attn(query, key, value, *offsets, is_causal=module.is_causal)
    return output.unflatten(0, (rows, row_length)), None


def shift_packed_labels(
    labels: torch.Tensor, cu_seq_lens: torch.Tensor, pad_token_id: int, decoder_start_token_id: int
) -> torch.Tensor:
    """Teacher forcing on a flattened target: each sequence's labels shifted right behind the decoder start token,
    -100 replaced by the pad token (what `shift_tokens_right` does to each row of a padded batch)."""
    # Laid end to end (packed rows too); one more position takes the starts of empty sequences at the end.
    shifted = torch.nn.functional.pad(labels.flatten().roll(1), (0, 1))
    shifted[cu_seq_lens[:-1].long()] = decoder_start_token_id
    shifted = shifted[:-1].view(labels.shape)
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad_token_id)


__all__ = [
    "VARLEN_IMPLEMENTATIONS",
    "block_attention_masks",
    "positions_in_sequences",
    "shift_packed_labels",
    "varlen_attention",
    "varlen_kernel",
]
