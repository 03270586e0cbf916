"""Padding-free batches (packing_vanilla_transformer): a batch laid end to end with its layout, built on the CPU by
the collator, computes what the padded batch computes at every real token, with no work on padding and no host sync.

The references are independent of the packed path: the same sentences padded as transformers' collators pad them
(run through masks and SDPA), and attention computed one sequence at a time with torch's SDPA.
"""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config
from test_accelerator_path import SyncCounter
from transformers import DataCollatorWithFlattening

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
from hf_vanilla_transformer.packing_vanilla_transformer import Sequences, packed_attention

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
    with pytest.raises(ValueError, match="at least one"):
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


def reference_attention(query, key, value, queries, keys, causal, scale):
    """Attention one sequence at a time, torch's SDPA on each slice: (tokens, heads, head_dim) layouts."""
    outputs = []
    q_offsets, k_offsets = queries.tolist(), keys.tolist()
    for index in range(len(q_offsets) - 1):
        q = query[q_offsets[index] : q_offsets[index + 1]].transpose(0, 1)
        k = key[k_offsets[index] : k_offsets[index + 1]].transpose(0, 1)
        v = value[k_offsets[index] : k_offsets[index + 1]].transpose(0, 1)
        k, v = (x.repeat_interleave(q.shape[0] // k.shape[0], dim=0) for x in (k, v))
        outputs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale).transpose(0, 1))
    return torch.cat(outputs)


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["causal self", "bidirectional self", "cross", "grouped kv"])
def test_packed_attention_equals_attention_per_sequence(kind, implementation):
    """The CPU path of `packed_attention` (scatter, masked SDPA or eager attention, gather) against torch's SDPA run
    on each sequence alone; cross-attention with other query and key sequences."""
    torch.manual_seed(0)
    model = build(VanillaTransformerForConditionalGeneration, attn_implementation=implementation)
    module = (
        model.model.decoder.layers[0].self_attn if kind == "causal self" else model.model.encoder.layers[0].self_attn
    )
    queries = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    keys = torch.tensor([0, 2, 9, 12], dtype=torch.int32) if kind == "cross" else queries
    heads, kv_heads = 4, 2 if kind == "grouped kv" else 4
    query = torch.randn(int(queries[-1]), heads, 8)
    key, value = torch.randn(2, int(keys[-1]), kv_heads, 8)
    module.num_key_value_groups = heads // kv_heads
    output, _ = packed_attention(
        module,
        *(tensor.transpose(0, 1)[None] for tensor in (query, key, value)),
        None,
        scaling=0.3,
        cu_seq_lens_q=queries,
        cu_seq_lens_k=keys,
        max_length_q=int((queries[1:] - queries[:-1]).max()),
        max_length_k=int((keys[1:] - keys[:-1]).max()),
    )
    expected = reference_attention(query, key, value, queries, keys, kind == "causal self", 0.3)
    torch.testing.assert_close(output[0], expected, rtol=1e-5, atol=1e-6)


def varlen_attn_reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size, enable_gqa):
    """torch's `varlen_attn` as its docstring defines it, on the CPU: (tokens, heads, head_dim) inputs, int32 offsets,
    window (-1, 0) causal and (-1, -1) full, K/V heads shared by groups of query heads with `enable_gqa`."""
    assert query.dim() == 3 and cu_seq_q.dtype == torch.int32 and window_size in ((-1, 0), (-1, -1))
    assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max()) and max_k == int((cu_seq_k[1:] - cu_seq_k[:-1]).max())
    assert enable_gqa == (key.shape[1] != query.shape[1])
    return reference_attention(query, key, value, cu_seq_q, cu_seq_k, window_size == (-1, 0), scale)


@pytest.mark.parametrize("kind", ["causal self", "cross", "grouped kv"])
def test_packed_attention_calls_the_varlen_kernel_as_documented(kind):
    """The CUDA branch's call of `varlen_attn` (layout, offsets, causal window, grouped heads, output shape), run on
    the CPU against a stand-in that computes what the kernel's docstring specifies; the GPU benchmark compares the
    real kernel with the padded computation on the device."""
    model = build(VanillaTransformerForConditionalGeneration, num_key_value_heads=2 if kind == "grouped kv" else None)
    stack = model.model.decoder if kind != "grouped kv" else model.model.encoder
    module = stack.layers[0].encoder_attn if kind == "cross" else stack.layers[0].self_attn
    queries = torch.tensor([0, 4, 5, 11], dtype=torch.int32)
    keys = torch.tensor([0, 2, 9, 12], dtype=torch.int32) if kind == "cross" else queries
    kv_heads = 2 if kind == "grouped kv" else 4
    query = torch.randn(1, 4, int(queries[-1]), 8)
    key, value = torch.randn(2, 1, kv_heads, int(keys[-1]), 8)
    layout = dict(
        cu_seq_lens_q=queries,
        cu_seq_lens_k=keys,
        max_length_q=int((queries[1:] - queries[:-1]).max()),
        max_length_k=int((keys[1:] - keys[:-1]).max()),
    )
    with (
        mock.patch.object(packing, "runs_varlen_kernel", lambda query, dropout: True),
        mock.patch.object(packing, "varlen_attn", varlen_attn_reference),
    ):
        output, _ = packed_attention(module, query, key, value, None, scaling=0.3, **layout)
    expected, _ = packing.padded_attention(module, query, key, value, 0.3, 0.0, *(Sequences(offsets, length) for
        offsets, length in ((queries, layout["max_length_q"]), (keys, layout["max_length_k"]))))  # fmt: skip
    assert output.shape == (1, int(queries[-1]), 4, 8)
    torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)


def test_the_varlen_kernel_is_called_only_where_it_takes_our_keywords():
    """torch 2.11's `varlen_attn` has no scale, window or grouped-query keywords (the first H100 run failed on it):
    such a kernel leaves packed attention to the padded path."""

    def torch_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1)): ...  # fmt: skip

    def torch_2_13(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                   window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None): ...  # fmt: skip

    assert not packing.takes_our_call(torch_2_11) and packing.takes_our_call(torch_2_13)
    assert not packing.takes_our_call(None)
    cuda_half = mock.Mock(is_cuda=True, dtype=torch.bfloat16)
    with mock.patch.object(packing, "VARLEN_TAKES_OUR_CALL", False):
        assert not packing.runs_varlen_kernel(cuda_half, dropout=0.0)
    with mock.patch.object(packing, "VARLEN_TAKES_OUR_CALL", True):
        assert packing.runs_varlen_kernel(cuda_half, dropout=0.0)
        assert not packing.runs_varlen_kernel(cuda_half, dropout=0.1)
        assert not packing.runs_varlen_kernel(mock.Mock(is_cuda=True, dtype=torch.float32), dropout=0.0)


def test_sequences_positions_and_padded_index():
    sequences = Sequences(torch.tensor([0, 3, 4, 6], dtype=torch.int32), max_length=3)
    assert sequences.positions(6).tolist() == [[0, 1, 2, 0, 0, 1]]
    assert sequences.padded_index(6).tolist() == [0, 1, 2, 3, 6, 7]
    assert sequences.lengths.tolist() == [3, 1, 2]


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
