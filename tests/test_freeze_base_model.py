"""--freeze_base_model (feature-based transfer) in train_classifier.py and train_image_classifier.py: the pretrained
stack leaves training bit for bit as it came, and only the new classifier learns; without the flag the stack learns.

Run: python -m pytest -q tests/test_freeze_base_model.py
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import pretrain_finetune_demo  # noqa: E402
import train_classifier  # noqa: E402
import train_image_classifier  # noqa: E402
import train_masked_lm  # noqa: E402

QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--seed", "0"]
QUIET += ["--save_strategy", "no", "--per_device_train_batch_size", "8"]
TINY_TEXT = ["--preset", "demo-small", "--config_overrides", "d_model=16,encoder_layers=1,decoder_layers=1,"
             "encoder_ffn_dim=32,decoder_ffn_dim=32,encoder_attention_heads=2,decoder_attention_heads=2"]  # fmt: skip
TINY_IMAGE = ["--config_overrides", "d_model=16,encoder_layers=1,encoder_attention_heads=2,encoder_ffn_dim=32"]
IMAGES = ["--max_train_samples", "32", "--max_eval_samples", "16"]


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def assert_only_the_classifier_learned(pretrained: dict, trained: dict) -> None:
    stack = [name for name in trained if name.startswith("model.")]
    assert stack and all(torch.equal(trained[name], pretrained[name]) for name in stack)
    assert set(trained) - set(stack) == {"classifier.weight", "classifier.bias"}


@pytest.fixture(scope="module")
def pretrained_image_classifier(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("image") / "pretrained"
    train_image_classifier.main([*TINY_IMAGE, *QUIET, *IMAGES, "--output_dir", str(output_dir), "--do_train"]
                                + ["--max_steps", "2"])  # fmt: skip
    return output_dir


@pytest.mark.parametrize("freeze", [True, False], ids=["frozen", "fine-tuned"])
def test_image_classifier_freezes_its_encoder(pretrained_image_classifier, tmp_path, freeze):
    train_image_classifier.main(
        [*QUIET, *IMAGES, "--model_name_or_path", str(pretrained_image_classifier), "--output_dir", str(tmp_path)]
        + ["--do_train", "--max_steps", "3", "--learning_rate", "1e-2"]
        + (["--freeze_base_model"] if freeze else [])
    )
    pretrained, trained = weights(pretrained_image_classifier), weights(tmp_path)
    assert not torch.equal(trained["classifier.weight"], pretrained["classifier.weight"])
    if freeze:
        assert_only_the_classifier_learned(pretrained, trained)
        assert "frozen" in (tmp_path / "README.md").read_text()
    else:
        assert not all(torch.equal(trained[name], pretrained[name]) for name in trained)


def test_text_classifier_freezes_a_pretrained_masked_lm(tmp_path):
    text_file, tokenizer_dir = pretrain_finetune_demo.write_shared_inputs(tmp_path, pretrain_size=100)
    masked_lm = tmp_path / "mlm"
    train_masked_lm.main(
        [*TINY_TEXT, *QUIET, "--output_dir", str(masked_lm), "--train_file", str(text_file), "--tokenizer_name"]
        + [str(tokenizer_dir), "--max_seq_length", "32", "--do_train", "--max_steps", "2", "--warmup_steps", "1"]
    )
    classifier = tmp_path / "classifier"
    train_classifier.main(
        [*QUIET, "--model_name_or_path", str(masked_lm), "--output_dir", str(classifier), "--do_train"]
        + ["--freeze_base_model", "--max_steps", "3", "--learning_rate", "1e-2", "--demo_train_size", "16"]
    )
    pretrained = {name: value for name, value in weights(masked_lm).items() if name.startswith("model.")}
    assert_only_the_classifier_learned(pretrained, weights(classifier))
