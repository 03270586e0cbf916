"""Tensor, expert and pipeline parallelism with transformers' own distributed engine, on two CPU ranks (gloo).

Single-process checkpoints of every kind of head are written here; two ranks of tests/tensor_parallel_script.py (one
launch) load each of them whole and with `DistributedConfig(tp_size=2)` (MoE: `tp_size=2, ep_size=2`; a causal LM
also `pp_size=2`), and report what differs; then they fine-tune a model with training/train_seq2seq.py --tp_size 2,
which this process repeats unsharded. The module takes 1.5-2.5 minutes on a busy 2-core machine.

The ranks are started directly (RANK, WORLD_SIZE, MASTER_ADDR/PORT in their environment), as in tests/test_moe.py:
torchrun's agent adds nothing to test. Ranks that outlive the test are killed.

Run: python -m pytest -q tests/test_tensor_parallel.py
"""

import json
from pathlib import Path

import pytest
import torch
from ranks import run_ranks
from safetensors.torch import load_file
from tensor_parallel_script import (
    CASES,
    CHECKPOINTS,
    FINE_TUNING,
    REFUSED,
    SCRIPT_DATA,
    SCRIPT_MODEL,
    train_seq2seq,
)

from hf_vanilla_transformer import VanillaTransformerForCausalLM, VanillaTransformerForConditionalGeneration

SCRIPT = Path(__file__).with_name("tensor_parallel_script.py")
GENERATING_HEADS = (VanillaTransformerForConditionalGeneration, VanillaTransformerForCausalLM)
RANK_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The checkpoints, the ranks' run over them, and the single-process fine-tuning the ranks repeated sharded."""
    root = tmp_path_factory.mktemp("tensor_parallel")
    for name, case in CHECKPOINTS.items():
        case.new_model().save_pretrained(root / name)
    # A new model with its tokenizer, as the training script writes it (after one step).
    new_model = [*SCRIPT_DATA, "--config_overrides", SCRIPT_MODEL, "--do_train", "--max_steps", "1"]
    train_seq2seq.main([*new_model, "--output_dir", str(root / "script_model")])
    run_ranks([str(SCRIPT), str(root)], log_dir=root, timeout_s=RANK_TIMEOUT_S)
    fine_tuning = [*FINE_TUNING, "--model_name_or_path", str(root / "script_model")]
    train_seq2seq.main([*fine_tuning, "--output_dir", str(root / "fine_tuned")])
    return root


@pytest.fixture(scope="module")
def results(root) -> dict:
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_model_computes_what_the_whole_one_does(results, name):
    """Logits of a padded batch (run padding-free), greedy and beam tokens, the training loss and every gradient."""
    result = results[name]
    assert result["logits_shape"][0] == result["logits_shape"][1]
    assert result["logits"] <= 1e-5
    assert result["loss"][1] == pytest.approx(result["loss"][0], abs=1e-5)
    assert len(result["gradients"]) > 10
    for parameter, share_of_tolerance in result["gradients"].items():
        assert share_of_tolerance is not None and share_of_tolerance <= 1, parameter  # rtol 1e-4, atol 1e-6
    if CASES[name].head in GENERATING_HEADS:  # the sharded model generated, and the whole one's tokens
        for decoding in ("greedy", "beam"):
            assert result[f"{decoding}_new_tokens"] > 0 and result[f"{decoding}_tokens_equal"], decoding


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_holds_a_slice_of_every_attention_and_ffn(results, name):
    """The plans reach every sharded module of the head: attention (cross-attention too), the FFN or the experts,
    the vocabulary projection; norms and routers stay whole."""
    sharded = set(results[name]["sharded_parameters"])
    config = CASES[name].new_model().config
    stacks = ["model.encoder.layers.0", "model.decoder.layers.0"] if config.is_encoder_decoder else ["model.layers.0"]
    expected = {f"{stack}.self_attn.{projection}.weight" for stack in stacks for projection in ("q_proj", "out_proj")}
    if config.is_encoder_decoder:
        expected |= {"model.decoder.layers.0.encoder_attn.k_proj.weight", "model.shared.weight"}
    else:
        expected.add("model.embed_tokens.weight")
    if config.num_experts:
        expected |= {f"{stack}.mlp.experts.down_proj" for stack in stacks}
    else:
        ffn = "mlp.down_proj" if config.ffn_type in ("swiglu", "geglu") else "mlp.fc2"
        expected |= {f"{stack}.{ffn}.weight" for stack in stacks}
    assert expected <= sharded
    assert not {name for name in sharded if "norm" in name or "mlp.gate." in name or "classifier" in name}
    assert results[name]["rules_matching_nothing"] == []  # which transformers would warn about at every load


def test_pipeline_parallel_causal_lm_gives_the_same_logits_and_tokens(results):
    """A pre-norm causal LM with sinusoidal positions: the second rank neither adds the positions again nor gets the
    first rank's output normalised by the final norm."""
    pipeline = results["pipeline"]
    assert pipeline["logits"] <= 1e-5
    assert pipeline["greedy_tokens_equal"] and pipeline["beam_tokens_equal"]


@pytest.mark.parametrize("name", list(REFUSED))
def test_what_the_engine_cannot_shard_is_refused_at_load_time(results, name):
    """Pipeline parallelism for the heads that are not a causal LM; tensor parallelism that would split a head."""
    checkpoint, parallel, expected = REFUSED[name]
    message = results["refused"][name]
    assert message is not None, f"{checkpoint} loaded with {parallel}"
    assert expected in message


def logged_losses(run_dir: Path) -> list[float]:
    history = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def test_training_script_trains_a_tensor_parallel_model_with_the_single_process_losses(root):
    sharded, whole = logged_losses(root / "fine_tuned_tp"), logged_losses(root / "fine_tuned")
    assert len(whole) == 3
    assert sharded == pytest.approx(whole, rel=1e-5)


def test_tensor_parallel_training_saves_whole_weights_that_reload_in_one_process(root):
    model, info = VanillaTransformerForConditionalGeneration.from_pretrained(
        root / "fine_tuned_tp", output_loading_info=True
    )
    assert not any(info.values()), info
    expected = load_file(root / "fine_tuned" / "model.safetensors")
    saved = load_file(root / "fine_tuned_tp" / "model.safetensors")
    assert saved.keys() == expected.keys()
    state = model.state_dict()
    for name, tensor in expected.items():
        assert saved[name].shape == tensor.shape, name
        # Three Adam steps at rates up to 0.066: Adam's normalised update of a component whose gradient is near zero
        # carries the sharded reductions' rounding (measured: up to 3e-5 on one or two elements of a tensor); a
        # wrongly sharded or gathered weight would be off by the order of the learning rate.
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-4, msg=name)
