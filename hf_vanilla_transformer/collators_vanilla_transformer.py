"""Collators for padding-free training: translation pairs laid end to end, with the offsets of their sequences,
built on the CPU once per batch (what the model's attention reads: packing_vanilla_transformer)."""

from typing import Any

import torch
from transformers.models.bart.modeling_bart import shift_tokens_right


class DataCollatorForSeq2SeqWithFlattening:
    """Collates translation pairs for a padding-free training step, on the CPU: the sources laid end to end, the
    targets laid end to end, and their offsets (see the module docstring). Features are dicts with `input_ids` and
    `labels` (lists or 1-D tensors), as for transformers' `DataCollatorForSeq2Seq`.

    A batch whose sources and targets all have one length has no padding to skip: it is returned in the (batch,
    length) layout without masks, the layout every attention kernel runs fastest.
    """

    def __init__(self, model=None, *, decoder_start_token_id: int | None = None, pad_token_id: int | None = None):
        config = getattr(model, "config", None)
        self.decoder_start_token_id = first_set(decoder_start_token_id, getattr(config, "decoder_start_token_id", None))
        self.pad_token_id = first_set(pad_token_id, getattr(config, "pad_token_id", None))
        if self.decoder_start_token_id is None or self.pad_token_id is None:
            raise ValueError(
                "DataCollatorForSeq2SeqWithFlattening needs decoder_start_token_id and pad_token_id: pass the model "
                "(its config has them) or give both."
            )

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        sources = [torch.as_tensor(feature["input_ids"], dtype=torch.long) for feature in features]
        labels = [torch.as_tensor(feature["labels"], dtype=torch.long) for feature in features]
        if any(len(sequence) == 0 for sequence in sources + labels):
            raise ValueError("Every feature needs at least one input id and one label.")
        decoder_inputs = [self.shift(sequence) for sequence in labels]
        if len({len(sequence) for sequence in sources}) == 1 and len({len(sequence) for sequence in labels}) == 1:
            return dict(
                input_ids=torch.stack(sources),
                labels=torch.stack(labels),
                decoder_input_ids=torch.stack(decoder_inputs),
            )
        return dict(
            input_ids=torch.cat(sources)[None],
            position_ids=positions_of(sources),
            labels=torch.cat(labels)[None],
            decoder_input_ids=torch.cat(decoder_inputs)[None],
            decoder_position_ids=positions_of(labels),
            **offsets_of(sources, "k"),
            **offsets_of(labels, "q"),
        )

    def shift(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels[None], self.pad_token_id, self.decoder_start_token_id)[0]


def first_set(*values):
    return next((value for value in values if value is not None), None)


def positions_of(sequences: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.arange(len(sequence)) for sequence in sequences])[None]


def offsets_of(sequences: list[torch.Tensor], side: str) -> dict[str, Any]:
    lengths = torch.tensor([len(sequence) for sequence in sequences])
    cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return {f"cu_seq_lens_{side}": cu_seq_lens, f"max_length_{side}": int(lengths.max())}


__all__ = ["DataCollatorForSeq2SeqWithFlattening"]
