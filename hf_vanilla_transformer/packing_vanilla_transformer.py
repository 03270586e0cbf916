"""Padding-free batches: the sequences of a batch laid end to end, with their layout known before the model runs.

In a padded batch every linear map, norm, FFN, dropout and the vocabulary projection also run on the padding. Only
attention (§3.2) mixes positions, so a batch can instead arrive flattened, (1, total tokens), with the offsets at
which its sequences start: then every position-wise layer runs on real tokens only, and attention runs per sequence
over those offsets. Finding the tokens of a padded batch on the device would need `nonzero` (a host-device sync that
stalls an accelerator's queue), so the offsets are built on the CPU, once per batch, by a collator:

- single-stack models take what transformers' `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` gives:
  `input_ids` (1, total), `position_ids` restarting at 0, `cu_seq_lens_q/k` and `max_length_q/k`;
- encoder-decoders take `DataCollatorForSeq2SeqWithFlattening` (collators_vanilla_transformer): the source with
  `cu_seq_lens_k`/`max_length_k`, the target with `cu_seq_lens_q`/`max_length_q`, as cross-attention reads them
  (queries from the target, keys from the source).

Each stack turns the offsets into `AttentionLayout`s once per forward (encoder self-attention: source/source; decoder
self-attention: target/target; cross-attention: target/source) and hands one to each attention call. The call runs
a variable-length kernel where one runs (`varlen_kernel`: torch's `varlen_attn` in either of its signatures, or
flash-attn's through transformers' integration), else the fallback: the queries, keys and values gathered into
(sequences, max_length) by indices the layout built once, SDPA under the layout's mask, and the rows gathered back.

The collator can also pack the pairs into rows of whole sentences, (rows, row_length) with offsets over all their
tokens: without a kernel each row then runs as a padded batch's row under a mask that keeps each sentence to
itself (no gathers: a padded step's kernel launches), with one as a single stream.
"""

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.llama.modeling_llama import eager_attention_forward
from transformers.utils import is_flash_attn_2_available

from .inputs_vanilla_transformer import IGNORE_INDEX, require

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
FLASH_ATTN_INSTALLED = is_flash_attn_2_available()

# The attention implementations that run packed sequences themselves, from the cu_seq_lens_*/max_length_* keywords.
VARLEN_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


def varlen_kernel(device: torch.device | str, dtype: torch.dtype, dropout: float = 0.0) -> str | None:
    """The variable-length kernel that attention over a flattened batch runs on `device` in `dtype` with attention
    dropout `dropout`: "torch" (`varlen_attn`, which has no dropout), "flash_attn" (flash-attn's, which has), or None
    where none does (CPU, float32, or dropout without flash-attn), and the fallback runs."""
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if VARLEN_SIGNATURE is not None and not dropout:
        return "torch"
    return "flash_attn" if FLASH_ATTN_INSTALLED else None


def varlen_kernel_runs(device: torch.device | str, dtype: torch.dtype, dropout: float = 0.0) -> bool:
    return varlen_kernel(device, dtype, dropout) is not None


def attention_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in for a model whose weights are `weight`'s: autocast's where it is on (the
    Trainer's bf16 keeps float32 weights), else the weights'."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


def layout_kernel(config, weight: torch.Tensor, training: bool) -> str | None:
    """What runs the attention of a flattened batch in this forward, for a model whose weights are `weight`'s:
    transformers' flash integration where the config asks for it, else `varlen_kernel`, else None: the fallback."""
    if config._attn_implementation in VARLEN_IMPLEMENTATIONS:
        return config._attn_implementation
    dropout = config.attention_dropout if training else 0.0
    return varlen_kernel(weight.device, attention_dtype(weight), dropout)


@dataclass(frozen=True)
class Grid:
    """Where the fallback attends: the (sequences, max_length) grid of one side. `reads` (sequences * max_length,)
    the token each cell copies, `sequence` and `position` (tokens,) each token's cell, `visible` (sequences,
    max_length) the cells that hold a key."""

    reads: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    visible: torch.Tensor

    @classmethod
    def of(cls, cu_seq_lens: torch.Tensor, max_length: int, num_tokens: int) -> "Grid":
        starts, ends = cu_seq_lens[:-1].long(), cu_seq_lens[1:].long()
        cells = torch.arange(max_length, device=starts.device)
        # A cell past its sequence's end reads the sequence's last token (any real row would do: the mask hides it),
        # an empty sequence's cells the token before it: every index stays inside the tokens.
        reads = torch.minimum(starts[:, None] + cells, (ends - 1).clamp(min=0)[:, None])
        tokens = torch.arange(num_tokens, device=starts.device)
        sequence = torch.searchsorted(ends, tokens, right=True)
        # An empty sequence keeps one visible key, so that its softmax has a row to normalise: its outputs are never
        # read, and without one they would be NaN, which backward would spread.
        visible = cells < (ends - starts).clamp(min=1)[:, None]
        return cls(reads.flatten(), sequence, tokens - starts[sequence], visible)


@dataclass(frozen=True)
class Sequences:
    """Where the sequences of one side of a flattened batch are: `cu_seq_lens` (sequences + 1,) int32 offsets into
    its tokens, the longest one's length (a Python int: a shape, so no sync reads it), and where the fallback will
    attend, a (1, tokens) batch's `grid`, or a batch of packed rows' `row_sequences`: (rows, row_length), the
    sequence of each token."""

    cu_seq_lens: torch.Tensor
    max_length: int
    grid: Grid | None = None
    row_sequences: torch.Tensor | None = None

    @classmethod
    def of(cls, kwargs: dict[str, Any], side: str, shape: tuple[int, int], kernel: str | None) -> "Sequences | None":
        """The sequences of one side ("q": the target or a single stack's, "k": the source) given in `kwargs`, laid
        out in a (rows, row_length) `shape`. Trusted: the head checked them (`check_flattened_batch`)."""
        cu_seq_lens = kwargs.get(f"cu_seq_lens_{side}")
        if cu_seq_lens is None:
            return None
        max_length = int(kwargs[f"max_length_{side}"])
        if kernel is not None:
            return cls(cu_seq_lens, max_length)
        if shape[0] == 1:
            return cls(cu_seq_lens, max_length, grid=Grid.of(cu_seq_lens, max_length, shape[1]))
        tokens = torch.arange(shape[0] * shape[1], dtype=torch.int32, device=cu_seq_lens.device)
        row_sequences = torch.searchsorted(cu_seq_lens[1:], tokens, right=True).view(shape)
        return cls(cu_seq_lens, max_length, row_sequences=row_sequences)

    @property
    def count(self) -> int:
        return self.cu_seq_lens.shape[0] - 1

    def positions(self, shape: tuple[int, int]) -> torch.Tensor:
        """`shape`: each token's position in its own sequence, 0 at each start."""
        tokens = torch.arange(shape[0] * shape[1], device=self.cu_seq_lens.device)
        starts = self.cu_seq_lens.long()
        return (tokens - starts[torch.searchsorted(starts[1:], tokens, right=True)]).view(shape)


@dataclass(frozen=True)
class AttentionLayout:
    """The sequences one attention call attends within: its queries' and its keys' (the same for self-attention),
    what runs it (`kernel`, see `layout_kernel`), and for the fallback the mask over the grids, (sequences, 1,
    max_length_q, max_length_k): keys inside their sequence and, for causal attention, at or before the query
    (§3.2.3). Built once per stack forward and handed to every layer."""

    queries: Sequences
    keys: Sequences
    kernel: str | None
    mask: torch.Tensor | None = None

    @classmethod
    def of(cls, queries: Sequences | None, keys: Sequences | None, causal: bool, kernel: str | None, weight):
        """`weight`: one of the model's, whose `attention_dtype` the fallback's mask takes: additive, as eager
        attention adds it and as SDPA would convert a boolean one in every call."""
        if queries is None and keys is None:
            return None
        if queries is None or keys is None:
            raise ValueError(
                "A flattened batch flattens the source and the target: cu_seq_lens_q and cu_seq_lens_k come together."
            )
        if queries.count != keys.count:
            raise ValueError(
                f"cu_seq_lens_q has {queries.count} sequences and cu_seq_lens_k {keys.count}: cross-attention pairs "
                "each target sequence with one source sequence."
            )
        if kernel is not None:
            return cls(queries, keys, kernel)
        if queries.row_sequences is not None:  # packed rows: a key is visible to the queries of its own sequence
            visible = (queries.row_sequences[:, :, None] == keys.row_sequences[:, None, :])[:, None]
            cells_q, cells_k = queries.row_sequences.shape[1], keys.row_sequences.shape[1]
        else:
            visible = keys.grid.visible[:, None, None, :]
            cells_q, cells_k = queries.max_length, keys.max_length
        if causal:  # cell i of a sequence (or of a row, which holds whole sequences) sees its cells <= i
            device = visible.device
            visible = visible & (torch.arange(cells_k, device=device) <= torch.arange(cells_q, device=device)[:, None])
        dtype = attention_dtype(weight)
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
            ~visible, torch.finfo(dtype).min
        )
        return cls(queries, keys, kernel, mask)

    def flash_kwargs(self) -> dict[str, Any]:
        """The keywords transformers' flash-attention integration reads for packed sequences."""
        return dict(
            cu_seq_lens_q=self.queries.cu_seq_lens,
            cu_seq_lens_k=self.keys.cu_seq_lens,
            max_length_q=self.queries.max_length,
            max_length_k=self.keys.max_length,
        )


def check_flattened_batch(
    kwargs: dict[str, Any], inputs: torch.Tensor | None, source_inputs: torch.Tensor | None = None
) -> None:
    """The offsets of a flattened batch, checked once, where a head receives them (the stacks trust them): the
    target's or a single stack's ("q") against the tokens of `inputs` (ids or embeddings), the source's ("k")
    against `source_inputs`' (a single stack's: `inputs`' too, as transformers' collator gives both). The tokens lie
    in one row, or in packed rows that each hold whole sequences, as many on both sides."""
    if inputs is None or kwargs.get("cu_seq_lens_q") is None and kwargs.get("cu_seq_lens_k") is None:
        return
    source_inputs = inputs if source_inputs is None else source_inputs
    if inputs.shape[0] != source_inputs.shape[0]:
        raise ValueError(
            f"A batch of packed rows has as many source rows as target rows, got {source_inputs.shape[0]} and "
            f"{inputs.shape[0]}."
        )
    for side, tokens in (("q", inputs), ("k", source_inputs)):
        if kwargs.get(f"cu_seq_lens_{side}") is not None:
            check_offsets(kwargs[f"cu_seq_lens_{side}"], kwargs.get(f"max_length_{side}"), tokens.shape[:2], side)


def check_offsets(cu_seq_lens: Any, max_length: Any, shape: tuple[int, int], side: str) -> None:
    """Offsets that would attend across sequences or index past the tokens are refused: int32 (what the kernels
    take), 1-D, from 0, not decreasing, ending at the token count, `max_length` at least the longest sequence, and
    in a (rows, row_length) `shape` of several rows, no sequence across two rows. Values are checked without a host
    sync (`require`: a ValueError on a CPU, a device-side assert on CUDA)."""
    name, length_name = f"cu_seq_lens_{side}", f"max_length_{side}"
    if not isinstance(cu_seq_lens, torch.Tensor) or cu_seq_lens.dtype != torch.int32 or cu_seq_lens.dim() != 1:
        tensor = isinstance(cu_seq_lens, torch.Tensor)
        got = f"{cu_seq_lens.dtype} of shape {tuple(cu_seq_lens.shape)}" if tensor else type(cu_seq_lens).__name__
        raise ValueError(f"{name} must be a 1-D torch.int32 tensor of sequence offsets, got {got}.")
    if cu_seq_lens.shape[0] < 2:
        raise ValueError(f"{name} must hold at least two offsets (0 and the token count), got {cu_seq_lens.shape[0]}.")
    if isinstance(max_length, torch.Tensor) and max_length.device.type == "cpu" and max_length.numel() == 1:
        max_length = int(max_length)  # a collator's 0-dim tensor: on the CPU, so no sync
    if not isinstance(max_length, int) or isinstance(max_length, bool):
        raise ValueError(f"{name} needs {length_name}, the longest sequence's length as an int, got {max_length!r}.")
    # One check, one device-side assert: each condition is a kernel launch on an accelerator.
    rows, row_length = shape
    lengths = cu_seq_lens[1:] - cu_seq_lens[:-1]
    conditions = [cu_seq_lens[:1] == 0, cu_seq_lens[-1:] == rows * row_length, lengths >= 0, lengths <= max_length]
    across_rows = ""
    if rows > 1:
        # no sequence across a row's end: every row starts one (offsets rise, so this is the same thing)
        row_starts = torch.arange(0, rows * row_length, row_length, device=cu_seq_lens.device, dtype=torch.int32)
        conditions.append(torch.isin(row_starts, cu_seq_lens))
        across_rows = f", and none across two of the {rows} rows of {row_length} tokens"
    require(
        torch.cat(conditions).all(),
        f"{name} must rise from 0 to the token count ({rows * row_length}) without decreasing, its sequences no "
        f"longer than {length_name}={max_length}{across_rows}.",
    )


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: None,
    dropout: float = 0.0,
    scaling: float | None = None,
    *,
    layout: AttentionLayout,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention within each sequence of a flattened batch: query (rows, heads, row_length, head_dim), key and value
    (rows, kv_heads, row_length, head_dim) -> (rows, row_length, heads, head_dim), and the weights where eager
    attention ran; one row of every token, or, for a kernel, packed rows too (without one, packed rows run as a
    padded batch under the layout's mask). Causal for a module with `is_causal` (each sequence aligned at its
    start, as §3.2.3's mask)."""
    if layout.kernel == "torch":
        return torch_varlen_attention(module, query, key, value, layout, scaling), None
    if layout.kernel == "flash_attn":
        return flash_attn_attention(module, query, key, value, layout, scaling, dropout), None
    return fallback_attention(module, query, key, value, layout, scaling, dropout)


def torch_varlen_attention(module, query, key, value, layout: AttentionLayout, scaling: float) -> torch.Tensor:
    """torch's `varlen_attn` on (tokens, heads, head_dim) views, the projections' own memory order."""
    rows, row_length = query.shape[0], query.shape[2]
    query, key, value = (tensor.transpose(1, 2).flatten(0, 1) for tensor in (query, key, value))
    offsets = layout.flash_kwargs().values()
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
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        output = varlen_attn(query, key, value, *offsets, is_causal=module.is_causal)
    return output.unflatten(0, (rows, row_length))


def flash_attn_attention(module, query, key, value, layout: AttentionLayout, scaling: float, dropout: float):
    """flash-attn's variable-length kernel through transformers' integration (it has attention dropout)."""
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    return _flash_attention_forward(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        None,
        query_length=query.shape[2],
        is_causal=module.is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        attn_implementation="flash_attention_2",
        **layout.flash_kwargs(),
    )


def fallback_attention(module, query, key, value, layout: AttentionLayout, scaling: float, dropout: float):
    """Where no variable-length kernel runs: each of query, key and value gathered into the (sequences, heads,
    max_length, head_dim) grid by the layout's indices, attention under its mask, each token's row read back."""
    query = to_grid(query, layout.queries)
    key, value = to_grid(key, layout.keys), to_grid(value, layout.keys)
    if module.config._attn_implementation == "eager":
        output, weights = eager_attention_forward(module, query, key, value, layout.mask, scaling, dropout)
    else:
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, layout.mask, dropout, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        ).transpose(1, 2)
        weights = None
    # (sequences, max_length, heads, head_dim) -> (1, tokens, heads, head_dim)
    grid = layout.queries.grid
    return output[grid.sequence, grid.position][None], weights


def to_grid(packed: torch.Tensor, sequences: Sequences) -> torch.Tensor:
    """(1, heads, tokens, head_dim) -> (sequences, heads, max_length, head_dim), read through the projection's own
    (tokens, heads, head_dim) order, so that neither the result nor its gradient needs a copy."""
    cells = packed.transpose(1, 2).index_select(1, sequences.grid.reads)
    return cells.view(-1, sequences.max_length, packed.shape[1], packed.shape[3]).transpose(1, 2)


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
    "AttentionLayout",
    "check_flattened_batch",
    "check_offsets",
    "attention_dtype",
    "layout_kernel",
    "Sequences",
    "VARLEN_IMPLEMENTATIONS",
    "packed_attention",
    "shift_packed_labels",
    "varlen_kernel",
    "varlen_kernel_runs",
]
