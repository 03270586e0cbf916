"""The decoder-only LM and the encoder-only classifier train with the HF Trainer and reload through the Auto classes.

Each model trains one epoch on tiny synthetic data that a working model learns within a few steps: counting sequences
(next token = previous + 1) for the LM, "are most tokens in the upper half of the vocabulary?" for the classifier.

Run: python -m pytest -q tests/test_heads_training.py
"""

import torch
from conftest import tiny_config
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, Trainer, TrainingArguments

from hf_vanilla_transformer import VanillaTransformerForCausalLM, VanillaTransformerForSequenceClassification

VOCAB_SIZE, FIRST_WORD_ID = 64, 3  # ids 0-2 are pad/bos/eos


def counting_sequences(count: int, length: int = 16, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB_SIZE - FIRST_WORD_ID, (count, 1), generator=generator)
    input_ids = (starts + torch.arange(length)) % (VOCAB_SIZE - FIRST_WORD_ID) + FIRST_WORD_ID
    return Dataset.from_dict({"input_ids": input_ids.tolist(), "labels": input_ids.tolist()})


def majority_sequences(count: int, length: int = 11, seed: int = 0) -> Dataset:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(FIRST_WORD_ID, VOCAB_SIZE, (count, length), generator=generator)
    upper_half = (input_ids >= (VOCAB_SIZE + FIRST_WORD_ID) // 2).sum(dim=1)
    return Dataset.from_dict({"input_ids": input_ids.tolist(), "labels": (2 * upper_half > length).long().tolist()})


def train_one_epoch(model, train: Dataset, evaluation: Dataset, output_dir) -> tuple[float, float, list[float]]:
    """Eval loss before and after one epoch, and the logged training losses."""
    arguments = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=1,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=64,
        learning_rate=1e-2,
        warmup_steps=2,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=arguments, train_dataset=train, eval_dataset=evaluation)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    return before, after, [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def assert_reloads_identically(model, auto_class, inputs: dict, path) -> None:
    model.save_pretrained(path)
    reloaded = auto_class.from_pretrained(path).eval()
    assert type(reloaded) is type(model)
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model.eval()(**inputs).logits)


def test_causal_lm_trains_with_trainer_and_reloads(tmp_path) -> None:
    torch.manual_seed(0)
    model = VanillaTransformerForCausalLM(tiny_config(norm_position="pre", position_embedding_type="rope"))
    before, after, logged = train_one_epoch(model, counting_sequences(384), counting_sequences(64, seed=1), tmp_path)
    assert after < 0.5 * before, (before, after)  # measured: 4.80 -> 0.69
    assert mean(logged[-2:]) < 0.5 * mean(logged[:2]), logged
    assert_reloads_identically(
        model, AutoModelForCausalLM, {"input_ids": torch.tensor(counting_sequences(2)["input_ids"])}, tmp_path / "lm"
    )


def test_sequence_classifier_trains_with_trainer_and_reloads(tmp_path) -> None:
    torch.manual_seed(0)
    model = VanillaTransformerForSequenceClassification(tiny_config(num_labels=2))
    before, after, logged = train_one_epoch(model, majority_sequences(512), majority_sequences(128, seed=1), tmp_path)
    assert after < 0.85 * before, (before, after)  # measured: 0.69 -> 0.49
    assert mean(logged[-2:]) < mean(logged[:2]), logged  # single batches are noisy: two logged steps at each end
    assert_reloads_identically(
        model,
        AutoModelForSequenceClassification,
        {"input_ids": torch.tensor(majority_sequences(2)["input_ids"])},
        tmp_path / "classifier",
    )
