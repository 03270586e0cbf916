"""The hot path is written for an accelerator: no host waits, few launches, one compiled graph.

A training step of a model this size is host-bound on a GPU: every host-device synchronization stops the CPU from
queueing kernels ahead, and every aten op is one more launch. These tests define what the accelerator-ready forward
must do, measured on the CPU:

1. No host waits. A padded training step (forward with labels + backward) of every head, dense and Mixture of
   Experts, makes at most one host-device synchronization; a decoding step of `generate()` makes none. Counted with a
   `TorchDispatchMode` that records the aten ops which, on an accelerator, copy a value to the host (`SyncCounter`).
   Bad input on the CPU still gets a clear ValueError.
2. Fewer launches. A padded seq2seq training step dispatches no more aten ops than HF's `MarianMTModel` of the same
   architecture and dimensions, and a flattened one where the variable-length kernel runs (a one-op stand-in) no
   more that launch a kernel; no KV cache is built in training.
3. Compiled whole. `torch.compile(fullgraph=True)` (Dynamo only: backend "eager") traces every head's training
   forward with labels, and `generate()` with a static cache runs its decoding steps compiled with fullgraph=True.

Run: python -m pytest -q tests/test_accelerator_path.py
"""

import collections
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch._dynamo
import transformers
from conftest import padded_batch, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MarianMTModel
from transformers.cache_utils import DynamicLayer

import hf_vanilla_transformer.modeling_vanilla_transformer as modeling
from hf_vanilla_transformer import (
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from aten_op_counts import (  # noqa: E402  (the op counts of benchmarks/aten_op_counts.py)
    kernel_count,
    kernel_ops,
    op_count_case,
    training_step_op_names,
    varlen_kernel_stand_in,
)
from marian_twin import marian_config  # noqa: E402  (HF Marian with our dimensions, as the speed benchmarks build it)

aten = torch.ops.aten
IGNORE_INDEX = -100
NUM_LABELS = 3
MOE = {"num_experts": 4, "num_experts_per_tok": 2}
UNIQUE_OPS = {"unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}
INDEX_OPS = {"index", "index_put", "index_put_", "_index_put_impl_"}


def is_host_sync(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> bool:
    """Whether the op, run on an accelerator, waits for the device and copies a value to the host: a scalar read
    (`.item()`, `bool()`, `int()` of a tensor), or an output whose shape depends on the data (nonzero, unique,
    masked_select, indexing with a bool mask, repeat_interleave without `output_size`)."""
    name = func.overloadpacket.__name__
    if func is aten._local_scalar_dense.default or name in {"nonzero", "masked_select"} | UNIQUE_OPS:
        return True
    if name in INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices)
    if name == "repeat_interleave":
        # repeat_interleave.Tensor(repeats, *, output_size) and .self_Tensor(self, repeats, dim, *, output_size):
        # without output_size the output length is the sum of `repeats`, read on the host.
        return isinstance(args[1] if len(args) > 1 else args[0], torch.Tensor) and kwargs.get("output_size") is None
    return False


class SyncCounter(TorchDispatchMode):
    """Counts, while active, the aten ops dispatched (`ops`, forward and backward) and those that would force a
    host-device synchronization on an accelerator (`syncs`, by op name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        if is_host_sync(func, args, kwargs):
            self.syncs[str(func)] += 1
        return func(*args, **kwargs)

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())


def masked_labels(values: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Labels that ignore (-100) the padding."""
    return values.masked_fill(attention_mask == 0, IGNORE_INDEX)


def text_config(kind: str, moe: bool, layers: int = 2) -> VanillaTransformerConfig:
    """The tiny config of each head family: encoder-decoder, decoder-only (GPT-style), encoder-only (BERT-style)."""
    stacks = {
        "seq2seq": {},
        "decoder": {"is_encoder_decoder": False, "is_decoder": True},
        "encoder": {"is_encoder_decoder": False, "is_decoder": False},
    }[kind]
    sizes = {"encoder_layers": layers, "decoder_layers": layers, "num_labels": NUM_LABELS}
    return tiny_config(**sizes, **stacks, **(MOE if moe else {}))


def training_case(head: str, moe: bool, layers: int = 2) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A freshly built model of `head` with `layers` layers per stack and a training batch for it: right-padded
    token ids with a mask holding zeros and labels ignoring the padding (the image classifier: images and class
    ids)."""
    torch.manual_seed(0)
    input_ids, attention_mask = padded_batch()
    text = {"input_ids": input_ids, "attention_mask": attention_mask}
    token_labels = masked_labels(input_ids, attention_mask)
    class_ids = torch.tensor([0, 2, 1])
    if head == "seq2seq":
        target_ids, target_mask = padded_batch(length=7, seed=1)
        return VanillaTransformerForConditionalGeneration(text_config("seq2seq", moe, layers)), dict(
            **text, labels=masked_labels(target_ids, target_mask)
        )
    if head == "causal_lm":
        return VanillaTransformerForCausalLM(text_config("decoder", moe, layers)), dict(**text, labels=token_labels)
    if head == "masked_lm":
        return VanillaTransformerForMaskedLM(text_config("encoder", moe, layers)), dict(**text, labels=token_labels)
    if head in ("sequence_classification_encoder", "sequence_classification_decoder"):
        kind = head.rsplit("_", 1)[1]
        return VanillaTransformerForSequenceClassification(text_config(kind, moe, layers)), dict(
            **text, labels=class_ids
        )
    if head == "token_classification":
        tags = masked_labels(input_ids % NUM_LABELS, attention_mask)
        return VanillaTransformerForTokenClassification(text_config("encoder", moe, layers)), dict(**text, labels=tags)
    if head == "question_answering":
        spans = {"start_positions": torch.tensor([1, 2, 0]), "end_positions": torch.tensor([3, 4, 2])}
        return VanillaTransformerForQuestionAnswering(text_config("encoder", moe, layers)), dict(**text, **spans)
    if head == "image_classification":
        config = image_classification_config(
            d_model=32,
            encoder_layers=layers,
            encoder_attention_heads=4,
            encoder_ffn_dim=64,
            dropout=0.0,
            num_labels=NUM_LABELS,
            image_size=8,
            patch_size=2,
            num_channels=3,
            **(MOE if moe else {}),
        )
        images = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(0))
        return VanillaTransformerForImageClassification(config), {"pixel_values": images, "labels": class_ids}
    raise AssertionError(f"unknown head {head}")


HEADS = [
    "seq2seq",
    "causal_lm",
    "masked_lm",
    "sequence_classification_encoder",
    "sequence_classification_decoder",
    "token_classification",
    "question_answering",
    "image_classification",
]
HEAD_GRID = [
    pytest.param(head, moe, id=f"{head}-{'moe' if moe else 'dense'}") for head in HEADS for moe in (False, True)
]


# 1. No host waits ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head, moe", HEAD_GRID)
def test_training_step_makes_at_most_one_host_sync(head: str, moe: bool) -> None:
    """A padded training step (forward with labels, backward) makes at most one host-device sync (each one stops the
    host from queueing kernels ahead of the device). One warm-up step first, so one-off work (caches of rotary
    tables, lazy checks) is not counted."""
    model, inputs = training_case(head, moe)
    model.train()
    model(**inputs).loss.backward()
    counter = SyncCounter()
    with counter:
        model(**inputs).loss.backward()
    assert counter.total_syncs <= 1, (
        f"{head} ({'MoE' if moe else 'dense'}) training step made {counter.total_syncs} host syncs, budget 1: "
        f"{dict(counter.syncs)}"
    )


@pytest.mark.parametrize("head", HEADS)
def test_expert_capacity_adds_no_host_sync(head: str) -> None:
    """With `expert_capacity_factor` (each expert serves a fixed number of slots, the rest of its tokens dropped) a
    MoE training step of every head makes no host-device sync: the slots have fixed shapes and the dropped count
    stays on the device until `dropped_token_counts` is asked."""
    with mock.patch.dict(MOE, expert_capacity_factor=0.5):  # half the room the routed tokens need: some are dropped
        model, inputs = training_case(head, moe=True)
    model.train()
    model(**inputs).loss.backward()
    counter = SyncCounter()
    with counter:
        model(**inputs).loss.backward()
    assert counter.total_syncs == 0, f"{head} with expert capacity made host syncs: {dict(counter.syncs)}"
    assert sum(modeling.dropped_token_counts(model).values()) > 0  # the capacity path did run and drop


def counting_decoding_steps(model: torch.nn.Module) -> dict[str, Any]:
    """Wraps `model.forward` for one `generate()`: the first call (the prefill) runs as is, every later call (one
    decoding step each) runs under one `SyncCounter`. transformers' loop around the forward (its stopping check)
    stays outside the count."""
    original = model.forward
    state: dict[str, Any] = {"calls": 0, "counter": SyncCounter()}

    def forward(*args, **kwargs):
        state["calls"] += 1
        if state["calls"] == 1:
            return original(*args, **kwargs)
        with state["counter"]:
            return original(*args, **kwargs)

    model.forward = forward
    return state


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts of 6 and 4 tokens, the shorter left-padded (a decoder-only model continues from the right)."""
    input_ids, attention_mask = padded_batch(batch=2, length=6)  # the second row right-padded by 2
    return (
        torch.stack([input_ids[0], input_ids[1].roll(2)]),
        torch.stack([attention_mask[0], attention_mask[1].roll(2)]),
    )


def generation_case(head: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A tiny model in eval mode and two prompts, padded (left-padded for the causal LM)."""
    torch.manual_seed(0)
    if head == "seq2seq":
        model = VanillaTransformerForConditionalGeneration(text_config("seq2seq", moe=False))
        input_ids, attention_mask = padded_batch(batch=2, length=6)
    else:
        model = VanillaTransformerForCausalLM(text_config("decoder", moe=False))
        input_ids, attention_mask = left_padded_prompts()
    return model.eval(), input_ids, attention_mask


@pytest.mark.parametrize(
    "head, num_beams", [("seq2seq", 1), ("seq2seq", 2), ("causal_lm", 1)], ids=["seq2seq-greedy", "seq2seq-beam2", "lm"]
)
def test_decoding_step_makes_no_host_sync(head: str, num_beams: int) -> None:
    """Each decoding step's model forward in `generate()` makes no host-device sync (a wait would stop the host
    queueing kernels at every token), on a padded batch of two prompts (left-padded for the causal LM)."""
    model, input_ids, attention_mask = generation_case(head)
    model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False)  # warm-up
    state = counting_decoding_steps(model)
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=5,
        min_new_tokens=5,
        num_beams=num_beams,
        do_sample=False,
    )
    assert state["calls"] == 5, f"expected a prefill and 4 decoding steps, the model's forward ran {state['calls']}x"
    counter = state["counter"]
    assert counter.total_syncs == 0, (
        f"{head} (num_beams={num_beams}): 4 decoding steps made {counter.total_syncs} host syncs inside the model's "
        f"forward, budget 0: {dict(counter.syncs)}"
    )


def test_left_padded_prompts_are_left_padded() -> None:
    """The helper of the decoding test gives what it claims: the second prompt's padding is on the left."""
    input_ids, attention_mask = left_padded_prompts()
    assert attention_mask.tolist() == [[1] * 6, [0, 0, 1, 1, 1, 1]]
    assert input_ids[1, :2].tolist() == [0, 0] and bool((input_ids[attention_mask == 1] >= 3).all())


@pytest.mark.parametrize(
    "head_class, stacks",
    [(VanillaTransformerForConditionalGeneration, "seq2seq"), (VanillaTransformerForCausalLM, "decoder")],
)
@pytest.mark.parametrize(
    "corrupt, message",
    [
        ("input_id", "outside the vocabulary"),
        ("label", "labels"),  # the seq2seq head shifts them into its decoder inputs first
        ("mask", "attention_mask must hold 1 for tokens and 0 for padding"),
    ],
)
def test_bad_cpu_input_gets_a_clear_error(head_class, stacks: str, corrupt: str, message: str) -> None:
    """Removing the syncs must not remove the checks: on CPU tensors an out-of-vocabulary input id, an out-of-range
    label and a mask holding 2 each raise a ValueError naming the problem (a check that would need a sync runs on the
    CPU batch, or on the device as an asynchronous assert). Regression test: today's code passes it."""
    torch.manual_seed(0)
    model = head_class(text_config(stacks, moe=False)).train()
    input_ids, attention_mask = padded_batch()
    labels = masked_labels(input_ids, attention_mask)
    if corrupt == "input_id":
        input_ids[0, 1] = model.config.vocab_size
    elif corrupt == "label":
        labels[0, 1] = model.config.vocab_size
    else:
        attention_mask[0, 1] = 2
    with pytest.raises(ValueError, match=message):
        model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


# 2. Fewer launches -----------------------------------------------------------------------------------------------


def training_step_ops(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> SyncCounter:
    """The aten ops of one training step (forward + backward) after a warm-up step."""
    model.train()
    model(**inputs).loss.backward()
    counter = SyncCounter()
    with counter:
        model(**inputs).loss.backward()
    return counter


def test_seq2seq_training_step_dispatches_no_more_ops_than_marian() -> None:
    """A padded seq2seq training step launches no more aten ops than HF `MarianMTModel` of the same architecture and
    dimensions, on the same batch, dropout 0.1 in both. On an accelerator each op is a kernel launch the host must
    issue, so a model that computes the same function as Marian should not need more of them."""
    torch.manual_seed(0)
    config = tiny_config(dropout=0.1, sinusoidal_layout="concatenated")
    ours = VanillaTransformerForConditionalGeneration(config)
    marian = MarianMTModel(marian_config(config))
    # Same dimensions: the same parameter shapes, but for Marian's fixed sinusoid tables (parameters there, not here).
    marian_shapes = [tuple(p.shape) for name, p in marian.named_parameters() if "embed_positions" not in name]
    assert sorted(tuple(p.shape) for p in ours.parameters()) == sorted(marian_shapes), "the Marian twin differs"
    input_ids, attention_mask = padded_batch()
    target_ids, target_mask = padded_batch(length=7, seed=1)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": masked_labels(target_ids, target_mask),
    }
    ours_ops, marian_ops = training_step_ops(ours, inputs).ops, training_step_ops(marian, inputs).ops
    assert ours_ops <= marian_ops, (
        f"a padded seq2seq training step dispatches {ours_ops} aten ops, MarianMTModel of the same dimensions "
        f"{marian_ops}"
    )


def test_packed_rows_step_without_a_kernel_dispatches_no_more_ops_than_marian() -> None:
    """Where no variable-length kernel runs (a CPU, float32, attention dropout), sentences packed into rows of whole
    sentences (`row_length`) train with one mask per attention kind built once per stack: the step dispatches no
    more aten ops, and no more that launch a kernel, than HF Marian's padded step on the same sentences (8 pairs of
    4-24 tokens, 2+2 layers, d_model 64, dropout 0.1), the offsets' checks included."""
    ours, marian, _, rows, padded = op_count_case()
    ours_ops, marian_ops = training_step_op_names(ours, rows), training_step_op_names(marian, padded)
    assert sum(ours_ops.values()) <= sum(marian_ops.values())
    assert kernel_count(ours_ops) <= kernel_count(marian_ops)


def test_flattened_step_where_the_varlen_kernel_runs_launches_no_more_kernels_than_marian() -> None:
    """The layout a GPU trains on by default (flattened, with torch's variable-length kernel: here a stand-in that is
    one op each way) dispatches no more aten ops that launch a kernel (views left out) than HF Marian's padded step
    on the same sentences: 8 pairs of 4-24 tokens, 2+2 layers, d_model 64, dropout 0.1 (benchmarks/aten_op_counts.py
    prints every count). The offsets' value checks are counted: they run on the device too. And the kernel's branch
    computes the block mask's loss and gradients."""
    ours, marian, flattened, _, padded = op_count_case()

    def step(batch) -> list[torch.Tensor]:  # the loss and the gradients, dropout drawn from one seed
        ours.zero_grad()
        torch.manual_seed(2)
        loss = ours(**batch).loss
        loss.backward()
        return [loss.detach()] + [parameter.grad.clone() for parameter in ours.parameters()]

    block_mask = step(flattened)
    with varlen_kernel_stand_in():
        ours_kernels, marian_kernels = kernel_ops(ours, flattened), kernel_ops(marian, padded)
        kernel = step(flattened)
    assert ours_kernels <= marian_kernels, f"ours flattened: {ours_kernels} kernel ops, Marian padded: {marian_kernels}"
    for computed, expected in zip(kernel, block_mask):
        torch.testing.assert_close(computed, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("head", ["seq2seq", "causal_lm"])
def test_no_kv_cache_in_training(head: str) -> None:
    """With labels (training), no KV cache is built: `past_key_values` is None and no cache layer stores keys and
    values (BART turns `use_cache` off when labels are given too). Building one costs copies and ops that a training
    step throws away."""
    model, inputs = training_case(head, moe=False)
    model.train()
    original_update = DynamicLayer.update
    updates = []

    def update(self, *args, **kwargs):
        updates.append(type(self).__name__)
        return original_update(self, *args, **kwargs)

    with mock.patch.object(DynamicLayer, "update", update):
        outputs = model(**inputs)
    assert outputs.past_key_values is None, f"training forward returned a {type(outputs.past_key_values).__name__}"
    assert not updates, f"training forward stored keys and values in a cache {len(updates)} times"


# 3. Compiled whole -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head, moe", HEAD_GRID)
def test_training_forward_compiles_without_graph_break(head: str, moe: bool) -> None:
    """`torch.compile(fullgraph=True)` traces the padded training forward with labels of every head into one graph
    (fullgraph=True raises at the first graph break: a `.item()`, a data-dependent shape), and the compiled loss
    equals the eager one. Backend "eager" runs Dynamo only: the trace is what is tested, fast on a CPU."""
    model, inputs = training_case(head, moe, layers=1)  # one layer per stack: Dynamo unrolls the layers' loop
    model.train()  # dropout is 0 in these configs: eager and compiled compute the same loss
    eager_loss = model(**inputs).loss
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    compiled_loss = compiled(**inputs).loss
    torch._dynamo.reset()
    torch.testing.assert_close(compiled_loss, eager_loss, msg=lambda m: f"compiled and eager losses differ: {m}")


def spy_on_compiled_call(model: torch.nn.Module) -> list[int]:
    """Wraps `model.get_compiled_call` (what `generate()` asks for the compiled forward) so that each call of the
    compiled forward it returns is recorded; returns the record."""
    original = model.get_compiled_call
    calls: list[int] = []

    def get_compiled_call(compile_config):
        compiled = original(compile_config)

        def call(*args, **kwargs):
            calls.append(1)
            return compiled(*args, **kwargs)

        return call

    model.get_compiled_call = get_compiled_call
    return calls


@pytest.mark.parametrize("head", ["seq2seq", "causal_lm"])
def test_static_cache_generate_compiles_fullgraph(head: str) -> None:
    """`generate()` with a static cache and `CompileConfig(fullgraph=True)` runs its decoding steps through the
    compiled forward (one graph, no break) and gives the same tokens as the dynamic cache. transformers compiles
    only on accelerators unless `CompileConfig._compile_all_devices` is set (`_valid_auto_compile_criteria`), so the
    test sets it; backend "eager" runs Dynamo only."""
    model, input_ids, attention_mask = generation_case(head)
    arguments = {"input_ids": input_ids, "attention_mask": attention_mask, "max_new_tokens": 4, "min_new_tokens": 4}
    dynamic_tokens = model.generate(**arguments, do_sample=False)

    compile_config = transformers.CompileConfig(fullgraph=True, backend="eager", mode="default")
    compile_config._compile_all_devices = True  # compile on the CPU too (transformers' testing switch)
    model.generation_config.compile_config = compile_config
    compiled_calls = spy_on_compiled_call(model)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    static_tokens = model.generate(**arguments, do_sample=False, cache_implementation="static")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert len(compiled_calls) == 3, f"the 3 decoding steps should run compiled, {len(compiled_calls)} did"
    assert graphs >= 1, "Dynamo compiled no graph: the compiled forward did not really run"
    assert torch.equal(static_tokens, dynamic_tokens), (
        f"static-cache compiled decoding gave {static_tokens.tolist()}, dynamic cache {dynamic_tokens.tolist()}"
    )
