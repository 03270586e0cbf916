"""Checks of the tensors a model is called with, run where a stack receives them (each stack checks its own inputs;
a decoder under an encoder also what it reads from it); a head checks only its labels and calls the model it wraps.

Each check raises a `TypeError` (wrong kind of tensor) or `ValueError` (wrong shape or value) naming the argument,
what it got and what it expects, before a torch op fails deep inside the model with a message about its internals or,
worse, silently computes something else (a (batch, length, length) mask that would be ignored, a mask using -1 for
padding, offsets that attend across sequences). Shapes and dtypes are known on the host. Values are checked with
`require`, which never waits for the device (see there); under torch.compile value checks are left out of the graph.
"""

from contextlib import contextmanager
from typing import Any

import torch
from transformers.utils import is_torchdynamo_compiling

from .compat_vanilla_transformer import fits

IGNORE_INDEX = -100  # transformers' label for "no loss here"

# `skip_logits=True` leaves the loss as the only output.
SKIP_LOGITS_WITHOUT_LABELS = "skip_logits=True returns the loss without logits, so it needs labels: pass labels too."

# The keywords of a flattened batch (cu_seq_lens_q is the target's or a single stack's, _k the source's).
FLATTENED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


# Without it (a torch that dropped or renamed it), `require` reads the condition on the host, as a CPU tensor is read.
ASSERTS_ON_DEVICE = fits("torch._assert_async")


def require(condition: torch.Tensor, message: str) -> None:
    """Raise `message` where the 0-dim bool tensor `condition` is False, without a host-device sync: on an
    accelerator `torch._assert_async` fails the device's stream later instead of stopping the host to read the value
    now; on a CPU tensor it raises at once, as a ValueError here. Not traced by torch.compile."""
    if is_torchdynamo_compiling():
        return
    if not ASSERTS_ON_DEVICE:
        if not condition:
            raise ValueError(message)
        return
    try:
        torch._assert_async(condition, message)
    except RuntimeError:
        raise ValueError(message) from None


@contextmanager
def raises_value_error(error_type: type[Exception], message: str):
    """Replace an `error_type` raised inside by a ValueError with `message`: for the checks a kernel makes anyway, a
    loss's of its targets, whose CPU errors name no argument (on an accelerator they assert on the device). Free:
    nothing runs unless it failed."""
    try:
        yield
    except error_type as error:
        raise ValueError(f"{message}: {error}") from None


def labels_outside(num_classes: int, name: str = "labels"):
    """The context a loss over class ids runs in: an id outside [0, num_classes) (and not -100) is a ValueError."""
    return raises_value_error(IndexError, f"{name} must hold ids in [0, {num_classes}) or {IGNORE_INDEX} (ignored)")


# ---------------------------------------------------------------------------------------------- one tensor


def check_token_ids(
    input_ids: Any, name: str = "input_ids", shape: tuple[int, ...] | None = None, what: str = "token ids"
) -> None:
    """Token ids, token labels or class labels (`what`): an integer tensor, (batch, length) with at least one sequence
    of at least one token, of `shape` where given (labels: the shape of the outputs they score; class labels (batch,)).
    The embedding checks that ids are inside the vocabulary, the loss that labels are (`labels_outside`)."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(input_ids).__name__}.")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise TypeError(f"{name} must hold integer {what} (torch.long), got dtype {input_ids.dtype}.")
    if input_ids.dim() != 2 and (shape is None or len(shape) == 2):
        raise ValueError(
            f"{name} must be 2-D (batch, length), got shape {tuple(input_ids.shape)}"
            + (": add a batch dimension, e.g. input_ids[None]." if input_ids.dim() == 1 else ".")
        )
    if input_ids.numel() == 0 and shape is None:
        raise ValueError(f"{name} has shape {tuple(input_ids.shape)}; expected at least one sequence of one token.")
    if shape is not None and tuple(input_ids.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(input_ids.shape)}, expected the shape of the outputs they score = {tuple(shape)}."
        )


def check_inputs_embeds(inputs_embeds: Any, d_model: int, name: str = "inputs_embeds") -> None:
    """Embedded inputs (or encoder states): a floating (batch, length, d_model) tensor, not empty."""
    if not isinstance(inputs_embeds, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(inputs_embeds).__name__}.")
    if not inputs_embeds.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {inputs_embeds.dtype}.")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d_model:
        raise ValueError(f"{name} has shape {tuple(inputs_embeds.shape)}, expected (batch, length, d_model={d_model}).")
    if inputs_embeds.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(inputs_embeds.shape)}; expected at least one sequence of one token.")


def check_attention_mask(
    mask: Any, batch_size: int, query_length: int, key_length: int | None, name: str, check_values: bool = True
) -> None:
    """A padding mask (batch, key_length) of 0/1 or bool (1 = token, 0 = padding), or a 4-D mask the caller built,
    (batch or 1, heads or 1, query_length, key_length), bool or additive float. `key_length` is None where the keys
    are a static cache's, whose masks span the whole cache. Any other rank is refused: transformers' mask functions
    would ignore a (batch, length, length) mask, and a 1-D one has no batch."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}.")
    if mask.dim() == 2:
        if mask.shape[0] != batch_size or key_length not in (None, mask.shape[1]):
            expected = (batch_size, key_length)
            raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected (batch, length) = {expected}.")
        if check_values and mask.dtype != torch.bool:
            require(mask.eq(mask.bool()).all(), f"{name} must hold 1 for tokens and 0 for padding (or be bool).")
    elif mask.dim() == 4:
        batch, _, rows, columns = mask.shape
        if batch not in (1, batch_size) or rows != query_length or key_length not in (None, columns):
            raise ValueError(
                f"{name} has shape {tuple(mask.shape)}, expected a 4-D mask (batch={batch_size} or 1, heads or 1, "
                f"query_length={query_length}, key_length={key_length})."
            )
    else:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)}: expected a (batch, length) padding mask of 0/1, or a 4-D "
            "(batch, 1, query_length, key_length) mask; a 3-D (batch, length, length) mask is not supported "
            "(add the head dimension: mask[:, None])."
        )


def check_offsets(
    cu_seq_lens: Any, max_length: Any, shape: tuple[int, int], side: str, check_values: bool = True
) -> None:
    """The offsets of one side of a flattened batch. Offsets that would attend across sequences or index past the
    tokens are refused: int32 (what the kernels take), 1-D, from 0, not decreasing, ending at the token count,
    `max_length` at least the longest sequence, and in a (rows, row_length) `shape` of several rows, no sequence
    across two rows. Values are checked without a host sync (`require`), unless `check_values` is False (the source's
    offsets in a decoder: the encoder checked them)."""
    name, length_name = f"cu_seq_lens_{side}", f"max_length_{side}"
    if cu_seq_lens is None:
        raise ValueError(
            f"A flattened batch needs {name}: an encoder-decoder's gives the source's offsets as cu_seq_lens_k and the "
            "target's as cu_seq_lens_q, together."
        )
    if not isinstance(cu_seq_lens, torch.Tensor) or cu_seq_lens.dtype != torch.int32 or cu_seq_lens.dim() != 1:
        tensor = isinstance(cu_seq_lens, torch.Tensor)
        got = f"{cu_seq_lens.dtype} of shape {tuple(cu_seq_lens.shape)}" if tensor else type(cu_seq_lens).__name__
        raise ValueError(f"{name} must be a 1-D torch.int32 tensor of sequence offsets, got {got}.")
    if cu_seq_lens.shape[0] < 2:
        raise ValueError(f"{name} must hold at least two offsets (0 and the token count), got {cu_seq_lens.shape[0]}.")
    if isinstance(max_length, torch.Tensor) and max_length.device.type == "cpu" and max_length.numel() == 1:
        max_length = int(max_length)  # a collator's 0-dim tensor: on the CPU, so no sync
    if not isinstance(max_length, int | torch.SymInt) or isinstance(max_length, bool):
        raise ValueError(f"{name} needs {length_name}, the longest sequence's length as an int, got {max_length!r}.")
    if not check_values or is_torchdynamo_compiling():  # `require` checks nothing in a graph: build nothing for it
        return
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


# ---------------------------------------------------------------------------------------------- entry points


def mask_key_length(cache: Any, length: int, first_layer: int = 0) -> int | None:
    """The key length of a decoder's mask: the cache's and this forward's tokens, or None for a static cache, whose
    masks span the whole cache. `first_layer`: the first layer this rank runs, whose cache holds the decoded length
    (a later rank of a pipeline runs none before it)."""
    if getattr(cache, "is_compileable", False):
        return None
    return length + (cache.get_seq_length(first_layer) if cache is not None else 0)


def check_stack_inputs(
    config,
    *,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: Any = None,
    offsets: dict | None = None,
    prefix: str = "",
    first_layer: int = 0,
    encoder_hidden_states: Any = None,
    encoder_attention_mask: torch.Tensor | None = None,
    offsets_side: str = "q",
) -> None:
    """Everything one stack reads, checked where the stack receives it: exactly one of its ids or embeddings, its
    positions, its mask (over the keys of the decoder `cache` and the inputs), a flattened batch's offsets in
    `offsets` (the stack's own sequences, "q"; transformers' collator gives "k" too, equal), and, for a decoder under
    an encoder, the encoder's output, the mask over it (its shape: the encoder checked its values) and the source's
    offsets ("k"). `prefix`: "decoder_" for the target side of an encoder-decoder, as its callers name the inputs;
    `offsets_side`: the side its own offsets have in the batch a user gives (an encoder-decoder's source is its "k"
    side); `first_layer`: see `mask_key_length`."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"Pass exactly one of {prefix}input_ids or {prefix}inputs_embeds.")
    if input_ids is not None:
        check_token_ids(input_ids, f"{prefix}input_ids")
    else:
        check_inputs_embeds(inputs_embeds, config.d_model, f"{prefix}inputs_embeds")
    batch_size, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if attention_mask is not None:
        key_length = mask_key_length(cache, length, first_layer)
        check_attention_mask(attention_mask, batch_size, length, key_length, f"{prefix}attention_mask")
    if position_ids is not None:
        name = f"{prefix}position_ids"
        check_token_ids(position_ids if position_ids.dim() == 2 else position_ids[None], name)
        if position_ids.shape[-1] != length or position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch_size):
            raise ValueError(
                f"{name} has shape {tuple(position_ids.shape)}, expected (batch={batch_size} or 1, length={length})."
            )
        require((position_ids >= 0).all(), f"{name} must be >= 0.")
    source_shape = (batch_size, length)
    if encoder_hidden_states is not None:
        source_shape = check_encoder_output(encoder_hidden_states, encoder_attention_mask, config, batch_size, length)
    queries, keys = (offsets.get(f"cu_seq_lens_{side}") if offsets else None for side in ("q", "k"))
    if queries is None and keys is None:
        return
    # A flattened batch: the stack's own offsets ("q") against its tokens; the "k" side under an encoder against the
    # source (its values the encoder checked, as its own), else the same sequences (the encoder's, and transformers'
    # collator's, are the same tensor).
    check_offsets(queries, offsets.get("max_length_q"), (batch_size, length), offsets_side)
    if encoder_hidden_states is not None or keys is not None and keys is not queries:
        check_offsets(keys, offsets.get("max_length_k"), source_shape, "k", encoder_hidden_states is None)
    if encoder_hidden_states is not None and queries.shape[0] != keys.shape[0]:
        raise ValueError(
            f"cu_seq_lens_q has {queries.shape[0] - 1} sequences and cu_seq_lens_k {keys.shape[0] - 1}: "
            "cross-attention pairs each target sequence with one source sequence."
        )


def check_encoder_output(encoder_hidden_states: Any, encoder_attention_mask, config, batch_size: int, length: int):
    """What a decoder reads from the encoder: its output, (batch, source length, d_model) with the decoder's batch,
    and the padding mask over it (its shape; the encoder checked its values). Named as the encoder-decoder takes
    them. Returns the source's (batch, length)."""
    check_inputs_embeds(encoder_hidden_states, config.d_model, "encoder_outputs.last_hidden_state")
    source_batch, source_length = encoder_hidden_states.shape[:2]
    if source_batch != batch_size:
        raise ValueError(
            f"decoder_input_ids (or labels) has batch size {batch_size} but the source has {source_batch}: they must "
            "be equal (a batch of packed rows has as many source rows as target rows)."
        )
    if encoder_attention_mask is not None:
        check_attention_mask(encoder_attention_mask, batch_size, length, source_length, "attention_mask", False)
    return source_batch, source_length


def check_token_labels(labels: Any, inputs: torch.Tensor | None, name: str, skip_logits: bool = False) -> None:
    """A language-model head's token labels: (batch, length) ids aligned with `inputs`, the ids or embeddings named
    `name` (None where the labels will be shifted into the decoder's input); `skip_logits` needs them."""
    if labels is None:
        if skip_logits:
            raise ValueError(SKIP_LOGITS_WITHOUT_LABELS)
        return
    check_token_ids(labels, f"labels (aligned with {name})", None if inputs is None else inputs.shape[:2])


def check_can_shift_labels(pad_token_id: int | None, decoder_start_token_id: int | None) -> None:
    """Teacher forcing from labels alone: the decoder input is the labels shifted right behind
    `decoder_start_token_id`, -100 replaced by `pad_token_id`; both must be set."""
    for name, value in (("decoder_start_token_id", decoder_start_token_id), ("pad_token_id", pad_token_id)):
        if value is None:
            raise ValueError(
                f"labels without decoder_input_ids need config.{name} (the decoder input is the labels shifted right "
                "behind decoder_start_token_id, -100 replaced by pad_token_id); set it, or pass decoder_input_ids."
            )


# ---------------------------------------------------------------------------------------------- classifiers


def check_sequence_classification_labels(
    labels: torch.Tensor | None, batch_size: int, num_labels: int, problem_type: str | None
) -> None:
    """Labels of a sequence classifier, for the problem type transformers' loss will infer when `problem_type` is
    None (one label: regression; integer labels: single-label; else multi-label): class ids (batch,) in
    [0, num_labels), -100 ignored; multi-label targets (batch, num_labels); regression targets (batch,) or
    (batch, num_labels)."""
    if labels is None:
        return
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}.")
    if problem_type is None:
        is_class_id = labels.dtype in (torch.long, torch.int)
        problem_type = "regression" if num_labels == 1 else "single_label_classification" if is_class_id else None
        problem_type = problem_type or "multi_label_classification"
    if problem_type == "single_label_classification":
        check_token_ids(labels, "labels", (batch_size,), "class ids (-100 where ignored)")
        return
    if not labels.is_floating_point():
        raise TypeError(f"labels for problem_type={problem_type!r} must be floating point, got dtype {labels.dtype}.")
    # transformers' regression loss squeezes one-label logits and targets: (batch,) and (batch, 1) both fit.
    allowed = [(batch_size, num_labels)] + ([(batch_size,)] if problem_type == "regression" and num_labels == 1 else [])
    if tuple(labels.shape) not in allowed:
        raise ValueError(
            f"labels for problem_type={problem_type!r} have shape {tuple(labels.shape)}, expected one of {allowed}."
        )


__all__ = [
    "FLATTENED_KEYWORDS",
    "IGNORE_INDEX",
    "check_attention_mask",
    "check_can_shift_labels",
    "check_inputs_embeds",
    "check_offsets",
    "check_encoder_output",
    "check_sequence_classification_labels",
    "SKIP_LOGITS_WITHOUT_LABELS",
    "check_stack_inputs",
    "check_token_ids",
    "check_token_labels",
    "mask_key_length",
    "labels_outside",
    "raises_value_error",
    "require",
]
