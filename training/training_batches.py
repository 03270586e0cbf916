"""How the seq2seq script forms its training batches: the collator of the layout chosen for the device
(hf_vanilla_transformer.seq2seq_training_collator), and, with --max_tokens, batches cut by a token budget instead of a
sentence count (fairseq's --max-tokens), with the static-shape options that let a compiled step see few shapes."""

import math
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import seed_worker

from hf_vanilla_transformer.collators_vanilla_transformer import PADDED_MULTIPLE_OF

DEFAULT_BATCH_SIZE = next(f.default for f in fields(TrainingArguments) if f.name == "per_device_train_batch_size")
# What `CountingCollator` puts beside a training batch: its pairs, and their source and target tokens.
PAIRS, TOKENS = "counted_pairs", "counted_tokens"


@dataclass
class BatchingArguments:
    """Token-budget batches and static shapes; mixed into the seq2seq script's TrainingArguments."""

    max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Cut training batches by a token budget instead of --per_device_train_batch_size sentences "
            "(fairseq's --max-tokens): sentence pairs sorted by length are grouped so that the source and the "
            "target of a batch each hold at most this many tokens as the batch is laid out (flattened: their sum "
            "and padding; padded: sentences x longest); the batches' order is shuffled every epoch."
        },
    )
    pad_to_multiple_of: int | None = field(
        default=None,
        metadata={
            "help": "Flattened batches: pad the source and target streams with one more sequence of pad tokens up "
            "to a multiple of this many tokens, and round their longest-sequence lengths up to it, so that "
            "torch.compile sees few shapes. Padded batches: their length's multiple (default 8)."
        },
    )
    num_sequences: int | None = field(
        default=None,
        metadata={
            "help": "Flattened batches: a fixed number of sequence slots (empty sequences fill the unused ones). "
            "With --max_tokens it also caps a batch's sentences; with --max_tokens and --pad_to_multiple_of it "
            "defaults to the largest batch plus the padding's sequence."
        },
    )

    def __post_init__(self):
        for name in ("max_tokens", "pad_to_multiple_of", "num_sequences"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name} must be 1 or more, got {getattr(self, name)}.")
        super().__post_init__()
        if self.max_tokens is None:
            slots = self.sentences_per_batch()
            if slots is not None and self.per_device_train_batch_size > slots:
                padding = " with the padding" if self.pad_to_multiple_of else ""
                raise ValueError(
                    f"--per_device_train_batch_size {self.per_device_train_batch_size} pairs do not fit "
                    f"--num_sequences {self.num_sequences} slots{padding}."
                )
            return
        if self.per_device_train_batch_size != DEFAULT_BATCH_SIZE:
            raise ValueError(
                "--max_tokens sizes the training batches by tokens; drop --per_device_train_batch_size (to cap the "
                "sentences of a batch, give --num_sequences)."
            )
        if self.train_sampling_strategy != "random":
            raise ValueError(
                f"--max_tokens forms its own length-sorted batches; --train_sampling_strategy "
                f"{self.train_sampling_strategy} cannot apply to them."
            )

    def sentences_per_batch(self) -> int | None:
        """The most sentence pairs a batch may hold: the slots of --num_sequences, less the padding's."""
        if self.num_sequences is None:
            return None
        return self.num_sequences - (self.pad_to_multiple_of is not None)


def round_up(tokens: int, multiple: int | None) -> int:
    return -(-tokens // multiple) * multiple if multiple else tokens


def stream_tokens(lengths: list[int], flattened: bool, pad_to_multiple_of: int | None) -> int:
    """The tokens of one stream (source or target) of a batch as its collator lays it out: end to end, with the
    padding's sequence of at least one token when padded to a multiple; or padded to the longest row (and its
    multiple)."""
    if not flattened:
        return len(lengths) * round_up(max(lengths), pad_to_multiple_of)
    return round_up(sum(lengths) + 1, pad_to_multiple_of) if pad_to_multiple_of else sum(lengths)


def token_budget_batches(
    source_lengths: Sequence[int],
    target_lengths: Sequence[int],
    max_tokens: int,
    *,
    flattened: bool,
    pad_to_multiple_of: int | None = None,
    max_sentences: int | None = None,
    seed: int = 0,
) -> list[list[int]]:
    """Indices of sentence pairs cut into batches whose source and target streams each hold at most `max_tokens`
    tokens (`stream_tokens`), and at most `max_sentences` pairs: sorted by their longer side, ties in an order drawn
    from `seed`, each batch filled in turn. Batches that fill the budget have nearly one size, so padded to a
    multiple they take few shapes."""
    longest = max(range(len(source_lengths)), key=lambda i: max(source_lengths[i], target_lengths[i]))
    pair = [source_lengths[longest]], [target_lengths[longest]]
    if max(stream_tokens(side, flattened, pad_to_multiple_of) for side in pair) > max_tokens:
        raise ValueError(
            f"--max_tokens {max_tokens} cannot hold the longest training pair ({source_lengths[longest]} source, "
            f"{target_lengths[longest]} target tokens{', with its padding' if pad_to_multiple_of else ''})."
        )
    order = list(range(len(source_lengths)))
    random.Random(seed).shuffle(order)
    order.sort(key=lambda i: max(source_lengths[i], target_lengths[i]))  # stable: ties keep the drawn order
    batches, batch, sources, targets = [], [], [], []
    for index in order:
        sources.append(source_lengths[index])
        targets.append(target_lengths[index])
        over = any(stream_tokens(side, flattened, pad_to_multiple_of) > max_tokens for side in (sources, targets))
        if batch and (over or len(batch) == max_sentences):
            batches.append(batch)
            batch, sources, targets = [], [source_lengths[index]], [target_lengths[index]]
        batch.append(index)
    return [*batches, batch]


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """The batches of `token_budget_batches`, formed once, in an order drawn from (seed, epoch): every example once
    per epoch, the same order for the same epoch in a resumed run (`SamplerEpoch` sets the epoch, the Trainer skips
    the batches it already trained on)."""

    def __init__(self, source_lengths: Sequence[int], target_lengths: Sequence[int], max_tokens: int, **options):
        self.batches = token_budget_batches(source_lengths, target_lengths, max_tokens, **options)
        self.seed = options.get("seed", 0)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        order = list(range(len(self.batches)))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        for index in order:
            yield list(self.batches[index])

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def largest_batch(self) -> int:
        return max(map(len, self.batches))


def token_budget_sampler(
    args: BatchingArguments, train_dataset: Any, flattened: bool
) -> TokenBudgetBatchSampler | None:
    """--max_tokens' sampler over the tokenized training pairs laid out `flattened` or padded, seeded with
    --data_seed or --seed; None without --max_tokens."""
    if args.max_tokens is None:
        return None
    return TokenBudgetBatchSampler(
        [len(source) for source in train_dataset["input_ids"]],
        [len(target) for target in train_dataset["labels"]],
        args.max_tokens,
        flattened=flattened,
        pad_to_multiple_of=args.pad_to_multiple_of or (None if flattened else PADDED_MULTIPLE_OF),
        max_sentences=args.sentences_per_batch(),
        seed=args.data_seed if args.data_seed is not None else args.seed,
    )


def sequence_slots(args: BatchingArguments, sampler: TokenBudgetBatchSampler | None) -> int | None:
    """--num_sequences, or with --max_tokens and --pad_to_multiple_of the slots of the largest batch and its
    padding, so that flattened batches keep one number of sequences."""
    if args.num_sequences is not None or sampler is None or args.pad_to_multiple_of is None:
        return args.num_sequences
    return sampler.largest_batch + 1


@dataclass
class CountingCollator:
    """`collator`'s batch, and beside it (as PAIRS and TOKENS) its sentence pairs and their source and target tokens
    without padding, counted on the CPU from the features."""

    collator: Callable[[list[dict[str, Any]]], Any]

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        tokens = sum(len(feature["input_ids"]) + len(feature["labels"]) for feature in features)
        batch = self.collator(features)
        batch[PAIRS], batch[TOKENS] = len(features), tokens
        return batch


class SamplerEpoch(TrainerCallback):
    """Gives `sampler` the epoch as each epoch begins. The Trainer reaches a batch sampler through accelerate's
    wrappers by hand, one level deep: under DDP the sampler sits inside accelerate's per-process shard, and in a
    resumed epoch inside a sampler that skips the batches trained as well, where the epoch never reaches it, so that
    the resumed run would train the first epoch's order again. The state's epoch counts finished epochs in its whole
    part (the end of epoch e is e + steps/steps = e + 1 exactly, and a resumed state holds its checkpoint's)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.sampler.set_epoch(math.floor(state.epoch or 0))


class TrainingBatchesMixin(Trainer):
    """Training batches of their own: `train_data_collator` (e.g. the package's flattening collator) and
    `train_batch_sampler` (e.g. `TokenBudgetBatchSampler`); evaluation and prediction keep `data_collator`'s padded
    batches, which `generate` needs, and the sentence count of --per_device_eval_batch_size.

    The Trainer counts `train_samples_per_second` as --per_device_train_batch_size pairs a step, which batches cut by
    a token budget are not: the pairs and tokens of the batches trained on are counted instead, and the training's
    end reports them per second of `train_runtime` (`train_samples_per_second` = `train_pairs_per_second`, and
    `train_tokens_per_second`, source and target tokens without padding)."""

    def __init__(self, *args, train_data_collator=None, train_batch_sampler: Sampler | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_data_collator = train_data_collator
        self.train_batch_sampler = train_batch_sampler
        if hasattr(train_batch_sampler, "set_epoch"):
            self.add_callback(SamplerEpoch(train_batch_sampler))
        self.trained = {PAIRS: 0, TOKENS: 0}  # by this process, in this call of train()

    def train(self, *args, **kwargs):
        self.trained = {PAIRS: 0, TOKENS: 0}
        return super().train(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        for name in self.trained:
            self.trained[name] += inputs.pop(name)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "train_runtime" in logs:  # the training's end, reached by every process
            counted = torch.tensor(list(self.trained.values()), device=self.args.device)
            pairs, tokens = self.accelerator.reduce(counted, reduction="sum").tolist()
            logs["train_samples_per_second"] = logs["train_pairs_per_second"] = round(pairs / logs["train_runtime"], 3)
            logs["train_tokens_per_second"] = round(tokens / logs["train_runtime"], 3)
        super().log(logs, start_time)

    def get_train_dataloader(self) -> DataLoader:
        evaluation_collator = self.data_collator
        self.data_collator = CountingCollator(self.train_data_collator or evaluation_collator)
        try:
            if self.train_batch_sampler is None:
                return super().get_train_dataloader()
            return self.batch_sampler_dataloader()
        finally:
            self.data_collator = evaluation_collator

    def batch_sampler_dataloader(self) -> DataLoader:
        """The Trainer's training DataLoader (its workers, seeding and column removal) with batches from
        `train_batch_sampler`. Accelerate hands each process every n-th batch."""
        args = self.args
        loader = DataLoader(
            self._remove_unused_columns(self.train_dataset, description="Training"),
            batch_sampler=self.train_batch_sampler,
            collate_fn=self.data_collator,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            worker_init_fn=partial(seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index),
        )
        return self.accelerator.prepare(loader)
