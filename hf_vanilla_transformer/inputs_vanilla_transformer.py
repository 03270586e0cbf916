"""Checks of the tensors a model is called with, run in one call where a head, the base model or a stack run alone
receives them (the stacks trust what they are given).

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


def check_offsets(cu_seq_lens: Any, max_length: Any, shape: tuple[int, int], side: str) -> None:
    """The offsets of one side of a flattened batch. Offsets that would attend across sequences or index past the
    tokens are refused: int32 (what the kernels take), 1-D, from 0, not decreasing, ending at the token count,
    `max_length` at least the longest sequence, and in a (rows, row_length) `shape` of several rows, no sequence
    across two rows. Values are checked without a host sync (`require`)."""
    name, length_name = f"cu_seq_lens_{side}", f"max_length_{side}"
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
    if is_torchdynamo_compiling():  # `require` checks nothing in a graph: neither build its conditions nor message
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
    labels: torch.Tensor | None = None,
    first_layer: int = 0,
) -> None:
    """Everything one stack reads: exactly one of its ids or embeddings, its positions, its mask (over the keys of
    the decoder `cache` and the inputs), run alone on a flattened batch the offsets in `offsets` (a stack's
    "q" side; transformers' collator gives "k" too, equal), and a language-model head's token `labels`, aligned with
    the inputs. `prefix`: "decoder_" for the target side of an encoder-decoder, as the caller names its inputs;
    `first_layer`: see `mask_key_length`."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError(f"Pass exactly one of {prefix}input_ids or {prefix}inputs_embeds.")
    if input_ids is not None:
        check_token_ids(input_ids, f"{prefix}input_ids")
    else:
        check_inputs_embeds(inputs_embeds, config.d_model, f"{prefix}inputs_embeds")
    batch_size, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
    if position_ids is not None:
        check_token_ids(position_ids if position_ids.dim() == 2 else position_ids[None], "position_ids")
        if position_ids.shape[-1] != length or position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch_size):
            raise ValueError(
                f"position_ids has shape {tuple(position_ids.shape)}, expected (batch={batch_size} or 1, "
                f"length={length})."
            )
        require((position_ids >= 0).all(), "position_ids must be >= 0.")
    if attention_mask is not None:
        key_length = mask_key_length(cache, length, first_layer)
        check_attention_mask(attention_mask, batch_size, length, key_length, f"{prefix}attention_mask")
    if labels is not None:
        check_token_ids(labels, f"labels (aligned with {prefix}input_ids)", (batch_size, length))
    for side in ("q", "k") if offsets and offsets.get("cu_seq_lens_q") is not None else ():
        check_offsets(offsets.get(f"cu_seq_lens_{side}"), offsets.get(f"max_length_{side}"), (batch_size, length), side)


def check_seq2seq_inputs(
    config,
    *,
    input_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    encoder_hidden_states: Any = None,
    decoder_input_ids: torch.Tensor | None = None,
    decoder_attention_mask: torch.Tensor | None = None,
    decoder_inputs_embeds: torch.Tensor | None = None,
    cache: Any = None,
    labels: torch.Tensor | None = None,
    kwargs: dict | None = None,
    skip_logits: bool = False,
) -> None:
    """Everything an encoder-decoder reads, in one call: the source (or the given encoder output's states and the mask
    over them), the target (absent where the labels will be shifted into it), the labels aligned with the target (needed
    with `skip_logits`), and a flattened batch's offsets (`kwargs`, which also carry the position ids)."""
    kwargs = kwargs or {}
    if encoder_hidden_states is None:
        check_stack_inputs(
            config,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=kwargs.get("position_ids"),
        )
        source = input_ids if input_ids is not None else inputs_embeds
    else:  # generate passes the encoder output at every step; the mask over it is checked against its shape
        source = encoder_hidden_states
        check_inputs_embeds(source, config.d_model, "encoder_outputs.last_hidden_state")
        if attention_mask is not None:  # generate drops a mask without padding: no call at its steps
            check_attention_mask(attention_mask, source.shape[0], 1, source.shape[1], "attention_mask")
    target = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
    if target is not None:
        check_stack_inputs(
            config,
            input_ids=decoder_input_ids,
            inputs_embeds=decoder_inputs_embeds,
            attention_mask=decoder_attention_mask,
            position_ids=kwargs.get("decoder_position_ids"),
            cache=cache,
            prefix="decoder_",
        )
    if skip_logits and labels is None:
        raise ValueError(SKIP_LOGITS_WITHOUT_LABELS)
    if labels is not None:
        check_token_ids(labels, "labels (aligned with decoder_input_ids)", None if target is None else target.shape[:2])
    target = target if target is not None else labels
    if target is not None and target.shape[0] != source.shape[0]:
        raise ValueError(
            f"decoder_input_ids (or labels) has batch size {target.shape[0]} but the source has {source.shape[0]}: "
            "they must be equal (a batch of packed rows has as many source rows as target rows)."
        )
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        check_seq2seq_offsets(kwargs, target, source)


def check_seq2seq_offsets(kwargs: dict, target: torch.Tensor, source: torch.Tensor) -> None:
    """A flattened encoder-decoder batch: the target's offsets ("q") and the source's ("k") come together, each
    checked against its side's tokens, and pair each target sequence with one source sequence."""
    for side, tokens in (("q", target), ("k", source)):
        if kwargs.get(f"cu_seq_lens_{side}") is None:
            raise ValueError(
                "A flattened batch flattens the source and the target: cu_seq_lens_q and cu_seq_lens_k come together."
            )
        check_offsets(kwargs[f"cu_seq_lens_{side}"], kwargs.get(f"max_length_{side}"), tuple(tokens.shape[:2]), side)
    targets, sources = kwargs["cu_seq_lens_q"].shape[0] - 1, kwargs["cu_seq_lens_k"].shape[0] - 1
    if targets != sources:
        raise ValueError(
            f"cu_seq_lens_q has {targets} sequences and cu_seq_lens_k {sources}: cross-attention pairs each target "
            "sequence with one source sequence."
        )


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
    "check_seq2seq_inputs",
    "check_sequence_classification_labels",
    "SKIP_LOGITS_WITHOUT_LABELS",
    "check_stack_inputs",
    "check_token_ids",
    "mask_key_length",
    "labels_outside",
    "raises_value_error",
    "require",
]
