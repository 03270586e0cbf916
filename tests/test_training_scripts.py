"""End-to-end tests of training/: the seq2seq and causal-LM scripts, Noam schedule, checkpoint averaging, resuming,
and a 2-process `accelerate launch` on CPU. Models are tiny and runs a few dozen steps, so this takes ~2 minutes.
What makes the scripts safe to use (output folders, time budget, early checks) is tested in test_safe_scripts.py.

Run: python -m pytest -q tests/test_training_scripts.py
"""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import average_checkpoints  # noqa: E402
import train_causal_lm  # noqa: E402
import train_seq2seq  # noqa: E402
import training_batches  # noqa: E402
from run_common import noam_scheduler, parse_config_overrides  # noqa: E402
from transformers import MarianConfig, MarianMTModel  # noqa: E402
from transformers.trainer_pt_utils import LabelSmoother  # noqa: E402

from hf_vanilla_transformer import (  # noqa: E402
    DataCollatorForSeq2SeqWithFlattening,
    VanillaTransformerConfig,
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForImageClassification,
    VanillaTransformerForMaskedLM,
    VanillaTransformerForQuestionAnswering,
    VanillaTransformerForSequenceClassification,
    VanillaTransformerForTokenClassification,
    image_classification_config,
)

TINY_MODEL = [
    "--preset",
    "demo-small",
    "--config_overrides",
    "d_model=32,encoder_layers=1,decoder_layers=1,encoder_ffn_dim=64,decoder_ffn_dim=64,"
    "encoder_attention_heads=2,decoder_attention_heads=2",
    "--tokenizer_vocab_size",
    "300",
]
QUIET = ["--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--seed", "0"]
SEQ2SEQ_DEMO = [*TINY_MODEL, *QUIET, "--demo_train_size", "400", "--demo_validation_size", "16", "--warmup_steps", "8"]
SEQ2SEQ_DEMO += ["--max_new_tokens_over_source", "4", "--per_device_eval_batch_size", "16"]  # short decoding


def tiny_translation_config() -> VanillaTransformerConfig:
    return VanillaTransformerConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
    )  # fmt: skip


def record_forward_calls(model: torch.nn.Module, seen: list) -> None:
    """Append (keyword arguments, output) of each call of `model` to `seen`."""
    model.register_forward_hook(lambda module, args, kwargs, output: seen.append((kwargs, output)), with_kwargs=True)


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def closed_form_noam(step: int, d_model: int, warmup: int, scale: float) -> float:
    """The paper's eq. 3, lr = scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), written out again."""
    return scale / math.sqrt(d_model) * min(1 / math.sqrt(step), step / warmup**1.5)


@pytest.fixture(scope="module")
def seq2seq_run(tmp_path_factory) -> Path:
    """24 steps on the demo data with checkpoints every 12, then evaluation (beam search, BLEU/chrF)."""
    output_dir = tmp_path_factory.mktemp("seq2seq") / "run"
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(output_dir), "--do_train", "--do_eval", "--max_steps", "24"]
    argv += ["--per_device_train_batch_size", "16", "--save_steps", "12", "--logging_steps", "4"]
    train_seq2seq.main(argv)
    return output_dir


def test_noam_schedule_follows_its_formula():
    d_model, warmup, scale = 64, 10, 2.0
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([parameter], lr=scale)  # the optimiser's lr is the Noam scale factor
    scheduler = noam_scheduler(optimizer, d_model, warmup)
    rates = []
    for _ in range(40):
        rates.append(optimizer.param_groups[0]["lr"])  # the rate of the coming update
        optimizer.step()
        scheduler.step()
    expected = [closed_form_noam(step, d_model, warmup, scale) for step in range(1, 41)]
    assert rates == pytest.approx(expected, rel=1e-12)
    assert max(rates) == pytest.approx(rates[warmup - 1])  # peak at the end of the warm-up


def test_label_smoothing_runs_in_our_model_with_the_trainers_loss(tmp_path):
    """With --label_smoothing_factor our model smooths its own loss (in float32; it keeps its labels): the loss and
    every gradient equal transformers' LabelSmoother over the logits. HF Marian, whose loss ignores `loss_function`,
    keeps the Trainer's smoothing."""
    torch.manual_seed(0)
    config = tiny_translation_config()
    model = VanillaTransformerForConditionalGeneration(config).train()
    input_ids = torch.randint(3, 40, (3, 7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = attention_mask[2, 2:] = 0
    labels = torch.randint(3, 40, (3, 6))
    labels[0, 3:] = labels[2, 5:] = -100  # the collator's label padding
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    counted = (labels != -100).sum()

    args = train_seq2seq.PaperSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "ours"), label_smoothing_factor=0.1, use_cpu=True, report_to=[]
    )
    trainer = train_seq2seq.PaperSeq2SeqTrainer(model=model, args=args)
    assert trainer.label_smoother is None
    loss, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True, num_items_in_batch=counted)
    loss.backward()
    gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}
    model.zero_grad()

    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    outputs = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids)
    expected = LabelSmoother(epsilon=0.1)(outputs, labels, num_items_in_batch=counted)
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(gradients[name], parameter.grad, msg=name)

    marian_config = MarianConfig(
        vocab_size=40, decoder_vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, pad_token_id=0,
        eos_token_id=2, decoder_start_token_id=0,
    )  # fmt: skip
    marian = MarianMTModel(marian_config)
    args = train_seq2seq.PaperSeq2SeqTrainingArguments(
        output_dir=str(tmp_path / "marian"), label_smoothing_factor=0.1, use_cpu=True, report_to=[]
    )
    assert train_seq2seq.PaperSeq2SeqTrainer(model=marian, args=args).label_smoother is not None


def test_a_training_step_asks_our_language_models_for_the_loss_only(tmp_path):
    """The training step reads only the loss: the scripts' trainers pass `skip_logits` to our language models (no
    vocabulary-wide logits scattered back to the padded layout and copied to float32), with the loss unchanged;
    evaluation (`return_outputs=True`) still gets the logits; heads without the flag get nothing new."""
    torch.manual_seed(0)
    config = tiny_translation_config()
    model = VanillaTransformerForConditionalGeneration(config).train()
    seen = []
    record_forward_calls(model, seen)
    batch = {"input_ids": torch.randint(3, 40, (2, 5)), "labels": torch.randint(3, 40, (2, 4))}
    args = train_seq2seq.PaperSeq2SeqTrainingArguments(output_dir=str(tmp_path / "s"), use_cpu=True, report_to=[])
    trainer = train_seq2seq.PaperSeq2SeqTrainer(model=model, args=args)
    loss = trainer.compute_loss(model, dict(batch))
    assert seen[-1][0]["skip_logits"] is True and seen[-1][1].logits is None
    evaluated, outputs = trainer.compute_loss(model, dict(batch), return_outputs=True)
    assert "skip_logits" not in seen[-1][0] and outputs.logits.shape == (2, 4, 40)
    torch.testing.assert_close(loss, evaluated, rtol=0, atol=0)

    classifier = VanillaTransformerForSequenceClassification(config.for_single_stack("encoder"))
    args = train_causal_lm.PaperTrainingArguments(output_dir=str(tmp_path / "c"), use_cpu=True, report_to=[])
    record_forward_calls(classifier, seen)
    trainer = train_causal_lm.PaperTrainer(model=classifier, args=args)
    trainer.compute_loss(classifier, {"input_ids": batch["input_ids"], "labels": torch.tensor([0, 1])})
    assert "skip_logits" not in seen[-1][0] and seen[-1][1].logits.shape == (2, 2)


def test_label_smoothing_of_the_causal_lm_scores_the_next_token(tmp_path):
    """The causal-LM script's label smoothing scores each position against the next token. (transformers' Trainer
    shifts the labels only for the causal LMs it knows by name, so on this remote-code model its `LabelSmoother`
    would score every position against its own input token.)"""
    torch.manual_seed(0)
    config = VanillaTransformerConfig(
        vocab_size=40, d_model=16, is_encoder_decoder=False, is_decoder=True, decoder_layers=1,
        decoder_attention_heads=2, decoder_ffn_dim=32, dropout=0.0,
    )  # fmt: skip
    model = VanillaTransformerForCausalLM(config).train()
    input_ids = torch.randint(3, 40, (2, 6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 4:] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    args = train_causal_lm.PaperTrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to=[]
    )
    trainer = train_causal_lm.PaperTrainer(model=model, args=args)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
    counted = (labels[:, 1:] != -100).sum()
    loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=counted)
    outputs = model(input_ids, attention_mask=attention_mask)
    expected = LabelSmoother(epsilon=0.1)(outputs, labels, shift_labels=True, num_items_in_batch=counted)
    torch.testing.assert_close(loss, expected)


def smoothed_span_loss(outputs, start_positions, end_positions, epsilon: float) -> torch.Tensor:
    """Label smoothing written out for a span's start and end scores, (1 - eps) NLL + eps * mean_v -log p_v,
    averaged over the two (the Trainer's `LabelSmoother` has no `labels` to smooth there)."""

    def smoothed(logits, targets):
        log_probs = logits.log_softmax(-1)
        nll = -log_probs.gather(-1, targets[:, None]).squeeze(-1)
        return ((1 - epsilon) * nll - epsilon * log_probs.mean(-1)).mean()

    return (smoothed(outputs.start_logits, start_positions) + smoothed(outputs.end_logits, end_positions)) / 2


def head_case(head: str):
    """A tiny model of `head`, a training batch for it, and its expected label-smoothed (0.1) loss from the
    outputs: the Trainer's `LabelSmoother`, or written out for question answering."""
    torch.manual_seed(0)
    encoder = tiny_translation_config().for_single_stack("encoder")
    encoder.num_labels = 3
    input_ids = torch.randint(3, 40, (3, 6))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 4:] = 0
    text = {"input_ids": input_ids, "attention_mask": attention_mask}
    smoother = LabelSmoother(epsilon=0.1)
    if head == "sequence classification":
        batch = {**text, "labels": torch.tensor([0, 2, 1])}
        return VanillaTransformerForSequenceClassification(encoder), batch, lambda out: smoother(out, batch["labels"])
    if head == "token classification":
        batch = {**text, "labels": (input_ids % 3).masked_fill(attention_mask == 0, -100)}
        return VanillaTransformerForTokenClassification(encoder), batch, lambda out: smoother(out, batch["labels"])
    if head == "masked LM":
        batch = {**text, "labels": input_ids.masked_fill(attention_mask == 0, -100)}
        return VanillaTransformerForMaskedLM(encoder), batch, lambda out: smoother(out, batch["labels"])
    if head == "question answering":
        spans = {"start_positions": torch.tensor([1, 0, 2]), "end_positions": torch.tensor([3, 4, 2])}

        def expected(outputs):
            return smoothed_span_loss(outputs, *spans.values(), epsilon=0.1)

        return VanillaTransformerForQuestionAnswering(encoder), {**text, **spans}, expected
    config = image_classification_config(
        d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, dropout=0.0, num_labels=3,
        image_size=8, patch_size=4, num_channels=3,
    )  # fmt: skip
    batch = {"pixel_values": torch.randn(3, 3, 8, 8), "labels": torch.tensor([0, 2, 1])}
    return VanillaTransformerForImageClassification(config), batch, lambda out: smoother(out, batch["labels"])


@pytest.mark.parametrize(
    "head",
    ["sequence classification", "token classification", "question answering", "image classification", "masked LM"],
)
def test_label_smoothing_runs_in_every_head_with_the_trainers_formula(tmp_path, head):
    """The scripts' trainers give each of our heads a label-smoothed loss of its own signature (the classifiers call
    theirs with other arguments than the language models): the loss of a training step is the Trainer's
    `LabelSmoother` over the head's outputs (for question answering, the same formula on the start and end scores)."""
    model, batch, expected_loss = head_case(head)
    args = train_causal_lm.PaperTrainingArguments(
        output_dir=str(tmp_path), label_smoothing_factor=0.1, use_cpu=True, report_to=[]
    )
    trainer = train_causal_lm.PaperTrainer(model=model.train(), args=args)
    loss = trainer.compute_loss(model, dict(batch))
    loss.backward()
    torch.testing.assert_close(loss, expected_loss(model(**batch)))


def test_translation_metrics_score_decoded_text(seq2seq_run):
    """BLEU/chrF/exact match compare the decoded strings; -100 label padding decodes as padding."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(seq2seq_run)
    references = ["sie hat zwei Bücher", "ich bin drei Jahre alt", "hier wohnen vier Menschen"]
    hypotheses = [references[0], references[1], "hier wohnen fünf Menschen"]
    predictions = tokenizer(hypotheses, padding=True, return_tensors="np")["input_ids"]
    labels = tokenizer(references, padding=True, return_tensors="np")["input_ids"]
    labels[labels == tokenizer.pad_token_id] = -100
    metrics = train_seq2seq.translation_metrics(tokenizer)((predictions, labels))
    assert metrics["exact_match"] == pytest.approx(200 / 3)
    assert 0 < metrics["bleu"] < 100 and 0 < metrics["chrf"] < 100


def test_seq2seq_demo_end_to_end(seq2seq_run):
    files = {path.name for path in seq2seq_run.iterdir()}
    code = {
        "configuration_vanilla_transformer.py",
        "modeling_vanilla_transformer.py",
        "language_modeling_vanilla_transformer.py",
    }
    assert {"model.safetensors", "tokenizer.json", "README.md", "training_curves.png", *code} <= files
    results = json.loads((seq2seq_run / "all_results.json").read_text())
    assert {"eval_bleu", "eval_chrf", "eval_exact_match", "eval_loss", "train_loss"} <= results.keys()
    card = (seq2seq_run / "README.md").read_text()
    assert "eval_bleu" not in card and "bleu" in card and "training_curves.png" in card and "Noam" in card
    state = json.loads((seq2seq_run / "checkpoint-24" / "trainer_state.json").read_text())
    logged = [entry for entry in state["log_history"] if "loss" in entry]
    assert logged[-1]["loss"] < logged[0]["loss"]  # it learns
    for entry in logged:  # the logged rate is the Noam rate of that update (d_model=32, warm-up 8, scale 1)
        assert entry["learning_rate"] == pytest.approx(closed_form_noam(entry["step"], 32, 8, 1.0), rel=1e-6)
    generation_config = json.loads((seq2seq_run / "generation_config.json").read_text())
    assert generation_config["length_penalty_type"] == "gnmt" and generation_config["num_beams"] == 4

    # transformers 5.23 has no "translation"/"text2text-generation" pipeline any more: load through the Auto
    # classes in a fresh process where hf_vanilla_transformer cannot be imported (the code comes from the folder).
    script = f"""
import sys
sys.modules["hf_vanilla_transformer"] = None  # importing it now fails: only the saved code files can be used
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained({str(seq2seq_run)!r}, trust_remote_code=True)
model = AutoModelForSeq2SeqLM.from_pretrained({str(seq2seq_run)!r}, trust_remote_code=True)
batch = tokenizer(["she has twenty-two books", "forty-two"], return_tensors="pt", padding=True)
assert batch["input_ids"][0, -1] == tokenizer.eos_token_id  # sources end with </s>
out = model.generate(**batch, max_new_tokens=12)
assert out.shape[0] == 2 and (out[:, 0] == model.config.decoder_start_token_id).all()
print(type(model).__module__, tokenizer.batch_decode(out, skip_special_tokens=True))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=seq2seq_run.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1].startswith("transformers_modules.")


def test_resume_from_checkpoint_equals_uninterrupted_run(seq2seq_run, tmp_path):
    """A run stopped after its step-12 checkpoint and resumed from it ends with the uninterrupted run's weights."""
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(seq2seq_run / "checkpoint-12", resumed / "checkpoint-12")  # all an interrupted run leaves
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(resumed), "--do_train", "--max_steps", "24"]
    argv += ["--per_device_train_batch_size", "16", "--save_steps", "12", "--logging_steps", "4"]
    train_seq2seq.main([*argv, "--resume_from_checkpoint", str(resumed / "checkpoint-12")])
    uninterrupted, after_resume = weights(seq2seq_run / "checkpoint-24"), weights(resumed)
    assert uninterrupted.keys() == after_resume.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, after_resume[name]), name
    halfway = weights(seq2seq_run / "checkpoint-12")
    assert any(not torch.equal(tensor, halfway[name]) for name, tensor in uninterrupted.items())  # steps 13-24 ran


def test_average_checkpoints_is_the_mean_of_weights(seq2seq_run, tmp_path):
    checkpoints = average_checkpoints.last_checkpoints(seq2seq_run, 2)
    assert [path.name for path in checkpoints] == ["checkpoint-12", "checkpoint-24"]
    averaged_dir = average_checkpoints.average_checkpoints(checkpoints, tmp_path / "averaged")
    first, second, averaged = weights(checkpoints[0]), weights(checkpoints[1]), weights(averaged_dir)
    for name in first:
        torch.testing.assert_close(averaged[name], (first[name] + second[name]) / 2, rtol=0, atol=1e-7)
    assert not (averaged_dir / "optimizer.pt").exists() and (averaged_dir / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="fewer than last_k"):
        average_checkpoints.last_checkpoints(seq2seq_run, 5)


def test_bpe_dropout_trains_on_several_segmentations_and_saves_the_plain_tokenizer(tmp_path, monkeypatch):
    datasets_seen = {}

    class RecordingTrainer(train_seq2seq.PaperSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            datasets_seen.update(train=kwargs["train_dataset"], validation=kwargs["eval_dataset"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(train_seq2seq, "PaperSeq2SeqTrainer", RecordingTrainer)
    output_dir = tmp_path / "run"
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(output_dir), "--do_train", "--do_eval", "--max_steps", "2"]
    argv += ["--per_device_train_batch_size", "8", "--eval_strategy", "no", "--predict_with_generate", "false"]
    train_seq2seq.main([*argv, "--bpe_dropout", "0.3", "--bpe_dropout_segmentations", "3"])

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(output_dir)  # what the run saved: no dropout, one segmentation
    assert tokenizer.backend_tokenizer.model.dropout is None
    raw = train_seq2seq.number_translation_dataset(400, 16)
    sources = [pair["en"] for pair in raw["train"]["translation"]]
    train = datasets_seen["train"]["input_ids"]
    assert len(train) == 3 * len(sources)
    copies = [train[k * len(sources) : (k + 1) * len(sources)] for k in range(3)]
    for copy in copies:  # every copy is the whole training set, in order, however it was cut
        assert tokenizer.batch_decode(copy, skip_special_tokens=True) == sources
    plain = tokenizer(sources)["input_ids"]
    for copy in copies:  # each copy cuts some of the sentences otherwise
        assert sum(ids != plain_ids for ids, plain_ids in zip(copy, plain)) > len(sources) // 10
    assert copies[0] != copies[1]
    validation_sources = [pair["en"] for pair in raw["validation"]["translation"]]
    assert datasets_seen["validation"]["input_ids"] == tokenizer(validation_sources)["input_ids"]
    assert "| `BPE-dropout` | 0.3, 3 segmentations |" in (output_dir / "README.md").read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--bpe_dropout", "1"], "--bpe_dropout is a probability"),
        (["--bpe_dropout", "0.1", "--bpe_dropout_segmentations", "0"], "--bpe_dropout_segmentations must be"),
        (["--bpe_dropout", "0.1", "--tokenizer_name", "WORD_LEVEL"], "--bpe_dropout needs a fast BPE tokenizer"),
    ],
)
def test_bpe_dropout_refuses_what_it_cannot_do(tmp_path, flags, message):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>", "<unk>", "one", "two", "eins", "zwei"]
    word_level = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    PreTrainedTokenizerFast(tokenizer_object=word_level, **special).save_pretrained(tmp_path / "word_level")
    flags = [str(tmp_path / "word_level") if flag == "WORD_LEVEL" else flag for flag in flags]
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(tmp_path / "run"), "--do_train", "--max_steps", "1", *flags]
    with pytest.raises(ValueError, match=message):
        train_seq2seq.main(argv)


@pytest.mark.parametrize("extension", ["jsonl", "csv"])
def test_seq2seq_on_local_files(tmp_path, extension):
    pairs = [("she has two books", "sie hat zwei Bücher"), ("forty-two", "zweiundvierzig")] * 20
    if extension == "jsonl":  # WMT-style `translation` dicts
        lines = [json.dumps({"translation": {"en": en, "de": de}}) for en, de in pairs]
        columns = []
    else:  # plain source/target columns
        lines = ["src,tgt"] + [f"{en},{de}" for en, de in pairs]
        columns = ["--source_column", "src", "--target_column", "tgt"]
    (tmp_path / f"train.{extension}").write_text("\n".join(lines) + "\n")
    (tmp_path / f"validation.{extension}").write_text("\n".join(lines[: len(lines) - 36]) + "\n")  # 4 pairs
    output_dir = tmp_path / "out"
    metrics = train_seq2seq.main(
        [*TINY_MODEL, *QUIET, *columns, "--output_dir", str(output_dir), "--do_train", "--do_eval"]
        + [
            "--train_file",
            str(tmp_path / f"train.{extension}"),
            "--validation_file",
            str(tmp_path / f"validation.{extension}"),
        ]
        + [
            "--max_steps",
            "6",
            "--warmup_steps",
            "3",
            "--per_device_train_batch_size",
            "8",
            "--tokenizer_vocab_size",
            "120",
        ]
    )
    assert {"eval_bleu", "eval_chrf"} <= metrics.keys()
    assert (output_dir / "model.safetensors").exists() and (output_dir / "README.md").exists()


def test_causal_lm_demo_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output_dir = tmp_path / "lm"
    metrics = train_causal_lm.main(
        [*TINY_MODEL, *QUIET, "--output_dir", str(output_dir), "--do_train", "--do_eval", "--max_steps", "10"]
        + ["--demo_train_size", "300", "--demo_validation_size", "30", "--block_size", "32", "--warmup_steps", "5"]
        + ["--per_device_train_batch_size", "8"]
    )
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    model = AutoModelForCausalLM.from_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    assert type(model).__name__ == "VanillaTransformerForCausalLM" and not model.config.is_encoder_decoder
    prompt = tokenizer(["forty-two plus"], return_tensors="pt", add_special_tokens=False)
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert prompt["input_ids"].shape[1] < out.shape[1] <= prompt["input_ids"].shape[1] + 5
    assert "perplexity" in (output_dir / "README.md").read_text()


def test_config_overrides_parse_as_json_and_name_unknown_fields():
    with pytest.raises(ValueError, match="not a VanillaTransformerConfig field"):
        parse_config_overrides("d_modle=32")
    assert parse_config_overrides("d_model=32,norm_position=pre,scale_embedding=false") == {
        "d_model": 32,
        "norm_position": "pre",
        "scale_embedding": False,
    }


def test_accelerate_launch_two_cpu_processes(tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` on a machine without GPU runs two CPU ranks (gloo) through
    the seq2seq script to the end (`--cpu` would start accelerate's single-process launcher, one rank)."""
    output_dir = tmp_path / "ddp"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += [str(TRAINING_DIR / "train_seq2seq.py"), *SEQ2SEQ_DEMO, "--output_dir", str(output_dir)]
    command += ["--do_train", "--do_eval", "--max_steps", "4", "--per_device_train_batch_size", "8"]
    command += ["--max_eval_samples", "8", "--save_strategy", "no"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    results = json.loads((output_dir / "all_results.json").read_text())
    assert results["train_steps_per_second"] > 0 and "eval_bleu" in results
    assert json.loads((output_dir / "config.json").read_text())["model_type"] == "vanilla_transformer"
    assert (output_dir / "README.md").exists()


# --- training batches: the device's layout, token budgets (training/training_batches.py) ---------------------------


def budget_tokens(lengths: list[int], layout: str, multiple: int | None) -> int:
    """A stream's tokens, written out again: padded = rows x longest (rounded up to the multiple); flattened = the
    sum, plus the padding's sequence (at least one token) up to the multiple."""
    if layout == "padded":
        longest = max(lengths) if multiple is None else math.ceil(max(lengths) / multiple) * multiple
        return len(lengths) * longest
    return sum(lengths) if multiple is None else math.ceil((sum(lengths) + 1) / multiple) * multiple


@pytest.mark.parametrize(
    ("layout", "multiple", "max_sentences"), [("padded", None, None), ("flattened", None, 7), ("flattened", 32, None)]
)
def test_token_budget_batches_hold_the_budget_and_cover_every_example_once_per_epoch(layout, multiple, max_sentences):
    generator = torch.Generator().manual_seed(0)
    sources, targets = torch.randint(1, 41, (2, 500), generator=generator).tolist()
    options = dict(flattened=layout == "flattened", pad_to_multiple_of=multiple, max_sentences=max_sentences)
    sampler = training_batches.TokenBudgetBatchSampler(sources, targets, 256, seed=3, **options)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
        assert sorted(index for batch in epochs[-1] for index in batch) == list(range(500)), epoch
        for batch in epochs[-1]:
            for lengths in ([sources[i] for i in batch], [targets[i] for i in batch]):
                assert budget_tokens(lengths, layout, multiple) <= 256
            assert max_sentences is None or len(batch) <= max_sentences
    assert len(epochs[0]) == len(sampler) and sorted(epochs[0]) == sorted(epochs[1]) and epochs[0] != epochs[1]
    # Batches that fill the budget: the next pair by length would not have fitted (the last one takes the rest).
    assert sum(map(len, epochs[0])) / len(sampler) > 256 / 40 / 2
    # What a resumed run rebuilds: the same batches in the same order for (seed, epoch); another seed differs.
    again = training_batches.TokenBudgetBatchSampler(sources, targets, 256, seed=3, **options)
    again.set_epoch(1)
    assert list(again) == epochs[1]
    other = training_batches.TokenBudgetBatchSampler(sources, targets, 256, seed=4, **options)
    other.set_epoch(1)
    assert list(other) != epochs[1]


def test_token_budget_refuses_a_budget_below_the_longest_pair():
    with pytest.raises(ValueError, match="--max_tokens 40 cannot hold the longest training pair"):
        training_batches.token_budget_batches([10, 41], [12, 3], 40, flattened=False)
    with pytest.raises(ValueError, match="with its padding"):  # 40 tokens and at least one of padding: 64
        training_batches.token_budget_batches([10, 40], [12, 3], 40, flattened=True, pad_to_multiple_of=32)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max_tokens", "0"], "--max_tokens must be 1 or more"),
        (["--pad_to_multiple_of", "0"], "--pad_to_multiple_of must be 1 or more"),
        (["--max_tokens", "512", "--per_device_train_batch_size", "16"], "drop --per_device_train_batch_size"),
        (["--max_tokens", "512", "--train_sampling_strategy", "group_by_length"], "--train_sampling_strategy"),
        (["--num_sequences", "8", "--pad_to_multiple_of", "8"], "8 pairs do not fit --num_sequences 8 slots"),
    ],
)
def test_batching_flags_refuse_what_conflicts(tmp_path, flags, message):
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(tmp_path / "run"), "--do_train", "--max_steps", "1", *flags]
    with pytest.raises(ValueError, match=message):
        train_seq2seq.main(argv)


class TrainerBuilt(Exception):
    """Stops a script once its trainer exists."""


def record_trainer(monkeypatch, stop: bool = True) -> dict:
    """Replace the script's trainer with one that records itself and, with `stop`, stops the script (raising
    TrainerBuilt)."""
    seen = {}

    class RecordingTrainer(train_seq2seq.PaperSeq2SeqTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            seen["trainer"] = self
            if stop:
                raise TrainerBuilt

    monkeypatch.setattr(train_seq2seq, "PaperSeq2SeqTrainer", RecordingTrainer)
    return seen


def test_max_tokens_reaches_the_trainers_train_dataloader_in_static_shapes(tmp_path, monkeypatch):
    """On the CPU the script trains on flattened batches; --max_tokens and --pad_to_multiple_of make every batch of
    an epoch a budget-held batch of the sampler, each stream a multiple of 32 tokens and one number of sequences
    (the largest batch's and the padding's); evaluation keeps padded batches of sentences."""
    seen = record_trainer(monkeypatch)
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(tmp_path / "run"), "--do_train", "--do_eval", "--max_steps", "1"]
    with pytest.raises(TrainerBuilt):
        train_seq2seq.main([*argv, "--max_tokens", "256", "--pad_to_multiple_of", "32"])
    trainer = seen["trainer"]
    sampler = trainer.train_batch_sampler
    assert isinstance(sampler, training_batches.TokenBudgetBatchSampler)
    assert isinstance(trainer.train_data_collator, DataCollatorForSeq2SeqWithFlattening)
    batches = list(trainer.get_train_dataloader())
    assert len(batches) == len(sampler) > 1
    assert sum(int((batch["labels"] != -100).sum()) for batch in batches) == sum(
        len(labels) for labels in trainer.train_dataset["labels"]
    )  # every target token once
    for batch in batches:
        for stream, offsets in (("input_ids", "cu_seq_lens_k"), ("labels", "cu_seq_lens_q")):
            tokens = batch[stream].shape[1]
            assert tokens % 32 == 0 and tokens <= 256 and batch[offsets][-1] == tokens
            assert len(batch[offsets]) == sampler.largest_batch + 2
    evaluation = next(iter(trainer.get_eval_dataloader()))
    assert evaluation["input_ids"].shape[0] == 16 and "cu_seq_lens_k" not in evaluation


def test_token_budget_runs_report_the_pairs_and_tokens_they_trained_on(tmp_path, monkeypatch):
    """With --max_tokens a step holds the pairs that fit the budget, not --per_device_train_batch_size of them: the
    throughput reported at the end counts the pairs and tokens (source and target, no padding) of the batches
    trained on, the epoch's first --max_steps batches, per second of train_runtime."""
    seen = record_trainer(monkeypatch, stop=False)
    argv = [*SEQ2SEQ_DEMO, "--output_dir", str(tmp_path / "run"), "--do_train", "--demo_train_size", "60"]
    metrics = train_seq2seq.main([*argv, "--max_tokens", "256", "--max_steps", "3", "--save_strategy", "no"])
    trainer = seen["trainer"]
    trainer.train_batch_sampler.set_epoch(0)
    trained = [index for batch in list(trainer.train_batch_sampler)[:3] for index in batch]
    examples = trainer.train_dataset.select(trained)
    tokens = sum(len(source) + len(target) for source, target in zip(examples["input_ids"], examples["labels"]))
    assert len(trained) != 3 * training_batches.DEFAULT_BATCH_SIZE  # what the Trainer would count
    runtime = metrics["train_runtime"]
    assert metrics["train_pairs_per_second"] == metrics["train_samples_per_second"] == round(len(trained) / runtime, 3)
    assert metrics["train_tokens_per_second"] == round(tokens / runtime, 3)


def test_resume_with_token_budget_batches_equals_the_uninterrupted_run(tmp_path):
    """A run stopped in its second epoch of --max_tokens batches and resumed from its checkpoint ends with the
    uninterrupted run's weights: the resumed run rebuilds the same batches, in the same order for that epoch, and
    skips those already trained on."""
    argv = [*SEQ2SEQ_DEMO, "--do_train", "--demo_train_size", "60", "--max_tokens", "256", "--pad_to_multiple_of"]
    argv += ["32", "--save_steps", "12", "--logging_steps", "100", "--max_steps", "14"]
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    train_seq2seq.main([*argv, "--output_dir", str(full)])
    state = json.loads((full / "checkpoint-12" / "trainer_state.json").read_text())
    assert 1 < state["epoch"] < 2  # the checkpoint is inside the second epoch
    resumed.mkdir()
    shutil.copytree(full / "checkpoint-12", resumed / "checkpoint-12")
    checkpoint = resumed / "checkpoint-12"
    train_seq2seq.main([*argv, "--output_dir", str(resumed), "--resume_from_checkpoint", str(checkpoint)])
    uninterrupted, after_resume = weights(full), weights(resumed)
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, after_resume[name]), name
