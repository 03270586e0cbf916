"""Train an image classifier (VanillaTransformerForImageClassification, ViT on the encoder), or fine-tune one, in the
style of transformers' examples/pytorch/image-classification/run_image_classification.py.

Data: a Hub dataset (--dataset_name, columns --image_column_name and --label_column_name), local image folders with
one sub-folder per class (--train_dir / --validation_dir, read by `datasets`' imagefolder), or with neither the
built-in demo: scikit-learn's handwritten digits (training/demo_image_data.py). Without a validation split, a share
of the training images is held out (--train_val_split).

Model: --model_name_or_path is any checkpoint `AutoModelForImageClassification` loads (one of ours, a converted ViT,
or transformers' own ViT; --ignore_mismatched_sizes for another number of classes), with its image processor; without
it a new model is built from the demo's small ViT-style config and --config_overrides (set image_size and patch_size
for your images), with transformers' ViT image processor at that size. --freeze_base_model trains only the new
classifier on the frozen encoder's features (feature-based transfer) instead of fine-tuning everything.

Images go through the image processor once (`datasets.map`, cached as any map); each training batch is then augmented
on the fly (random rotation, scale and shift of the processed tensors; horizontal flips on request: digits must not be
mirrored). Reports accuracy and macro-F1, plots the confusion matrix and writes a model card; the image processor is
saved beside the model, so `pipeline("image-classification", model=output_dir, trust_remote_code=True)` runs it.
A run's folder and final weights (resuming, --overwrite_output_dir, --average_last_checkpoints):
training/run_control.py.

    python training/train_image_classifier.py --output_dir out/digits --do_train --do_eval
"""

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Array3D, ClassLabel, DatasetDict, Features, Value, load_dataset
from demo_image_data import DIGITS_DATASET, digits_dataset
from run_common import (
    check_batches,
    check_metric_for_best_model,
    check_predictions_kept,
    config_errors_named,
    finish_run,
    parse_config_overrides,
    parse_script_arguments,
    plot_training_curves,
    pretrained_model_kwargs,
    refuse_training_split_as_validation,
)
from run_control import check_output_dir, keeps_the_previous_run, train_and_choose_weights
from train_causal_lm import PaperTrainer
from train_classifier import (
    CLASSIFICATION_METRICS,
    FineTuningArguments,
    freeze_base_model,
    label_names,
    metrics_for,
    validation_confusion_matrix,
)
from transformers import AutoImageProcessor, AutoModelForImageClassification, ViTImageProcessorPil

from hf_vanilla_transformer import image_classification_config
from hf_vanilla_transformer.model_card_vanilla_transformer import write_model_card

# A new model: ViT's choices (pre-norm, GELU) at a size that learns the 8x8 digits in about a minute on a CPU core,
# 16 patches of 2x2 pixels; --config_overrides changes any field.
DEMO_IMAGE_MODEL = dict(
    d_model=64,
    encoder_layers=4,
    encoder_attention_heads=4,
    encoder_ffn_dim=128,
    dropout=0.1,
    norm_position="pre",
    ffn_type="gelu",
    image_size=8,
    patch_size=2,
)


@dataclass
class ImageModelArguments:
    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A saved image classifier (directory or Hub id) to fine-tune instead of a new model."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "key=value pairs for the config of a new model, e.g. 'image_size=32,patch_size=4,"
            f"classifier_pooling=first'; the defaults are {DEMO_IMAGE_MODEL}."
        },
    )
    image_processor_name: str | None = field(
        default=None, metadata={"help": "An image processor (directory or Hub id); default: the checkpoint's."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow code from the Hub when loading --model_name_or_path or a dataset."}
    )
    ignore_mismatched_sizes: bool = field(
        default=False, metadata={"help": "Load a checkpoint with another number of classes (a new classifier)."}
    )
    freeze_base_model: bool = field(
        default=False,
        metadata={"help": "Train only the classifier on the frozen encoder's features (feature-based transfer)."},
    )
    tp_size: int = field(
        default=1,
        metadata={"help": "Shard --model_name_or_path over this many tensor-parallel ranks at load time (torchrun)."},
    )


@dataclass
class ImageDataArguments:
    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. cifar10 (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    train_dir: str | None = field(
        default=None, metadata={"help": "A folder of training images, one sub-folder per class."}
    )
    validation_dir: str | None = field(default=None, metadata={"help": "A folder of validation images, same layout."})
    validation_split: str = field(
        default="validation", metadata={"help": "The split to evaluate on (e.g. 'test' for Hub datasets without one)."}
    )
    train_val_split: float = field(
        default=0.15, metadata={"help": "Share of the training images held out when there is no validation split."}
    )
    image_column_name: str = field(default="image", metadata={"help": "Column holding the images."})
    label_column_name: str = field(default="label", metadata={"help": "Column holding the labels."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only this many validation images."})
    rotation_degrees: float = field(default=10.0, metadata={"help": "Augmentation: rotate by up to this many degrees."})
    scale_jitter: float = field(default=0.1, metadata={"help": "Augmentation: zoom by a factor in [1 - s, 1 + s]."})
    translate: float = field(default=0.1, metadata={"help": "Augmentation: shift by up to this share of the image."})
    horizontal_flip: bool = field(default=False, metadata={"help": "Augmentation: mirror half the images."})

    def __post_init__(self):
        refuse_training_split_as_validation(self.validation_split)


def load_image_data(data_args: ImageDataArguments, seed: int) -> tuple[DatasetDict, str]:
    """(train/validation DatasetDict, what to call the data in the model card), each split cut to --max_*_samples."""
    if data_args.dataset_name:
        raw, label = load_dataset(data_args.dataset_name, data_args.dataset_config_name), data_args.dataset_name
    elif data_args.train_dir or data_args.validation_dir:
        folders = {"train": data_args.train_dir, "validation": data_args.validation_dir}
        files = {split: str(Path(folder) / "**") for split, folder in folders.items() if folder}
        raw, label = load_dataset("imagefolder", data_files=files), "local image folders"
    else:
        raw, label = digits_dataset(), DIGITS_DATASET
    splits = {name: raw[name] for name in ("train",) if name in raw}
    if data_args.validation_split in raw:
        splits["validation"] = raw[data_args.validation_split]
    elif "train" in splits and data_args.train_val_split > 0:
        held_out = splits["train"].train_test_split(data_args.train_val_split, seed=seed)
        splits = {"train": held_out["train"], "validation": held_out["test"]}
    for name, limit in [("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)]:
        if limit and name in splits:
            splits[name] = splits[name].select(range(min(limit, len(splits[name]))))
    for split in splits.values():
        if data_args.image_column_name not in split.column_names:
            raise ValueError(
                f"--image_column_name {data_args.image_column_name!r} is not in the data; it has {split.column_names}."
            )
    return DatasetDict(splits), label


def random_affine(
    pixel_values: torch.Tensor, degrees: float, scale_jitter: float, translate: float, horizontal_flip: bool
) -> torch.Tensor:
    """Each image of a (batch, channels, height, width) batch rotated, zoomed and shifted at random (and mirrored with
    probability 1/2 if asked), resampled bilinearly; pixels that come from outside repeat the border."""
    batch = pixel_values.shape[0]
    angle = torch.empty(batch).uniform_(-degrees, degrees) * math.pi / 180
    zoom = torch.empty(batch).uniform_(1 - scale_jitter, 1 + scale_jitter)
    shift = torch.empty(batch, 2).uniform_(-2 * translate, 2 * translate)  # the grid spans [-1, 1]: width 2
    mirror = torch.where(torch.rand(batch) < 0.5, -1.0, 1.0) if horizontal_flip else torch.ones(batch)
    # affine_grid maps output coordinates to input ones: the inverse zoom, the rotation, then the shift.
    cos, sin = angle.cos() / zoom, angle.sin() / zoom
    theta = torch.stack(
        (torch.stack((cos * mirror, -sin, shift[:, 0]), dim=1), torch.stack((sin * mirror, cos, shift[:, 1]), dim=1)),
        dim=1,
    )
    grid = torch.nn.functional.affine_grid(theta, list(pixel_values.shape), align_corners=False)
    return torch.nn.functional.grid_sample(pixel_values, grid, padding_mode="border", align_corners=False)


def new_image_model(model_args: ImageModelArguments, labels: dict):
    overrides = {**DEMO_IMAGE_MODEL, **parse_config_overrides(model_args.config_overrides)}
    with config_errors_named("--config_overrides"):
        config = image_classification_config(**overrides, **labels)
    return AutoModelForImageClassification.from_config(config)


def image_processor_for(model_args: ImageModelArguments, config):
    """The checkpoint's (or --image_processor_name's) processor, else transformers' ViT processor at the config's
    image size (scaling to [0, 1], then normalising with mean and std 0.5)."""
    source = model_args.image_processor_name or model_args.model_name_or_path
    if source is not None:
        return AutoImageProcessor.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    height, width = (config.image_size,) * 2 if isinstance(config.image_size, int) else config.image_size
    return ViTImageProcessorPil(size={"height": height, "width": width})


def check_image_shape(config, shape: tuple[int, ...]) -> None:
    """The processed images are what the model takes, (num_channels, height, width) of its config, checked on the
    first one, before a training step would fail on them."""
    if getattr(config, "image_size", None) is None:
        return
    size = config.image_size
    expected = (config.num_channels, *((size, size) if isinstance(size, int) else size))
    if tuple(shape) != expected:
        raise ValueError(
            f"The image processor makes images of shape {tuple(shape)}; the model takes {expected} (num_channels, "
            "image_size): give --image_processor_name of the model's size, or --config_overrides image_size=... for "
            "a new model."
        )


def collate(examples: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.stack([example["labels"] for example in examples]),
    }


@dataclass
class AugmentingCollator:
    """`collate`, then `random_affine` on the batch with the data arguments' settings."""

    data_args: ImageDataArguments

    def __call__(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        batch = collate(examples)
        args = self.data_args
        batch["pixel_values"] = random_affine(
            batch["pixel_values"], args.rotation_degrees, args.scale_jitter, args.translate, args.horizontal_flip
        )
        return batch


class ImageTrainer(PaperTrainer):
    """A Trainer that augments the training batches only (it has one data collator for every split)."""

    def __init__(self, *args, train_collator: AugmentingCollator, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_collator = train_collator

    def get_train_dataloader(self):
        evaluation_collator, self.data_collator = self.data_collator, self.train_collator
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = evaluation_collator


@keeps_the_previous_run
def main(argv: list[str] | None = None) -> dict[str, float]:
    arguments = parse_script_arguments((ImageModelArguments, ImageDataArguments, FineTuningArguments), argv)
    model_args, data_args, training_args = arguments
    folder = check_output_dir(arguments)
    data, dataset_label = load_image_data(data_args, training_args.seed)
    names = label_names(data, data_args.label_column_name)
    label_ids = {name: i for i, name in enumerate(names)}
    labels = dict(num_labels=len(names), id2label=dict(enumerate(names)), label2id=label_ids)
    if model_args.model_name_or_path:
        model = AutoModelForImageClassification.from_pretrained(
            model_args.model_name_or_path,
            ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
            **pretrained_model_kwargs(model_args),
            **labels,
        )
    else:
        model = new_image_model(model_args, labels)
    if model_args.freeze_base_model:
        freeze_base_model(model)
    image_processor = image_processor_for(model_args, model.config)
    is_class_label = isinstance(next(iter(data.values())).features[data_args.label_column_name], ClassLabel)

    def preprocess(batch: dict) -> dict:
        images = [image.convert("RGB") for image in batch[data_args.image_column_name]]
        values = batch[data_args.label_column_name]
        ids = values if is_class_label else [label_ids[str(value)] for value in values]
        return {"pixel_values": image_processor(images, return_tensors="np").pixel_values, "labels": ids}

    def processed(split: str):
        """The split as (pixel_values, labels) tensors, stored with their fixed shape (read back as one array)."""
        part = data[split]
        shape = preprocess(part[:1])["pixel_values"].shape[1:]
        check_image_shape(model.config, shape)
        features = Features({"pixel_values": Array3D(shape=shape, dtype="float32"), "labels": Value("int64")})
        part = part.map(preprocess, batched=True, remove_columns=part.column_names, features=features)
        return part.with_format("torch")

    splits = {}
    for split, flag in [("train", "--do_train"), ("validation", "--do_eval")]:
        if getattr(training_args, flag[2:]):
            if split not in data:
                raise ValueError(f"{flag} needs a {split} split; the data has {list(data)}.")
            splits[split] = processed(split)
    check_batches(splits, training_args)
    check_metric_for_best_model(training_args, CLASSIFICATION_METRICS)
    check_predictions_kept(training_args)

    trainer = ImageTrainer(
        model=model,
        args=training_args,
        run_folder=folder,  # prepared when training begins, after every check
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        processing_class=image_processor,  # saved beside the model, for AutoImageProcessor and the pipeline
        data_collator=collate,
        train_collator=AugmentingCollator(data_args),
        compute_metrics=metrics_for(len(names)),
    )
    metrics = train_and_choose_weights(trainer, trainer.evaluate)
    trainer.save_model()
    trainer.save_state()
    output_dir = Path(training_args.output_dir)
    source = f"`{model_args.model_name_or_path}`" if model_args.model_name_or_path else "scratch"
    description = f"Trained with `training/train_image_classifier.py` of hf_vanilla_transformer from {source}"
    description += ", the encoder frozen (only the classifier trained)." if model_args.freeze_base_model else "."
    if training_args.do_eval:
        description += validation_confusion_matrix(trainer, splits["validation"], names, metrics)
    trainer.log_metrics("all", metrics)
    # Any checkpoint trains here (transformers' ViT too, for comparisons); the card describes this package's models.
    if trainer.is_world_process_zero() and model.config.model_type == "vanilla_transformer":
        recipe = {
            "init": model_args.model_name_or_path or "new",
            "frozen_base_model": model_args.freeze_base_model,
            "learning_rate": training_args.learning_rate,
            "steps": trainer.state.global_step,
            "batch_size": training_args.per_device_train_batch_size,
            "augmentation": f"rotation {data_args.rotation_degrees} deg, zoom {data_args.scale_jitter}, shift "
            f"{data_args.translate}, flips {data_args.horizontal_flip}",
        }
        write_model_card(
            model,
            output_dir,
            results={
                name: metrics[name] for name in ("eval_accuracy", "eval_macro_f1", "eval_loss") if name in metrics
            },
            dataset=dataset_label,
            plot_path=plot_training_curves(trainer.state.log_history, output_dir / "training_curves.png"),
            training_args=recipe,
            description=description,
        )
    finish_run(trainer)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
