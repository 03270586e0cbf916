"""A finished run is never lost: --overwrite_output_dir replaces it only once the new run has saved (whatever the new
run fails on before that, at any stage, or if it is killed, the old run is there file for file); one run per folder
(an OS lock, released when the process dies); a run that diverges stops with an error and keeps its last good
checkpoint; a full disk is named; label smoothing keeps the model picklable; the helper scripts keep what they find;
a resumed run reports the whole run's loss. Tiny models, a few seconds each.
"""

import errno
import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub.constants
import pytest
import torch
from transformers import TrainerCallback

TRAINING_DIR = Path(__file__).resolve().parents[1] / "training"
sys.path.insert(0, str(TRAINING_DIR))

import average_checkpoints  # noqa: E402
import run_common  # noqa: E402
import run_control  # noqa: E402
import train_causal_lm  # noqa: E402
import train_classifier  # noqa: E402
import train_masked_lm  # noqa: E402
import train_seq2seq  # noqa: E402
from test_safe_scripts import RUN, TINY_SIZES, copy_of, folder_contents  # noqa: E402
from test_training_scripts import QUIET, TINY_MODEL, tiny_translation_config, weights  # noqa: E402

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration  # noqa: E402


@pytest.fixture(scope="module")
def old_run(tmp_path_factory) -> Path:
    """A finished run of 8 steps (checkpoints at 4 and 8) that the tests try to replace."""
    output_dir = tmp_path_factory.mktemp("old") / "out"
    train_seq2seq.main([*RUN, "--output_dir", str(output_dir)])
    return output_dir


NEW_RUN = [*RUN, "--seed", "1", "--max_steps", "4", "--save_steps", "2", "--overwrite_output_dir"]


class FailAt(TrainerCallback):
    """Makes the run fail where a real failure would strike: in the first training step, or at the first save."""

    def __init__(self, stage: str, output_dir: Path):
        self.stage, self.output_dir = stage, output_dir

    def on_step_begin(self, args, state, control, **kwargs):
        if self.stage == "first step":
            raise RuntimeError("the first step failed")

    def on_step_end(self, args, state, control, **kwargs):
        if self.stage == "first save" and control.should_save:  # the optimizer's file goes to a full device
            checkpoint = self.output_dir / f"checkpoint-{state.global_step}"
            checkpoint.mkdir()
            (checkpoint / "optimizer.pt").symlink_to("/dev/full")


def trainer_with(callback: TrainerCallback) -> type:
    """The seq2seq script's Trainer class with `callback` added."""
    trainer_class = train_seq2seq.PaperSeq2SeqTrainer

    class TrainerWithCallback(trainer_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.add_callback(callback)

    return TrainerWithCallback


def with_callback(monkeypatch, callback: TrainerCallback) -> None:
    monkeypatch.setattr(train_seq2seq, "PaperSeq2SeqTrainer", trainer_with(callback))


@pytest.mark.parametrize(
    ("stage", "arguments", "error"),
    [
        ("argument", ["--adam_beta1", "1.5"], r"--adam_beta1 must be in \[0, 1\), got 1.5"),
        ("data", ["--train_file", "{tmp}/missing.jsonl"], "--train_file .*missing.jsonl: no such file"),
        ("model build", ["--config_overrides", TINY_SIZES + ",vocab_size=10"], "vocab_size=10 is below the tokeni"),
        ("first step", ["--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs", '{"bogus": 1}'], "bog"),
        ("first step", [], "the first step failed"),
        ("first save", [], "unexpected pos|write failed"),
    ],
)  # fmt: skip
def test_a_new_run_failing_before_its_first_save_leaves_the_old_run_file_for_file(
    old_run, tmp_path, monkeypatch, stage, arguments, error
):
    output_dir = copy_of(old_run, tmp_path)
    before = folder_contents(output_dir)
    if not arguments:
        with_callback(monkeypatch, FailAt(stage, output_dir))
    argv = [argument.replace("{tmp}", str(tmp_path)) for argument in [*NEW_RUN, *arguments]]
    with pytest.raises(Exception, match=error):
        train_seq2seq.main([*argv, "--output_dir", str(output_dir)])
    assert folder_contents(output_dir) == before


def test_the_old_run_goes_once_the_new_one_has_saved(old_run, tmp_path):
    output_dir = copy_of(old_run, tmp_path)
    (output_dir / "notes.txt").write_text("mine")  # not a run's file: kept
    (old_id,) = {average_checkpoints.run_id(path) for path in output_dir.glob("checkpoint-*")}
    train_seq2seq.main([*NEW_RUN, "--output_dir", str(output_dir)])
    assert sorted(path.name for path in output_dir.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert old_id not in {average_checkpoints.run_id(path) for path in output_dir.glob("checkpoint-*")}
    assert not (output_dir / run_control.REPLACED_RUN).exists()
    assert (output_dir / "notes.txt").read_text() == "mine"


KILLED_RUN = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
import train_seq2seq
from transformers import TrainerCallback

class KillAtStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

Trainer = train_seq2seq.PaperSeq2SeqTrainer
class KilledTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(KillAtStep())

train_seq2seq.PaperSeq2SeqTrainer = KilledTrainer
train_seq2seq.main(sys.argv[3:])
"""


def killed_run(argv: list[str], at_step: int) -> int:
    """train_seq2seq.main(argv) in a new process (a fork of this one, which has trained, can hang in OpenMP) that is
    SIGKILLed at the end of step `at_step`; its return code (-9 when killed)."""
    command = [sys.executable, "-c", KILLED_RUN, str(TRAINING_DIR), str(at_step), *argv]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, timeout=300, check=False, env=env).returncode


def test_a_new_run_killed_before_its_first_save_gives_the_old_run_back_when_the_folder_is_next_used(old_run, tmp_path):
    output_dir = copy_of(old_run, tmp_path)
    before = folder_contents(output_dir)
    assert killed_run([*NEW_RUN, "--output_dir", str(output_dir)], at_step=1) == -signal.SIGKILL
    assert (output_dir / run_control.REPLACED_RUN).is_dir()  # the kill left the old run set aside
    argument_types = (run_common.ModelArguments, train_seq2seq.DataArguments)
    argument_types += (train_seq2seq.PaperSeq2SeqTrainingArguments,)
    arguments = run_common.parse_script_arguments(argument_types, [*RUN, "--output_dir", str(output_dir)])
    folder = run_control.check_output_dir(arguments)  # the old run's command: the folder is settled first
    assert folder_contents(output_dir) == before
    assert folder.resumes and arguments[-1].resume_from_checkpoint == str(output_dir / "checkpoint-8")


def test_a_second_run_into_a_folder_in_use_is_refused_naming_the_first(tmp_path):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    ready_read, ready_write = os.pipe()
    holder = os.fork()
    if holder == 0:  # another process holds the folder, as a running training run does
        run_control.lock_output_dir(output_dir)
        os.write(ready_write, b"1")
        time.sleep(600)
        os._exit(0)
    os.read(ready_read, 1)
    try:
        with pytest.raises(ValueError, match=rf"--output_dir \S+ is in use by another run \(process {holder}\)"):
            train_seq2seq.main([*RUN, "--max_steps", "2", "--output_dir", str(output_dir)])
        assert sorted(path.name for path in output_dir.iterdir()) == [run_control.LOCK_FILE]
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
    train_seq2seq.main([*RUN, "--max_steps", "2", "--output_dir", str(output_dir)])  # the OS released the lock
    assert (output_dir / "model.safetensors").is_file()


def test_a_diverging_run_stops_with_an_error_and_keeps_its_last_good_checkpoint(tmp_path):
    """A learning rate of 1e30 makes the second step's loss non-finite (logging every 100 steps, the run logs at its
    saves): no checkpoint of that step is written, nor a final model."""
    output_dir = tmp_path / "out"
    argv = [*RUN, "--output_dir", str(output_dir), "--noam_schedule", "false", "--lr_scheduler_type", "constant"]
    argv += ["--learning_rate", "1e30", "--warmup_steps", "0", "--save_steps", "1", "--logging_steps", "100"]
    with pytest.raises(run_control.TrainingDiverged, match=r"diverged at step 2: .*last good checkpoint is \S+-1\b"):
        train_seq2seq.main(argv)
    assert [path.name for path in average_checkpoints.complete_checkpoints(output_dir)] == ["checkpoint-1"]
    assert all(tensor.isfinite().all() for tensor in weights(output_dir / "checkpoint-1").values())
    assert not (output_dir / "model.safetensors").exists()


def test_a_full_disk_is_named_and_the_old_run_kept(old_run, tmp_path, monkeypatch):
    """The run's state file goes to a full device (/dev/full: every write fails with ENOSPC) at the first save."""

    class FullDiskAtFirstSave(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if control.should_save:
                checkpoint = output_dir / f"checkpoint-{state.global_step}"
                checkpoint.mkdir()
                (checkpoint / "trainer_state.json").symlink_to("/dev/full")

    output_dir = copy_of(old_run, tmp_path)
    before = folder_contents(output_dir)
    with_callback(monkeypatch, FullDiskAtFirstSave())
    with pytest.raises(OSError, match=r"No space left on device while saving into --output_dir") as raised:
        train_seq2seq.main([*NEW_RUN, "--output_dir", str(output_dir)])
    assert raised.value.errno == errno.ENOSPC
    assert folder_contents(output_dir) == before


def test_torchs_failed_write_on_a_full_disk_is_named(tmp_path, monkeypatch):
    """torch's file writer reports a full disk as "unexpected pos", with no errno: named where the disk has no
    space left (its free space is what the test cannot make real without a small file system: faked)."""
    target = tmp_path / "optimizer.pt"
    target.symlink_to("/dev/full")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9, free=0))
    with pytest.raises(OSError, match="No space left on device") as raised:
        with run_control.disk_errors_named(tmp_path):
            torch.save({"a": torch.zeros(1000)}, target)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()  # with space left, torch's own error stays
    with pytest.raises(RuntimeError, match="unexpected pos"):
        with run_control.disk_errors_named(tmp_path):
            torch.save({"a": torch.zeros(1000)}, target)


def test_a_label_smoothed_model_pickles_and_computes_the_same_loss():
    """What data-loader workers started by spawn or forkserver need: the model, its loss included, pickles."""
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_translation_config()).eval()
    model.loss_function = run_common.label_smoothed_loss(0.1, model.loss_type)
    batch = {"input_ids": torch.randint(4, 40, (2, 5)), "labels": torch.randint(4, 40, (2, 4))}
    copy = pickle.loads(pickle.dumps(model))
    assert torch.equal(model(**batch).loss, copy(**batch).loss)
    unsmoothed = VanillaTransformerForConditionalGeneration(tiny_translation_config()).eval()
    unsmoothed.load_state_dict(model.state_dict())
    assert not torch.equal(model(**batch).loss, unsmoothed(**batch).loss)  # the smoothing is on


def test_a_resumed_run_reports_the_whole_runs_train_loss(tmp_path):
    """Killed at step 6 and run again, the run's train_loss is the uninterrupted run's (the steps before the
    checkpoint of step 4 counted from its logs), not the mean of steps 5-8 only."""
    argv = [*RUN, "--logging_steps", "3"]  # logs at 3 and 6; the run logs at its saves (4, 8) too
    uninterrupted = train_seq2seq.main([*argv, "--output_dir", str(tmp_path / "whole")])
    killed = tmp_path / "killed"
    assert killed_run([*argv, "--output_dir", str(killed)], at_step=6) == -signal.SIGKILL
    resumed = train_seq2seq.main([*argv, "--output_dir", str(killed)])
    assert resumed["train_loss"] == pytest.approx(uninterrupted["train_loss"], rel=1e-6)
    history = json.loads((killed / "trainer_state.json").read_text())["log_history"]
    after_resume = [entry["loss"] for entry in history if "loss" in entry and entry["step"] > 4]
    assert not math.isclose(resumed["train_loss"], sum(after_resume) / len(after_resume), rel_tol=1e-3)


@pytest.fixture(scope="module")
def masked_lm_checkpoint(tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("mlm") / "out"
    train_masked_lm.main(
        [*TINY_MODEL, *QUIET, "--do_train", "--max_steps", "2", "--save_steps", "2", "--warmup_steps", "1"]
        + ["--demo_train_size", "50", "--output_dir", str(output_dir)]
    )
    return output_dir / "checkpoint-2"


def test_a_causal_lm_is_not_resumed_from_a_masked_lms_checkpoint(masked_lm_checkpoint, tmp_path):
    output_dir = tmp_path / "lm"
    with pytest.raises(ValueError, match=r"holds a VanillaTransformerForMaskedLM; this script trains a .*ForCausalLM"):
        train_causal_lm.main(
            [*TINY_MODEL, "--report_to", "none", "--do_train", "--max_steps", "4", "--block_size", "16"]
            + ["--demo_train_size", "50", "--output_dir", str(output_dir)]
            + ["--resume_from_checkpoint", str(masked_lm_checkpoint)]
        )
    assert not (output_dir / "model.safetensors").exists()


def run_script(script: str, *arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(TRAINING_DIR / script), *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_train_tokenizer_refuses_a_file_as_output_and_a_negative_frequency(tmp_path):
    corpus, file = tmp_path / "corpus.txt", tmp_path / "a_file"
    corpus.write_text("one two three\n" * 10)
    file.write_text("mine")
    common = ["--files", str(corpus), "--vocab_size", "300"]
    refused = run_script("train_tokenizer.py", *common, "--output_dir", str(file))
    assert refused.returncode == 2 and f"--output_dir {file} is a file" in refused.stderr
    assert file.read_text() == "mine"
    refused = run_script("train_tokenizer.py", *common, "--output_dir", str(tmp_path / "t"), "--min_frequency", "-1")
    assert refused.returncode == 2 and "--min_frequency must be 0 or more, got -1" in refused.stderr
    assert not (tmp_path / "t").exists()


def test_averaging_refuses_to_write_over_a_run(old_run, tmp_path):
    run_dir = copy_of(old_run, tmp_path)
    before = folder_contents(run_dir)
    for output_dir, why in [(run_dir, "is the run averaged"), (run_dir / "checkpoint-4", "holds a run or a model")]:
        refused = run_script("average_checkpoints.py", "--run_dir", str(run_dir), "--last_k", "2", "--output_dir",
                             str(output_dir))  # fmt: skip
        assert refused.returncode == 2 and f"--output_dir {output_dir} {why}" in refused.stderr
    assert folder_contents(run_dir) == before
    averaged = tmp_path / "averaged"
    done = run_script(
        "average_checkpoints.py", "--run_dir", str(run_dir), "--last_k", "2", "--output_dir", str(averaged)
    )
    assert done.returncode == 0 and (averaged / "model.safetensors").is_file()


def test_offline_a_missing_folder_named_like_a_hub_repository_is_named_as_missing(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    missing = "no-such-run/mlm"  # a relative path, and a Hub repository id's form
    with pytest.raises(ValueError, match=f"--model_name_or_path {missing}: no such folder \\(and the Hub is off"):
        train_classifier.main([*QUIET, "--model_name_or_path", missing, "--output_dir", str(tmp_path), "--do_train"])
