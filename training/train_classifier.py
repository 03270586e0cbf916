"""Fine-tune a text classifier (VanillaTransformerForSequenceClassification) from any checkpoint, or train one anew.

--model_name_or_path may be a masked-LM checkpoint (BERT route: the bidirectional encoder, pooled), a causal-LM
checkpoint (GPT route: the causal decoder, the last real token's state) or a classifier; every transformer weight is
reused and only the classifier layer is new. Without it a new model is built from --preset on the stack --stack
names (the from-scratch baseline). Reports accuracy and macro-F1 (computed here from the confusion matrix, no
sklearn), plots the confusion matrix and writes a model card. Data: a Hub dataset (--dataset_name), local
csv/json/jsonl/parquet files (--train_file/--validation_file; columns --text_column and --label_column), or with
neither the built-in topic language (training/demo_text_data.py).

    python training/train_classifier.py --model_name_or_path out/mlm --output_dir out/clf --do_train --do_eval
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from datasets import ClassLabel, DatasetDict
from demo_text_data import labelled_topics, word_tokenizer
from run_common import (
    ModelArguments,
    NoamArguments,
    TextDataArguments,
    check_batches,
    check_metric_for_best_model,
    check_predictions_kept,
    check_text_positions,
    finish_run,
    load_text_data,
    new_model_config,
    parse_script_arguments,
    plot_training_curves,
    plt,
    required_split,
)
from run_control import RunArguments, check_output_dir, keeps_the_previous_run, train_and_choose_weights
from train_causal_lm import PaperTrainer
from train_tokenizer import train_bpe_tokenizer
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainingArguments,
)

from hf_vanilla_transformer.model_card_vanilla_transformer import write_model_card

DEMO_DATASET = "synthetic topic language, labelled by topic (built-in demo, training/demo_text_data.py)"
CONFUSION_PLOT = "confusion_matrix.png"
CLASSIFICATION_METRICS = {"loss", "accuracy", "macro_f1"}  # what `metrics_for`'s evaluation reports


@dataclass
class ClassifierDataArguments(TextDataArguments):
    label_column: str = field(default="label", metadata={"help": "Column holding the label (class name or index)."})
    demo_train_size: int = field(default=48, metadata={"help": "Labelled training sentences of the demo data."})
    demo_validation_size: int = field(default=400, metadata={"help": "Labelled validation sentences of the demo."})


@dataclass
class ClassifierModelArguments(ModelArguments):
    stack: Literal["encoder", "decoder"] = field(
        default="encoder",
        metadata={
            "help": "The stack of a new model (without --model_name_or_path): 'encoder' (bidirectional, pooled, "
            "BERT-style) or 'decoder' (causal, last token, GPT-style). A checkpoint's config decides otherwise."
        },
    )
    freeze_base_model: bool = field(
        default=False,
        metadata={
            "help": "Train only the new classifier on the frozen stack's features (feature-based transfer, as ELMo) "
            "instead of fine-tuning every weight."
        },
    )


@dataclass
class FineTuningArguments(RunArguments, NoamArguments, TrainingArguments):
    """TrainingArguments with fine-tuning defaults: a constant-after-warm-up peak rate rather than the Noam schedule."""

    noam_schedule: bool = field(default=False, metadata={"help": "Use the paper's Noam schedule instead (§5.3)."})
    learning_rate: float = field(
        default=3e-4, metadata={"help": "Peak learning rate (Noam scale with --noam_schedule)."}
    )
    warmup_steps: float = field(default=0, metadata={"help": "Warm-up steps (a float < 1: a share of all steps)."})
    lr_scheduler_type: str = field(default="constant_with_warmup", metadata={"help": "Schedule after the warm-up."})


def freeze_base_model(model: PreTrainedModel) -> None:
    """Feature-based transfer: the pretrained stack (`model.base_model`, embeddings included) stops learning, so only
    the task's output layer trains on its features; its weights leave training bit for bit as they came."""
    for parameter in model.base_model.parameters():
        parameter.requires_grad_(False)


def label_names(data: DatasetDict, label_column: str) -> list[str]:
    """The class names: a ClassLabel's, else the sorted distinct values of the training labels."""
    split = data["train"] if "train" in data else next(iter(data.values()))
    if label_column not in split.column_names:
        raise ValueError(f"--label_column {label_column!r} is not in the data; it has {split.column_names}.")
    feature = split.features[label_column]
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
    else:
        names = [str(value) for value in sorted(set(split[label_column]))]
    if len(names) < 2:  # one label would make transformers' loss a regression on class ids, which fails at step 1
        raise ValueError(f"--label_column {label_column!r} holds the labels {names}: a classifier needs two or more.")
    return names


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_labels: int) -> np.ndarray:
    """counts[true, predicted]."""
    counts = np.zeros((num_labels, num_labels), dtype=np.int64)
    np.add.at(counts, (labels, predictions), 1)
    return counts


def classification_metrics(counts: np.ndarray) -> dict[str, float]:
    """Accuracy and macro-F1 (the unweighted mean over classes of 2PR/(P+R); 0 for a class never predicted nor
    present) from a confusion matrix."""
    true_positives = np.diag(counts).astype(float)
    predicted, actual = counts.sum(axis=0), counts.sum(axis=1)
    denominators = predicted + actual
    f1 = np.divide(2 * true_positives, denominators, out=np.zeros_like(true_positives), where=denominators > 0)
    return {"accuracy": float(true_positives.sum() / max(counts.sum(), 1)), "macro_f1": float(f1.mean())}


def metrics_for(num_labels: int):
    def compute_metrics(prediction: EvalPrediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return classification_metrics(confusion_matrix(prediction.label_ids, logits.argmax(-1), num_labels))

    return compute_metrics


def plot_confusion_matrix(counts: np.ndarray, names: list[str], path: Path) -> Path:
    figure, axis = plt.subplots(figsize=(1.2 * len(names) + 2, 1.2 * len(names) + 1.5))
    axis.imshow(counts, cmap="Blues")
    axis.set_xticks(range(len(names)), names, rotation=45, ha="right")
    axis.set_yticks(range(len(names)), names)
    axis.set_xlabel("predicted")
    axis.set_ylabel("true")
    for (row, column), count in np.ndenumerate(counts):
        color = "white" if count > counts.max() / 2 else "black"
        axis.text(column, row, str(count), ha="center", va="center", color=color)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def validation_confusion_matrix(trainer, validation, names: list[str], metrics: dict[str, float]) -> str:
    """Predicts the validation split into `metrics` and plots its confusion matrix beside the model (main process);
    returns the model card's paragraph that shows the plot."""
    prediction = trainer.predict(validation, metric_key_prefix="eval")
    metrics.update(prediction.metrics)
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    counts = confusion_matrix(prediction.label_ids, logits.argmax(-1), len(names))
    if trainer.is_world_process_zero():
        plot_confusion_matrix(counts, names, Path(trainer.args.output_dir) / CONFUSION_PLOT)
    return f"\n\nConfusion matrix on the validation set:\n\n![Confusion matrix]({CONFUSION_PLOT})"


def classifier_tokenizer(
    model_args: ModelArguments, data_args: ClassifierDataArguments, data: DatasetDict
) -> PreTrainedTokenizerBase:
    """The checkpoint's (or --tokenizer_name's) tokenizer, else the demo's word-level one on the demo data, else a
    BPE tokenizer trained on the training texts."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if source is not None:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    if not (data_args.dataset_name or data_args.train_file):
        return word_tokenizer()
    texts = (text for batch in data["train"].iter(batch_size=1000) for text in batch[data_args.text_column])
    return train_bpe_tokenizer(texts, model_args.tokenizer_vocab_size)


@keeps_the_previous_run
def main(argv: list[str] | None = None) -> dict[str, float]:
    arguments = parse_script_arguments(
        (ClassifierModelArguments, ClassifierDataArguments, FineTuningArguments), argv, is_encoder_decoder=False
    )
    model_args, data_args, training_args = arguments
    folder = check_output_dir(arguments)

    data, dataset_label = load_text_data(data_args, labelled_topics, DEMO_DATASET)
    names = label_names(data, data_args.label_column)
    label_ids = {name: i for i, name in enumerate(names)}
    tokenizer = classifier_tokenizer(model_args, data_args, data)
    labels = dict(num_labels=len(names), id2label=dict(enumerate(names)), label2id=label_ids)
    if model_args.model_name_or_path:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code, **labels
        )
    else:
        stack = dict(is_encoder_decoder=False, is_decoder=model_args.stack == "decoder")
        model = AutoModelForSequenceClassification.from_config(
            new_model_config(model_args, tokenizer, **stack, **labels)
        )
    if model_args.freeze_base_model:
        freeze_base_model(model)

    is_class_label = isinstance(
        data["train" if "train" in data else "validation"].features[data_args.label_column], ClassLabel
    )

    def tokenize(batch):
        encoded = tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_seq_length)
        values = batch[data_args.label_column]
        encoded["labels"] = values if is_class_label else [label_ids[str(value)] for value in values]
        return encoded

    splits = {}
    for split, flag in [("train", "--do_train"), ("validation", "--do_eval")]:
        if getattr(training_args, flag[2:]):
            part = required_split(data, split, flag)
            splits[split] = part.map(tokenize, batched=True, remove_columns=part.column_names)
    check_batches(splits, training_args)
    check_text_positions(model.config, splits)
    check_metric_for_best_model(training_args, CLASSIFICATION_METRICS)
    check_predictions_kept(training_args)

    trainer = PaperTrainer(
        model=model,
        args=training_args,
        run_folder=folder,  # prepared when training begins, after every check
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        compute_metrics=metrics_for(len(names)),
    )
    metrics = train_and_choose_weights(trainer, trainer.evaluate)
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: the log history, i.e. the learning curve
    output_dir = Path(training_args.output_dir)
    description = "Fine-tuned with `training/train_classifier.py` of hf_vanilla_transformer"
    description += f" from `{model_args.model_name_or_path}`" if model_args.model_name_or_path else " from scratch"
    description += ", the stack frozen (only the classifier trained)." if model_args.freeze_base_model else "."
    if training_args.do_eval:
        description += validation_confusion_matrix(trainer, splits["validation"], names, metrics)
    trainer.log_metrics("all", metrics)
    if trainer.is_world_process_zero():
        plot = plot_training_curves(trainer.state.log_history, output_dir / "training_curves.png")
        results = {name: metrics[name] for name in ("eval_accuracy", "eval_macro_f1", "eval_loss") if name in metrics}
        recipe = {
            "init": model_args.model_name_or_path or f"new {model_args.stack} ({model_args.preset})",
            "frozen_base_model": model_args.freeze_base_model,
            "learning_rate": training_args.learning_rate,
            "steps": trainer.state.global_step,
            "batch_size": training_args.per_device_train_batch_size,
        }
        write_model_card(
            model,
            output_dir,
            results=results,
            dataset=dataset_label,
            plot_path=plot,
            training_args=recipe,
            description=description,
        )
    finish_run(trainer)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
