"""Built-in image data: scikit-learn's handwritten digits (UCI "Optical Recognition of Handwritten Digits"), 1,797
real 8 x 8 grey-level scans of the digits 0-9 that ship with scikit-learn: no download needed.

One fixed stratified split, 80 % train / 20 % test (360 images), shared by the training script's demo and the
benchmark's classical reference, so that every number on it is measured on the same test images.
"""

import functools

import numpy as np
from datasets import ClassLabel, Dataset, DatasetDict, Features, Image
from PIL import Image as PILImage
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

DIGITS_DATASET = "scikit-learn digits (1,797 8x8 grey-level scans; built-in demo, training/demo_image_data.py)"
TEST_SHARE = 0.2
MAX_GREY_LEVEL = 16  # the scans count 0..16 dark pixels per 4x4 block of the original 32x32 bitmap


@functools.cache
def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, test images, train labels, test labels): images (n, 8, 8) with values 0..16."""
    digits = load_digits()
    return tuple(
        train_test_split(digits.images, digits.target, test_size=TEST_SHARE, random_state=0, stratify=digits.target)
    )


def to_pil(image: np.ndarray) -> PILImage.Image:
    """A 0..16 scan as the RGB picture an image processor expects (ink dark on white, grey levels spread to 0..255)."""
    grey = np.round(255 * (1 - image / MAX_GREY_LEVEL)).astype(np.uint8)
    return PILImage.fromarray(grey, mode="L").convert("RGB")


def digits_dataset() -> DatasetDict:
    """The digits as a `train`/`validation` DatasetDict of `image` (PIL) and `label` (ClassLabel "0".."9"), the
    layout of Hub image datasets and of `imagefolder`."""
    train_images, test_images, train_labels, test_labels = digits_split()
    features = Features({"image": Image(), "label": ClassLabel(names=[str(digit) for digit in range(10)])})

    def split(images: np.ndarray, labels: np.ndarray) -> Dataset:
        return Dataset.from_dict(
            {"image": [to_pil(image) for image in images], "label": labels.tolist()}, features=features
        )

    return DatasetDict(train=split(train_images, train_labels), validation=split(test_images, test_labels))


__all__ = ["DIGITS_DATASET", "digits_dataset", "digits_split", "to_pil"]
