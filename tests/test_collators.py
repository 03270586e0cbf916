"""The training collators (collators_vanilla_transformer): the layout chosen for the device, the static-shape options
of the flattening collator, and that a compiled training step over such batches compiles one graph per shape.

Run: python -m pytest -q tests/test_collators.py
"""

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
from conftest import tiny_config
from tokenizers import Tokenizer, models
from transformers import DataCollatorForSeq2Seq, MarianConfig, MarianMTModel, PreTrainedTokenizerFast

from hf_vanilla_transformer import (
    DataCollatorForSeq2SeqWithFlattening,
    VanillaTransformerForConditionalGeneration,
    preferred_layout,
    seq2seq_training_collator,
)
from hf_vanilla_transformer import collators_vanilla_transformer as collators
from hf_vanilla_transformer import packing_vanilla_transformer as packing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "training"))
from training_batches import TokenBudgetBatchSampler  # noqa: E402

PAD, START = 0, 1


def translation_model(**overrides) -> VanillaTransformerForConditionalGeneration:
    torch.manual_seed(0)
    return VanillaTransformerForConditionalGeneration(tiny_config(**overrides)).train()


def random_pairs(source_lengths, target_lengths, seed: int = 0) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [
        {"input_ids": torch.randint(3, 64, (s,), generator=generator).tolist(),
         "labels": torch.randint(3, 64, (t,), generator=generator).tolist()}
        for s, t in zip(source_lengths, target_lengths)
    ]  # fmt: skip


def loss_and_gradients(model, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]


def test_static_layout_pads_each_stream_with_one_more_sequence_and_fills_the_slots():
    """Sources of 3 + 1 tokens padded to 8 by a sequence of 4 pad tokens, targets of 2 + 3 by one of 3, -100 as its
    labels and pad tokens as its decoder inputs; positions restart in every sequence; 5 slots, the last two empty;
    the longest lengths rounded up to the multiple."""
    features = [{"input_ids": [5, 6, 7], "labels": [8, 9]}, {"input_ids": [10], "labels": [11, -100, 12]}]
    collator = DataCollatorForSeq2SeqWithFlattening(
        decoder_start_token_id=START, pad_token_id=PAD, pad_to_multiple_of=8, num_sequences=5
    )
    batch = collator(features)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 10, PAD, PAD, PAD, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert batch["labels"].tolist() == [[8, 9, 11, -100, 12, -100, -100, -100]]
    assert batch["decoder_input_ids"].tolist() == [[START, 8, START, 11, PAD, PAD, PAD, PAD]]
    assert batch["decoder_position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1, 2]]
    assert batch["cu_seq_lens_k"].tolist() == [0, 3, 4, 8, 8, 8] and batch["max_length_k"] == 8
    assert batch["cu_seq_lens_q"].tolist() == [0, 2, 5, 8, 8, 8] and batch["max_length_q"] == 8
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and type(batch["max_length_k"]) is int


def test_a_stream_already_at_a_multiple_still_gets_a_padding_sequence():
    """A full multiple gets a whole multiple more: the padding's target tokens always have source tokens to attend
    to, and source and target keep one number of sequences."""
    features = [{"input_ids": [5, 6, 7, 8], "labels": [9, 10, 11]}]
    batch = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=START, pad_token_id=PAD, pad_to_multiple_of=4)(
        features
    )
    assert batch["cu_seq_lens_k"].tolist() == [0, 4, 8] and batch["cu_seq_lens_q"].tolist() == [0, 3, 4]
    assert (batch["max_length_k"], batch["max_length_q"]) == (4, 4)


@pytest.mark.parametrize("options", [dict(pad_to_multiple_of=8), dict(num_sequences=3), dict(num_sequences=1)])
def test_static_shapes_keep_the_flattened_layout_when_all_lengths_are_equal(options):
    """Equal lengths give the plain collator the padded layout; with static shapes that would switch graphs."""
    features = [{"input_ids": [5, 6], "labels": [8, 9, 10]}]
    batch = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=START, pad_token_id=PAD, **options)(features)
    assert batch["input_ids"].shape[0] == 1 and "cu_seq_lens_k" in batch
    assert len(batch["cu_seq_lens_k"]) == len(batch["cu_seq_lens_q"]) == options.get("num_sequences", 2) + 1


@pytest.mark.parametrize(
    ("options", "lengths"),
    [
        (dict(pad_to_multiple_of=16), ((9, 3, 6), (7, 2, 5))),
        (dict(pad_to_multiple_of=8, num_sequences=7), ((9, 3, 6), (7, 2, 5))),
        (dict(num_sequences=5), ((9, 3, 6), (7, 2, 5))),
        (dict(pad_to_multiple_of=4, num_sequences=4), ((4, 4), (5, 5))),  # equal lengths: flattened all the same
    ],
    ids=["multiple", "multiple-and-slots", "slots", "equal-lengths"],
)
def test_a_static_batch_trains_as_the_plain_flattened_batch(options, lengths):
    """Loss and every gradient of a training step on the static batch equal the plain flattened (or padded) batch's:
    the padding's sequence adds no loss and, attending only to itself, changes no real token."""
    model = translation_model()
    features = random_pairs(*lengths)
    static = DataCollatorForSeq2SeqWithFlattening(model, **options)(features)
    assert static["input_ids"].shape[1] % options.get("pad_to_multiple_of", 1) == 0
    loss, gradients = loss_and_gradients(model, static)
    expected_loss, expected_gradients = loss_and_gradients(model, DataCollatorForSeq2SeqWithFlattening(model)(features))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert len(gradients) == len(expected_gradients)
    for gradient, expected in zip(gradients, expected_gradients):
        torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-6)


def test_static_options_are_checked_with_their_names():
    tokens = dict(decoder_start_token_id=START, pad_token_id=PAD)
    bad = [("pad_to_multiple_of", 0), ("num_sequences", 0), ("num_sequences", 2.5), ("num_sequences", True)]
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            DataCollatorForSeq2SeqWithFlattening(**tokens, **{name: value})
    with pytest.raises(ValueError, match="num_sequences=1 leaves no slot"):
        DataCollatorForSeq2SeqWithFlattening(**tokens, pad_to_multiple_of=8, num_sequences=1)
    learned = translation_model(position_embedding_type="learned", max_position_embeddings=64)
    with pytest.raises(ValueError, match="pad_to_multiple_of=128 exceeds the model's learned positions"):
        DataCollatorForSeq2SeqWithFlattening(learned, pad_to_multiple_of=128)


def test_a_batch_with_more_pairs_than_slots_is_refused():
    collator = DataCollatorForSeq2SeqWithFlattening(
        decoder_start_token_id=START, pad_token_id=PAD, pad_to_multiple_of=8, num_sequences=3
    )
    collator(random_pairs((2, 3), (4, 5)))  # two pairs and the padding: three slots
    with pytest.raises(ValueError, match=r"3 sentence pairs needs 4 sequence slots .* num_sequences=3"):
        collator(random_pairs((2, 3, 4), (4, 5, 6)))


# --- the layout a run trains on -------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "flash_attention_2"])
@pytest.mark.parametrize("attention_dropout", [0.0, 0.1])
@pytest.mark.parametrize("half_precision", [True, False])
def test_the_cpu_trains_on_flattened_batches(implementation, attention_dropout, half_precision):
    """On the CPU the flattened layout's savings in every position-wise layer outweigh attention over the whole row
    under its block mask, whatever the attention, its dropout and the precision."""
    model = translation_model(attention_dropout=attention_dropout)
    model.config._attn_implementation = implementation
    assert preferred_layout(model, "cpu", half_precision=half_precision) == "flattened"
    assert preferred_layout(model, torch.device("cpu"), half_precision=half_precision) == "flattened"


# The GPU runs users start: (attention, attention dropout, --bf16, a torch with `varlen_attn`), and the layout they
# train on. Flattened only where a variable-length kernel runs the attention: transformers' flash integration
# (`attn_implementation="flash_attention_2"`, which has attention dropout) or torch's `varlen_attn` (half precision,
# no attention dropout).
GPU_RUNS = {
    "bf16, sdpa, torch with varlen_attn": ("sdpa", 0.0, True, True, "flattened"),
    "bf16, eager, torch with varlen_attn": ("eager", 0.0, True, True, "flattened"),
    "bf16, sdpa, a torch before varlen_attn": ("sdpa", 0.0, True, False, "padded"),
    "bf16, the paper's attention dropout": ("sdpa", 0.1, True, True, "padded"),
    "float32, sdpa": ("sdpa", 0.0, False, True, "padded"),
    "float32, eager, dropout": ("eager", 0.1, False, True, "padded"),
    "float32, flash_attention_2": ("flash_attention_2", 0.0, False, False, "flattened"),
    "bf16, flash_attention_2, dropout": ("flash_attention_2", 0.1, True, False, "flattened"),
    "bf16, flash_attention_3, dropout": ("flash_attention_3", 0.1, True, True, "flattened"),
}


@pytest.mark.parametrize("run", GPU_RUNS.values(), ids=GPU_RUNS.keys())
def test_cuda_trains_flattened_only_where_a_varlen_kernel_runs(run):
    """Elsewhere attention would run over every token of the flattened row under its block mask, where padded
    attention runs over each sentence's row."""
    implementation, attention_dropout, half_precision, torch_varlen, layout = run
    model = translation_model(attention_dropout=attention_dropout)
    model.config._attn_implementation = implementation
    with mock.patch.object(packing, "VARLEN_SIGNATURE", "scale" if torch_varlen else None):
        assert preferred_layout(model, "cuda:0", half_precision=half_precision) == layout


def word_tokenizer() -> PreTrainedTokenizerFast:
    vocabulary = {"<pad>": PAD, "<s>": START, "</s>": 2, "<unk>": 3}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>")),
        pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
    )  # fmt: skip


def test_the_training_collator_follows_the_layout_and_keeps_transformers_models_padded():
    """The collator of the chosen layout, with the run's options: on the CPU flattened batches of 9 sequence slots
    filled up to a multiple of 16 tokens; transformers' models, and a GPU without a variable-length kernel (float32
    SDPA), take padded batches, to a multiple of 8 tokens unless told otherwise."""
    model, tokenizer = translation_model(), word_tokenizer()
    pairs = random_pairs((5, 3), (4, 6))
    flattened = seq2seq_training_collator(
        model, tokenizer, device="cpu", half_precision=False, pad_to_multiple_of=16, num_sequences=9
    )
    batch = flattened(pairs)
    assert batch["input_ids"].shape == batch["labels"].shape == (1, 16)  # 8 source, 10 target tokens and padding
    assert len(batch["cu_seq_lens_k"]) == len(batch["cu_seq_lens_q"]) == 9 + 1

    marian = MarianMTModel(
        MarianConfig(
            vocab_size=8, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
            decoder_attention_heads=2, pad_token_id=PAD, decoder_start_token_id=START,
        )
    )  # fmt: skip
    assert preferred_layout(marian, "cpu", half_precision=False) == "padded"
    batch = seq2seq_training_collator(marian, tokenizer, device="cpu", half_precision=False)(pairs)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 8) and "cu_seq_lens_k" not in batch
    assert batch["attention_mask"].sum(1).tolist() == [5, 3] and (batch["labels"] == -100).sum(1).tolist() == [4, 2]
    padded = seq2seq_training_collator(model, tokenizer, device="cuda", half_precision=False, pad_to_multiple_of=64)
    batch = padded(pairs)
    assert batch["input_ids"].shape == batch["labels"].shape == (2, 64) and "cu_seq_lens_k" not in batch


# --- a compiled step over static batches ----------------------------------------------------------------------------


def multi30k_like_pairs(count: int, seed: int) -> list[dict]:
    """Sentence pairs whose source and target lengths are drawn like Multi30k's BPE sentences: 5 to 40 tokens,
    mean about 13 (a gamma distribution, shape 4 and scale 1 / 0.3)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.distributions.Gamma(4.0, 0.3).sample((2, count)).round().clamp(5, 40).long()
    return [
        {"input_ids": torch.randint(3, 64, (s,), generator=generator).tolist(),
         "labels": torch.randint(3, 64, (t,), generator=generator).tolist()}
        for s, t in lengths.T.tolist()
    ]  # fmt: skip


def test_a_compiled_training_step_compiles_one_graph_per_bucket():
    """50 token-budget batches (256 tokens a stream) of Multi30k-like pairs through the static collator (streams
    padded to multiples of 64, one number of sequence slots): the training forward, compiled as one graph, is
    compiled again only for new stream lengths, at most once per bucket of 64 tokens up to the budget, and nothing
    else (a Python int it branches on, a guard on a value) recompiles it. Batches that fill the budget leave few
    stream lengths."""
    torch.manual_seed(1)
    pairs = multi30k_like_pairs(1000, seed=0)
    budget, multiple = 256, 64
    sampler = TokenBudgetBatchSampler(
        [len(pair["input_ids"]) for pair in pairs], [len(pair["labels"]) for pair in pairs], budget,
        flattened=True, pad_to_multiple_of=multiple, seed=0,
    )  # fmt: skip
    model = translation_model(encoder_layers=1, decoder_layers=1)
    collator = DataCollatorForSeq2SeqWithFlattening(
        model, pad_to_multiple_of=multiple, num_sequences=sampler.largest_batch + 1
    )
    batches = [collator([pairs[i] for i in batch]) for batch, _ in zip(sampler, range(50))]
    assert len(batches) == 50
    shapes = {(batch["input_ids"].shape[1], batch["labels"].shape[1]) for batch in batches}
    assert {(batch["max_length_k"], batch["max_length_q"]) for batch in batches} == {(multiple, multiple)}

    buckets = budget // multiple  # the stream lengths a batch can take: 64, 128, 192, 256
    assert graphs_compiled(model, batches) == len(shapes) <= buckets


def graphs_compiled(model, batches: list[dict]) -> int:
    """How many graphs `torch.compile(fullgraph=True)` of the training forward compiles over `batches` (forward and
    backward run on each)."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward  # eager: only the number of graphs matters here

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting_backend, fullgraph=True, dynamic=False)
    try:
        for batch in batches:
            compiled(**batch).loss.backward()
    finally:
        torch._dynamo.reset()
    return len(graphs)


def test_packed_rows_of_fixed_shape_compile_once():
    """Packed rows with a fixed row length and number of rows (`row_length`, `num_rows`): 50 batches of 8
    Multi30k-like pairs give one shape, and the compiled training forward (one graph) is compiled once."""
    pairs = multi30k_like_pairs(400, seed=1)
    model = translation_model(encoder_layers=1, decoder_layers=1)
    collator = DataCollatorForSeq2SeqWithFlattening(model, row_length=48, num_rows=8)
    batches = [collator(pairs[start : start + 8]) for start in range(0, 400, 8)]
    assert {tuple(batch["input_ids"].shape) for batch in batches} == {(8, 48)}
    assert graphs_compiled(model, batches) == 1


# --- what a batch needs ---------------------------------------------------------------------------------------------


def test_packed_rows_give_every_target_sequence_source_tokens():
    """Rows whose pairs fill their source side exactly (5 + 0 and 3 + 2 source tokens in rows of 5) would leave the
    padding's target tokens an empty source sequence, cross-attention over no keys: their padding ends the row's last
    target instead, and the padding's sequence is left empty on both sides (each row keeps its number of sequences).
    Every pair of sequences with target tokens has source tokens, and the step's loss and gradients are still the
    plain flattened batch's."""
    model = translation_model()
    features = random_pairs((5, 3, 2), (2, 3, 1))
    rows = DataCollatorForSeq2SeqWithFlattening(model, row_length=5)(features)
    source_lengths, target_lengths = rows["cu_seq_lens_k"].diff().tolist(), rows["cu_seq_lens_q"].diff().tolist()
    assert list(zip(source_lengths, target_lengths)) == [(5, 5), (0, 0), (3, 3), (2, 2), (0, 0)]
    assert rows["labels"][0].tolist() == [*features[0]["labels"], -100, -100, -100]
    assert rows["decoder_position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    loss, gradients = loss_and_gradients(model, rows)
    expected_loss, expected_gradients = loss_and_gradients(model, DataCollatorForSeq2SeqWithFlattening(model)(features))
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    for gradient, expected in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(gradient, expected, rtol=1e-4, atol=1e-6)


def test_packed_rows_of_many_batches_pair_no_target_with_an_empty_source():
    """50 batches of 8 Multi30k-like pairs in rows as long as their longest sentence (where full source sides are
    common): every pair of sequences with target tokens has source tokens, and every batch as many sequences."""
    pairs = multi30k_like_pairs(400, seed=2)
    full_source_sides = 0
    for start in range(0, 400, 8):
        features = pairs[start : start + 8]
        width = max(max(len(pair["input_ids"]), len(pair["labels"])) for pair in features)
        rows = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=START, pad_token_id=PAD, row_length=width)(
            features
        )
        sources, targets = rows["cu_seq_lens_k"].diff(), rows["cu_seq_lens_q"].diff()
        assert len(sources) == len(targets) == len(features) + len(rows["input_ids"])
        assert not bool(((targets > 0) & (sources == 0)).any()), (sources, targets)
        full_source_sides += sum(rows["input_ids"][:, -1] != PAD).item()
    assert full_source_sides > 0  # the case the guarantee is for did occur


@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([], "got no features: a batch needs at least one pair"),
        (
            [{"input_ids": [5, 6], "labels": [7]}, {"input_ids": [5]}],
            r"Feature 1 has no labels \(it has \['input_ids'\]\)",
        ),
        ([{"labels": [7]}], "Feature 0 has no input_ids"),
    ],
)
def test_a_batch_without_pairs_or_labels_is_refused_by_name(features, message):
    collator = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=START, pad_token_id=PAD)
    with pytest.raises(ValueError, match=message):
        collator(features)


@pytest.mark.parametrize(
    "options", [{}, {"pad_to_multiple_of": 8}, {"row_length": 16}], ids=["plain", "static", "rows"]
)
@pytest.mark.parametrize(
    ("features", "message"),
    [
        ([{"input_ids": [5, 6], "labels": [7]}, {"input_ids": [5], "labels": None}], "Feature 1's labels is None"),
        ([{"input_ids": None, "labels": [7]}], "Feature 0's input_ids is None: expected the source token ids"),
        ([{"input_ids": [5], "labels": [7]}, {"input_ids": [5], "labels": []}], "Feature 1's labels is empty"),
        ([{"input_ids": [[5, 6, 7]], "labels": [7, 8]}], r"Feature 0's input_ids has shape \(1, 3\): expected"),
        ([{"input_ids": [5, 6], "labels": [7.5]}], "Feature 0's labels holds torch.float32 values: expected"),
        ([{"input_ids": ["five"], "labels": [7]}], "Feature 0's input_ids cannot be read as token ids"),
    ],
    ids=["labels-none", "input-ids-none", "labels-empty", "input-ids-2d", "float-labels", "strings"],
)
def test_a_bad_feature_is_refused_naming_the_feature_the_field_and_what_was_expected(options, features, message):
    """Every layout, the plain one (which stacked 2-D ids silently) and the static ones (which failed in torch), names
    the feature and the field that is None, empty, not one sequence, or not integers."""
    collator = DataCollatorForSeq2SeqWithFlattening(decoder_start_token_id=START, pad_token_id=PAD, **options)
    with pytest.raises(ValueError, match=message):
        collator(features)
