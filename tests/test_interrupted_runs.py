"""Interrupted runs lose nothing: a training run SIGKILLed during training, while saving a checkpoint or while saving
the final model, then started again with the same command, ends with the weights of the run that was never
interrupted (bit for bit: the RNG states come back with the checkpoint), and what a kill during a save leaves never
loads as a model.

One subprocess (tests/interrupted_runs.py) trains a tiny model seven times in forked children, ~20 s.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TESTS_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS_DIR.parent / "training"))

import average_checkpoints  # noqa: E402

TINY_RUN = [
    "--preset", "demo-small", "--tokenizer_vocab_size", "300", "--demo_train_size", "200",
    "--config_overrides", "d_model=32,encoder_layers=1,decoder_layers=1,encoder_ffn_dim=64,decoder_ffn_dim=64,"
    "encoder_attention_heads=2,decoder_attention_heads=2",
    "--do_train", "--max_steps", "12", "--save_steps", "4", "--per_device_train_batch_size", "8",
    "--warmup_steps", "4", "--logging_steps", "2", "--seed", "0", "--report_to", "none", "--disable_tqdm", "true",
]  # fmt: skip
KILLED = ["killed_in_training", "killed_in_checkpoint_save", "killed_in_final_save"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("interrupted")
    command = [sys.executable, str(TESTS_DIR / "interrupted_runs.py"), str(root), *TINY_RUN]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_each_run_ends_as_planned(runs):
    statuses = json.loads((runs / "statuses.json").read_text())
    assert statuses == {"uninterrupted": ["exit 0"]} | {scenario: ["SIGKILL", "exit 0"] for scenario in KILLED}, [
        (runs / f"{scenario}.stderr").read_text()[-2000:] for scenario in statuses
    ]


@pytest.mark.parametrize("scenario", KILLED)
def test_the_same_command_again_ends_with_the_uninterrupted_weights(runs, scenario):
    uninterrupted = load_file(runs / "uninterrupted" / "model.safetensors")
    again = load_file(runs / scenario / "model.safetensors")
    assert uninterrupted.keys() == again.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, again[name]), name
    halfway = load_file(runs / "uninterrupted" / "checkpoint-4" / "model.safetensors")
    assert any(not torch.equal(tensor, halfway[name]) for name, tensor in uninterrupted.items())  # steps 5-12 ran
    assert "resuming from checkpoint-" in (runs / f"{scenario}.stderr").read_text()


@pytest.mark.parametrize(
    "scenario, folder", [("killed_in_checkpoint_save", "checkpoint-8"), ("killed_in_final_save", ".")]
)
def test_a_kill_during_a_save_leaves_nothing_that_loads_as_a_model(runs, scenario, folder):
    from transformers import AutoModelForSeq2SeqLM

    import hf_vanilla_transformer  # noqa: F401  (registers the Auto classes)

    left = runs / f"{scenario}-as-killed" / folder
    whole = (runs / "uninterrupted" / folder / "model.safetensors").stat().st_size
    assert 0 < (left / "model.safetensors").stat().st_size < whole  # the kill came while the weights were written
    assert (left / "config.json").exists()
    with pytest.raises(Exception, match="incomplete metadata|header"):  # safetensors checks the file's length
        AutoModelForSeq2SeqLM.from_pretrained(left)
    if folder != ".":
        assert not average_checkpoints.is_complete(left)  # neither resumed from nor averaged
        assert average_checkpoints.complete_checkpoints(left.parent)[-1].name == "checkpoint-4"


def test_no_deepspeed_banner_nor_pin_memory_warning_on_cpu(runs):
    if torch.accelerator.is_available():
        pytest.skip("the warnings concern machines without an accelerator")
    stderr = (runs / "uninterrupted.stderr").read_text()
    assert "Training a 300-token shared BPE tokenizer" in stderr  # the run's own log is there
    assert "Setting accelerator to CPU" not in stderr and "pin_memory" not in stderr
