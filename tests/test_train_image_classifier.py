"""training/train_image_classifier.py and its built-in digits data.

Runs are tiny (a few steps on a few dozen 8x8 images): they check that the pieces fit together (the demo split, the
augmentation's closed-form cases, image folders, the reported accuracy equal to what the saved model and the
`image-classification` pipeline predict, the processor and card beside the model), not the numbers the demo reports.

Run: python -m pytest -q tests/test_train_image_classifier.py
"""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification, HfArgumentParser, pipeline

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import demo_image_data  # noqa: E402
import train_image_classifier  # noqa: E402

TINY = ["--config_overrides", "d_model=16,encoder_layers=1,encoder_attention_heads=2,encoder_ffn_dim=32"]
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--seed", "0"]
QUIET += ["--save_strategy", "no", "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "16"]


def test_digits_are_a_fixed_stratified_split_of_real_scans():
    train_images, test_images, train_labels, test_labels = demo_image_data.digits_split()
    assert train_images.shape == (1437, 8, 8) and test_images.shape == (360, 8, 8)
    assert np.bincount(test_labels).min() >= 35  # every digit about a tenth of the test set
    data = demo_image_data.digits_dataset()
    assert data["validation"].features["label"].names == [str(digit) for digit in range(10)]
    first = data["validation"][0]
    assert first["image"].size == (8, 8) and first["label"] == test_labels[0]
    # Ink (16) is black, paper (0) white, in all three channels.
    pixels = np.asarray(first["image"])
    expected = np.round(255 * (1 - test_images[0] / 16)).astype(np.uint8)
    assert pixels.shape == (8, 8, 3) and (pixels == expected[..., None]).all()


def test_augmentation_without_changes_is_the_identity_and_a_flip_mirrors():
    pixels = torch.randn(6, 3, 8, 8)
    same = train_image_classifier.random_affine(pixels, degrees=0, scale_jitter=0, translate=0, horizontal_flip=False)
    torch.testing.assert_close(same, pixels)
    torch.manual_seed(0)
    flipped = train_image_classifier.random_affine(pixels, 0, 0, 0, horizontal_flip=True)
    mirrored = [torch.allclose(out, image.flip(-1), atol=1e-5) for out, image in zip(flipped, pixels)]
    unchanged = [torch.allclose(out, image, atol=1e-5) for out, image in zip(flipped, pixels)]
    assert all(m != u for m, u in zip(mirrored, unchanged)) and any(mirrored) and any(unchanged)
    moved = train_image_classifier.random_affine(
        pixels, degrees=10, scale_jitter=0.1, translate=0.1, horizontal_flip=False
    )
    assert moved.shape == pixels.shape and not torch.allclose(moved, pixels)


@pytest.mark.parametrize("dataclass_type", [train_image_classifier.ImageModelArguments,
                                            train_image_classifier.ImageDataArguments])  # fmt: skip
def test_every_flag_has_help(dataclass_type):
    parser = HfArgumentParser(dataclass_type)
    assert [a.dest for a in parser._actions if a.dest != "help" and not a.help] == []


def test_digits_demo_reports_what_the_saved_model_and_the_pipeline_predict(tmp_path):
    metrics = train_image_classifier.main(
        [*TINY, *QUIET, "--output_dir", str(tmp_path), "--do_train", "--do_eval", "--max_steps", "3"]
        + ["--max_train_samples", "48", "--max_eval_samples", "40"]
    )
    files = {path.name for path in tmp_path.iterdir()}
    assert {"model.safetensors", "preprocessor_config.json", "confusion_matrix.png", "README.md"} <= files
    card = (tmp_path / "README.md").read_text()
    assert "pipeline_tag: image-classification" in card and "AutoImageProcessor" in card and "macro_f1" in card

    validation = demo_image_data.digits_dataset()["validation"].select(range(40))
    model = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    with torch.no_grad():
        logits = model(processor(list(validation["image"]), return_tensors="pt").pixel_values).logits
    predicted = logits.argmax(-1)
    accuracy = (predicted == torch.tensor(validation["label"])).float().mean().item()
    assert metrics["eval_accuracy"] == pytest.approx(accuracy)
    classify = pipeline("image-classification", model=str(tmp_path), trust_remote_code=True)
    top = [result[0]["label"] for result in classify(list(validation["image"][:5]), top_k=1)]
    assert top == [model.config.id2label[int(i)] for i in predicted[:5]]


def test_image_folders_name_the_classes(tmp_path):
    rng = np.random.default_rng(0)
    for split, count in [("train", 6), ("validation", 4)]:
        for name in ("circle", "square"):
            folder = tmp_path / split / name
            folder.mkdir(parents=True)
            for index in range(count):
                Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8)).save(folder / f"{index}.png")
    output_dir = tmp_path / "out"
    metrics = train_image_classifier.main(
        [*TINY, *QUIET, "--output_dir", str(output_dir), "--do_train", "--do_eval", "--max_steps", "2"]
        + ["--train_dir", str(tmp_path / "train"), "--validation_dir", str(tmp_path / "validation")]
    )
    model = AutoModelForImageClassification.from_pretrained(output_dir)
    assert model.config.id2label == {0: "circle", 1: "square"} and 0 <= metrics["eval_accuracy"] <= 1
    assert AutoImageProcessor.from_pretrained(output_dir).size == {"height": 8, "width": 8}  # resized to the model
