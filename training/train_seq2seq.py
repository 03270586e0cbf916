"""Train or fine-tune the Transformer for translation (or any text-to-text task) with the paper's recipe.

Defaults follow Vaswani et al. 2017: label smoothing 0.1 (§5.4), Adam(0.9, 0.98, 1e-9) with the Noam schedule and
4000 warm-up steps (§5.3), and evaluation with beam 4, the GNMT length penalty alpha = 0.6 and a maximum output length
of input length + 50 (§6.1), scored with BLEU and chrF (sacrebleu).

Data: a Hub dataset (--dataset_name), local files (--train_file/--validation_file/--test_file), or, with neither, the
built-in English -> German number-sentence demo (training/demo_data.py). A run's folder, time budget and final
weights (resuming, --overwrite_output_dir, --max_train_minutes, --average_last_checkpoints): training/run_control.py.
Examples:

    python training/train_seq2seq.py --output_dir out/demo --preset demo-small --do_train --do_eval \
        --max_steps 600 --warmup_steps 200 --per_device_train_batch_size 64
    bash training/recipes/multi30k.sh ../shared/data/multi30k out/multi30k   # a time budget, then averaging
    python training/train_seq2seq.py ... --max_tokens 4096 --pad_to_multiple_of 256 --torch_compile  # few shapes
    python training/train_seq2seq.py --output_dir out/wmt --dataset_name wmt14 --dataset_config_name de-en \\
        --source_lang en --target_lang de --tokenizer_vocab_size 37000 --do_train --do_eval --max_steps 100000
    accelerate launch --config_file training/accelerate_configs/ddp.yaml training/train_seq2seq.py ...
    accelerate launch --config_file training/accelerate_configs/fsdp.yaml --num_processes 2 --mixed_precision no \\
        training/train_seq2seq.py ...   # FSDP2; on a machine without a GPU, on CPU processes (gloo)
"""

import logging
import sys
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import sacrebleu
import tokenizers
import transformers
from datasets import DatasetDict, concatenate_datasets, load_dataset
from demo_data import number_translation_dataset
from run_common import (
    FsdpTrainerMixin,
    ModelArguments,
    ModelLossMixin,
    NoamArguments,
    NoamTrainerMixin,
    check_batches,
    check_metric_for_best_model,
    check_positions,
    finish_run,
    load_local_files,
    longest,
    new_model_config,
    parse_script_arguments,
    pretrained_model_kwargs,
    round_up,
    save_run,
    schedule_description,
)
from run_control import RunArguments, RunTrainerMixin, check_output_dir, keeps_the_previous_run, train_and_evaluate
from train_tokenizer import train_bpe_tokenizer
from training_batches import BatchingArguments, TrainingBatchesMixin, sequence_slots, token_budget_sampler
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)

from hf_vanilla_transformer import preferred_layout, seq2seq_training_collator  # also registers the Auto classes
from hf_vanilla_transformer.collators_vanilla_transformer import PADDED_MULTIPLE_OF

logger = logging.getLogger(__name__)
DEMO_DATASET = "num2words-en-de (built-in demo, training/demo_data.py)"
EVALUATION_MULTIPLE = 8  # the evaluation collator pads a batch's sources and targets to a multiple of this
TRANSLATION_METRICS = {"bleu", "bleu_lowercase", "chrf", "exact_match"}  # what `translation_metrics` reports


@dataclass
class DataArguments:
    """Where the sentence pairs come from and how they are cut."""

    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. wmt14 (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config, e.g. de-en."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data: json/jsonl/csv/tsv/parquet."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation data, same format."})
    test_file: str | None = field(
        default=None,
        metadata={"help": "Test data for --do_predict, same format: scored once, after training and every choice."},
    )
    source_column: str | None = field(
        default=None, metadata={"help": "Column with source texts. Default: a `translation` dict column."}
    )
    target_column: str | None = field(default=None, metadata={"help": "Column with target texts."})
    source_lang: str = field(default="en", metadata={"help": "Source key in the `translation` dicts."})
    target_lang: str = field(default="de", metadata={"help": "Target key in the `translation` dicts."})
    max_source_length: int = field(default=256, metadata={"help": "Longer source sequences are truncated (tokens)."})
    max_target_length: int = field(default=256, metadata={"help": "Longer target sequences are truncated (tokens)."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only this many validation examples."})
    demo_train_size: int = field(default=20000, metadata={"help": "Training pairs generated for the demo dataset."})
    demo_validation_size: int = field(default=500, metadata={"help": "Validation pairs generated for the demo."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})
    bpe_dropout: float = field(
        default=0.0,
        metadata={
            "help": "BPE-dropout (Provilkov et al. 2020) on the training pairs: each merge is skipped with this "
            "probability, so the model learns from several segmentations of every sentence. Validation, test and "
            "the saved tokenizer segment as usual. 0: off."
        },
    )
    bpe_dropout_segmentations: int = field(
        default=10,
        metadata={
            "help": "With --bpe_dropout: how many segmentations of the training set are drawn before training. The "
            "training set is that many times as long (an epoch in the logs is that many passes over the pairs)."
        },
    )

    def __post_init__(self):
        if not 0 <= self.bpe_dropout < 1:
            raise ValueError(f"--bpe_dropout is a probability in [0, 1), got {self.bpe_dropout}.")
        if self.bpe_dropout_segmentations < 1:
            raise ValueError(f"--bpe_dropout_segmentations must be 1 or more, got {self.bpe_dropout_segmentations}.")


@dataclass
class PaperSeq2SeqTrainingArguments(BatchingArguments, RunArguments, NoamArguments, Seq2SeqTrainingArguments):
    """Seq2SeqTrainingArguments with the paper's training and decoding recipe as defaults."""

    label_smoothing_factor: float = field(default=0.1, metadata={"help": "Label smoothing (paper §5.4: 0.1)."})
    predict_with_generate: bool = field(
        default=True, metadata={"help": "Evaluate by decoding (BLEU, chrF), not only by loss."}
    )
    generation_num_beams: int | None = field(default=4, metadata={"help": "Beam size for evaluation (paper: 4)."})
    gnmt_alpha: float = field(
        default=0.6, metadata={"help": "Alpha of the GNMT length penalty ((5+|Y|)/6)^alpha in beam search (§6.1: 0.6)."}
    )
    max_new_tokens_over_source: int = field(
        default=50,
        metadata={
            "help": "Evaluation decodes at most (source length + this) tokens (paper §6.1: 50). "
            "--generation_max_length, when given, wins."
        },
    )

    def __post_init__(self):
        if self.sortish_sampler:  # transformers' Seq2SeqTrainer reads it no more
            raise ValueError(
                "--sortish_sampler does nothing in transformers' Seq2SeqTrainer: for batches of similar lengths pass "
                "--max_tokens (batches by token budget) or --group_by_length."
            )
        super().__post_init__()


class PaperSeq2SeqTrainer(
    RunTrainerMixin, NoamTrainerMixin, ModelLossMixin, TrainingBatchesMixin, FsdpTrainerMixin, Seq2SeqTrainer
):
    """Seq2SeqTrainer with the Noam schedule, training batches in the device's layout (by token budget with
    --max_tokens) and the paper's source-relative output length limit."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        if not gen_kwargs and getattr(self, "_gen_kwargs", None):
            gen_kwargs = self._gen_kwargs.copy()
        if gen_kwargs.get("max_length") is None:
            # tensor2tensor's decode_length: the (padded) source length of the batch + 50, after the start token.
            gen_kwargs["max_length"] = 1 + inputs["input_ids"].shape[1] + self.args.max_new_tokens_over_source
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)


def load_raw_datasets(data_args: DataArguments) -> tuple[DatasetDict, str]:
    """The raw splits and the dataset's name for the model card."""
    if data_args.dataset_name:
        return load_dataset(data_args.dataset_name, data_args.dataset_config_name), data_args.dataset_name
    if data_args.train_file or data_args.validation_file:
        files = load_local_files(data_args.train_file, data_args.validation_file, data_args.test_file)
        return files, f"local files ({Path(data_args.train_file or data_args.validation_file).parent.name})"
    demo = number_translation_dataset(data_args.demo_train_size, data_args.demo_validation_size)
    return demo, DEMO_DATASET


def source_target_columns(data_args: DataArguments, raw: DatasetDict) -> tuple[str, str] | None:
    """The (source, target) columns, or None for a `translation` dict column. Missing columns or languages raise
    ValueError naming the flag, checked on every split (its first example) before any tokenizer is trained."""
    if data_args.source_column or data_args.target_column:
        wanted = {"--source_column": data_args.source_column, "--target_column": data_args.target_column}
        for split, data in raw.items():
            for flag, name in wanted.items():
                if name not in data.column_names:
                    raise ValueError(f"{flag} {name!r} is not a column of the {split} data ({data.column_names}).")
        return data_args.source_column, data_args.target_column
    wanted = {"--source_lang": data_args.source_lang, "--target_lang": data_args.target_lang}
    for split, data in raw.items():
        if "translation" not in data.column_names:
            raise ValueError(
                f"The {split} data has no `translation` column ({data.column_names}): pass --source_column and "
                "--target_column."
            )
        languages = sorted(data[0]["translation"]) if len(data) else []
        for flag, language in wanted.items():
            if language not in languages:
                raise ValueError(
                    f"{flag} {language!r} is not a language of the {split} data's `translation` {languages}."
                )
    return None


def pair_texts(batch: dict, columns: tuple[str, str] | None, data_args: DataArguments) -> tuple[list, list]:
    if columns is not None:
        return batch[columns[0]], batch[columns[1]]
    pairs = batch["translation"]
    return [p[data_args.source_lang] for p in pairs], [p[data_args.target_lang] for p in pairs]


def load_tokenizer(model_args: ModelArguments, training_args, raw: DatasetDict, texts_of) -> transformers.AutoTokenizer:
    """--tokenizer_name, else the fine-tuned model's, else the checkpoint being resumed, else a new shared BPE."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if source is None and isinstance(training_args.resume_from_checkpoint, str):
        source = training_args.resume_from_checkpoint
    if source is not None:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    logger.info("Training a %d-token shared BPE tokenizer on the training data", model_args.tokenizer_vocab_size)
    return train_bpe_tokenizer(texts_of(raw["train"]), model_args.tokenizer_vocab_size)


def bpe_dropout_tokenizer(tokenizer, probability: float):
    """A copy of `tokenizer` whose BPE skips each merge with `probability` (BPE-dropout); the original is untouched."""
    backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
    if backend is None or not isinstance(backend.model, tokenizers.models.BPE):
        kind = type(backend.model if backend else tokenizer).__name__
        raise ValueError(f"--bpe_dropout needs a fast BPE tokenizer; this one is a {kind}.")
    copy = deepcopy(tokenizer)
    copy.backend_tokenizer.model.dropout = probability
    return copy


def decode(tokenizer, token_ids: np.ndarray) -> list[str]:
    token_ids = np.where(token_ids < 0, tokenizer.pad_token_id, token_ids)  # -100: the label padding
    return [text.strip() for text in tokenizer.batch_decode(token_ids, skip_special_tokens=True)]


def translation_metrics(tokenizer):
    """compute_metrics for Seq2SeqTrainer: sacreBLEU (cased, its default; and lowercased, as the multimodal
    translation shared tasks report Multi30k), chrF, and the percentage of outputs equal to their reference.
    `evaluate.load("sacrebleu")` fetches its metric script from the Hub and fails offline, so sacrebleu (which that
    script wraps) is called directly; the scores are the same."""

    def compute_metrics(eval_prediction) -> dict[str, float]:
        hypotheses, references = decode(tokenizer, eval_prediction[0]), decode(tokenizer, eval_prediction[1])
        return {
            "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
            "bleu_lowercase": sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True).score,
            "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
            "exact_match": 100 * float(np.mean([h == r for h, r in zip(hypotheses, references)])),
        }

    return compute_metrics


def positions_needed(splits: dict, training_args, flattened: bool) -> dict[str, int]:
    """What the data asks of the model's positions: each split's longest source and target as batched (a padded
    batch is as long as a multiple of its collator's: training's --pad_to_multiple_of or 8, evaluation's 8; a
    flattened one counts each sequence from 0), and where evaluation decodes, the decoder's last position
    (`PaperSeq2SeqTrainer.prediction_step`'s max_length less one: the last token is generated, not read)."""
    needs = {}
    for split, data in splits.items():
        multiple = EVALUATION_MULTIPLE
        if split == "train":
            multiple = 1 if flattened else training_args.pad_to_multiple_of or PADDED_MULTIPLE_OF
        source, target = round_up(longest(data), multiple), round_up(longest(data, "labels"), multiple)
        needs[f"The {split} split's longest source, batched,"] = source
        needs[f"The {split} split's longest target, batched,"] = target
        if split != "train" and training_args.predict_with_generate:
            max_length = training_args.generation_max_length or 1 + source + training_args.max_new_tokens_over_source
            needs[f"Decoding the {split} split up to max_length {max_length}"] = max_length - 1
    return needs


def check_model_against_the_data(training_args, model, splits: dict, flattened: bool) -> None:
    """What training, evaluation and decoding will ask of the model, checked on the prepared data before training:
    the positions they need, and the metric that chooses weights among those evaluation reports."""
    check_positions(
        model.config,
        lambda: positions_needed(splits, training_args, flattened),
        "lower --max_source_length/--max_target_length (or --max_new_tokens_over_source, --generation_max_length), "
        "or give the model more positions",
    )
    decodes = training_args.predict_with_generate and not training_args.prediction_loss_only
    reported = {"loss"} | (TRANSLATION_METRICS if decodes else set())
    check_metric_for_best_model(training_args, reported)


@keeps_the_previous_run
def main(argv: list[str] | None = None) -> dict[str, float]:
    arguments = parse_script_arguments((ModelArguments, DataArguments, PaperSeq2SeqTrainingArguments), argv)
    model_args, data_args, training_args = arguments
    folder = check_output_dir(arguments)

    raw, dataset_label = load_raw_datasets(data_args)
    columns = source_target_columns(data_args, raw)

    def texts_of(split):  # source and target text together: the BPE vocabulary is shared (§5.1)
        for batch in split.iter(batch_size=1000):
            sources, targets = pair_texts(batch, columns, data_args)
            yield from sources
            yield from targets

    tokenizer = load_tokenizer(model_args, training_args, raw, texts_of)
    if model_args.model_name_or_path:
        model = AutoModelForSeq2SeqLM.from_pretrained(
            model_args.model_name_or_path, **pretrained_model_kwargs(model_args)
        )
    else:
        model = AutoModelForSeq2SeqLM.from_config(new_model_config(model_args, tokenizer))
    # The paper's decoding becomes the saved model's default (generation_config.json), so pipelines decode alike.
    model.generation_config.update(
        num_beams=training_args.generation_num_beams or 1,
        length_penalty=training_args.gnmt_alpha,
        length_penalty_type="gnmt",
        max_length=1 + data_args.max_source_length + training_args.max_new_tokens_over_source,
        allow_custom_entries=True,
    )

    def preprocess(batch, tokenizer=tokenizer):
        sources, targets = pair_texts(batch, columns, data_args)
        features = tokenizer(sources, max_length=data_args.max_source_length, truncation=True)
        labels = tokenizer(text_target=targets, max_length=data_args.max_target_length, truncation=True)
        return features | {"labels": labels["input_ids"]}

    def tokenize(data, split, **options):
        return data.map(
            preprocess,
            batched=True,
            remove_columns=data.column_names,
            num_proc=data_args.preprocessing_num_workers,
            desc=f"Tokenizing {split}",
            **options,
        )

    splits = {}
    for split, flag, limit in [
        ("train", "--do_train", data_args.max_train_samples),
        ("validation", "--do_eval", data_args.max_eval_samples),
        ("test", "--do_predict", None),
    ]:
        if not getattr(training_args, flag[2:]):
            continue
        if split not in raw:
            raise ValueError(f"{flag} needs a {split} split; got {list(raw)}.")
        data = raw[split].select(range(min(limit, len(raw[split])))) if limit else raw[split]
        with training_args.main_process_first(desc=f"tokenizing {split}"):
            if split == "train" and data_args.bpe_dropout:
                # Random segmentations are drawn once, before training, and kept in memory: a cached map would
                # hand every copy the same segmentation.
                dropout = {"tokenizer": bpe_dropout_tokenizer(tokenizer, data_args.bpe_dropout)}
                copies = range(data_args.bpe_dropout_segmentations)
                options = dict(fn_kwargs=dropout, keep_in_memory=True, load_from_cache_file=False)
                splits[split] = concatenate_datasets([tokenize(data, split, **options) for _ in copies])
            else:
                splits[split] = tokenize(data, split)

    # Flattened batches where they are the faster layout, padded ones elsewhere and for transformers' own models
    # (INIT_MODEL); chosen once (the collator logs the choice and why), before --max_tokens fills batches in it.
    device, half_precision = training_args.device, training_args.bf16 or training_args.fp16
    flattened = preferred_layout(model, device, half_precision) == "flattened"
    if training_args.num_sequences is not None and not flattened:
        raise ValueError(
            "--num_sequences fixes the sequence slots of flattened batches; this model trains on padded ones on "
            f"{device} (bf16/fp16: {half_precision}): drop it."
        )
    check_batches(splits, training_args)
    check_model_against_the_data(training_args, model, splits, flattened)
    sampler = token_budget_sampler(training_args, splits["train"], flattened) if "train" in splits else None
    train_collator = seq2seq_training_collator(
        model,
        tokenizer,
        device=device,
        half_precision=half_precision,
        pad_to_multiple_of=training_args.pad_to_multiple_of,
        num_sequences=sequence_slots(training_args, sampler),
    )
    trainer = PaperSeq2SeqTrainer(
        model=model,
        args=training_args,
        run_folder=folder,  # prepared when training begins, after every check
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        processing_class=tokenizer,
        # Without the model (which shifts the labels itself): the collator is pickled to data-loader workers.
        data_collator=DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=EVALUATION_MULTIPLE),
        train_data_collator=train_collator,
        train_batch_sampler=sampler,
        compute_metrics=translation_metrics(tokenizer) if training_args.predict_with_generate else None,
    )
    metrics = train_and_evaluate(trainer, lambda: trainer.evaluate(metric_key_prefix="eval"))
    if training_args.do_predict:  # the test set is decoded once, with the weights the validation set chose
        prediction = trainer.predict(splits["test"], metric_key_prefix="test")
        metrics |= prediction.metrics
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            hypotheses = decode(tokenizer, prediction.predictions)
            Path(training_args.output_dir, "test_generations.txt").write_text("\n".join(hypotheses) + "\n")
    trainer.log_metrics("all", metrics)
    recipe = {
        "preset": model_args.model_name_or_path or model_args.preset,
        "config_overrides": model_args.config_overrides,
        "label_smoothing": training_args.label_smoothing_factor,
        "optimizer": f"Adam(beta1={training_args.adam_beta1}, beta2={training_args.adam_beta2}, "
        f"eps={training_args.adam_epsilon})",
        "schedule": schedule_description(training_args),
        "steps": trainer.state.global_step,
        "training minutes": round(trainer.run_tracker.elapsed_seconds() / 60, 1),
        "batch size per device": f"{training_args.max_tokens} tokens"
        if training_args.max_tokens
        else training_args.per_device_train_batch_size,
        "bf16": training_args.bf16,
        "weights": f"average of the last {metrics['averaged_checkpoints']} checkpoints"
        if metrics.get("averaged_checkpoints", 1) > 1
        else "the last step's",
        "evaluation decoding": f"beam {training_args.generation_num_beams}, GNMT alpha {training_args.gnmt_alpha}, "
        f"max length source + {training_args.max_new_tokens_over_source}",
    }
    if data_args.bpe_dropout:
        recipe["BPE-dropout"] = f"{data_args.bpe_dropout}, {data_args.bpe_dropout_segmentations} segmentations"
    language = [data_args.source_lang, data_args.target_lang] if columns is None else None
    description = "Trained with `training/train_seq2seq.py` of hf_vanilla_transformer" + (
        " on the built-in English -> German number-sentence demo data." if dataset_label == DEMO_DATASET else "."
    )
    if training_args.do_predict:
        test = Path(data_args.test_file).name if data_args.test_file else "the dataset's test split"
        description += f" The results are on the test set ({test}), decoded once after the validation set chose the "
        description += (
            "weights; BLEU is sacreBLEU's default (cased, 13a tokenization), bleu_lowercase the same lowercased."
        )
    save_run(trainer, metrics, dataset_label, dict(training_args=recipe, language=language, description=description))
    finish_run(trainer)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
