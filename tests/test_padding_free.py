"""Padding-free batches (packing_vanilla_transformer): a batch laid end to end with its layout, built on the CPU by
the collator, computes what the padded batch computes at every real token, with no work on padding and no host sync.

The references are independent of the packed path: the same sentences padded as transformers' collators pad them
(run through masks and SDPA), and attention computed one sequence at a time with torch's SDPA.
"""

import collections
import copy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import tiny_config
from test_accelerator_path import SyncCounter
from transformers import DataCollatorWithFlattening
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from hf_vanilla_transformer import (
    DataCollatorForSeq2SeqWithFlattening,
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForMaskedLM,
    VanillaTransformerForQuestionAnswering,
    VanillaTransformerForSequenceClassification,
    VanillaTransformerForTokenClassification,
)
from hf_vanilla_transformer import packing_vanilla_transformer as packing
from hf_vanilla_transformer.cpu_training_vanilla_transformer import optimize_for_cpu_training, sequence_grid_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from aten_op_counts import OpNames, per_sequence_attention, varlen_kernel_stand_in  # noqa: E402

VARIANTS = {
    "paper": {},
    "pre-rmsnorm-rope-swiglu-gqa": dict(
        norm_position="pre",
        norm_type="rmsnorm",
        position_embedding_type="rope",
        ffn_type="swiglu",
        num_key_value_heads=2,
    ),
    "learned-positions-eager": dict(position_embedding_type="learned", attn_implementation="eager"),
    "moe-shared-experts": dict(num_experts=4, num_experts_per_tok=2, ffn_type="swiglu", num_shared_experts=1),
}
SOURCE_LENGTHS, TARGET_LENGTHS = (9, 3, 6), (7, 2, 5)


def build(model_class, **overrides):
    attn_implementation = overrides.pop("attn_implementation", "sdpa")
    torch.manual_seed(0)
    return model_class._from_config(tiny_config(**overrides), attn_implementation=attn_implementation).train()


def sentences(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 64, (length,), generator=generator).tolist() for length in lengths]


def translation_features() -> list[dict]:
    pairs = zip(sentences(SOURCE_LENGTHS, 1), sentences(TARGET_LENGTHS, 2))
    return [{"input_ids": source, "labels": target} for source, target in pairs]


def padded(sequences: list[list[int]], value: int) -> torch.Tensor:
    longest = max(map(len, sequences))
    return torch.tensor([sequence + [value] * (longest - len(sequence)) for sequence in sequences])


def padded_translation_batch(features: list[dict], model) -> dict:
    """As transformers' DataCollatorForSeq2Seq pads (plus the target mask, so that the MoE losses of both layouts
    count the same tokens)."""
    sources = [feature["input_ids"] for feature in features]
    targets = [feature["labels"] for feature in features]
    labels = padded(targets, -100)
    return dict(
        input_ids=padded(sources, 0),
        attention_mask=padded([[1] * len(source) for source in sources], 0),
        labels=labels,
        decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels),
        decoder_attention_mask=padded([[1] * len(target) for target in targets], 0),
    )


def loss_and_gradients(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]


def assert_same_step(model, batch: dict, reference: dict) -> None:
    loss, gradients = loss_and_gradients(model, batch)
    expected_loss, expected_gradients = loss_and_gradients(model, reference)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert len(gradients) == len(expected_gradients)
    for gradient, expected in zip(gradients, expected_gradients):
        torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-6)


def test_collator_lays_sources_and_targets_end_to_end():
    """Sources and targets each concatenated, with their offsets, longest lengths and per-sequence positions; each
    target's decoder input is its own labels shifted behind the start token (-100 becomes the pad token)."""
    features = [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [10], "labels": [11, -100, 12]}]
    batch = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0]]
    assert batch["labels"].tolist() == [[8, 9, 11, -100, 12]]
    assert batch["decoder_input_ids"].tolist() == [[1, 8, 1, 11, 0]]
    assert batch["decoder_position_ids"].tolist() == [[0, 1, 0, 1, 2]]
    assert batch["cu_seq_lens_k"].tolist() == [0, 3, 4] and batch["max_length_k"] == 3
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5] and batch["max_length_q"] == 3
    assert batch["cu_seq_lens_k"].dtype == torch.int32 and isinstance(batch["max_length_q"], int)


def test_collator_keeps_the_padded_layout_when_nothing_is_padded():
    """Equal lengths leave nothing to skip: the plain (batch, length) layout, without masks or offsets."""
    features = [{"input_ids": [5, 6], "labels": [8, 9, 10]}, {"input_ids": [11, 12], "labels": [13, 14, 15]}]
    batch = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0)(features)
    assert set(batch) == {"input_ids", "labels", "decoder_input_ids"}
    assert batch["decoder_input_ids"].tolist() == [[1, 8, 9], [1, 13, 14]]


def test_collator_needs_the_special_tokens_and_non_empty_features():
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        DataCollatorForSeq2SeqWithFlattening(pad_token_id=0)
    collator = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0)
    with pytest.raises(ValueError, match="Feature 0's input_ids is empty"):  # the feature and the field
        collator([{"input_ids": [], "labels": [3]}, {"input_ids": [4], "labels": [5, 6]}])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_flattened_translation_step_equals_the_padded_step(variant):
    """Loss and every gradient of a training step on the flattened batch equal those of the padded batch: the
    position-wise layers never see the padding, attention runs within each sequence, the loss counts the same
    tokens (MoE: the router losses too)."""
    model = build(VanillaTransformerForConditionalGeneration, **VARIANTS[variant])
    features = translation_features()
    flattened = DataCollatorForSeq2SeqWithFlattening(model)(features)
    assert flattened["input_ids"].shape == (1, sum(SOURCE_LENGTHS))
    assert_same_step(model, flattened, padded_translation_batch(features, model))


@pytest.mark.parametrize("variant", [name for name in VARIANTS if "moe" not in name])
def test_packed_rows_step_equals_the_padded_step(variant):
    """Pairs packed into rows of whole sentences (`row_length`): loss and every gradient equal the padded batch's,
    attention per row under a mask that keeps each sentence to itself. (Not with experts: their routers also route
    the rows' padding, which the balancing loss then counts.)"""
    model = build(VanillaTransformerForConditionalGeneration, **VARIANTS[variant])
    features = translation_features()
    rows = DataCollatorForSeq2SeqWithFlattening(model, row_length=12)(features)
    assert rows["input_ids"].shape == (2, 12)
    assert_same_step(model, rows, padded_translation_batch(features, model))


def test_packed_rows_through_a_varlen_kernel_train_as_on_the_fallback():
    """Packed rows where torch's variable-length kernel runs (a stand-in that computes what its documentation
    specifies: benchmarks/aten_op_counts.py) give the fallback's loss and gradients: the kernel reads the rows as one
    stream over the offsets."""
    model = build(VanillaTransformerForConditionalGeneration)
    rows = DataCollatorForSeq2SeqWithFlattening(model, row_length=12)(translation_features())
    fallback_loss, fallback_gradients = loss_and_gradients(model, rows)
    with varlen_kernel_stand_in():
        loss, gradients = loss_and_gradients(model, rows)
    torch.testing.assert_close(loss, fallback_loss, rtol=1e-5, atol=1e-6)
    for gradient, expected in zip(gradients, fallback_gradients):
        torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-6)


def test_packed_rows_hold_whole_sentences_in_the_same_order_on_both_sides():
    """First fit, longest pair first: each row holds whole sentences and ends with its padding's sequence (pad
    tokens, labels -100, positions from 0; empty where the row is full); `num_rows` adds rows of padding."""
    features = [
        {"input_ids": [5, 6, 7], "labels": [8, 9]},
        {"input_ids": [10], "labels": [11, 12, 13, 14]},
        {"input_ids": [15, 16], "labels": [17]},
    ]
    collator = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0, row_length=5, num_rows=3)
    batch = collator(features)
    # The longest pair (1 + 4 tokens) first; the next (3 + 2) overflows its row's target: a row of its own; the
    # last (2 + 1) fills the first row's target, whose padding's sequence is then empty.
    assert batch["input_ids"].tolist() == [[10, 15, 16, 0, 0], [5, 6, 7, 0, 0], [0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[11, 12, 13, 14, 17], [8, 9, -100, -100, -100], [-100] * 5]
    assert batch["decoder_input_ids"].tolist() == [[1, 11, 12, 13, 1], [1, 8, 0, 0, 0], [0] * 5]
    assert batch["position_ids"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch["decoder_position_ids"].tolist() == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert batch["cu_seq_lens_k"].tolist() == [0, 1, 3, 5, 8, 10, 15]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 5, 5, 7, 10, 15]
    assert batch["max_length_k"] == batch["max_length_q"] == 5
    with pytest.raises(ValueError, match="does not fit in row_length=3"):
        DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0, row_length=3)(features)
    with pytest.raises(ValueError, match="more than num_rows=1"):
        DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0, row_length=5, num_rows=1)(
            features
        )
    with pytest.raises(ValueError, match="needs row_length"):
        DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0, num_rows=2)
    with pytest.raises(ValueError, match="one-row layout"):
        DataCollatorForSeq2SeqWithFlattening(
            decoder_start_token_id=1, pad_token_id=0, row_length=5, pad_to_multiple_of=4
        )
    with pytest.raises(ValueError, match=r"needs 5 sequence slots \(one per pair and one per row for its padding\)"):
        DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=1, pad_token_id=0, row_length=5, num_sequences=4)(
            features
        )


def test_flattened_translation_derives_decoder_inputs_and_positions():
    """Without decoder_input_ids and position ids the model shifts the flattened labels per sequence and restarts
    the positions at each sequence, as the collator does."""
    model = build(VanillaTransformerForConditionalGeneration, position_embedding_type="learned")
    batch = DataCollatorForSeq2SeqWithFlattening(model)(translation_features())
    minimal = {key: value for key, value in batch.items() if "position_ids" not in key and key != "decoder_input_ids"}
    assert_same_step(model, minimal, batch)


def causal_lm_batches(lengths=(7, 3, 5)) -> tuple[dict, dict]:
    """transformers' DataCollatorWithFlattening output, and the same texts right-padded with labels -100 there."""
    texts = sentences(lengths, 3)
    flattened = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(
        [{"input_ids": text} for text in texts]
    )
    mask = padded([[1] * len(text) for text in texts], 0)
    input_ids = padded(texts, 0)
    return flattened, dict(input_ids=input_ids, attention_mask=mask, labels=input_ids.masked_fill(mask == 0, -100))


@pytest.mark.parametrize("variant", ["paper", "pre-rmsnorm-rope-swiglu-gqa", "moe-shared-experts"])
def test_transformers_flattening_collator_trains_the_causal_lm_as_the_padded_batch(variant):
    """The causal LM takes `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` as it is: the same loss and
    gradients as the padded batch (each sequence's first label is -100, so no position predicts the next text)."""
    overrides = dict(VARIANTS[variant], is_encoder_decoder=False, is_decoder=True)
    model = build(VanillaTransformerForCausalLM, **overrides)
    assert_same_step(model, *causal_lm_batches())


@pytest.mark.parametrize("model_class", [VanillaTransformerForMaskedLM, VanillaTransformerForTokenClassification])
def test_flattened_encoder_outputs_equal_the_padded_ones_at_every_token(model_class):
    """Per-token heads on the bidirectional encoder: each token's logits are those of its padded row."""
    model = build(model_class, is_encoder_decoder=False).eval()
    flattened, padded_batch = causal_lm_batches()
    del flattened["labels"], padded_batch["labels"]
    with torch.no_grad():
        packed_logits = model(**flattened).logits[0]
        padded_logits = model(**padded_batch).logits
    torch.testing.assert_close(packed_logits, padded_logits[padded_batch["attention_mask"].bool()])


@pytest.mark.parametrize(
    "model_class", [VanillaTransformerForSequenceClassification, VanillaTransformerForQuestionAnswering]
)
def test_pooling_heads_refuse_a_flattened_batch(model_class):
    """A head with one output per sequence would pool across the texts of a flattened batch: refused."""
    model = build(model_class, is_encoder_decoder=False)
    flattened = causal_lm_batches()[0]
    del flattened["labels"]
    with pytest.raises(ValueError, match="flattened"):
        model(**flattened)


QUERY_OFFSETS, CROSS_KEY_OFFSETS = [0, 4, 5, 11], [0, 2, 9, 12]


def attention_case(kind: str, implementation: str = "sdpa", empty_sequence: bool = False):
    """A module of the tiny seq2seq model, (tokens, heads, head_dim) queries, keys and values, and their offsets; with
    an empty sequence in the middle and one at the end (a collator's fixed slots) where asked."""
    torch.manual_seed(0)
    model = build(VanillaTransformerForConditionalGeneration, attn_implementation=implementation)
    stack = model.model.decoder if kind == "causal self" else model.model.encoder
    module = model.model.decoder.layers[0].encoder_attn if kind == "cross" else stack.layers[0].self_attn
    query_offsets = QUERY_OFFSETS + ([11] if empty_sequence else [])
    key_offsets = (
        (CROSS_KEY_OFFSETS + [12] if empty_sequence else CROSS_KEY_OFFSETS) if kind == "cross" else query_offsets
    )
    if empty_sequence:
        query_offsets, key_offsets = (
            query_offsets[:2] + [4] + query_offsets[2:],
            key_offsets[:2] + key_offsets[1:2] + key_offsets[2:],
        )
    queries, keys = (torch.tensor(offsets, dtype=torch.int32) for offsets in (query_offsets, key_offsets))
    heads, kv_heads = 4, 2 if kind == "grouped kv" else 4
    module.num_key_value_groups = heads // kv_heads
    query = torch.randn(int(queries[-1]), heads, 8)
    key, value = torch.randn(2, int(keys[-1]), kv_heads, 8)
    return module, query, key, value, queries, keys


def packed_attention(module, query, key, value, queries, keys, causal: bool):
    """One attention call as a stack makes it over a (1, tokens) batch without a variable-length kernel: the config's
    function under the block mask of the queries' and keys' sequences."""
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    offsets = dict(cu_seq_lens_q=queries, cu_seq_lens_k=keys)
    layouts = (1, query.shape[2]), (1, key.shape[2])
    self_mask, cross_mask = packing.block_attention_masks(offsets, *layouts, causal, torch.float32)
    mask = cross_mask if module.is_cross_attention else self_mask
    return interface(module, query, key, value, mask, scaling=0.3)


def heads_first(*tensors):
    """(tokens, heads, head_dim) -> the (1, heads, tokens, head_dim) the attention functions take."""
    return [tensor.transpose(0, 1)[None] for tensor in tensors]


@pytest.mark.parametrize("empty_sequence", [False, True])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["causal self", "bidirectional self", "cross", "grouped kv"])
def test_packed_attention_equals_attention_per_sequence(kind, implementation, empty_sequence):
    """Attention under the block mask (masked SDPA or eager attention over the whole (1, tokens) batch) against
    torch's SDPA run on each sequence alone; cross-attention with other query and key sequences; empty sequences
    (fixed slots) change nothing and leave the gradient finite."""
    module, query, key, value, queries, keys = attention_case(kind, implementation, empty_sequence)
    inputs = [tensor.requires_grad_() for tensor in heads_first(query, key, value)]
    output, _ = packed_attention(module, *inputs, queries, keys, kind == "causal self")
    expected = per_sequence_attention(query, key, value, queries, keys, 0.3, kind == "causal self")
    torch.testing.assert_close(output[0], expected, rtol=1e-5, atol=1e-6)
    output.sum().backward()
    assert all(tensor.grad.isfinite().all() for tensor in inputs)


@pytest.mark.parametrize("empty_sequence", [False, True])
@pytest.mark.parametrize("kind", ["causal self", "bidirectional self", "cross", "grouped kv"])
def test_the_cpu_opt_ins_sequence_grid_equals_attention_per_sequence(kind, empty_sequence):
    """`optimize_for_cpu_training`'s attention over the offsets (each sequence in a row of a padded grid) against
    torch's SDPA run on each sequence alone; empty sequences change nothing and leave the gradient finite."""
    module, query, key, value, queries, keys = attention_case(kind, "sdpa", empty_sequence)
    inputs = [tensor.requires_grad_() for tensor in heads_first(query, key, value)]
    longest = {side: int((offsets[1:] - offsets[:-1]).max()) for side, offsets in (("q", queries), ("k", keys))}
    output, _ = sequence_grid_attention(
        module, *inputs, scaling=0.3, cu_seq_lens_q=queries, cu_seq_lens_k=keys,
        max_length_q=longest["q"], max_length_k=longest["k"],
    )  # fmt: skip
    expected = per_sequence_attention(query, key, value, queries, keys, 0.3, kind == "causal self")
    torch.testing.assert_close(output[0], expected, rtol=1e-5, atol=1e-6)
    output.sum().backward()
    assert all(tensor.grad.isfinite().all() for tensor in inputs)


@pytest.mark.parametrize(
    "layout", [{}, {"pad_to_multiple_of": 16, "num_sequences": 5}, {"row_length": 12}], ids=["flat", "slots", "rows"]
)
@pytest.mark.parametrize("variant", ["paper", "pre-rmsnorm-rope-swiglu-gqa"])
def test_the_cpu_opt_in_trains_flattened_translation_batches_as_the_padded_batch(variant, layout):
    """After `optimize_for_cpu_training` a flattened batch's attention runs sequence by sequence from the offsets
    (no block mask): loss and every gradient are still the padded batch's, in each layout the collator makes."""
    model = optimize_for_cpu_training(build(VanillaTransformerForConditionalGeneration, **VARIANTS[variant]))
    assert packing.varlen_kernel(model.config._attn_implementation, "cpu", torch.float32) is not None
    features = translation_features()
    batch = DataCollatorForSeq2SeqWithFlattening(model, **layout)(features)
    assert_same_step(model, batch, padded_translation_batch(features, model))


@pytest.mark.parametrize("model_class", [VanillaTransformerForCausalLM, VanillaTransformerForMaskedLM])
def test_the_cpu_opt_in_trains_flattened_single_stack_batches_as_the_padded_batch(model_class):
    """The same for transformers' `DataCollatorWithFlattening` batches: causal (decoder-only) and bidirectional
    (encoder-only) attention per sequence."""
    stack = dict(is_decoder=True) if model_class is VanillaTransformerForCausalLM else {}
    model = optimize_for_cpu_training(build(model_class, is_encoder_decoder=False, **stack))
    flattened, padded_batch = causal_lm_batches()
    if model_class is VanillaTransformerForMaskedLM:  # every real token labelled with itself, in both layouts
        flattened["labels"] = flattened["input_ids"]
        padded_batch["labels"] = padded_batch["input_ids"].masked_fill(padded_batch["attention_mask"] == 0, -100)
    assert_same_step(model, flattened, padded_batch)


def test_the_cpu_opt_ins_flattened_step_makes_no_host_sync_and_compiles_whole():
    """The opt-in's attention over the offsets reads nothing back from the device, and a bfloat16 training step on a
    flattened batch compiles with `fullgraph=True` and computes the eager step's loss."""
    model = optimize_for_cpu_training(build(VanillaTransformerForConditionalGeneration))
    batch = DataCollatorForSeq2SeqWithFlattening(model)(translation_features())
    model(**batch).loss.backward()  # warm-up
    with SyncCounter() as counter:
        model(**batch).loss.backward()
    assert sum(counter.syncs.values()) == 0, counter.syncs
    compiled_model = torch.compile(model, fullgraph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled_loss, eager_loss = compiled_model(**batch).loss, model(**batch).loss
    compiled_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=2e-2, atol=2e-2)


def varlen_attn_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch's `varlen_attn` (torch >= 2.12) as its docstring defines it, on the CPU: (tokens, heads, head_dim)
    inputs, int32 offsets, window (-1, 0) causal and (-1, -1) full, K/V heads shared by groups of query heads with
    `enable_gqa`."""
    assert query.dim() == 3 and cu_seq_q.dtype == torch.int32 and window_size in ((-1, 0), (-1, -1))
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k == int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    assert enable_gqa == (key.shape[1] != query.shape[1])
    return per_sequence_attention(query, key, value, cu_seq_q, cu_seq_k, scale, window_size == (-1, 0))


def varlen_attn_reference_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    """torch 2.9-2.11's `varlen_attn`: the default 1/sqrt(head_dim) scale, one K/V head per query head."""
    assert query.dim() == 3 and cu_seq_q.dtype == torch.int32 and return_aux is None
    assert key.shape[1] == query.shape[1], "this signature has no grouped-query attention"
    return per_sequence_attention(query, key, value, cu_seq_q, cu_seq_k, query.shape[-1] ** -0.5, is_causal)


def flash_attention_reference(query, key, value, attention_mask, query_length, is_causal, dropout, softmax_scale,
                              attn_implementation, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                              **kwargs):  # fmt: skip
    """transformers' `_flash_attention_forward` over packed sequences (flash-attn's varlen kernel): (1, tokens,
    heads, head_dim) inputs, K/V heads shared by groups, the output in the same layout."""
    assert attention_mask is None and attn_implementation == "flash_attention_2" and dropout == 0.0
    assert query_length == query.shape[1] and max_length_q == int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    output = per_sequence_attention(query[0], key[0], value[0], cu_seq_lens_q, cu_seq_lens_k, softmax_scale, is_causal)
    return output[None]


KERNEL_STAND_INS = {
    "torch >= 2.12": ("sdpa", "scale", varlen_attn_reference),
    "torch 2.9-2.11": ("sdpa", "is_causal", varlen_attn_reference_2_11),
    "flash-attn": ("flash_attention_2", None, flash_attention_reference),
}


@pytest.mark.parametrize("kernel", list(KERNEL_STAND_INS))
@pytest.mark.parametrize("kind", ["causal self", "cross", "grouped kv"])
def test_attention_runs_each_varlen_kernel_from_the_offsets_in_its_kwargs(kind, kernel):
    """The attention module given a flattened batch's offsets in its keyword arguments, as a stack passes them where
    a variable-length kernel runs, calls the kernel as its documentation specifies (layout, offsets, causal window,
    scale, grouped heads; run on the CPU against a stand-in that computes it) and equals the module under the block
    mask: torch's `varlen_attn` in both its signatures (2.11's has no scale, window or grouped heads) for an "sdpa"
    model, and flash-attn's through transformers' flash integration. A self-attention reads its own sequences as
    keys, whatever "k" side the batch gives (a decoder's is the source's). The GPU benchmark runs the real kernels."""
    implementation, signature, stand_in = KERNEL_STAND_INS[kernel]
    model = build(VanillaTransformerForConditionalGeneration, num_key_value_heads=2 if kind == "grouped kv" else None)
    decoder_layer = model.model.decoder.layers[0]
    module = {"cross": decoder_layer.encoder_attn, "causal self": decoder_layer.self_attn}.get(
        kind, model.model.encoder.layers[0].self_attn
    )
    queries, keys = (torch.tensor(offsets, dtype=torch.int32) for offsets in (QUERY_OFFSETS, CROSS_KEY_OFFSETS))
    source_offsets = keys  # a self-attention must ignore the batch's "k" side, a decoder's source
    torch.manual_seed(1)
    hidden_states = torch.randn(1, int(queries[-1]), module.config.d_model)
    source = torch.randn(1, int(source_offsets[-1]), module.config.d_model) if kind == "cross" else None
    self_mask, cross_mask = packing.block_attention_masks(
        dict(cu_seq_lens_q=queries, cu_seq_lens_k=source_offsets),
        hidden_states.shape[:2],
        (1, int(source_offsets[-1])),
        kind == "causal self",
        torch.float32,
    )
    mask = cross_mask if kind == "cross" else self_mask
    expected, _ = module.eval()(hidden_states, mask, key_value_states=source)
    lengths = {name: int((offsets[1:] - offsets[:-1]).max()) for name, offsets in (("q", queries), ("k", keys))}
    offsets = dict(cu_seq_lens_q=queries, cu_seq_lens_k=keys, max_length_q=lengths["q"], max_length_k=lengths["k"])
    with (
        mock.patch.object(packing, "VARLEN_SIGNATURE", signature),
        mock.patch.object(packing, "varlen_attn", stand_in),
        mock.patch("transformers.integrations.flash_attention._flash_attention_forward", stand_in),
    ):
        module.config = copy.deepcopy(module.config)
        module.config._attn_implementation = implementation
        output, _ = module(hidden_states, None, key_value_states=source, **offsets)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


def test_each_varlen_signature_is_recognised():
    """torch 2.11's `varlen_attn` takes `is_causal`, 2.13's `scale`, `window_size` and `enable_gqa` (the first H100
    run called the newer one on 2.11 and failed); both are kernels, a function with neither is not."""

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None): ...

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None): ...  # fmt: skip

    def unknown(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k): ...

    assert packing.varlen_signature(torch_2_11) == "is_causal"
    assert packing.varlen_signature(torch_2_13) == "scale"
    assert packing.varlen_signature(unknown) is None and packing.varlen_signature(None) is None


@pytest.mark.parametrize(
    "device, dtype, dropout, signature, expected",
    [
        ("cpu", torch.bfloat16, 0.0, "scale", None),  # no varlen kernel on a CPU
        ("cuda", torch.float32, 0.0, "scale", None),  # the kernels run in half precision
        ("cuda", torch.bfloat16, 0.0, "is_causal", "torch"),  # torch 2.11
        ("cuda", torch.float16, 0.0, "scale", "torch"),
        ("cuda", torch.bfloat16, 0.1, "scale", None),  # attention dropout: torch's kernel has none
        ("cuda", torch.bfloat16, 0.0, None, None),  # torch without varlen_attn
    ],
)
def test_the_varlen_kernel_is_chosen_by_device_dtype_and_dropout(device, dtype, dropout, signature, expected):
    with mock.patch.object(packing, "VARLEN_SIGNATURE", signature):
        assert packing.varlen_kernel("sdpa", device, dtype, dropout) == expected
        # transformers' flash integration reads the offsets itself, whatever torch offers
        assert packing.varlen_kernel("flash_attention_3", device, dtype, dropout) == "flash_attention_3"


def test_positions_sequences_and_block_mask():
    """Each token's position in its sequence and its sequence, and the block mask: a key is visible to the queries of
    its own sequence (and, causal, at or before them), in one row or in packed rows; empty sequences take no token."""
    offsets = torch.tensor([0, 3, 4, 4, 6], dtype=torch.int32)
    assert packing.positions_in_sequences(offsets, (1, 6)).tolist() == [[0, 1, 2, 0, 0, 1]]
    sources = torch.tensor([0, 2, 3, 5, 6], dtype=torch.int32)  # one row of 6 tokens: 2, 1, 2, 1 per sequence
    self_mask, cross_mask = packing.block_attention_masks(
        dict(cu_seq_lens_q=offsets, cu_seq_lens_k=sources), (2, 3), (1, 6), True, torch.float32
    )
    assert (self_mask[:, 0] == 0).int().tolist() == [  # rows of 3: sequence 0 | sequences 1 and 3
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]],
        [[1, 0, 0], [0, 1, 0], [0, 1, 1]],
    ]
    assert (cross_mask[:, 0] == 0).int().tolist() == [  # not causal: each query sees its own source sequence
        [[1, 1, 0, 0, 0, 0]] * 3,
        [[0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]],
    ]
    assert (
        self_mask.dtype == torch.float32 and self_mask.max() == 0 and self_mask.min() == torch.finfo(torch.float32).min
    )


@pytest.mark.parametrize("model_class", [VanillaTransformerForConditionalGeneration, VanillaTransformerForCausalLM])
def test_flattened_training_step_makes_no_host_sync(model_class):
    """The layout is Python ints and offsets built on the CPU: a training step reads nothing back from the device."""
    if model_class is VanillaTransformerForCausalLM:
        model = build(model_class, is_encoder_decoder=False, is_decoder=True)
        batch = causal_lm_batches()[0]
    else:
        model = build(model_class)
        batch = DataCollatorForSeq2SeqWithFlattening(model)(translation_features())
    model(**batch).loss.backward()  # warm-up
    with SyncCounter() as counter:
        model(**batch).loss.backward()
    assert sum(counter.syncs.values()) == 0, counter.syncs


def test_gradient_checkpointing_with_a_flattened_batch():
    """Recomputed layers get the sequences of their attention again: the same gradients."""
    model = build(VanillaTransformerForConditionalGeneration)
    batch = DataCollatorForSeq2SeqWithFlattening(model)(translation_features())
    expected = loss_and_gradients(model, batch)
    checkpointed = copy.deepcopy(model)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, gradients = loss_and_gradients(checkpointed, batch)
    torch.testing.assert_close(loss, expected[0])
    for gradient, reference in zip(gradients, expected[1]):
        torch.testing.assert_close(gradient, reference)


# Bad offsets: each corrupts one side's `cu_seq_lens`/`max_length` (tokens: 15 on the "q" side of the seq2seq batch).
BAD_OFFSETS = {
    "int64": (lambda offsets, longest: (offsets.long(), longest), "1-D torch.int32"),
    "float": (lambda offsets, longest: (offsets.float(), longest), "1-D torch.int32"),
    "past the tokens": (
        lambda offsets, longest: (offsets + torch.tensor([0, 0, 0, 2], dtype=torch.int32), longest),
        "rise from 0 to the token count",
    ),  # fmt: skip
    "short of the tokens": (lambda offsets, longest: (offsets[:-1], longest), "rise from 0 to the token count"),
    "decreasing": (lambda offsets, longest: (offsets.flip(0).contiguous(), longest), "rise from 0"),
    "not from 0": (lambda offsets, longest: (offsets + 1, longest), "rise from 0"),
    "max length below the longest": (lambda offsets, longest: (offsets, longest - 1), "no longer than max_length"),
    "max length missing": (lambda offsets, longest: (offsets, None), "needs max_length"),
}


def corrupted(batch: dict, side: str, corruption: str) -> dict:
    corrupt, _ = BAD_OFFSETS[corruption]
    offsets, longest = corrupt(batch[f"cu_seq_lens_{side}"], batch[f"max_length_{side}"])
    batch = dict(batch, **{f"cu_seq_lens_{side}": offsets, f"max_length_{side}": longest})
    return {key: value for key, value in batch.items() if value is not None}


@pytest.mark.parametrize("side", ["q", "k"])
@pytest.mark.parametrize("corruption", list(BAD_OFFSETS))
def test_bad_offsets_of_a_flattened_translation_batch_are_refused(corruption, side):
    """Offsets that are not int32, that do not rise from 0 to the token count, or a max length below the longest
    sequence: a ValueError naming the argument (on CUDA a device-side assert, without a sync), never a loss."""
    model = build(VanillaTransformerForConditionalGeneration)
    batch = corrupted(DataCollatorForSeq2SeqWithFlattening(model)(translation_features()), side, corruption)
    with pytest.raises(ValueError, match=rf"(cu_seq_lens|max_length)_{side}.*{BAD_OFFSETS[corruption][1]}"):
        model(**batch)


@pytest.mark.parametrize(
    "model_class",
    [VanillaTransformerForCausalLM, VanillaTransformerForMaskedLM, VanillaTransformerForTokenClassification],
)
@pytest.mark.parametrize("corruption", list(BAD_OFFSETS))
def test_bad_offsets_of_a_flattened_single_stack_batch_are_refused(corruption, model_class):
    overrides = dict(is_encoder_decoder=False, is_decoder=model_class is VanillaTransformerForCausalLM)
    model = build(model_class, **overrides)
    flattened = causal_lm_batches()[0]
    if model_class is VanillaTransformerForTokenClassification:
        flattened["labels"] = flattened["labels"].clamp(min=0) % 3
    side = "k" if model_class is not VanillaTransformerForCausalLM else "q"
    with pytest.raises(ValueError, match=rf"(cu_seq_lens|max_length)_[qk].*{BAD_OFFSETS[corruption][1]}"):
        model(**corrupted(flattened, side, corruption))


def test_packed_rows_must_hold_whole_sequences_as_many_on_both_sides():
    """A batch of several rows must keep each sequence in one row, and have as many source rows as target rows."""
    model = build(VanillaTransformerForConditionalGeneration)
    batch = DataCollatorForSeq2SeqWithFlattening(model, row_length=12)(translation_features())
    across = dict(batch, cu_seq_lens_k=batch["cu_seq_lens_k"] + torch.tensor([0, 0, 1, 1, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seq_lens_k must .* none across two of the 2 rows of 12 tokens"):
        model(**across)
    fewer_rows = dict(batch, input_ids=batch["input_ids"][:1], position_ids=batch["position_ids"][:1])
    with pytest.raises(ValueError, match=r"cu_seq_lens_k must rise from 0 to the token count \(12\)"):
        model(**fewer_rows)  # the encoder, which runs first, finds its offsets past its one row


def test_the_block_masks_are_built_once_per_stack_forward():
    """The masks of a flattened batch are built once per stack forward, not in every attention call: a training step
    dispatches as many index-building ops (`searchsorted`: the source's sequences for the encoder's mask, the
    target's and the source's for the decoder's two) and as many masks with 4 layers as with 1."""

    def ops(layers: int) -> collections.Counter[str]:
        model = build(VanillaTransformerForConditionalGeneration, encoder_layers=layers, decoder_layers=layers)
        batch = DataCollatorForSeq2SeqWithFlattening(model)(translation_features())
        with OpNames() as counter:
            model(**batch).loss.backward()
        return counter.names

    one, four = ops(1), ops(4)
    assert one["searchsorted"] == four["searchsorted"] == 3
    assert one["masked_fill_"] == four["masked_fill_"]
