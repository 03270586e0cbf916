"""The pretrain -> fine-tune workflow: the demo data, the masked-LM and classifier scripts, the demo driver.

Runs are tiny (a few steps): they check that the pieces fit together (checkpoints of either route fine-tune with
their stack, local files with string labels, metrics equal to what the saved model predicts, plots and cards
written), not the numbers the full demo reports.

Run: python -m pytest -q tests/test_pretrain_finetune.py
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, HfArgumentParser

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import demo_text_data  # noqa: E402
import pretrain_finetune_demo  # noqa: E402
import train_causal_lm  # noqa: E402
import train_classifier  # noqa: E402
import train_masked_lm  # noqa: E402
from run_common import ModelArguments  # noqa: E402

from hf_vanilla_transformer.modeling_vanilla_transformer import (  # noqa: E402
    VanillaTransformerDecoder,
    VanillaTransformerEncoder,
)

TINY = ["--preset", "demo-small", "--config_overrides", "d_model=32,encoder_layers=1,decoder_layers=1,"
        "encoder_ffn_dim=64,decoder_ffn_dim=64,encoder_attention_heads=2,decoder_attention_heads=2"]  # fmt: skip
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--seed", "0"]
QUIET += ["--save_strategy", "no"]


def test_demo_language_hides_topics_that_co_occurrence_reveals():
    language = demo_text_data.TopicLanguage.build()
    topic_of = {word: topic for topic, words in enumerate(language.topic_words) for word in words}
    assert len(topic_of) == demo_text_data.TOPICS * demo_text_data.WORDS_PER_TOPIC  # topics are disjoint
    assert not set(topic_of) & set(demo_text_data.FUNCTION_WORDS)
    data = demo_text_data.labelled_topics(train_size=400, validation_size=8)
    assert np.bincount(data["train"]["label"]).tolist() == [100] * demo_text_data.TOPICS
    # The label is the topic most of a sentence's content words belong to.
    majority = [
        np.bincount([topic_of[w] for w in text.split() if w in topic_of], minlength=demo_text_data.TOPICS).argmax()
        for text in data["train"]["text"]
    ]
    assert np.mean(np.array(majority) == np.array(data["train"]["label"])) > 0.9
    assert data["train"]["text"] == demo_text_data.labelled_topics(400, 8)["train"]["text"]  # deterministic
    tokenizer = demo_text_data.word_tokenizer()
    ids = tokenizer(data["train"]["text"][:20])["input_ids"]
    assert tokenizer.unk_token_id not in {i for row in ids for i in row}
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)


def test_metrics_match_their_closed_forms():
    labels = np.array([0, 0, 0, 1, 1, 2])
    predictions = np.array([0, 0, 1, 1, 2, 2])
    counts = train_classifier.confusion_matrix(labels, predictions, num_labels=4)
    assert counts.tolist() == [[2, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0], [0, 0, 0, 0]]
    metrics = train_classifier.classification_metrics(counts)
    # F1 per class = 2 TP / (2 TP + FP + FN): 4/5, 2/4, 2/3, and 0 for the class never seen nor predicted.
    assert metrics["accuracy"] == pytest.approx(4 / 6)
    assert metrics["macro_f1"] == pytest.approx((4 / 5 + 2 / 4 + 2 / 3 + 0) / 4)


@pytest.mark.parametrize(
    "dataclass_type",
    [ModelArguments, train_classifier.ClassifierModelArguments, train_classifier.ClassifierDataArguments,
     train_masked_lm.MaskedLMDataArguments, train_classifier.FineTuningArguments],
)  # fmt: skip
def test_every_flag_has_help(dataclass_type):
    parser = HfArgumentParser(dataclass_type)
    undocumented = [a.dest for a in parser._actions if a.dest != "help" and not a.help]
    assert undocumented == []


def write_labelled_csv(path: Path, size: int, seed: int) -> None:
    """The demo task with string labels, as a local user file would have them."""
    data = demo_text_data.TopicLanguage.build().examples(size, seed)
    rows = ["sentence,topic"] + [f"{text},t{label}" for text, label in zip(data["text"], data["label"])]
    path.write_text("\n".join(rows) + "\n")


@pytest.mark.parametrize("route", ["bert", "gpt"])
def test_pretrained_checkpoint_fine_tunes_on_local_files(tmp_path, route):
    text_file, tokenizer_dir = pretrain_finetune_demo.write_shared_inputs(tmp_path, pretrain_size=200)
    pretrained = tmp_path / "lm"
    script, length_flag = (
        (train_masked_lm, "--max_seq_length") if route == "bert" else (train_causal_lm, "--block_size")
    )
    script.main(
        [*TINY, *QUIET, "--output_dir", str(pretrained), "--train_file", str(text_file), "--tokenizer_name"]
        + [str(tokenizer_dir), length_flag, "32", "--do_train", "--max_steps", "3", "--warmup_steps", "2"]
    )
    write_labelled_csv(tmp_path / "train.csv", 24, seed=5)
    write_labelled_csv(tmp_path / "validation.csv", 40, seed=6)
    classifier_dir = tmp_path / "classifier"
    metrics = train_classifier.main(
        [*QUIET, "--model_name_or_path", str(pretrained), "--output_dir", str(classifier_dir), "--do_train"]
        + ["--do_eval", "--train_file", str(tmp_path / "train.csv"), "--validation_file"]
        + [str(tmp_path / "validation.csv"), "--text_column", "sentence", "--label_column", "topic"]
        + ["--max_steps", "3", "--per_device_train_batch_size", "8"]
    )

    model = AutoModelForSequenceClassification.from_pretrained(classifier_dir).eval()
    stack = VanillaTransformerDecoder if route == "gpt" else VanillaTransformerEncoder
    assert type(model.model) is stack and model.config.id2label == {i: f"t{i}" for i in range(4)}
    # The reported accuracy is what the saved model predicts on the validation file.
    tokenizer = AutoTokenizer.from_pretrained(classifier_dir)
    lines = (tmp_path / "validation.csv").read_text().splitlines()[1:]
    texts, labels = zip(*(line.rsplit(",", 1) for line in lines))
    with torch.no_grad():
        predicted = model(**tokenizer(list(texts), padding=True, return_tensors="pt")).logits.argmax(-1)
    expected = [model.config.label2id[label] for label in labels]
    assert metrics["eval_accuracy"] == pytest.approx((predicted == torch.tensor(expected)).float().mean().item())
    card = (classifier_dir / "README.md").read_text()
    assert "accuracy" in card and "confusion_matrix.png" in card and (classifier_dir / "confusion_matrix.png").exists()
    assert ("decoder-only" in card) if route == "gpt" else ("encoder-only" in card)


def test_masked_lm_script_reports_perplexity_and_loads_as_masked_lm(tmp_path):
    from transformers import AutoModelForMaskedLM

    metrics = train_masked_lm.main(
        [*TINY, *QUIET, "--output_dir", str(tmp_path), "--do_train", "--do_eval", "--max_steps", "3"]
        + ["--demo_train_size", "64", "--demo_validation_size", "16", "--warmup_steps", "2"]
    )
    assert metrics["eval_perplexity"] == pytest.approx(np.exp(metrics["eval_loss"]))
    model = AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert type(model).__name__ == "VanillaTransformerForMaskedLM" and not model.config.is_decoder
    assert "fill-mask" in (tmp_path / "README.md").read_text()


def test_demo_driver_writes_the_table_and_learning_curves(tmp_path):
    pretrain_finetune_demo.main(
        ["--output_dir", str(tmp_path / "runs"), "--card_dir", str(tmp_path / "card"), "--seeds", "2"]
        + ["--pretrain_size", "100", "--pretrain_steps", "2", "--finetune_steps", "2", "--routes", "bert"]
        + ["--labelled_size", "16", "--validation_size", "16"]
    )
    card = (tmp_path / "card" / "README.md").read_text()
    results = json.loads((tmp_path / "runs" / "results.json").read_text())
    inits = ("frozen", "fine-tuned", "scratch")
    assert set(results) == {f"bert/{init}" for init in inits} and all(len(r) == 2 for r in results.values())
    accuracies = [results[f"bert/{init}"] for init in inits]
    cells = [f"{np.mean(values):.3f} ± {np.std(values, ddof=1):.3f}" for values in accuracies]
    assert "| Route | Frozen features | Full fine-tuning | From scratch |" in card
    assert f"| BERT | {' | '.join(cells)} |" in card
    assert (tmp_path / "card" / "learning_curves.png").stat().st_size > 1000
