"""Checks of the tensors a model is called with, run once where a head or stack receives them.

Each check raises a `TypeError` (wrong kind of tensor) or `ValueError` (wrong shape or value) naming the argument,
what it got and what it expects, before a torch op fails deep inside the model with a message about its internals or,
worse, silently computes something else (a (batch, length, length) mask that would be ignored, a mask using -1 for
padding). Shapes and dtypes are known on the host. Values are checked with `require`, which never waits for the
device (see there); under torch.compile value checks are left out of the graph.
"""

from contextlib import contextmanager

import torch
from transformers.utils import is_torchdynamo_compiling

IGNORE_INDEX = -100  # transformers' label for "no loss here"

Shape = tuple[int, ...]


def _require_tensor(value: object, name: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")


def _require_integer_dtype(tensor: torch.Tensor, name: str, what: str) -> None:
    if tensor.dtype == torch.bool or tensor.is_floating_point() or tensor.is_complex():
        raise TypeError(f"{name} must hold integer {what} (torch.long), got dtype {tensor.dtype}.")


def _require_shape(tensor: torch.Tensor, expected: Shape, name: str, meaning: str) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {meaning} = {tuple(expected)}.")


def require(condition: torch.Tensor, message: str) -> None:
    """Raise `message` where the 0-dim bool tensor `condition` is False, without a host-device sync: on an
    accelerator `torch._assert_async` fails the device's stream later instead of stopping the host to read the value
    now; on a CPU tensor it raises at once, as a ValueError here. Not traced by torch.compile."""
    if is_torchdynamo_compiling():
        return
    try:
        torch._assert_async(condition, message)
    except RuntimeError:
        raise ValueError(message) from None


def current_tokens(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The tokens among the last `length` columns of a 2D padding mask, (batch, length) bool: the positions of this
    forward (the mask of a decoding step also covers the cache). None for no mask or a 4D one, which says nothing
    about padding."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask[:, -length:].bool()


@contextmanager
def raises_value_error(error_type: type[Exception], message: str):
    """Replace an `error_type` raised inside by a ValueError with `message`: for the checks a kernel makes anyway, an
    embedding's of its ids and a loss's of its targets, whose CPU errors name no argument (on an accelerator they
    assert on the device). Free: nothing runs unless it failed."""
    try:
        yield
    except error_type as error:
        raise ValueError(f"{message}: {error}") from None


def check_token_ids(input_ids: torch.Tensor, name: str = "input_ids") -> None:
    """Token ids: an integer (batch, length) tensor with at least one sequence of at least one token. (The embedding
    checks that they are inside the vocabulary.)"""
    _require_tensor(input_ids, name)
    _require_integer_dtype(input_ids, name, "token ids")
    if input_ids.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D (batch, length), got shape {tuple(input_ids.shape)}"
            + (": add a batch dimension, e.g. input_ids[None]." if input_ids.dim() == 1 else ".")
        )
    check_not_empty(input_ids.shape, name)


def check_inputs_embeds(inputs_embeds: torch.Tensor, d_model: int, name: str = "inputs_embeds") -> None:
    """Embedded inputs (or encoder states): a floating (batch, length, d_model) tensor, not empty."""
    _require_tensor(inputs_embeds, name)
    if not inputs_embeds.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {inputs_embeds.dtype}.")
    if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != d_model:
        raise ValueError(f"{name} has shape {tuple(inputs_embeds.shape)}, expected (batch, length, d_model={d_model}).")
    check_not_empty(inputs_embeds.shape[:2], name)


def check_not_empty(batch_and_length: Shape, name: str) -> None:
    batch_size, length = batch_and_length[:2]
    if batch_size == 0 or length == 0:
        raise ValueError(
            f"{name} has batch size {batch_size} and length {length}; expected at least one sequence of at least "
            "one token."
        )


def checked_attention_mask(
    mask: torch.Tensor | None,
    batch_size: int,
    query_length: int,
    key_length: int | None,
    name: str,
    check_values: bool = True,
) -> torch.Tensor | None:
    """The mask, checked: a padding mask (batch, key_length) of 0/1 or bool (1 = token, 0 = padding), returned as bool
    (what transformers' mask functions convert it to), or a 4-D mask the caller built, (batch or 1, heads or 1,
    query_length, key_length), bool or additive float, returned as given. `key_length` is None where the keys are a
    static cache's, whose masks span the whole cache; `check_values=False` where the mask's values were checked
    already. Any other rank is refused: transformers' mask functions would ignore a (batch, length, length) mask,
    and a 1-D one has no batch."""
    if mask is None:
        return None
    _require_tensor(mask, name)
    if mask.dim() == 2:
        if mask.shape[0] != batch_size or key_length not in (None, mask.shape[1]):
            expected = (batch_size, key_length)
            raise ValueError(f"{name} has shape {tuple(mask.shape)}, expected (batch, length) = {expected}.")
        token_mask = mask.bool()
        if check_values and mask.dtype != torch.bool:
            require(mask.eq(token_mask).all(), f"{name} must hold 1 for tokens and 0 for padding (or be bool).")
        return token_mask
    if mask.dim() == 4:
        batch, _, rows, columns = mask.shape
        if batch not in (1, batch_size) or rows != query_length or key_length not in (None, columns):
            raise ValueError(
                f"{name} has shape {tuple(mask.shape)}, expected a 4-D mask (batch={batch_size} or 1, heads or 1, "
                f"query_length={query_length}, key_length={key_length})."
            )
        return mask
    raise ValueError(
        f"{name} has shape {tuple(mask.shape)}: expected a (batch, length) padding mask of 0/1, or a 4-D "
        "(batch, 1, query_length, key_length) mask; a 3-D (batch, length, length) mask is not supported "
        "(add the head dimension: mask[:, None])."
    )


def check_position_ids(position_ids: torch.Tensor | None, batch_size: int, length: int) -> None:
    """Positions: integer, (batch or 1, length) or (length,), and not negative."""
    if position_ids is None:
        return
    _require_tensor(position_ids, "position_ids")
    _require_integer_dtype(position_ids, "position_ids", "positions")
    if (
        position_ids.shape[-1:] != (length,)
        or position_ids.dim() > 2
        or (position_ids.dim() == 2 and position_ids.shape[0] not in (1, batch_size))
    ):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}, expected (batch={batch_size} or 1, length={length})."
        )
    require((position_ids >= 0).all(), "position_ids must be >= 0.")


def check_labels(labels: torch.Tensor | None, expected_shape: Shape, num_classes: int, name: str = "labels") -> None:
    """Class labels: integer, of `expected_shape`. Their values, each in [0, num_classes) or -100 (ignored), are
    checked by the loss (see `raises_value_error`)."""
    if labels is None:
        return
    _require_tensor(labels, name)
    _require_integer_dtype(labels, name, "class ids (-100 where ignored)")
    _require_shape(labels, expected_shape, name, "the shape of the outputs they score")


def labels_outside(num_classes: int, name: str = "labels"):
    """The context a loss over class ids runs in: an id outside [0, num_classes) (and not -100) is a ValueError."""
    return raises_value_error(IndexError, f"{name} must hold ids in [0, {num_classes}) or {IGNORE_INDEX} (ignored)")


def check_same_batch(name: str, batch_size: int, other_name: str, other_batch_size: int) -> None:
    if batch_size != other_batch_size:
        raise ValueError(
            f"{name} has batch size {batch_size} but {other_name} has {other_batch_size}; they must be equal."
        )


def check_sequence_classification_labels(
    labels: torch.Tensor | None, batch_size: int, num_labels: int, problem_type: str | None
) -> None:
    """Labels of a sequence classifier, for the problem type transformers' loss will infer when `problem_type` is
    None (one label: regression; integer labels: single-label; else multi-label): class ids (batch,) in
    [0, num_labels), -100 ignored; multi-label targets (batch, num_labels); regression targets (batch,) or
    (batch, num_labels)."""
    if labels is None:
        return
    _require_tensor(labels, "labels")
    if problem_type is None:
        is_class_id = labels.dtype in (torch.long, torch.int)
        problem_type = "regression" if num_labels == 1 else "single_label_classification" if is_class_id else None
        problem_type = problem_type or "multi_label_classification"
    if problem_type == "single_label_classification":
        check_labels(labels, (batch_size,), num_labels)
        return
    if not labels.is_floating_point():
        raise TypeError(f"labels for problem_type={problem_type!r} must be floating point, got dtype {labels.dtype}.")
    # transformers' regression loss squeezes one-label logits and targets: (batch,) and (batch, 1) both fit.
    allowed = [(batch_size, num_labels)] + ([(batch_size,)] if problem_type == "regression" and num_labels == 1 else [])
    if tuple(labels.shape) not in allowed:
        raise ValueError(
            f"labels for problem_type={problem_type!r} have shape {tuple(labels.shape)}, expected one of {allowed}."
        )


def check_token_labels(
    labels: torch.Tensor | None, vocab_size: int, aligned_with: torch.Tensor | None, aligned_name: str
) -> None:
    """Token labels: (batch, length) like `aligned_with` (the ids or embeddings whose outputs they score; None when
    the labels themselves become the inputs), each in [0, vocab_size) or -100."""
    if labels is None:
        return
    _require_tensor(labels, "labels")
    if labels.dim() != 2:
        raise ValueError(f"labels must be 2-D (batch, length), got shape {tuple(labels.shape)}.")
    expected = labels.shape if aligned_with is None else aligned_with.shape[:2]
    check_not_empty(labels.shape, "labels")
    check_labels(labels, expected, vocab_size, f"labels (aligned with {aligned_name})")


def check_skip_logits(skip_logits: bool, labels: torch.Tensor | None) -> None:
    """`skip_logits=True` leaves the loss as the only output, so it needs labels."""
    if skip_logits and labels is None:
        raise ValueError("skip_logits=True returns the loss without logits, so it needs labels: pass labels too.")


def check_stack_inputs(
    input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, d_model: int, prefix: str = ""
) -> None:
    """The one input of a stack: token ids, or embeddings of width d_model (`prefix`: "decoder_" for the target
    side of an encoder-decoder, as the caller names them)."""
    if input_ids is not None:
        check_token_ids(input_ids, f"{prefix}input_ids")
    else:
        check_inputs_embeds(inputs_embeds, d_model, f"{prefix}inputs_embeds")


def check_can_shift_labels(pad_token_id: int | None, decoder_start_token_id: int | None) -> None:
    """Teacher forcing from labels alone: the decoder input is the labels shifted right behind
    `decoder_start_token_id`, -100 replaced by `pad_token_id`; both must be set."""
    for name, value in (("decoder_start_token_id", decoder_start_token_id), ("pad_token_id", pad_token_id)):
        if value is None:
            raise ValueError(
                f"labels without decoder_input_ids need config.{name} (the decoder input is the labels shifted right "
                "behind decoder_start_token_id, -100 replaced by pad_token_id); set it, or pass decoder_input_ids."
            )


__all__ = [
    "IGNORE_INDEX",
    "labels_outside",
    "raises_value_error",
    "require",
    "checked_attention_mask",
    "current_tokens",
    "check_inputs_embeds",
    "check_labels",
    "check_not_empty",
    "check_position_ids",
    "check_same_batch",
    "check_can_shift_labels",
    "check_sequence_classification_labels",
    "check_stack_inputs",
    "check_token_ids",
    "check_token_labels",
]
