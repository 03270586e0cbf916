"""One rank of tests/test_tensor_parallel.py: each saved single-process checkpoint is loaded twice in this process,
whole and sharded by transformers' own distributed engine (`DistributedConfig`), and the two are compared: logits,
greedy and beam tokens, training loss and every gradient; loads the engine must refuse are tried; then
training/train_seq2seq.py --tp_size 2 fine-tunes a model. Rank 0 writes what it measured to `<root>/results.json` for
the test to judge.

By hand, after the test has written the checkpoints to ROOT:
`python -m torch.distributed.run --standalone --nproc_per_node 2 tests/tensor_parallel_script.py ROOT`.
"""

import json
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import padded_batch, tiny_config
from torch.distributed.tensor import DTensor
from transformers.distributed import DistributedConfig

try:  # transformers' own, as the reference for the rules the plans keep
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard
except ImportError:  # before transformers 5.23
    from transformers.distributed.tensor_parallel import replace_layer_number_by_wildcard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
import train_seq2seq  # noqa: E402

from hf_vanilla_transformer import (  # noqa: E402
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForMaskedLM,
    VanillaTransformerForSequenceClassification,
)

MODERN = dict(
    norm_position="pre", norm_type="rmsnorm", ffn_type="swiglu", position_embedding_type="rope", num_key_value_heads=2
)
DECODER_ONLY = dict(is_encoder_decoder=False, is_decoder=True)
ENCODER_ONLY = dict(is_encoder_decoder=False, is_decoder=False)
MOE = dict(num_experts=4, num_experts_per_tok=2, num_shared_experts=1)
TENSOR_PARALLEL = dict(tp_size=2)
EXPERT_PARALLEL = dict(tp_size=2, ep_size=2)


@dataclass
class Case:
    head: type
    config: dict
    parallel: dict = field(default_factory=lambda: TENSOR_PARALLEL)

    def new_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.head(tiny_config(**self.config))


CASES = {
    "seq2seq_paper": Case(VanillaTransformerForConditionalGeneration, {}, dict(tp_plan="auto")),  # tp_size: all ranks
    "seq2seq_modern": Case(VanillaTransformerForConditionalGeneration, dict(MODERN, use_bias=False)),
    # A vocabulary the two ranks cannot split evenly, as most tokenizers' are.
    "causal_lm": Case(VanillaTransformerForCausalLM, dict(MODERN, **DECODER_ONLY, vocab_size=61)),
    "masked_lm": Case(VanillaTransformerForMaskedLM, dict(ENCODER_ONLY, ffn_type="geglu")),
    "classifier": Case(VanillaTransformerForSequenceClassification, dict(ENCODER_ONLY, num_labels=3)),
    "moe_seq2seq": Case(VanillaTransformerForConditionalGeneration, MOE, EXPERT_PARALLEL),
    "moe_causal_lm": Case(
        VanillaTransformerForCausalLM, dict(MODERN, **DECODER_ONLY, **MOE, use_bias=False), EXPERT_PARALLEL
    ),
}
# Pipeline parallelism: transformers' engine pipelines decoder-only language models (here with positions added to
# the embeddings and a final norm, the two things the rank after the first must not apply again); the other heads are
# refused at load time.
PIPELINE_CASE = Case(VanillaTransformerForCausalLM, dict(DECODER_ONLY, norm_position="pre"), dict(pp_size=2))
# Checkpoints the engine cannot shard as asked: name -> (checkpoint, DistributedConfig, what the error must say).
MQA_CASE = Case(VanillaTransformerForCausalLM, dict(DECODER_ONLY, num_key_value_heads=1))  # one K/V head for all
REFUSED = {
    "pipeline_seq2seq": ("seq2seq_paper", dict(pp_size=2), "not supported for VanillaTransformerForConditionalGen"),
    "pipeline_masked_lm": ("masked_lm", dict(pp_size=2), "not supported for VanillaTransformerForMaskedLM"),
    "tensor_mqa": ("mqa", dict(tp_size=2), "tp_size=2 does not divide num_key_value_heads=1"),
}
CHECKPOINTS = {**CASES, "pipeline": PIPELINE_CASE, "mqa": MQA_CASE}

# The training script: a new tiny modern model with its tokenizer (written by the test to <root>/script_model), then
# fine-tuned from there for a few steps, on two tensor-parallel ranks and in one process.
SCRIPT_MODEL = "d_model=32,encoder_layers=1,decoder_layers=1,encoder_ffn_dim=64,decoder_ffn_dim=64,dropout=0,"
SCRIPT_MODEL += "encoder_attention_heads=4,decoder_attention_heads=4,num_key_value_heads=2,norm_position=pre,"
SCRIPT_MODEL += "norm_type=rmsnorm,ffn_type=swiglu,position_embedding_type=rope,use_bias=false"
SCRIPT_DATA = ["--preset", "demo-small", "--tokenizer_vocab_size", "300", "--demo_train_size", "48", "--seed", "0"]
SCRIPT_DATA += ["--report_to", "none", "--disable_tqdm", "true", "--dataloader_pin_memory", "false"]
FINE_TUNING = [*SCRIPT_DATA, "--do_train", "--max_steps", "3", "--per_device_train_batch_size", "16"]
FINE_TUNING += ["--warmup_steps", "4", "--logging_steps", "1", "--save_steps", "3", "--save_only_model", "true"]


def model_inputs(case: Case, vocab_size: int) -> dict[str, torch.Tensor]:
    """A right-padded batch (the stacks run it packed, padding-free) with the head's labels."""
    input_ids, attention_mask = padded_batch(vocab_size)
    tokens = input_ids.masked_fill(attention_mask == 0, -100)
    if case.head is VanillaTransformerForSequenceClassification:
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 2, 1]))
    if case.head is VanillaTransformerForMaskedLM:
        masked = tokens.masked_fill(input_ids % 3 > 0, -100)  # about a third of the tokens
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=masked)
    if case.head is VanillaTransformerForCausalLM:
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=tokens)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=tokens.flip(0))


def generation_inputs(case: Case, vocab_size: int) -> dict[str, torch.Tensor]:
    """Sources for an encoder-decoder (right-padded), prompts for a causal LM (left-padded)."""
    input_ids, attention_mask = padded_batch(vocab_size)
    if case.head is VanillaTransformerForCausalLM:
        input_ids, attention_mask = input_ids.flip(1), attention_mask.flip(1)
    return dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4, do_sample=False)


def full(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """The whole tensor of a sharded one (a collective: every rank calls it)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def largest_difference(expected: torch.Tensor, actual: torch.Tensor) -> float:
    return (expected - actual).abs().max().item()


def share_of_tolerance(expected: torch.Tensor, actual: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-6) -> float:
    """max |actual - expected| / (atol + rtol |expected|), elementwise: at most 1 where `torch.testing.assert_close`
    would pass. The absolute part covers gradients that are 0 but for rounding (the key bias's, since softmax ignores
    a score added to a whole row), whose ratio of two rounding errors means nothing."""
    return ((actual - expected).abs() / (atol + rtol * expected.abs())).max().item()


def compare(case: Case, whole: torch.nn.Module, sharded: torch.nn.Module) -> dict:
    """What the sharded model computes differently from the whole one."""
    vocab_size = whole.config.vocab_size
    inputs = model_inputs(case, vocab_size)
    result = {}
    with torch.no_grad():
        expected, actual = whole.eval()(**inputs).logits, sharded.eval()(**inputs).logits
    result["logits_shape"] = [list(expected.shape), list(actual.shape)]
    result["logits"] = largest_difference(expected, actual)
    if case.head is not VanillaTransformerForMaskedLM and hasattr(whole, "generate") and whole.can_generate():
        prompts = generation_inputs(case, vocab_size)
        # generate() returns a causal LM's prompt and an encoder-decoder's start token before the new tokens.
        before_new = prompts["input_ids"].shape[1] if case.head is VanillaTransformerForCausalLM else 1
        for name, beams in (("greedy", 1), ("beam", 3)):
            expected, actual = whole.generate(**prompts, num_beams=beams), sharded.generate(**prompts, num_beams=beams)
            result[f"{name}_tokens_equal"] = torch.equal(expected, actual)
            result[f"{name}_new_tokens"] = actual.shape[1] - before_new
    losses = [model.train()(**inputs).loss for model in (whole, sharded)]
    for loss in losses:
        loss.backward()
    result["loss"] = [loss.item() for loss in losses]
    sharded_parameters = dict(sharded.named_parameters())
    result["gradients"] = {}  # name -> share of the tolerance its largest difference uses (None: no gradient)
    for name, parameter in whole.named_parameters():
        sharded_gradient = full(sharded_parameters[name].grad)
        if parameter.grad is None or sharded_gradient is None:
            result["gradients"][name] = None
        else:
            result["gradients"][name] = share_of_tolerance(parameter.grad, sharded_gradient)
    result["sharded_parameters"] = sorted(name for name, p in sharded_parameters.items() if isinstance(p, DTensor))
    names = chain(sharded.named_modules(), sharded.named_parameters())
    names = {replace_layer_number_by_wildcard(name) for name, _ in names}
    result["rules_matching_nothing"] = sorted((sharded.tp_plan.keys() | sharded.ep_plan.keys()) - names)
    return result


def pipeline_results(root: Path) -> dict:
    whole = PIPELINE_CASE.head.from_pretrained(root / "pipeline")
    staged = PIPELINE_CASE.head.from_pretrained(
        root / "pipeline", distributed_config=DistributedConfig(**PIPELINE_CASE.parallel)
    )
    inputs = model_inputs(PIPELINE_CASE, whole.config.vocab_size)
    del inputs["labels"]  # the engine returns logits only
    with torch.no_grad():
        result = {"logits": largest_difference(whole.eval()(**inputs).logits, staged.eval()(**inputs).logits)}
    prompts = generation_inputs(PIPELINE_CASE, whole.config.vocab_size)
    for name, beams in (("greedy", 1), ("beam", 3)):
        expected, actual = whole.generate(**prompts, num_beams=beams), staged.generate(**prompts, num_beams=beams)
        result[f"{name}_tokens_equal"] = torch.equal(expected, actual)
    return result


def refusals(root: Path) -> dict[str, str | None]:
    """The error each refused load raises (None: it loaded)."""
    errors = {}
    for name, (checkpoint, parallel, _) in REFUSED.items():
        try:
            head = CHECKPOINTS[checkpoint].head
            head.from_pretrained(root / checkpoint, distributed_config=DistributedConfig(**parallel))
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    return errors


def main(root: Path) -> None:
    results = {}
    for name, case in CASES.items():
        whole = case.head.from_pretrained(root / name)
        sharded = case.head.from_pretrained(root / name, distributed_config=DistributedConfig(**case.parallel))
        results[name] = compare(case, whole, sharded)
    results["pipeline"] = pipeline_results(root)
    results["refused"] = refusals(root)
    rank = dist.get_rank()
    if rank == 0:
        (root / "results.json").write_text(json.dumps(results, indent=1))
    fine_tuning = [*FINE_TUNING, "--model_name_or_path", str(root / "script_model"), "--tp_size", "2"]
    # The script ends the job as a script does: the ranks wait for each other and leave the process group.
    train_seq2seq.main([*fine_tuning, "--output_dir", str(root / "fine_tuned_tp")])
    print(f"TP OK rank {rank}", flush=True)
    # Exit without tearing down the gloo process group (see tests/ddp_moe_script.py): nothing is left to clean up.
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
