"""Compiled training as the Trainer compiles it (`--torch_compile`: `torch.compile(model, dynamic=None)`): batches
whose lengths change from one step to the next must not break the graph nor recompile it for each new length, or
after torch's limit of 8 recompilations the model runs uncompiled."""

import sys
from pathlib import Path

import torch
from conftest import tiny_config
from test_collators import multi30k_like_pairs

from hf_vanilla_transformer import DataCollatorForSeq2SeqWithFlattening, VanillaTransformerForConditionalGeneration

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_batches import TokenBudgetBatchSampler  # noqa: E402


def token_budget_batches(model, budget: int, count: int, **static_options) -> list[dict]:
    """`count` consecutive token-budget batches of Multi30k-like pairs, flattened, as the training script does."""
    pairs = multi30k_like_pairs(1000, seed=0)
    multiple = static_options.get("pad_to_multiple_of")
    sampler = TokenBudgetBatchSampler(
        [len(pair["input_ids"]) for pair in pairs], [len(pair["labels"]) for pair in pairs], budget,
        flattened=True, pad_to_multiple_of=multiple, seed=0,
    )  # fmt: skip
    if multiple is not None:
        static_options["num_sequences"] = sampler.largest_batch + 1
    collator = DataCollatorForSeq2SeqWithFlattening(model, **static_options)
    return [collator([pairs[i] for i in batch]) for batch, _ in zip(sampler, range(count))]


def compiled_like_the_trainer(model, batches: list[dict], dynamic: bool | None = None) -> int:
    """The graphs `torch.compile(fullgraph=True, dynamic=dynamic)` compiles over `batches` (the Trainer's: None),
    forward and backward run on each; a graph break raises (fullgraph), and so does a recompilation past torch's
    limit."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward  # eager: only the number of graphs matters here

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend, fullgraph=True, dynamic=dynamic)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            for batch in batches:
                compiled(**batch).loss.backward()
    finally:
        torch._dynamo.reset()
    return len(graphs)


def model() -> VanillaTransformerForConditionalGeneration:
    torch.manual_seed(0)
    return VanillaTransformerForConditionalGeneration(tiny_config(encoder_layers=1, decoder_layers=1)).train()


def test_token_budget_batches_compile_into_two_graphs_under_dynamic_none():
    """50 consecutive token-budget batches without static options: every batch another length, and other offsets.
    The first batch compiles a graph for its shapes, the second one a graph with symbolic lengths that every later
    batch reuses: no f-string, `int()` or branch on a length specialises it."""
    translation = model()
    batches = token_budget_batches(translation, budget=256, count=50)
    assert len({(batch["input_ids"].shape[1], batch["max_length_q"]) for batch in batches}) > 10
    assert compiled_like_the_trainer(translation, batches) <= 2


def test_static_batches_compile_at_most_one_graph_per_bucket_under_dynamic_none():
    """With the static options (streams padded to multiples of 32, fixed sequence slots) the batches take at most
    one shape per bucket of 32 tokens up to the budget, and no more graphs than buckets are compiled."""
    translation = model()
    batches = token_budget_batches(translation, budget=128, count=50, pad_to_multiple_of=32)
    assert compiled_like_the_trainer(translation, batches) <= 128 // 32


def test_packed_rows_with_fixed_slots_are_one_shape_and_one_graph():
    """Packed rows with a fixed number of rows and of sequence slots (`row_length`, `num_rows`, `num_sequences`):
    over 50 token-budget batches every tensor has one shape, the offsets included, and the compiled training
    forward is one graph, with static shapes as with the Trainer's dynamic=None."""
    translation = model()
    pairs = multi30k_like_pairs(1000, seed=0)
    sampler = TokenBudgetBatchSampler(
        [len(pair["input_ids"]) for pair in pairs], [len(pair["labels"]) for pair in pairs], 192, flattened=True, seed=0
    )
    num_rows = 8
    collator = DataCollatorForSeq2SeqWithFlattening(
        translation, row_length=48, num_rows=num_rows, num_sequences=sampler.largest_batch + num_rows
    )
    batches = [collator([pairs[i] for i in batch]) for batch, _ in zip(sampler, range(50))]
    tensors = [name for name, value in batches[0].items() if isinstance(value, torch.Tensor)]
    shapes = {name: {tuple(batch[name].shape) for batch in batches} for name in tensors}
    assert all(len(shape) == 1 for shape in shapes.values()), shapes
    assert compiled_like_the_trainer(translation, batches, dynamic=False) == 1
    assert compiled_like_the_trainer(translation, batches) == 1
