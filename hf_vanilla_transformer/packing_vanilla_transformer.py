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

The encoder-decoder turns the offsets into three `FlattenedAttention`s once per forward, before either stack runs
(`seq2seq_flattened_attention`: encoder self-attention source/source, decoder self-attention target/target,
cross-attention target/source; the source side built once); a stack run alone builds its own
(`stack_flattened_attention`). A padded batch builds none: its attention calls the config's function from
transformers' attention interface, as Bart's and Llama's do. A flattened call runs a variable-length kernel where one
runs (`varlen_kernel`: torch's `varlen_attn` in either of its signatures, flash-attn's, or transformers' flash
integration), else the fallback: the queries, keys and values gathered into (sequences, max_length) by indices built
once, the config's attention function under the fallback's mask, and the rows gathered back.

The collator can also pack the pairs into rows of whole sentences, (rows, row_length) with offsets over all their
tokens: without a kernel each row then runs as a padded batch's row under a mask that keeps each sentence to
itself (no gathers: a padded step's kernel launches), with one as a single stream.
"""

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils import is_flash_attn_2_available

from .inputs_vanilla_transformer import FLATTENED_KEYWORDS, IGNORE_INDEX

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

# The longest sequence at which PyTorch's math SDPA kernel is the faster one for bfloat16/float16 training on a CPU:
# there PyTorch's flash SDPA kernel (its choice) is up to 2.9x slower at short sequences (docs/benchmarks.md,
# "Figures quoted in the package's docstrings"). The attention module takes the choice (`under_math_sdpa`).
SHORT_SEQUENCE_ON_CPU = 128


def varlen_kernel(
    attn_implementation: str | None, device: torch.device | str, dtype: torch.dtype, dropout: float = 0.0
) -> str | None:
    """What runs attention over a flattened batch, for a model of `attn_implementation` on `device` in `dtype` with
    attention dropout `dropout`: transformers' flash integration where the implementation is one (it reads the
    offsets itself), else "torch" (`varlen_attn`: CUDA, half precision, no dropout), "flash_attn" (flash-attn's,
    which has dropout), or None where none does (CPU, float32, or dropout without flash-attn): the fallback. The one
    place that decides: the model asks it once per forward, the collator to choose the layout."""
    if attn_implementation in VARLEN_IMPLEMENTATIONS:
        return attn_implementation
    if torch.device(device).type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    if VARLEN_SIGNATURE is not None and not dropout:
        return "torch"
    return "flash_attn" if FLASH_ATTN_INSTALLED else None


@dataclass(frozen=True)
class Sequences:
    """Where the sequences of one side of a flattened batch are: `cu_seq_lens` (sequences + 1,) int32 offsets into
    its tokens and the longest one's length (a Python int: a shape, so no sync reads it). Where the fallback attends
    (no kernel): in a (1, tokens) batch, the (sequences, max_length) grid: `reads` (sequences * max_length,) the token
    each cell copies, `sequence` and `position` (tokens,) each token's cell, `visible` (sequences, max_length) the
    cells that hold a key; in a batch of packed rows, `row_sequences` (rows, row_length), each token's sequence."""

    cu_seq_lens: torch.Tensor
    max_length: int
    reads: torch.Tensor | None = None
    sequence: torch.Tensor | None = None
    position: torch.Tensor | None = None
    visible: torch.Tensor | None = None
    row_sequences: torch.Tensor | None = None

    @classmethod
    def of(cls, cu_seq_lens: torch.Tensor, max_length, shape: tuple[int, int], kernel: str | None) -> "Sequences":
        """The sequences at `cu_seq_lens` of tokens laid out in a (rows, row_length) `shape`. Trusted: the entry
        point checked them (`check_offsets`)."""
        # A Python int (symbolic under torch.compile, kept so: int() would specialise it), or a collator's 0-dim CPU
        # tensor: no sync.
        max_length = int(max_length) if isinstance(max_length, torch.Tensor) else max_length
        if kernel is not None:
            return cls(cu_seq_lens, max_length)
        if shape[0] > 1:
            tokens = torch.arange(shape[0] * shape[1], dtype=torch.int32, device=cu_seq_lens.device)
            row_sequences = torch.searchsorted(cu_seq_lens[1:], tokens, right=True).view(shape)
            return cls(cu_seq_lens, max_length, row_sequences=row_sequences)
        starts, ends = cu_seq_lens[:-1].long(), cu_seq_lens[1:].long()
        cells = torch.arange(max_length, device=starts.device)
        # A cell past its sequence's end reads the sequence's last token (any real row would do: the mask hides it),
        # an empty sequence's cells the token before it: every index stays inside the tokens.
        reads = torch.minimum(starts[:, None] + cells, (ends - 1).clamp(min=0)[:, None])
        tokens = torch.arange(shape[1], device=starts.device)
        sequence = torch.searchsorted(ends, tokens, right=True)
        # An empty sequence keeps one visible key, so that its softmax has a row to normalise: its outputs are never
        # read, and without one they would be NaN, which backward would spread.
        visible = cells < (ends - starts).clamp(min=1)[:, None]
        return cls(cu_seq_lens, max_length, reads.flatten(), sequence, tokens - starts[sequence], visible)

    def positions(self, shape: tuple[int, int]) -> torch.Tensor:
        """`shape`: each token's position in its own sequence, 0 at each start (where the batch gives none)."""
        tokens = torch.arange(shape[0] * shape[1], device=self.cu_seq_lens.device)
        starts = self.cu_seq_lens.long()
        return (tokens - starts[torch.searchsorted(starts[1:], tokens, right=True)]).view(shape)


@dataclass(frozen=True)
class FlattenedAttention:
    """How one kind of attention call (encoder self, decoder self, cross) runs over a flattened batch in this forward:
    the sequences of its queries and keys, `kernel`, a variable-length kernel bound to their offsets (None: the
    fallback), and the fallback's `mask`, which replaces the stack's: (sequences, 1, max_length_q, max_length_k) over
    the grids, or (rows, 1, row_length, row_length) over packed rows; keys inside their sequence and, for causal
    attention, at or before the query (§3.2.3). Built once per model forward."""

    queries: Sequences
    keys: Sequences
    kernel: Callable | None = None
    mask: torch.Tensor | None = None

    @classmethod
    def of(cls, queries: Sequences, keys: Sequences, causal: bool, kernel: str | None, dtype) -> "FlattenedAttention":
        """The attention of the given sequences, run by `kernel` (`varlen_kernel`) or, without one, under a mask."""
        if kernel in VARLEN_IMPLEMENTATIONS:
            offsets = dict(cu_seq_lens_q=queries.cu_seq_lens, cu_seq_lens_k=keys.cu_seq_lens)
            offsets.update(max_length_q=queries.max_length, max_length_k=keys.max_length)
            return cls(queries, keys, partial(ALL_ATTENTION_FUNCTIONS[kernel], **offsets))
        if kernel is not None:
            kernel_function = torch_varlen_attention if kernel == "torch" else flash_attn_attention
            return cls(queries, keys, partial(kernel_function, queries=queries, keys=keys))
        if queries.row_sequences is not None:  # packed rows: a key is visible to the queries of its own sequence
            visible = (queries.row_sequences[:, :, None] == keys.row_sequences[:, None, :])[:, None]
            cells_q = visible.shape[-2]
        else:
            visible, cells_q = keys.visible[:, None, None, :], queries.max_length
        if causal:  # cell i of a sequence (or of a row, which holds whole sequences) sees its cells <= i
            cells = torch.arange(max(cells_q, visible.shape[-1]), device=visible.device)
            visible = visible & (cells[: visible.shape[-1]] <= cells[:cells_q, None])
        # Additive, as eager attention adds it and as SDPA would convert a boolean one in every call.
        mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
        return cls(queries, keys, mask=mask.masked_fill_(~visible, torch.finfo(dtype).min))

    def function(self, attention_interface: Callable) -> Callable:
        """What runs the call, given the config's `attention_interface`: the kernel; or the interface itself on packed
        rows (under `mask`); or the interface over the (sequences, max_length) grids of a (1, tokens) batch."""
        if self.kernel is not None:
            return self.kernel
        if self.queries.row_sequences is not None:
            return attention_interface
        return partial(fallback_attention, attention_interface, queries=self.queries, keys=self.keys)


def flattened_attention_setting(config, weight: torch.Tensor, training: bool) -> tuple[str | None, torch.dtype]:
    """(the variable-length kernel that runs a flattened batch or None, the dtype attention runs in). `weight`: one
    of the model's, on the device attention runs on; autocast's dtype where it is on (the Trainer's bf16 keeps float32
    weights), else the weights'."""
    device = weight.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
    dropout = config.attention_dropout if training else 0.0
    return varlen_kernel(config._attn_implementation, device, dtype, dropout), dtype


def seq2seq_flattened_attention(config, kwargs: dict, weight: torch.Tensor, training: bool, source_shape, target_shape):
    """The (encoder self-attention, decoder self-attention, cross-attention) of a flattened encoder-decoder batch,
    built once before either stack runs, the source's sequences once for both stacks; its offsets are taken out of
    `kwargs`. `weight`: see `flattened_attention_setting`."""
    offsets = {name: kwargs.pop(name) for name in FLATTENED_KEYWORDS if name in kwargs}
    kernel, dtype = flattened_attention_setting(config, weight, training)
    sources = Sequences.of(offsets["cu_seq_lens_k"], offsets["max_length_k"], source_shape, kernel)
    targets = Sequences.of(offsets["cu_seq_lens_q"], offsets["max_length_q"], target_shape, kernel)
    return (
        FlattenedAttention.of(sources, sources, False, kernel, dtype),
        FlattenedAttention.of(targets, targets, True, kernel, dtype),
        FlattenedAttention.of(targets, sources, False, kernel, dtype),
    )


def stack_flattened_attention(config, kwargs: dict, weight: torch.Tensor, training: bool, shape, causal: bool):
    """The self-attention of a flattened batch given to a stack run alone (see `seq2seq_flattened_attention`): its
    sequences are the "q" side (transformers' collator gives "k" too, the same)."""
    offsets = {name: kwargs.pop(name) for name in FLATTENED_KEYWORDS if name in kwargs}
    kernel, dtype = flattened_attention_setting(config, weight, training)
    sequences = Sequences.of(offsets["cu_seq_lens_q"], offsets["max_length_q"], shape, kernel)
    return FlattenedAttention.of(sequences, sequences, causal, kernel, dtype)


def under_math_sdpa(attention: Callable, *args, **kwargs):
    """`attention` with SDPA restricted to PyTorch's math kernel (see `SHORT_SEQUENCE_ON_CPU`)."""
    with sdpa_kernel(SDPBackend.MATH):
        return attention(*args, **kwargs)


def torch_varlen_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, queries, keys, **kwargs
) -> tuple[torch.Tensor, None]:
    """torch's `varlen_attn` on (tokens, heads, head_dim) views, the projections' own memory order: query (rows,
    heads, row_length, head_dim), key and value (rows, kv_heads, row_length, head_dim) -> (rows, row_length, heads,
    head_dim). Causal for a module with `is_causal` (each sequence aligned at its start, as §3.2.3's mask)."""
    rows, row_length = query.shape[0], query.shape[2]
    query, key, value = (tensor.transpose(1, 2).flatten(0, 1) for tensor in (query, key, value))
    offsets = (queries.cu_seq_lens, keys.cu_seq_lens, queries.max_length, keys.max_length)
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
    return output.unflatten(0, (rows, row_length)), None


def flash_attn_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, queries, keys, **kwargs
) -> tuple[torch.Tensor, None]:
    """flash-attn's variable-length kernel through transformers' integration (it has attention dropout)."""
    from transformers.modeling_flash_attention_utils import _flash_attention_forward

    output = _flash_attention_forward(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        None,
        query_length=query.shape[2],
        is_causal=module.is_causal,
        dropout=dropout,
        softmax_scale=scaling,
        attn_implementation="flash_attention_2",
        cu_seq_lens_q=queries.cu_seq_lens,
        cu_seq_lens_k=keys.cu_seq_lens,
        max_length_q=queries.max_length,
        max_length_k=keys.max_length,
    )
    return output, None


def fallback_attention(
    attention, module, query, key, value, attention_mask, dropout=0.0, scaling=None, *, queries, keys, **kwargs
):
    """Where no variable-length kernel runs on a (1, tokens) batch: query, key and value (1, heads, tokens,
    head_dim) gathered into the (sequences, heads, max_length, head_dim) grids of their sides, `attention` (the
    config's interface) under the grids' mask, each token's row read back: (1, tokens, heads, head_dim). The gathers
    read the projections' own (tokens, heads, head_dim) order, so that neither they nor their gradients copy."""
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    query = query.transpose(1, 2).index_select(1, queries.reads).view(-1, queries.max_length, heads, head_dim)
    key, value = (
        x.transpose(1, 2).index_select(1, keys.reads).view(-1, keys.max_length, kv_heads, head_dim)
        for x in (key, value)
    )
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    output, weights = attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return output[queries.sequence, queries.position][None], weights


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
    "FlattenedAttention",
    "Sequences",
    "SHORT_SEQUENCE_ON_CPU",
    "VARLEN_IMPLEMENTATIONS",
    "seq2seq_flattened_attention",
    "shift_packed_labels",
    "stack_flattened_attention",
    "under_math_sdpa",
    "varlen_kernel",
]
