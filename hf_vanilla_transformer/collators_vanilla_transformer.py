"""Collators for padding-free training: translation pairs laid end to end, with the offsets of their sequences,
built on the CPU once per batch (what the model's attention reads: packing_vanilla_transformer).

Which layout a training run takes is chosen once, from the device (`preferred_layout`): the flattened one where it
is the faster, the padded one elsewhere (`seq2seq_training_collator` builds the collator of either).
"""

from typing import Any, Literal

import torch
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase
from transformers.models.bart.modeling_bart import shift_tokens_right
from transformers.utils import logging

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .inputs_vanilla_transformer import IGNORE_INDEX
from .packing_vanilla_transformer import varlen_kernel

logger = logging.get_logger(__name__)

BatchLayout = Literal["flattened", "padded"]
# Padded batches' length is a multiple of 8 unless asked otherwise: tensor cores' multiple in half precision.
PADDED_MULTIPLE_OF = 8


class DataCollatorForSeq2SeqWithFlattening:
    """Collates translation pairs for a padding-free training step, on the CPU: the sources laid end to end, the
    targets laid end to end, and their offsets (see the module docstring). Features are dicts with `input_ids` and
    `labels` (lists or 1-D tensors), as for transformers' `DataCollatorForSeq2Seq`.

    A batch whose sources and targets all have one length has no padding to skip: it is returned in the (batch,
    length) layout without masks, the layout every attention kernel runs fastest.

    Static shapes, so that a compiled step is one graph from batch to batch (torch.compile specialises on shapes and
    on the Python ints `max_length_q/k`; CUDA graphs need fixed shapes):

    - `pad_to_multiple_of`: each stream (source, target) ends with one more sequence, of pad tokens (labels -100, so
      nothing is added to the loss; positions from 0), that fills it up to a multiple of this many tokens; it has at
      least one token on each side, so that its target tokens have source tokens to attend to. `max_length_q/k` are
      rounded up to the same multiple.
    - `num_sequences`: the number of sequence slots, the length of `cu_seq_lens_q/k` minus 1; the slots a batch does
      not use are empty sequences (repeated offsets). A batch needs one slot per pair, plus one for the padding.

    Packed rows, so that attention needs no variable-length kernel (`row_length`): the pairs are packed into rows of
    `row_length` tokens (first fit, longest first), each row holding whole sentences, in the same order on both
    sides, and ending with a sequence of pad tokens up to its length (labels -100; empty where the row is full):
    (rows, row_length) tensors with offsets over all their tokens. Where the pairs fill a row's source side, the
    target's padding ends the row's last target instead (the padding's sequence left empty on both sides), so that
    every target token has source tokens to attend to. Without a kernel, attention runs per row under a mask that
    keeps each sentence to itself, as a padded batch runs it; with one, over the offsets. `num_rows` fixes the number
    of rows (the unused ones all padding), `num_sequences` the sequence slots as above (a pair each, and a row's
    padding each): with both, every batch has one shape.

    Each option returns every batch flattened or packed. The sequences of source and target always pair up one
    to one: cross-attention reads target sequence i against source sequence i. (A Mixture-of-Experts router also
    routes the pad tokens: they count in its load-balancing statistics and its expert capacity.)
    """

    def __init__(
        self,
        model=None,
        *,
        decoder_start_token_id: int | None = None,
        pad_token_id: int | None = None,
        pad_to_multiple_of: int | None = None,
        num_sequences: int | None = None,
        row_length: int | None = None,
        num_rows: int | None = None,
    ):
        config = getattr(model, "config", None)
        self.decoder_start_token_id = first_set(decoder_start_token_id, getattr(config, "decoder_start_token_id", None))
        self.pad_token_id = first_set(pad_token_id, getattr(config, "pad_token_id", None))
        if self.decoder_start_token_id is None or self.pad_token_id is None:
            raise ValueError(
                "DataCollatorForSeq2SeqWithFlattening needs decoder_start_token_id and pad_token_id: pass the model "
                "(its config has them) or give both."
            )
        sizes = dict(
            pad_to_multiple_of=pad_to_multiple_of, num_sequences=num_sequences, row_length=row_length, num_rows=num_rows
        )
        for name, value in sizes.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {value!r}.")
        if row_length is None and num_rows is not None:
            raise ValueError("num_rows fixes the number of packed rows: it needs row_length.")
        if row_length is not None and pad_to_multiple_of is not None:
            raise ValueError(
                "row_length packs whole rows, which fixes the token shapes already: pad_to_multiple_of is for the "
                "one-row layout (num_sequences fixes the sequence slots of either)."
            )
        if pad_to_multiple_of is not None and num_sequences == 1:
            raise ValueError("num_sequences=1 leaves no slot for a sentence once pad_to_multiple_of takes one.")
        # The padding's positions run up to pad_to_multiple_of - 1 (row_length - 1): learned positions must have them.
        padding_name, padding = ("row_length", row_length) if row_length else ("pad_to_multiple_of", pad_to_multiple_of)
        if getattr(config, "position_embedding_type", None) == "learned" and padding is not None:
            if padding > config.max_position_embeddings:
                raise ValueError(
                    f"{padding_name}={padding} exceeds the model's learned positions "
                    f"(max_position_embeddings={config.max_position_embeddings}): the padding's sequence could be "
                    "that long."
                )
        self.pad_to_multiple_of = pad_to_multiple_of
        self.num_sequences = num_sequences
        self.row_length = row_length
        self.num_rows = num_rows

    @property
    def static_shapes(self) -> bool:
        return self.pad_to_multiple_of is not None or self.num_sequences is not None or self.row_length is not None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        check_features(features)
        sources = [token_sequence(feature, index, "input_ids") for index, feature in enumerate(features)]
        labels = [token_sequence(feature, index, "labels") for index, feature in enumerate(features)]
        decoder_inputs = [self.shift(sequence) for sequence in labels]
        equal_lengths = len({len(sequence) for sequence in sources}) == len({len(sequence) for sequence in labels}) == 1
        if equal_lengths and not self.static_shapes:
            return dict(
                input_ids=torch.stack(sources),
                labels=torch.stack(labels),
                decoder_input_ids=torch.stack(decoder_inputs),
            )
        if self.row_length is not None:
            return self.packed_rows(sources, labels, decoder_inputs)
        if self.pad_to_multiple_of is not None:
            source_padding, target_padding = self.padding_length(sources), self.padding_length(labels)
            sources.append(torch.full((source_padding,), self.pad_token_id))
            labels.append(torch.full((target_padding,), IGNORE_INDEX))
            decoder_inputs.append(torch.full((target_padding,), self.pad_token_id))
        self.check_slots(len(features), len(sources), "and the padding's" if self.pad_to_multiple_of else "")
        return dict(
            input_ids=torch.cat(sources)[None],
            position_ids=positions_of(sources),
            labels=torch.cat(labels)[None],
            decoder_input_ids=torch.cat(decoder_inputs)[None],
            decoder_position_ids=positions_of(labels),
            **self.offsets(sources, "k"),
            **self.offsets(labels, "q"),
        )

    def packed_rows(self, sources: list, labels: list, decoder_inputs: list) -> dict[str, Any]:
        """The pairs in rows of `row_length` tokens (see the class docstring)."""
        width = self.row_length
        sizes = [(len(source), len(target)) for source, target in zip(sources, labels)]
        if max(map(max, sizes)) > width:
            raise ValueError(f"A sentence of {max(map(max, sizes))} tokens does not fit in row_length={width}.")
        rows = []  # [source tokens, target tokens, pairs] of each row
        for pair in sorted(range(len(sizes)), key=lambda index: -max(sizes[index])):
            source_size, target_size = sizes[pair]
            fits = (row for row in rows if row[0] + source_size <= width and row[1] + target_size <= width)
            row = next(fits, None)
            if row is None:
                row = [0, 0, []]
                rows.append(row)
            row[0], row[1] = row[0] + source_size, row[1] + target_size
            row[2].append(pair)
        if self.num_rows is not None and len(rows) > self.num_rows:
            raise ValueError(
                f"A batch of {len(sizes)} pairs fills {len(rows)} rows, more than num_rows={self.num_rows}."
            )
        rows += [[0, 0, []] for _ in range(max((self.num_rows or 0) - len(rows), 0))]
        streams = {"input_ids": [], "labels": [], "decoder_input_ids": []}
        for source_size, target_size, pairs in rows:
            for name, sequences, padding, used in (
                ("input_ids", sources, self.pad_token_id, source_size),
                ("labels", labels, IGNORE_INDEX, target_size),
                ("decoder_input_ids", decoder_inputs, self.pad_token_id, target_size),
            ):
                row = [sequences[pair] for pair in pairs] + [torch.full((width - used,), padding)]
                if source_size == width:
                    # A full source side leaves the padding's sequence no source token: its target tokens would
                    # cross-attend over no keys, which the kernels leave undefined. They end the row's last target
                    # instead, after its tokens (causal attention keeps them from those); the padding's sequence
                    # stays, empty on both sides, so that every row keeps its number of sequences.
                    row[-2:] = [torch.cat(row[-2:]), row[-1][:0]]
                streams[name] += row
        shape = (len(rows), width)
        self.check_slots(len(sizes), len(sizes) + len(rows), "and one per row for its padding")
        return dict(
            **{name: torch.cat(sequences).view(shape) for name, sequences in streams.items()},
            position_ids=positions_of(streams["input_ids"]).view(shape),
            decoder_position_ids=positions_of(streams["labels"]).view(shape),
            cu_seq_lens_k=offsets_of(streams["input_ids"] + self.empty_slots(len(sizes) + len(rows))),
            cu_seq_lens_q=offsets_of(streams["labels"] + self.empty_slots(len(sizes) + len(rows))),
            max_length_k=width,
            max_length_q=width,
        )

    def shift(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels[None], self.pad_token_id, self.decoder_start_token_id)[0]

    def round_up(self, length: int) -> int:
        multiple = self.pad_to_multiple_of or 1
        return -(-length // multiple) * multiple

    def padding_length(self, sequences: list[torch.Tensor]) -> int:
        """Tokens of the padding's sequence: at least one, up to the next multiple of `pad_to_multiple_of`."""
        tokens = sum(len(sequence) for sequence in sequences)
        return self.round_up(tokens + 1) - tokens

    def check_slots(self, pairs: int, sequences: int, padding: str) -> None:
        if self.num_sequences is not None and sequences > self.num_sequences:
            raise ValueError(
                f"A batch of {pairs} sentence pairs needs {sequences} sequence slots (one per pair {padding}), more "
                f"than num_sequences={self.num_sequences}: raise num_sequences or cap the batches' sentences."
            )

    def empty_slots(self, sequences: int) -> list[torch.Tensor]:
        """The sequence slots a batch of `sequences` leaves unused: empty sequences (repeated offsets)."""
        return [torch.empty(0)] * ((self.num_sequences or sequences) - sequences)

    def offsets(self, sequences: list[torch.Tensor], side: str) -> dict[str, Any]:
        longest = max(len(sequence) for sequence in sequences)
        return {
            f"cu_seq_lens_{side}": offsets_of(sequences + self.empty_slots(len(sequences))),
            f"max_length_{side}": self.round_up(longest),
        }


def check_features(features: list[dict[str, Any]]) -> None:
    """What a batch needs, said by name before torch fails without one."""
    if not features:
        raise ValueError("DataCollatorForSeq2SeqWithFlattening got no features: a batch needs at least one pair.")
    for index, feature in enumerate(features):
        missing = [key for key in ("input_ids", "labels") if key not in feature]
        if missing:
            raise ValueError(
                f"Feature {index} has no {' and no '.join(missing)} (it has {sorted(feature)}): every feature needs "
                "input_ids (the source token ids) and labels (the target token ids)."
            )


FIELDS = {"input_ids": "the source token ids", "labels": "the target token ids"}


def token_sequence(feature: dict[str, Any], index: int, name: str) -> torch.Tensor:
    """A feature's `input_ids` or `labels` as a 1-D long tensor; anything else is a ValueError naming the feature,
    the field and what it should hold, before torch fails on it (or, for a 2-D list, stacks it silently)."""
    expected = f"expected {FIELDS[name]}, a non-empty list or 1-D tensor of integers"
    value = feature[name]
    if value is None:
        raise ValueError(f"Feature {index}'s {name} is None: {expected}.")
    try:
        sequence = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"Feature {index}'s {name} cannot be read as token ids ({error}): {expected}.") from None
    if sequence.dim() != 1:
        raise ValueError(f"Feature {index}'s {name} has shape {tuple(sequence.shape)}: {expected}.")
    if len(sequence) == 0:
        raise ValueError(f"Feature {index}'s {name} is empty: {expected}.")
    if sequence.is_floating_point() or sequence.is_complex() or sequence.dtype == torch.bool:
        raise ValueError(f"Feature {index}'s {name} holds {sequence.dtype} values: {expected}.")
    return sequence.long()


def first_set(*values):
    return next((value for value in values if value is not None), None)


def offsets_of(sequences: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([0, *map(len, sequences)]).cumsum(0).to(torch.int32)


def positions_of(sequences: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.arange(len(sequence)) for sequence in sequences])[None]


def layout_choice(model, device: torch.device | str, half_precision: bool) -> tuple[BatchLayout, str]:
    """`preferred_layout` and the reason for it, for the log."""
    device = torch.device(device)
    model_type = getattr(model.config, "model_type", None)
    if model_type != VanillaTransformerConfig.model_type:
        return "padded", f"a {model_type} model: transformers' models read padded batches only"
    if device.type == "cpu":
        return "flattened", "on the CPU it skips the padding in every position-wise layer, which is the larger cost"
    dtype = torch.bfloat16 if half_precision else torch.float32
    dropout = model.config.attention_dropout
    kernel = varlen_kernel(model.config._attn_implementation, device, dtype, dropout)
    if kernel is not None:
        return "flattened", f"a variable-length attention kernel ({kernel}) runs on {device.type} in {dtype}"
    return "padded", (
        f"no variable-length attention kernel runs on {device.type} in {dtype} with attention dropout {dropout}, "
        "and attention under the flattened layout's block mask runs over every token of the row"
    )


def preferred_layout(model, device: torch.device | str, half_precision: bool) -> BatchLayout:
    """The layout of a training run's batches that is not slower than the other one on `device`: "flattened" on the
    CPU (it skips the padding in every position-wise layer, the bulk of the work there) and where a variable-length
    attention kernel runs (`varlen_kernel`, which the model asks too: transformers' flash integration, or CUDA in
    half precision without attention dropout); "padded" elsewhere (a GPU's step is bound by kernel launches, and
    attention under the flattened layout's block mask runs over every token of the row) and for models other than
    this package's. Decided once per run, not per batch."""
    return layout_choice(model, device, half_precision)[0]


def seq2seq_training_collator(
    model,
    tokenizer: PreTrainedTokenizerBase,
    *,
    device: torch.device | str,
    half_precision: bool,
    pad_to_multiple_of: int | None = None,
    num_sequences: int | None = None,
) -> "DataCollatorForSeq2SeqWithFlattening | DataCollatorForSeq2Seq":
    """The training collator of `preferred_layout`: `DataCollatorForSeq2SeqWithFlattening` with the static-shape
    options, or transformers' `DataCollatorForSeq2Seq` padding to `pad_to_multiple_of` (default
    `PADDED_MULTIPLE_OF`). The padded layout has no sequence slots: there `num_sequences` does nothing. Logs the
    choice."""
    layout, reason = layout_choice(model, device, half_precision)
    logger.info("Training batches: the %s layout (%s)", layout, reason)
    if layout == "flattened":
        return DataCollatorForSeq2SeqWithFlattening(
            model, pad_to_multiple_of=pad_to_multiple_of, num_sequences=num_sequences
        )
    return DataCollatorForSeq2Seq(tokenizer, model=model, pad_to_multiple_of=pad_to_multiple_of or PADDED_MULTIPLE_OF)


__all__ = ["DataCollatorForSeq2SeqWithFlattening", "preferred_layout", "seq2seq_training_collator"]
