"""The training scripts are safe in a user's hands: a warm-up longer than the run warns; the same command run again
resumes its run, another run's folder is refused unless --overwrite_output_dir, averaging never mixes runs; bad
arguments fail before any data work with one message naming the flag; a GPT-style model's tokenizer leaves prompts
open for text generation; `accelerate launch --cpu --num_processes 2` stops and says what to pass; a time budget
stops training cleanly, then the last checkpoints are averaged where the validation set prefers them and the test
set is scored. Tiny models, a few seconds each (the SIGKILL tests are in test_interrupted_runs.py).
"""

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    MarianConfig,
    MarianMTModel,
    TrainerControl,
    TrainerState,
    ViTImageProcessorPil,
)

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import average_checkpoints  # noqa: E402
import run_common  # noqa: E402
import run_control  # noqa: E402
import train_causal_lm  # noqa: E402
import train_classifier  # noqa: E402
import train_image_classifier  # noqa: E402
import train_masked_lm  # noqa: E402
import train_seq2seq  # noqa: E402
from demo_text_data import word_tokenizer  # noqa: E402
from test_training_scripts import QUIET, SEQ2SEQ_DEMO, TINY_MODEL, weights  # noqa: E402
from train_tokenizer import train_bpe_tokenizer  # noqa: E402

RUN = [*SEQ2SEQ_DEMO, "--do_train", "--max_steps", "8", "--save_steps", "4", "--per_device_train_batch_size", "8"]
RUN += ["--demo_train_size", "200"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, list[str]]:
    """A run of 8 steps with checkpoints at 4 and 8, and the arguments that made it (without --output_dir)."""
    output_dir = tmp_path_factory.mktemp("run") / "out"
    train_seq2seq.main([*RUN, "--output_dir", str(output_dir)])
    return output_dir, RUN


def copy_of(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "out"))


def run_ids(output_dir: Path) -> set[str | None]:
    return {average_checkpoints.run_id(path) for path in output_dir.glob("checkpoint-*")}


def test_warmup_longer_than_half_the_run_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="run_common"):
        train_seq2seq.main([*SEQ2SEQ_DEMO, "--output_dir", str(tmp_path / "o"), "--do_train", "--max_steps", "4"])
    assert "warm-up (8 steps) is longer than half of this run (4 optimizer steps)" in caplog.text
    assert "--warmup_steps" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="run_common"):
        run_common.warn_if_warmup_outlasts_run(warmup=4, num_training_steps=8)
    assert caplog.text == ""


def test_the_same_command_again_resumes_its_run(finished_run, tmp_path, caplog):
    run, argv = finished_run
    output_dir = copy_of(run, tmp_path)
    before = weights(output_dir)
    with caplog.at_level(logging.INFO, logger="run_control"):
        train_seq2seq.main([*argv, "--output_dir", str(output_dir)])
    assert "holds this run: resuming from checkpoint-8" in caplog.text
    assert "ends the run: its weights are loaded, nothing is trained" in caplog.text
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]
    after = weights(output_dir)
    assert all(torch.equal(tensor, after[name]) for name, tensor in before.items())


def test_another_run_is_refused_unless_asked_to_overwrite(finished_run, tmp_path):
    run, argv = finished_run
    output_dir = copy_of(run, tmp_path)
    (old_id,) = run_ids(output_dir)
    other = [*argv, "--output_dir", str(output_dir), "--seed", "1"]
    with pytest.raises(ValueError, match=r"holds another run \(--seed 0 there, 1 here\).*--overwrite_output_dir"):
        train_seq2seq.main(other)
    assert run_ids(output_dir) == {old_id}  # nothing touched

    train_seq2seq.main([*other, "--max_steps", "4", "--overwrite_output_dir"])
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-4"]  # the old ones went
    (new_id,) = run_ids(output_dir)
    assert new_id not in (old_id, None)
    assert json.loads((output_dir / run_control.RUN_RECORD).read_text())["seed"] == 1

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds files but no run_arguments.json. Pass --overwrite_output_dir"):
        train_seq2seq.main([*argv, "--output_dir", str(stray)])


def test_averaging_takes_complete_checkpoints_of_one_run(finished_run, tmp_path):
    output_dir = copy_of(finished_run[0], tmp_path)
    interrupted = output_dir / "checkpoint-12"  # a save killed before its trainer state was written
    shutil.copytree(output_dir / "checkpoint-8", interrupted)
    (interrupted / "trainer_state.json").unlink()
    assert [path.name for path in average_checkpoints.last_checkpoints(output_dir, 1)] == ["checkpoint-8"]

    state_file = output_dir / "checkpoint-8" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["stateful_callbacks"]["RunTracker"]["attributes"]["run_id"] = "another-run"
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError, match="come from different runs"):
        average_checkpoints.last_checkpoints(output_dir, 2)


def write_pairs(path: Path, pairs: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"translation": {"en": en, "de": de}}) + "\n" for en, de in pairs))
    return path


PAIRS = [("she has two books", "sie hat zwei Bücher"), ("forty-two", "zweiundvierzig")] * 20


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--config_overrides", "norm_position=sideways"], r"--config_overrides: [\s\S]*'norm_position' expected"),
        (["--config_overrides", "d_modle=32"], r"--config_overrides: 'd_modle' is not a VanillaTransformerConfig"),
        (["--preset", "transformer-tiny"], r"--preset 'transformer-tiny' is not one of"),
        (["--train_file", "{tmp}/missing.jsonl"], r"--train_file \S+missing.jsonl: no such file"),
        (["--train_file", "{tmp}/empty.jsonl"], r"--train_file \S+empty.jsonl is empty"),
        (["--train_file", "{tmp}/train.jsonl", "--validation_file", "{tmp}/blank.jsonl"], r"--validation_file \S+ is"),
        (["--train_file", "{tmp}/train.jsonl", "--source_lang", "fr"], r"--source_lang 'fr' is not a language of"),
        (["--train_file", "{tmp}/train.jsonl", "--source_column", "src"], r"--source_column 'src' is not a column"),
    ],
)  # fmt: skip
def test_bad_arguments_fail_before_any_data_work(tmp_path, monkeypatch, arguments, message):
    (tmp_path / "empty.jsonl").touch()
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    write_pairs(tmp_path / "train.jsonl", PAIRS)

    def data_work(*args, **kwargs):
        raise AssertionError("data processing or tokenizer training started before the arguments were checked")

    monkeypatch.setattr(train_seq2seq, "train_bpe_tokenizer", data_work)
    monkeypatch.setattr("datasets.Dataset.map", data_work)
    arguments = [argument.format(tmp=tmp_path) for argument in arguments]
    if "--train_file" not in arguments:  # a bad model argument fails even before a missing data file is noticed
        arguments += ["--train_file", str(tmp_path / "missing.jsonl")]
    with pytest.raises(ValueError, match=message):
        train_seq2seq.main([*TINY_MODEL, *QUIET, "--output_dir", str(tmp_path / "out"), "--do_train", *arguments])
    assert not (tmp_path / "out").exists()


def test_causal_lm_text_column_is_checked_before_tokenizer_training(tmp_path, monkeypatch):
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "one plus one"}) + "\n")
    monkeypatch.setattr(train_causal_lm, "train_bpe_tokenizer", lambda *a, **k: pytest.fail("tokenizer trained"))
    with pytest.raises(ValueError, match=r"--text_column 'body' is not in the data; it has \['text'\]"):
        train_causal_lm.main(
            [*TINY_MODEL, *QUIET, "--output_dir", str(tmp_path / "o"), "--do_train", "--text_column", "body"]
            + ["--train_file", str(tmp_path / "train.jsonl")]
        )


SHORT_RUN = [*QUIET, "--do_train", "--max_steps", "2", "--warmup_steps", "1"]
TEXT_DEMO = ["--demo_train_size", "200", "--demo_validation_size", "10"]
SCRIPTS = {  # each script, and the arguments of a short run of it on its demo data
    "seq2seq": (train_seq2seq, [*TINY_MODEL, *SHORT_RUN, *TEXT_DEMO]),
    "seq2seq from Marian": (train_seq2seq, [*SHORT_RUN, *TEXT_DEMO, "--model_name_or_path", "{tmp}/marian"]),
    "causal LM": (train_causal_lm, [*TINY_MODEL, *SHORT_RUN, *TEXT_DEMO, "--block_size", "32"]),
    "masked LM": (train_masked_lm, [*TINY_MODEL, *SHORT_RUN, *TEXT_DEMO]),
    "classifier": (train_classifier, [*TINY_MODEL, *SHORT_RUN]),
    "image classifier": (
        train_image_classifier,
        ["--config_overrides", "d_model=16,encoder_layers=1,encoder_attention_heads=2,encoder_ffn_dim=32", *SHORT_RUN],
    ),
}


@pytest.mark.parametrize("script", ["classifier", "image classifier", "causal LM", "masked LM"])
def test_label_smoothing_trains_with_every_script(tmp_path, script):
    """--label_smoothing_factor 0.1 trains every head the scripts train (seq2seq smooths by default): each head's
    loss is smoothed with its own arguments (the classifiers' are not the language models')."""
    module, run = SCRIPTS[script]
    metrics = module.main([*run, "--label_smoothing_factor", "0.1", "--output_dir", str(tmp_path / "out")])
    assert math.isfinite(metrics["train_loss"]) and metrics["train_loss"] > 0


def folder_contents(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.mark.parametrize(
    ("script", "arguments", "message"),
    [
        ("seq2seq", ["--config_overrides", "norm_position=sideways"], "'norm_position' expected"),
        ("seq2seq", ["--warmup_steps", "0"], r"The Noam schedule needs --warmup_steps > 0, got 0"),
        ("seq2seq", ["--source_lang", "fr"], "--source_lang 'fr' is not a language of the train data"),
        ("seq2seq", ["--do_predict"], r"--do_predict needs a test split; got \['train', 'validation'\]"),
        ("seq2seq", ["--max_tokens", "8"], "--max_tokens 8 cannot hold the longest training pair"),
        ("seq2seq from Marian", ["--num_sequences", "9"], "--num_sequences fixes the sequence slots of flattened"),
        ("causal LM", ["--block_size", "1"], "--block_size must be 2 or more"),
        ("causal LM", ["--text_column", "body"], "--text_column 'body' is not in the data"),
        ("causal LM", ["--train_file", "{tmp}/texts.jsonl", "--do_eval"], "--do_eval needs a validation split"),
        ("masked LM", ["--mlm_probability", "1.5"], r"--mlm_probability must be in \(0, 1\)"),
        ("masked LM", ["--do_eval", "--validation_split", "dev"], "--do_eval needs a validation split"),
        ("classifier", ["--label_column", "topic"], "--label_column 'topic' is not in the data"),
        ("classifier", ["--do_eval", "--validation_split", "dev"], "--do_eval needs a validation split"),
        ("classifier", ["--lr_scheduler_type", "linear", "--lr_scheduler_kwargs", '{"num_cycles": 2}'], "num_cycles"),
        ("image classifier", ["--image_column_name", "picture"], "--image_column_name 'picture' is not in the data"),
        ("image classifier", ["--config_overrides", "norm_position=sideways"], "--config_overrides: .*norm_position"),
        ("image classifier", ["--do_eval", "--validation_split", "dev", "--train_val_split", "0"], "--do_eval needs"),
    ],
)  # fmt: skip
def test_a_bad_argument_leaves_the_previous_run_as_it_was(finished_run, tmp_path, script, arguments, message):
    """Every check that can fail (flags, the data against them, the token budget against the longest pair, the layout
    against the model and device, the model config, the schedule the Trainer builds as training starts) fails before
    --overwrite_output_dir removes anything: the folder of the previous run keeps every file as it was."""
    assert_refused_and_the_run_kept(finished_run[0], tmp_path, script, arguments, message)


def assert_refused_and_the_run_kept(run: Path, tmp_path: Path, script: str, arguments: list[str], message: str):
    """`script` with `arguments` and --overwrite_output_dir on a copy of `run` fails with `message`, leaving every file
    of the copy as it was. {tmp}/ in an argument names a file the test writes there."""
    output_dir = copy_of(run, tmp_path)
    before = folder_contents(output_dir)
    assert "checkpoint-8/model.safetensors" in before  # what --overwrite_output_dir would remove
    module, run_arguments = SCRIPTS[script]
    if "{tmp}/marian" in run_arguments:
        tiny_marian(tmp_path / "marian")
    (tmp_path / "texts.jsonl").write_text(json.dumps({"text": "one plus one is two"}) + "\n")
    one_class = [{"text": f"the river number {n}", "label": "rivers"} for n in range(8)]
    (tmp_path / "one_class.jsonl").write_text("".join(json.dumps(row) + "\n" for row in one_class))
    ViTImageProcessorPil(size={"height": 8, "width": 8}).save_pretrained(tmp_path / "processor8")
    argv = [argument.replace("{tmp}", str(tmp_path)) for argument in [*run_arguments, *arguments]]
    with pytest.raises((ValueError, TypeError), match=message):  # TypeError: a schedule's unknown keyword
        module.main([*argv, "--output_dir", str(output_dir), "--overwrite_output_dir"])
    assert folder_contents(output_dir) == before


TINY_SIZES = TINY_MODEL[TINY_MODEL.index("--config_overrides") + 1]
LEARNED_POSITIONS = ["--config_overrides", TINY_SIZES + ",position_embedding_type=learned,max_position_embeddings="]
EVAL = ["--do_eval", "--demo_validation_size", "4"]


@pytest.mark.parametrize(
    ("script", "arguments", "message"),
    [
        *[(name, ["--label_smoothing_factor", "1.5"], r"--label_smoothing_factor must be in \[0, 1\), got 1.5")
          for name in ("seq2seq", "causal LM", "masked LM", "classifier", "image classifier")],
        ("masked LM", ["--label_smoothing_factor", "-0.1"], r"--label_smoothing_factor must be in \[0, 1\)"),
        ("seq2seq", ["--per_device_eval_batch_size", "0", *EVAL], "--per_device_eval_batch_size must be 1 or more"),
        ("seq2seq", ["--eval_accumulation_steps", "0", *EVAL], "--eval_accumulation_steps must be 1 or more"),
        ("seq2seq", ["--max_new_tokens_over_source", "-1000", *EVAL], "--max_new_tokens_over_source must be 0 or"),
        ("seq2seq", ["--generation_max_length", "1", *EVAL], "--generation_max_length must be 2 or more"),
        ("seq2seq", ["--generation_num_beams", "0", *EVAL], "--generation_num_beams must be 1 or more"),
        ("seq2seq", ["--gnmt_alpha", "nan", *EVAL], "--gnmt_alpha must be a finite number, got nan"),
        ("seq2seq", ["--max_source_length", "0"], r"--max_source_length must be 1 or more, got 0 \(tokens; the"),
        ("seq2seq", ["--max_target_length", "0"], r"--max_target_length must be 1 or more, got 0 \(tokens; the"),
        ("seq2seq", ["--max_eval_samples", "0", *EVAL], "--max_eval_samples must be 1 or more"),
        ("seq2seq", ["--num_train_epochs", "0", "--max_steps", "-1"], "--num_train_epochs must be above 0 without"),
        ("seq2seq", ["--save_steps", "-1"], "--save_steps must be above 0 with --save_strategy steps"),
        ("seq2seq", ["--logging_steps", "-1"], "--logging_steps must be above 0 with --logging_strategy steps"),
        ("seq2seq", ["--weight_decay", "-1"], "--weight_decay must be 0 or more"),
        ("seq2seq", ["--save_total_limit", "0"], "--save_total_limit must be 1 or more"),
        ("seq2seq", ["--tp_size", "0"], "--tp_size must be 1 or more"),
        ("seq2seq", ["--eval_every_minutes", "1"], "--eval_every_minutes evaluates .* it needs --do_eval"),
        ("seq2seq", ["--metric_for_best_model", "blue", *EVAL], "--metric_for_best_model 'blue' is not a metric"),
        ("seq2seq", ["--metric_for_best_model", "bleu", "--predict_with_generate", "false", *EVAL], r"\['loss'\]"),
        ("seq2seq", [LEARNED_POSITIONS[0], LEARNED_POSITIONS[1] + "40"], "longest source.*max_position_embeddings=40"),
        ("seq2seq", [LEARNED_POSITIONS[0], LEARNED_POSITIONS[1] + "32", "--max_source_length", "24"]
         + ["--max_target_length", "24", *EVAL], "Decoding the validation split up to max_length 75 needs 74"),
        ("seq2seq", ["--metric_for_best_model", "bleu", "--prediction_loss_only", *EVAL], r"\['loss'\]"),
        ("seq2seq", ["--dataloader_drop_last", "--demo_train_size", "4"], "train split holds 4 examples, fewer than"),
        ("causal LM", ["--label_names", "target", *EVAL], r"--label_names \['target'\]: the scripts' batches hold"),
        ("causal LM", [LEARNED_POSITIONS[0], LEARNED_POSITIONS[1] + "24"], "--block_size 32 needs 32 positions"),
        ("causal LM", ["--block_size", "64", *EVAL[:1], "--demo_validation_size", "1"], "validation split has no"),
        ("causal LM", ["--metric_for_best_model", "perplexity", *EVAL, "--eval_strategy", "steps"]
         + ["--eval_steps", "1"], r"'perplexity' is not a metric this script's evaluation reports: \['loss'\]"),
        ("masked LM", ["--max_seq_length", "0"], "--max_seq_length must be 1 or more"),
        ("masked LM", [LEARNED_POSITIONS[0], LEARNED_POSITIONS[1] + "8"], "The train split's longest text needs"),
        ("classifier", ["--max_seq_length", "0"], "--max_seq_length must be 1 or more"),
        ("classifier", [LEARNED_POSITIONS[0], LEARNED_POSITIONS[1] + "8"], "The train split's longest text needs"),
        ("classifier", ["--metric_for_best_model", "bleu", *EVAL[:1]], "'bleu' is not a metric this script's"),
        ("classifier", ["--train_file", "{tmp}/one_class.jsonl"], r"holds the labels \['rivers'\]: a classifier"),
        ("classifier", ["--prediction_loss_only", "--do_eval"], "--prediction_loss_only drops the predictions"),
        ("masked LM", ["--dataloader_drop_last", *EVAL, "--per_device_eval_batch_size", "64"], "validation split hol"),
        ("image classifier", ["--prediction_loss_only", "--do_eval"], "--prediction_loss_only drops the predictions"),
        ("image classifier", ["--rotation_degrees", "-5"], "--rotation_degrees must be 0 or more, got -5"),
        ("image classifier", ["--translate", "-0.1"], r"--translate must be in \[0, 1\], got -0.1"),
        ("image classifier", ["--scale_jitter", "-0.1"], r"--scale_jitter must be in \[0, 1\), got -0.1"),
        ("image classifier", ["--scale_jitter", "1"], r"--scale_jitter must be in \[0, 1\), got 1"),
        ("image classifier", ["--metric_for_best_model", "f1", "--do_eval"], "'f1' is not a metric this script's"),
        ("image classifier", ["--config_overrides", "image_size=16,patch_size=4,d_model=16,encoder_layers=1"]
         + ["--image_processor_name", "{tmp}/processor8"], r"makes images of shape \(3, 8, 8\); the model takes"),
        *[(name, ["--neftune_noise_alpha", "-1"], "--neftune_noise_alpha must be 0 or more, got -1")
          for name in ("seq2seq", "causal LM", "masked LM", "classifier")],
        ("seq2seq", ["--dataloader_num_workers", "1", "--dataloader_prefetch_factor", "0"], "factor must be 1"),
        ("seq2seq", ["--dataloader_prefetch_factor", "2"], "--dataloader_prefetch_factor can only be set"),
        ("masked LM", ["--config_overrides", TINY_SIZES + ",vocab_size=8"], "vocab_size=8 is below the tokenizer's"),
        ("causal LM", ["--config_overrides", TINY_SIZES + ",is_encoder_decoder=true"],
         "is_encoder_decoder=True: this script builds a model with is_encoder_decoder=False"),
        ("masked LM", ["--config_overrides", TINY_SIZES + ",is_decoder=true"], "builds a model with is_decoder=False"),
        ("seq2seq", ["--fp16", "true", "--use_cpu", "true"], "--fp16 trains in float16 on an accelerator only"),
        ("seq2seq", ["--sortish_sampler", "true"], "--sortish_sampler does nothing"),
        ("masked LM", ["--do_eval", "--validation_split", "train"], "--validation_split train would score the train"),
        ("image classifier", ["--validation_split", "train"], "--validation_split train would score the training"),
        ("seq2seq", ["--adam_beta1", "1.5"], r"--adam_beta1 must be in \[0, 1\), got 1.5"),
        ("classifier", ["--adam_beta2", "-0.1"], r"--adam_beta2 must be in \[0, 1\), got -0.1"),
        ("seq2seq", ["--adam_epsilon", "-1"], "--adam_epsilon must be 0 or more, got -1"),
        ("seq2seq", ["--optim_args", "foo"], "--optim_args 'foo' must be comma-separated key=value pairs"),
        ("seq2seq", ["--resume_from_checkpoint", "{tmp}/nowhere"], r"--resume_from_checkpoint \S+nowhere: no such"),
        ("seq2seq", ["--resume_from_checkpoint", "{tmp}"], r"--resume_from_checkpoint \S+: not a checkpoint"),
        ("seq2seq", ["--tokenizer_name", "{tmp}/nowhere/tokenizer"], r"--tokenizer_name \S+: no such folder"),
        ("classifier", ["--model_name_or_path", "{tmp}/nowhere"], r"--model_name_or_path \S+nowhere: no such folder"),
        ("image classifier", ["--image_processor_name", "./nowhere"], "--image_processor_name ./nowhere: no such"),
    ],
)  # fmt: skip
def test_every_value_read_late_is_refused_before_the_folder_is_cleared(
    finished_run, tmp_path, script, arguments, message
):
    """Values the Trainer reads only at its first step, at evaluation or at saving (label smoothing, evaluation batch
    size, decoding lengths, step intervals, label names, the metric that chooses weights, predictions the evaluation
    needs), the scripts' own (truncation lengths, augmentation ranges, sample limits) and the model against the data
    (positions against the longest sequence, block or decoded output; the image size against the processor's; a
    class count; a split that fills no batch) are all refused before --overwrite_output_dir removes anything: the
    previous run keeps every file."""
    assert_refused_and_the_run_kept(finished_run[0], tmp_path, script, arguments, message)


@pytest.mark.parametrize("make_tokenizer", ["bpe", "word"])
def test_prompt_tokenizer_leaves_prompts_open(make_tokenizer):
    """train_tokenizer.py's BPE ends every text with </s> ("$A </s>"), the demo's word tokenizer wraps it
    ("<s> $A </s>"); for a language model both end prompts without </s>, and a leading <s> stays."""
    if make_tokenizer == "bpe":
        tokenizer = train_bpe_tokenizer(["twelve minus three is nine"] * 20, vocab_size=300)
    else:
        tokenizer = word_tokenizer()
    text = "the river" if make_tokenizer == "word" else "twelve minus"
    before = tokenizer(text)["input_ids"]
    assert before[-1] == tokenizer.eos_token_id
    after = train_causal_lm.prompt_tokenizer(tokenizer)(text)["input_ids"]
    assert after == before[:-1]


def test_causal_lm_pipeline_continues_the_prompt(tmp_path):
    from transformers import pipeline

    output_dir = tmp_path / "lm"
    train_causal_lm.main(
        [*TINY_MODEL, *QUIET, "--output_dir", str(output_dir), "--do_train", "--max_steps", "4"]
        + ["--demo_train_size", "200", "--demo_validation_size", "10", "--block_size", "32", "--warmup_steps", "2"]
    )
    generator = pipeline("text-generation", model=str(output_dir))
    prompt = "twelve minus"
    prompt_ids = generator.preprocess(prompt)["input_ids"][0].tolist()
    assert prompt_ids and prompt_ids[-1] != generator.tokenizer.eos_token_id  # the prompt is not closed
    continuation = generator(prompt, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert continuation.startswith(prompt) and len(continuation) > len(prompt)


def test_accelerate_launch_cpu_with_two_processes_stops_and_says_what_to_pass(tmp_path):
    if torch.accelerator.is_available():
        pytest.skip("on a machine with an accelerator the launcher starts its processes")
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    command += [str(TRAINING_DIR / "train_seq2seq.py"), *SEQ2SEQ_DEMO, "--output_dir", str(tmp_path / "o")]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert result.returncode != 0
    assert "--multi_gpu --num_processes N" in result.stderr and "starts a single process" in result.stderr
    assert not (tmp_path / "o").exists()


def test_no_pinned_memory_without_accelerator(tmp_path):
    arguments = train_seq2seq.PaperSeq2SeqTrainingArguments(output_dir=str(tmp_path), dataloader_pin_memory=True)
    assert arguments.dataloader_pin_memory == torch.accelerator.is_available()


def test_run_tracker_keeps_time_across_restarts(tmp_path):
    now = [0.0]
    tracker = run_control.RunTracker(max_train_minutes=1, eval_every_minutes=0.5, clock=lambda: now[0])
    state, control = TrainerState(stateful_callbacks=[tracker]), TrainerControl()
    args = SimpleNamespace(output_dir=str(tmp_path), save_strategy="steps")
    tracker.on_train_begin(args, state, control)
    for second, should_evaluate, should_stop in [(20, False, False), (31, True, False), (45, False, False)]:
        now[0], control = second, TrainerControl()
        tracker.on_step_end(args, state, control)
        assert (control.should_evaluate, control.should_training_stop) == (should_evaluate, should_stop), second

    saved = tracker.state()  # what a checkpoint at 45 s holds
    assert saved["attributes"]["train_seconds"] == 45
    now[0] = 56.0  # trained on for 11 s, recorded beside the checkpoints; the process dies, another resumes at 1000
    tracker.on_step_end(args, state, TrainerControl())
    resumed = run_control.RunTracker(max_train_minutes=1, eval_every_minutes=0.5, clock=lambda: now[0])
    now[0] = 1000.0
    resumed.on_train_begin(args, TrainerState(stateful_callbacks={"RunTracker": saved}), TrainerControl())
    assert resumed.run_id == tracker.run_id and resumed.elapsed_seconds() == 56  # the 11 s lost count

    now[0], control = 1005.0, TrainerControl()  # 61 s of training: the budget is spent
    resumed.on_step_end(args, state, control)
    assert control.should_training_stop and control.should_save  # the evaluation due at 60 s is left to what follows
    assert not control.should_evaluate
    resumed.on_train_end(None, state, control)
    now[0] = 2000.0
    assert resumed.elapsed_seconds() == 61  # the clock stopped with training
    other_run = run_control.RunTracker(clock=lambda: now[0])
    other_run.on_train_begin(args, TrainerState(stateful_callbacks=[other_run]), TrainerControl())
    assert other_run.elapsed_seconds() == 0  # another run's recorded time is not this run's


def test_cooldown_factor_falls_linearly_over_the_budgets_end(tmp_path):
    now = [0.0]
    tracker = run_control.RunTracker(max_train_minutes=10, clock=lambda: now[0], cooldown_minutes=2)
    args = SimpleNamespace(output_dir=str(tmp_path))
    tracker.on_train_begin(args, TrainerState(stateful_callbacks=[tracker]), TrainerControl())
    for second, factor in [(0, 1.0), (480, 1.0), (510, 0.75), (570, 0.25), (600, 0.0), (700, 0.0)]:
        now[0] = second
        assert tracker.learning_rate_factor() == pytest.approx(factor), second
    assert run_control.RunTracker(max_train_minutes=10).learning_rate_factor() == 1.0  # no cool-down asked


@pytest.mark.parametrize(
    ("minutes", "message"),
    [
        ({"cooldown_minutes": 2}, "must be set"),
        ({"cooldown_minutes": 2, "max_train_minutes": 1}, "at least as long"),
        ({"cooldown_minutes": 0, "max_train_minutes": 1}, "--cooldown_minutes must be positive"),
        *[
            (
                {"cooldown_minutes": 1, "max_train_minutes": 2, "noam_schedule": False, "lr_scheduler_type": s}
                | {"eval_strategy": "steps", "eval_steps": 10},  # what transformers asks of these schedules
                f"type {s} sets the rate",
            )
            for s in ("reduce_lr_on_plateau", "greedy")  # they follow a metric: no step schedule to cool down
        ],
    ],
)
def test_cooldown_needs_a_time_budget_to_cool(tmp_path, minutes, message):
    with pytest.raises(ValueError, match=message):
        train_seq2seq.PaperSeq2SeqTrainingArguments(output_dir=str(tmp_path), **minutes)


def test_cooldown_takes_the_noam_rate_to_zero_at_the_budget(tmp_path, monkeypatch):
    """The logged learning rate is the Noam schedule's until the cool-down, then a falling share of it, near zero at
    the last step (the run's clock is fake: each reading one second later)."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(run_control, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    files = {split: write_pairs(tmp_path / f"{split}.jsonl", PAIRS[:40]) for split in ("train",)}
    budget, cooldown = 1.0, 0.5  # minutes: about 15 steps, each 4 clock readings
    train_seq2seq.main(
        [*TINY_MODEL, *QUIET, "--output_dir", str(tmp_path / "out"), "--do_train"]
        + ["--train_file", str(files["train"]), "--tokenizer_vocab_size", "120", "--per_device_train_batch_size", "4"]
        + ["--max_steps", "100000", "--warmup_steps", "4", "--max_train_minutes", str(budget)]
        + ["--cooldown_minutes", str(cooldown), "--logging_steps", "1", "--save_strategy", "no"]
    )
    history = json.loads((tmp_path / "out" / "trainer_state.json").read_text())["log_history"]
    d_model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out").config.d_model
    shares = [
        (entry["train_minutes"], entry["learning_rate"] / run_common.noam_learning_rate(entry["step"], d_model, 4))
        for entry in history
        if "learning_rate" in entry
    ]
    # A logged rate was set by the scheduler's step a few clock readings before the log: margins of 3 and 6 seconds.
    before = [share for minutes, share in shares if minutes < budget - cooldown - 0.05]
    during = [share for minutes, share in shares if minutes > budget - cooldown + 0.1]
    assert before and during
    assert before == pytest.approx([1.0] * len(before))
    assert all(later < earlier for earlier, later in zip(during, during[1:]))
    assert during[-1] < 0.2 and during[0] < 1.0  # the last rate was set one step (4 s) before the budget ended


def test_time_budget_stops_then_averages_and_scores_the_test_set(tmp_path, monkeypatch):
    ticks = iter(range(10**6))  # the run's clock: each reading one second later, so the budget is machine-free
    monkeypatch.setattr(run_control, "time", SimpleNamespace(monotonic=lambda: float(next(ticks))))
    sizes = {"train": 40, "validation": 6, "test": 4}
    files = {split: write_pairs(tmp_path / f"{split}.jsonl", PAIRS[:size]) for split, size in sizes.items()}
    output_dir = tmp_path / "out"
    budget = 0.25  # minutes: about 15 steps
    metrics = train_seq2seq.main(
        [*TINY_MODEL, *QUIET, "--output_dir", str(output_dir), "--do_train", "--do_eval", "--do_predict"]
        + ["--train_file", str(files["train"]), "--validation_file", str(files["validation"])]
        + ["--test_file", str(files["test"]), "--tokenizer_vocab_size", "120", "--per_device_train_batch_size", "4"]
        + ["--max_steps", "100000", "--warmup_steps", "4", "--max_train_minutes", str(budget)]
        + ["--save_every_minutes", "0.05", "--save_steps", "100000", "--average_last_checkpoints", "2"]
        + ["--max_new_tokens_over_source", "4"]
    )
    checkpoints = average_checkpoints.complete_checkpoints(output_dir)
    last_step = int(checkpoints[-1].name.split("-")[1])
    assert 2 < len(checkpoints) and last_step < 100000  # saved every 3 s, and at the stop
    assert budget <= metrics["train_minutes"] < budget + 0.1  # each clock reading adds a second
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())
    assert state["global_step"] == last_step
    assert {"test_bleu", "test_bleu_lowercase", "test_chrf", "eval_loss_last", "eval_loss_averaged"} <= metrics.keys()
    assert (output_dir / "test_generations.txt").read_text().count("\n") == 4

    final, last, before_last = weights(output_dir), weights(checkpoints[-1]), weights(checkpoints[-2])
    averaged_kept = metrics["eval_loss_averaged"] < metrics["eval_loss_last"]
    assert metrics["averaged_checkpoints"] == (2 if averaged_kept else 1)
    assert metrics["eval_loss"] == min(metrics["eval_loss_averaged"], metrics["eval_loss_last"])
    for name, tensor in final.items():
        expected = (last[name].double() + before_last[name].double()) / 2 if averaged_kept else last[name]
        torch.testing.assert_close(tensor, expected.float(), rtol=0, atol=1e-7)
    card = (output_dir / "README.md").read_text()
    assert "bleu_lowercase" in card and "training minutes" in card


def tiny_marian(folder: Path) -> Path:
    """A new HF Marian model and its BPE tokenizer (of PAIRS) saved in `folder`, as the recipe's INIT_MODEL."""
    tokenizer = train_bpe_tokenizer((text for pair in PAIRS for text in pair), 120)
    start_id = tokenizer.bos_token_id
    config = MarianConfig(
        vocab_size=len(tokenizer),
        decoder_vocab_size=len(tokenizer),
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=start_id,
        decoder_start_token_id=start_id,
    )
    torch.manual_seed(0)
    MarianMTModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_saved_transformers_seq2seq_model_trains_with_the_script(tmp_path):
    """What the recipe's INIT_MODEL does (benchmarks/multi30k_time_to_bleu.py trains HF Marian so): any saved seq2seq
    model and its tokenizer train with the script's flags, checkpoint averaging included (Marian never saves its
    fixed sinusoid tables); the run's log history is kept (trainer_state.json), and the package's model card is
    written for its own models only."""
    files = {
        split: write_pairs(tmp_path / f"{split}.jsonl", PAIRS[:size])
        for split, size in [("train", 40), ("validation", 6)]
    }
    init_dir, output_dir = tiny_marian(tmp_path / "marian-init"), tmp_path / "out"
    metrics = train_seq2seq.main(
        [*QUIET, "--model_name_or_path", str(init_dir), "--output_dir", str(output_dir), "--do_train", "--do_eval"]
        + ["--train_file", str(files["train"]), "--validation_file", str(files["validation"])]
        + ["--source_lang", "en", "--target_lang", "de", "--max_steps", "6", "--warmup_steps", "2"]
        + ["--per_device_train_batch_size", "4", "--logging_steps", "2", "--max_new_tokens_over_source", "4"]
        + ["--save_steps", "3", "--average_last_checkpoints", "2", "--metric_for_best_model", "bleu"]
    )
    # Both weights were scored on validation, and the better kept (the last on a tie): its score and its count.
    last, averaged = metrics["eval_bleu_last"], metrics["eval_bleu_averaged"]
    assert metrics["eval_bleu"] == max(last, averaged)
    assert metrics["averaged_checkpoints"] == (2 if averaged > last else 1)
    trained = MarianMTModel.from_pretrained(output_dir)
    initial = MarianMTModel.from_pretrained(init_dir)
    assert not torch.equal(trained.model.shared.weight, initial.model.shared.weight)
    history = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history if "loss" in entry] == [2, 3, 4, 6]  # every 2 steps, and at the save
    assert json.loads((output_dir / "all_results.json").read_text())["eval_bleu"] == metrics["eval_bleu"]
    assert not (output_dir / "README.md").exists()


def test_the_multi30k_recipe_runs_end_to_end_on_a_tiny_corpus(tmp_path):
    """`training/recipes/multi30k.sh DATA_DIR OUT_DIR de-en` on three tiny files laid out as Multi30k, a tiny model
    (EXTRA_ARGS win over the recipe's flags) and a few seconds of budget: it translates the pair it is given, trains,
    stops on the clock, averages or keeps the last weights on validation, scores test2016 once and leaves a model the
    Auto classes load."""
    data_dir = tmp_path / "multi30k"
    data_dir.mkdir()
    for split, size in [("train", 40), ("validation", 6), ("test2016", 4)]:
        write_pairs(data_dir / f"{split}.jsonl", PAIRS[:size])
    tiny = "d_model=16,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
    tiny += "encoder_ffn_dim=32,decoder_ffn_dim=32"
    extra = f"--config_overrides {tiny} --tokenizer_vocab_size 120 --per_device_train_batch_size 4 "
    extra += "--warmup_steps 4 --save_every_minutes 0.02 --eval_every_minutes 0.05 --max_new_tokens_over_source 4"
    env = os.environ | {"TRAIN_MINUTES": "0.1", "PYTHON": sys.executable, "EXTRA_ARGS": extra, "OMP_NUM_THREADS": "1"}
    recipe = TRAINING_DIR / "recipes" / "multi30k.sh"
    out = tmp_path / "out"
    command = ["bash", str(recipe), str(data_dir), str(out), "de-en"]
    finished = subprocess.run(command, env=env, capture_output=True, text=True)
    assert finished.returncode == 0, finished.stderr[-3000:]
    arguments = json.loads((out / "run_arguments.json").read_text())
    assert (arguments["source_lang"], arguments["target_lang"]) == ("de", "en")
    results = json.loads((out / "all_results.json").read_text())
    assert 0.1 <= results["train_minutes"] < 1 and {"test_bleu", "test_bleu_lowercase", "eval_bleu"} <= results.keys()
    assert (out / "test_generations.txt").read_text().count("\n") == 4
    assert (out / run_common.BLEU_PLOT).exists() and "test2016.jsonl" in (out / "README.md").read_text()
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert model.config.d_model == 16


@pytest.mark.parametrize(
    "pair, message",
    [("en_de", "SOURCE-TARGET must name two keys"), ("en-fr", "has no 'en' or 'fr' key"), ("de-xx", "'xx'")],
)
def test_the_multi30k_recipe_refuses_a_language_pair_its_data_lacks(tmp_path, pair, message):
    """A pair the data does not hold stops the recipe before anything is trained, naming the pair."""
    data_dir = tmp_path / "multi30k"
    data_dir.mkdir()
    for split in ("train", "validation", "test2016"):
        write_pairs(data_dir / f"{split}.jsonl", PAIRS[:2])
    recipe = TRAINING_DIR / "recipes" / "multi30k.sh"
    command = ["bash", str(recipe), str(data_dir), str(tmp_path / "out"), pair]
    finished = subprocess.run(command, env=os.environ | {"PYTHON": sys.executable}, capture_output=True, text=True)
    assert finished.returncode == 2 and message in finished.stderr, finished.stderr
    assert not (tmp_path / "out").exists()
