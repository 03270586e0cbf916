"""FSDP2 on two CPU processes (gloo) through training/train_seq2seq.py with training/accelerate_configs/fsdp.yaml:
the losses equal a single-process run with the same global batch, the sharded checkpoint resumes to the same
weights, and the consolidated `from_pretrained` folder holds exactly the trained weights. ~1 minute on 2 cores.

The two ranks get the variables `accelerate launch --config_file fsdp.yaml --num_processes 2` gives its ranks (read
once per config from ranks that accelerate's CLI starts and that only record their environment), but the training
ranks are started here directly, as tests/test_moe.py does: the launcher's torchrun agent adds nothing to test there
and is the part that has hung in CI.

Run: python -m pytest -q tests/test_distributed.py
"""

import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.utils import DistributedType
from conftest import tiny_config
from deepspeed.runtime.config import DeepSpeedConfig
from ranks import INHERITED, free_port, run_ranks
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import Seq2SeqTrainingArguments
from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "training" / "train_seq2seq.py"
ENDED_RANK = Path(__file__).with_name("ended_rank.py")  # each rank must leave its process group before it exits
sys.path.insert(0, str(SCRIPT.parent))

import train_seq2seq  # noqa: E402

FSDP_CONFIG = REPO / "training" / "accelerate_configs" / "fsdp.yaml"
DDP_CONFIG = FSDP_CONFIG.with_name("ddp.yaml")
RANK_TIMEOUT_S = 240

# No dropout and no label smoothing: dropout masks differ per rank, and the Trainer's label smoother averages each
# rank's tokens separately, while the model's own loss is normalised by the tokens of the global batch.
TINY = "d_model=32,encoder_layers=1,decoder_layers=1,encoder_ffn_dim=64,decoder_ffn_dim=64,"
TINY += "encoder_attention_heads=2,decoder_attention_heads=2,dropout=0"
# Dropless routing without router losses: capacity and the balancing/z statistics are computed over each rank's
# tokens (as in every data-parallel MoE), so only then is the 2-rank loss the single-process one.
MOE = ",num_experts=4,num_experts_per_tok=2,num_shared_experts=1,router_aux_loss_coef=0,router_z_loss_coef=0"
COMMON = ["--preset", "demo-small", "--tokenizer_vocab_size", "300", "--demo_train_size", "64"]
COMMON += ["--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false", "--seed", "0"]
COMMON += ["--label_smoothing_factor", "0", "--warmup_steps", "8", "--do_train", "--logging_steps", "1"]
FOUR_STEPS = ["--max_steps", "4", "--save_steps", "2"]
GLOBAL_BATCH = 16


# A rank that records its environment as rank<RANK>.json in the folder given.
RECORD_ENVIRONMENT = """import json, os, pathlib, sys
pathlib.Path(sys.argv[1], f"rank{os.environ['RANK']}.json").write_text(json.dumps(dict(os.environ)))
"""
# What accelerate's config gives a rank: its own variables (the rest, a rank's place in the job, run_ranks sets).
CONFIG_VARIABLES = ("ACCELERATE_", "FSDP_")


@functools.cache
def launch_environment(config_file: Path, num_processes: int) -> dict[str, str]:
    """The variables of accelerate's config that `accelerate launch --config_file config_file --num_processes n`
    gives its ranks, read from the first rank of a launch through accelerate's CLI."""
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder, "record_environment.py")
        script.write_text(RECORD_ENVIRONMENT)
        launch = ["launch", "--config_file", str(config_file), "--num_processes", str(num_processes)]
        launch += ["--mixed_precision", "no", "--main_process_port", str(free_port()), str(script), folder]
        clean = {key: value for key, value in os.environ.items() if not key.startswith(INHERITED)}
        launcher = subprocess.Popen(
            [sys.executable, "-m", "accelerate.commands.accelerate_cli", *launch],
            env=clean,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group: a hung launcher is ended with its ranks
        )
        try:
            output, _ = launcher.communicate(timeout=RANK_TIMEOUT_S)
        finally:
            if launcher.poll() is None:
                os.killpg(launcher.pid, signal.SIGKILL)
                launcher.wait()
        assert launcher.returncode == 0, output[-4000:]
        environment = json.loads(Path(folder, "rank0.json").read_text())
    return {key: value for key, value in environment.items() if key.startswith(CONFIG_VARIABLES)}


def run_fsdp_ranks(argv: list[str], log_dir: Path, num_processes: int = 2, config: Path = FSDP_CONFIG) -> None:
    """The training script as the ranks `accelerate launch --config_file config` (FSDP2 by default) would start; each
    rank fails if the script leaves its process group alive."""
    env = launch_environment(config, num_processes)
    run_ranks([str(ENDED_RANK), str(SCRIPT), *argv], log_dir, RANK_TIMEOUT_S, num_processes, env)


def logged(run_dir: Path, key: str) -> list[float]:
    history = json.loads((run_dir / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    return [entry[key] for entry in history if key in entry and "train_runtime" not in entry]


def trained_pair(tmp_path_factory, name: str, overrides: str) -> tuple[Path, Path]:
    """The same 4 steps on two FSDP ranks (batch 8 each) and in one process (batch 16)."""
    fsdp_dir, single_dir = tmp_path_factory.mktemp(f"{name}_fsdp"), tmp_path_factory.mktemp(f"{name}_single")
    argv = [*COMMON, *FOUR_STEPS, "--config_overrides", overrides]
    fsdp_argv = [*argv, "--output_dir", str(fsdp_dir), "--per_device_train_batch_size", str(GLOBAL_BATCH // 2)]
    run_fsdp_ranks(fsdp_argv, log_dir=tmp_path_factory.mktemp(f"{name}_logs"))
    train_seq2seq.main([*argv, "--output_dir", str(single_dir), "--per_device_train_batch_size", str(GLOBAL_BATCH)])
    return fsdp_dir, single_dir


@pytest.fixture(scope="module")
def dense_runs(tmp_path_factory) -> tuple[Path, Path]:
    return trained_pair(tmp_path_factory, "dense", TINY)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory) -> tuple[Path, Path]:
    return trained_pair(tmp_path_factory, "moe", TINY + MOE)


@pytest.mark.parametrize("runs", ["dense_runs", "moe_runs"])
def test_fsdp_losses_equal_single_process_with_the_same_global_batch(runs, request):
    fsdp_dir, single_dir = request.getfixturevalue(runs)
    fsdp_losses, single_losses = logged(fsdp_dir, "loss"), logged(single_dir, "loss")
    assert len(fsdp_losses) == 4
    assert fsdp_losses == pytest.approx(single_losses, rel=1e-4)
    assert fsdp_losses[-1] < fsdp_losses[0] - 1.0  # it trains
    assert logged(fsdp_dir, "grad_norm") == pytest.approx(logged(single_dir, "grad_norm"), rel=1e-3)


@pytest.mark.parametrize("runs", ["dense_runs", "moe_runs"])
def test_fsdp_checkpoint_is_sharded_and_the_export_holds_its_weights(runs, request, tmp_path):
    """Each rank wrote its own shard; the exported folder's weights equal the checkpoint's shards put together."""
    fsdp_dir, _ = request.getfixturevalue(runs)
    shards = fsdp_dir / "checkpoint-4" / "pytorch_model_fsdp_0"
    assert sorted(path.name for path in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    dcp_to_torch_save(shards, tmp_path / "full.pt")
    from_shards = torch.load(tmp_path / "full.pt", weights_only=True)["model"]  # accelerate's key for the model
    exported = load_file(fsdp_dir / "model.safetensors")
    assert exported.keys() <= from_shards.keys()
    for name, tensor in exported.items():
        assert torch.equal(tensor, from_shards[name]), name


@pytest.mark.parametrize("runs", ["dense_runs", "moe_runs"])
def test_fsdp_export_reloads_as_the_trained_model(runs, request):
    """from_pretrained restores every weight (none missing, none left over), under the package's own code, and
    computes what the single-process model computes."""
    fsdp_dir, single_dir = request.getfixturevalue(runs)
    config = json.loads((fsdp_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForSeq2SeqLM"].startswith("language_modeling_vanilla_transformer.")
    assert (fsdp_dir / "modeling_vanilla_transformer.py").exists()
    assert not list(fsdp_dir.glob("_fsdp*.py"))  # not torch's FSDP module taken for the model's code
    model, info = VanillaTransformerForConditionalGeneration.from_pretrained(fsdp_dir, output_loading_info=True)
    assert not any(info.values()), info
    exported = load_file(fsdp_dir / "model.safetensors")
    state = model.state_dict()
    for name, tensor in exported.items():
        assert torch.equal(state[name], tensor), name
    reference = VanillaTransformerForConditionalGeneration.from_pretrained(single_dir)
    source = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=source, decoder_input_ids=source).logits
        expected = reference(input_ids=source, decoder_input_ids=source).logits
    # With experts, a token whose top-2 experts are near a tie at the start (the router starts near-uniform) can be
    # routed otherwise when its attention sums in another order (the batch split across ranks, masked over other
    # rows): an expert then trains on other tokens (measured: one expert's down_proj 0.04 apart, logits 3e-3).
    tolerance = 1e-2 if runs == "moe_runs" else 1e-4
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=tolerance)


def test_fsdp_resumes_from_its_sharded_checkpoint(dense_runs, tmp_path):
    """Two ranks resumed from the step-2 checkpoint (all an interrupted run leaves) end with the weights of the
    uninterrupted run, bit for bit."""
    fsdp_dir, _ = dense_runs
    shutil.copytree(fsdp_dir / "checkpoint-2", tmp_path / "checkpoint-2")
    argv = [*COMMON, *FOUR_STEPS, "--config_overrides", TINY, "--output_dir", str(tmp_path)]
    argv += ["--per_device_train_batch_size", str(GLOBAL_BATCH // 2)]
    run_fsdp_ranks([*argv, "--resume_from_checkpoint", str(tmp_path / "checkpoint-2")], log_dir=tmp_path)
    uninterrupted, resumed = load_file(fsdp_dir / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert uninterrupted.keys() == resumed.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, resumed[name]), name
    assert logged(tmp_path, "loss") == logged(fsdp_dir, "loss")  # steps 1-2 from the checkpoint's history


def test_ddp_resumed_inside_an_epoch_of_token_budget_batches_trains_the_uninterrupted_batches(tmp_path):
    """Two DDP ranks on --max_tokens batches (8 an epoch, 4 steps of one batch per rank), resumed from the step-6
    checkpoint inside the second epoch, end with the uninterrupted run's losses and weights, bit for bit. Accelerate
    hands each rank every other batch through its own sampler around the script's, and a resumed epoch another one
    that skips the batches trained: the epoch must still reach the script's sampler, or the resumed run trains the
    first epoch's order again. The throughput reported counts the pairs of both ranks: two epochs of all 60 pairs."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    argv = [*COMMON, "--config_overrides", TINY, "--max_tokens", "288", "--demo_train_size", "60"]
    argv += ["--max_steps", "8", "--save_steps", "6"]
    run_fsdp_ranks([*argv, "--output_dir", str(full)], tmp_path, config=DDP_CONFIG)
    state = json.loads((full / "checkpoint-6" / "trainer_state.json").read_text())
    assert 1 < state["epoch"] < 2
    results = json.loads((full / "all_results.json").read_text())
    assert results["train_pairs_per_second"] == round(2 * 60 / results["train_runtime"], 3)
    shutil.copytree(full / "checkpoint-6", resumed / "checkpoint-6")
    argv += ["--output_dir", str(resumed), "--resume_from_checkpoint", str(resumed / "checkpoint-6")]
    run_fsdp_ranks(argv, tmp_path, config=DDP_CONFIG)
    histories = [json.loads((run / "trainer_state.json").read_text())["log_history"] for run in (full, resumed)]
    uninterrupted_losses, resumed_losses = ([(e["step"], e["loss"]) for e in h if "loss" in e] for h in histories)
    assert len(uninterrupted_losses) == 8 and resumed_losses == uninterrupted_losses
    uninterrupted, after_resume = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, after_resume[name]), name


def auto_values(config: dict | list, path: str = "") -> list[str]:
    """The paths of the "auto" values left anywhere in a DeepSpeed config."""
    items = config.items() if isinstance(config, dict) else enumerate(config)
    found = []
    for key, value in items:
        if value == "auto":
            found.append(f"{path}{key}")
        elif isinstance(value, dict | list):
            found += auto_values(value, f"{path}{key}.")
    return found


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs_pass_deepspeeds_own_parser(stage, tmp_path):
    """DeepSpeed does not run through Accelerate on CPU processes (see the README), so its configs are checked here
    the way a GPU run reads them: accelerate parses the yaml, transformers fills the "auto" values from the
    TrainingArguments and the model, and DeepSpeed's pydantic models, which reject unknown fields, parse the result."""
    launch = load_config_from_file(str(FSDP_CONFIG.with_name(f"deepspeed_zero{stage}.yaml")))
    assert launch.distributed_type == DistributedType.DEEPSPEED
    json_file = REPO / launch.deepspeed_config["deepspeed_config_file"]
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, gradient_accumulation_steps=2, max_grad_norm=0.5
    )
    filled = HfTrainerDeepSpeedConfig(str(json_file))
    filled.trainer_config_process(args)
    filled.trainer_config_finalize(args, VanillaTransformerForConditionalGeneration(tiny_config()), 100)
    assert auto_values(filled.config) == []
    parsed = DeepSpeedConfig(filled.config)
    assert parsed.zero_optimization_stage == stage
    assert (parsed.train_batch_size, parsed.gradient_clipping, parsed.optimizer_name) == (16, 0.5, "adamw")
    assert parsed.zero_config.gather_16bit_weights_on_model_save == (stage == 3)  # save_model gets full weights
    misspelt = json.loads(json.dumps(filled.config))
    misspelt["zero_optimization"]["overlap_comms"] = True
    with pytest.raises(ValueError, match="overlap_comms"):  # the parser would catch a misspelt field
        DeepSpeedConfig(misspelt)
