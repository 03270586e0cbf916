"""Conformance with transformers' common model tests (ModelTesterMixin, GenerationTesterMixin).

Every model merged into transformers passes those tests; this file re-states the behaviours they check that apply to
this package, for the encoder-decoder, the causal LM and (where it applies) the classifier, with the paper config, a
modern one (pre-norm, RMSNorm, SwiGLU, RoPE, grouped K/V heads) and a Mixture of Experts:
packed rows (`DataCollatorWithFlattening`), cache layout, generation output dicts, assisted and prompt-lookup
decoding, static cache, `torch.export`, left padding, the position of the logits in the output, and
`num_key_value_heads`.
"""

from collections.abc import Callable

import pytest
import torch
from conftest import padded_batch, tiny_config
from transformers import AutoModel, DataCollatorWithFlattening
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import (
    GenerateBeamDecoderOnlyOutput,
    GenerateBeamEncoderDecoderOutput,
    GenerateDecoderOnlyOutput,
    GenerateEncoderDecoderOutput,
)

from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForSequenceClassification,
)

VARIANTS: dict[str, dict] = {
    "paper": {},
    "modern": {
        "norm_position": "pre",
        "norm_type": "rmsnorm",
        "ffn_type": "swiglu",
        "position_embedding_type": "rope",
        "num_key_value_heads": 2,
    },
    "moe": {"num_experts": 4, "num_experts_per_tok": 2},
}
GENERATIVE_HEADS = [VanillaTransformerForConditionalGeneration, VanillaTransformerForCausalLM]
HEADS = [*GENERATIVE_HEADS, VanillaTransformerForSequenceClassification]
# One encoder layer against two decoder layers: a size read from the wrong stack shows up as a wrong count.
SIZES = {"encoder_layers": 1, "decoder_layers": 2}
NEW_TOKENS = 3
# generate's output class, by (encoder-decoder, beam search).
GENERATE_OUTPUTS = {
    (False, False): GenerateDecoderOnlyOutput,
    (False, True): GenerateBeamDecoderOnlyOutput,
    (True, False): GenerateEncoderDecoderOutput,
    (True, True): GenerateBeamEncoderDecoderOutput,
}


def build(model_class: type, variant: str, **overrides) -> torch.nn.Module:
    """A tiny model of `variant` in eval mode, the same weights for the same arguments."""
    torch.manual_seed(0)
    config = tiny_config(**VARIANTS[variant], **SIZES, **overrides)
    return model_class(config).eval()


def prompt(model: torch.nn.Module, batch: int = 2, length: int = 5) -> dict[str, torch.Tensor]:
    """Generation inputs without padding: the source of an encoder-decoder, the prompt of a causal LM."""
    input_ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def padded_inputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A right-padded batch, with a shorter target for an encoder-decoder."""
    input_ids, attention_mask = padded_batch()
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = input_ids[:, :4]
    return inputs


def greedy_settings(**overrides) -> dict:
    """Exactly NEW_TOKENS tokens, deterministic, no forced end of sequence."""
    settings = {
        "max_new_tokens": NEW_TOKENS,
        "min_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "forced_eos_token_id": None,
    }
    return {**settings, **overrides}


def decoder_sizes(config) -> tuple[int, int, int, int]:
    """(decoder layers, query heads, K/V heads, head dim) of the decoder a generative model runs."""
    text_config = config.get_text_config(decoder=True)
    heads = config.decoder_attention_heads
    return text_config.num_hidden_layers, heads, config.key_value_heads(heads), config.d_model // heads


# --- packed sequences (DataCollatorWithFlattening) ------------------------------------------------------------------


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_row_gives_each_document_its_own_logits_and_loss(variant: str, attn_implementation: str) -> None:
    """Documents packed in one row by `DataCollatorWithFlattening` (position ids restarting at 0) attend to
    themselves only: each gets the logits it has alone, and the training loss of the row is the token-weighted mean
    of theirs, with the default `use_cache=True` as with the Trainer's `use_cache=False`. (transformers finds packed
    sequences only in a forward without a cache, so with Llama's defaults they attend across documents; the decoder
    does not let the cache it starts hide them.)"""
    # The MoE router losses are statistics of the whole batch, not sums over documents: left out of the loss here.
    no_router_losses = {"router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.0} if variant == "moe" else {}
    model = build(VanillaTransformerForCausalLM, variant, attn_implementation=attn_implementation, **no_router_losses)
    generator = torch.Generator().manual_seed(2)
    documents = [torch.randint(3, 64, (length,), generator=generator) for length in (5, 3, 4)]
    packed = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": doc.tolist()} for doc in documents])
    with torch.no_grad():
        packed_logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits
        alone_logits = torch.cat([model(input_ids=doc[None]).logits[0] for doc in documents])
        model.train()  # dropout is 0: training only changes which positions the head projects
        packed_loss = model(**packed).loss
        alone_losses = torch.stack([model(input_ids=doc[None], labels=doc[None]).loss for doc in documents])
    torch.testing.assert_close(packed_logits[0], alone_logits, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        uncached = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"], use_cache=False).logits
    torch.testing.assert_close(uncached, packed_logits, atol=1e-6, rtol=1e-6)
    predicted_tokens = torch.tensor([len(doc) - 1 for doc in documents], dtype=torch.float32)
    torch.testing.assert_close(packed_loss, (alone_losses * predicted_tokens).sum() / predicted_tokens.sum())


# --- cache layout ---------------------------------------------------------------------------------------------------


def assert_layer_shapes(cache, num_layers: int, expected: tuple[int, ...]) -> None:
    """`num_layers` layers whose keys and values all have the shape `expected`."""
    assert len(cache.layers) == num_layers
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == expected
        assert tuple(layer.values.shape) == expected


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_class", GENERATIVE_HEADS)
def test_cache_layout(model_class: type, variant: str) -> None:
    """Per layer (batch, K/V heads, length, head dim); an encoder-decoder adds a cross cache over the source."""
    model = build(model_class, variant)
    batch, source_length, target_length = 2, 6, 4
    inputs = prompt(model, batch, source_length)
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(3, 64, (batch, target_length))
    else:
        target_length = source_length
    with torch.no_grad():
        cache = model(**inputs, use_cache=True).past_key_values
    layers, _, kv_heads, head_dim = decoder_sizes(model.config)
    if model.config.is_encoder_decoder:
        assert isinstance(cache, EncoderDecoderCache)
        assert isinstance(cache.self_attention_cache, DynamicCache)
        assert isinstance(cache.cross_attention_cache, DynamicCache)
        assert_layer_shapes(cache.cross_attention_cache, layers, (batch, kv_heads, source_length, head_dim))
        cache = cache.self_attention_cache
    else:
        assert type(cache) is DynamicCache
    assert_layer_shapes(cache, layers, (batch, kv_heads, target_length, head_dim))
    assert cache.get_seq_length() == target_length


# --- generation output dicts ----------------------------------------------------------------------------------------


def assert_per_step(steps: tuple, shapes: list[tuple[int, ...]]) -> None:
    """`steps`: one tuple of per-layer tensors per generated token, of the given shapes."""
    assert isinstance(steps, tuple) and len(steps) == len(shapes)
    for step, shape in zip(steps, shapes):
        assert isinstance(step, tuple)
        assert [tuple(tensor.shape) for tensor in step] == [shape] * len(step)


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_class", GENERATIVE_HEADS)
def test_generate_output_dict(model_class: type, variant: str, num_beams: int) -> None:
    """Scores, logits, attentions, hidden states and cache of `return_dict_in_generate`, as GenerationTesterMixin
    checks them: one entry per generated token, the whole prompt at the first step and one token after (cached)."""
    model = build(model_class, variant, attn_implementation="eager")
    batch, prompt_length = 2, 5
    inputs = prompt(model, batch, prompt_length)
    output = model.generate(
        **inputs,
        **greedy_settings(num_beams=num_beams),
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
        output_attentions=True,
        output_hidden_states=True,
    )
    config = model.config
    rows = batch * num_beams
    layers, heads, kv_heads, head_dim = decoder_sizes(config)
    encoder_decoder = config.is_encoder_decoder
    # An encoder-decoder's decoder starts from decoder_start_token_id alone.
    start = 1 if encoder_decoder else prompt_length
    assert type(output) is GENERATE_OUTPUTS[encoder_decoder, num_beams > 1]
    assert tuple(output.sequences.shape) == (batch, start + NEW_TOKENS)
    for scores in (output.scores, output.logits):
        assert len(scores) == NEW_TOKENS
        assert all(tuple(step.shape) == (rows, config.vocab_size) for step in scores)
    inputs_per_step = [start] + [1] * (NEW_TOKENS - 1)
    keys_per_step = [start + step for step in range(NEW_TOKENS)]
    attention_shapes = [(rows, heads, q, k) for q, k in zip(inputs_per_step, keys_per_step)]
    hidden_shapes = [(rows, q, config.d_model) for q in inputs_per_step]
    if encoder_decoder:
        encoder_heads = config.encoder_attention_heads
        assert_per_step((output.encoder_attentions,), [(batch, encoder_heads, prompt_length, prompt_length)])
        assert_per_step((output.encoder_hidden_states,), [(batch, prompt_length, config.d_model)])
        assert len(output.encoder_attentions) == config.encoder_layers
        assert len(output.encoder_hidden_states) == config.encoder_layers + 1
        assert_per_step(output.cross_attentions, [(rows, heads, q, prompt_length) for q in inputs_per_step])
        attentions, hidden_states = output.decoder_attentions, output.decoder_hidden_states
    else:
        attentions, hidden_states = output.attentions, output.hidden_states
    assert_per_step(attentions, attention_shapes)
    assert_per_step(hidden_states, hidden_shapes)
    assert all(len(step) == layers for step in attentions)
    assert all(len(step) == layers + 1 for step in hidden_states)
    if num_beams > 1:
        assert tuple(output.sequences_scores.shape) == (batch,)
        assert tuple(output.beam_indices.shape) == (batch, NEW_TOKENS)
    # The cache holds every token but the last generated one, which no forward has read yet.
    cache = output.past_key_values
    if encoder_decoder:
        assert_layer_shapes(cache.cross_attention_cache, layers, (rows, kv_heads, prompt_length, head_dim))
        cache = cache.self_attention_cache
    assert_layer_shapes(cache, layers, (rows, kv_heads, output.sequences.shape[1] - 1, head_dim))


# --- decoding strategies that must reproduce greedy search ----------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_class", GENERATIVE_HEADS)
def test_assisted_prompt_lookup_and_static_cache_decode_like_greedy(model_class: type, variant: str) -> None:
    """Assisted decoding (the model as its own assistant, so candidates are accepted and the cache cropped),
    prompt-lookup decoding and a static cache give greedy search's tokens."""
    model = build(model_class, variant)
    # Batch 1: assisted and prompt-lookup decoding refuse larger batches. A repeated n-gram gives prompt lookup
    # candidates to verify.
    input_ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 9]])
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    settings = greedy_settings(max_new_tokens=6, min_new_tokens=6)
    greedy = model.generate(**inputs, **settings)
    assert torch.equal(model.generate(**inputs, assistant_model=model, **settings), greedy)
    assert torch.equal(model.generate(**inputs, prompt_lookup_num_tokens=2, **settings), greedy)
    assert torch.equal(model.generate(**inputs, cache_implementation="static", **settings), greedy)


# --- left padding ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padding_gives_each_row_its_unpadded_result(variant: str) -> None:
    """A left-padded batch (positions counted from each row's first token, as generate does) gives each row the
    next-token logits and the tokens it gets alone."""
    model = build(VanillaTransformerForCausalLM, variant)
    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 64, (length,), generator=generator) for length in (7, 4, 2)]
    width = max(len(row) for row in rows)
    input_ids = torch.stack([torch.cat([row.new_zeros(width - len(row)), row]) for row in rows])
    attention_mask = torch.stack([torch.arange(width) >= width - len(row) for row in rows]).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits[:, -1]
        alone = torch.cat([model(input_ids=row[None]).logits[:, -1] for row in rows])
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)

    generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **greedy_settings())
    for index, row in enumerate(rows):
        row_alone = model.generate(input_ids=row[None], **greedy_settings())
        assert torch.equal(generated[index, width:], row_alone[0, len(row) :])


# --- torch.export and torch.compile ---------------------------------------------------------------------------------


def right_padded_inputs() -> dict:
    """A right-padded batch for one forward without a cache: a program returns tensors only (a DynamicCache is no
    pytree torch.export can return)."""
    input_ids, attention_mask = padded_batch(batch=2, length=6)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}


def assert_equals_eager_everywhere(model: torch.nn.Module, traced: Callable, inputs: dict) -> None:
    """`traced` gives eager's logits at every position, the padding's included."""
    with torch.no_grad():
        eager = model(**inputs).logits
        logits = traced(**inputs).logits
    torch.testing.assert_close(logits, eager, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_causal_lm_equals_eager_at_every_position(variant: str) -> None:
    """`torch.export` of the decoder-only forward (fixed shapes) is eager's function, padding positions included."""
    model = build(VanillaTransformerForCausalLM, variant)
    inputs = right_padded_inputs()
    with torch.no_grad():
        program = torch.export.export(model, args=(), kwargs=inputs, strict=False)
    assert_equals_eager_everywhere(model, program.module(), inputs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_compiled_causal_lm_equals_eager_at_every_position(variant: str) -> None:
    """`torch.compile(fullgraph=True)`: one graph, eager's logits at every position. The aot_eager backend traces
    what inductor would compile, without the C++ build time."""
    model = build(VanillaTransformerForCausalLM, variant)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_equals_eager_everywhere(model, compiled, right_padded_inputs())


# --- output layout and config conventions ---------------------------------------------------------------------------


ROUTER_OUTPUTS = (
    "aux_loss",
    "z_loss",
    "router_logits",
    *(f"{stack}_{kind}" for stack in ("encoder", "decoder") for kind in ("aux_loss", "z_loss", "router_logits")),
)


@pytest.mark.parametrize("model_class", HEADS)
def test_moe_outputs_start_with_the_logits_in_every_mode(model_class: type) -> None:
    """Without labels and without `output_router_logits`, `outputs[0]` and the tuple's first element are the logits
    in training and evaluation, with and without gradients; no router loss is returned."""
    model = build(model_class, "moe")
    inputs = padded_inputs(model)
    reference = None
    for training in (True, False):
        model.train(training)  # dropout is 0: both modes compute the same logits
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                output = model(**inputs)
                as_tuple = model(**inputs, return_dict=False)
            reference = output.logits if reference is None else reference
            assert output[0] is output.logits
            torch.testing.assert_close(as_tuple[0], reference)
            assert all(getattr(output, name, None) is None for name in ROUTER_OUTPUTS)


@pytest.mark.parametrize("model_class", GENERATIVE_HEADS)
def test_moe_config_output_router_logits_is_the_forward_default(model_class: type) -> None:
    """`config.output_router_logits=True` returns router logits and losses unless the call says False."""
    model = build(model_class, "moe", output_router_logits=True)
    inputs = padded_inputs(model)
    with torch.no_grad():
        asked = model(**inputs)
        declined = model(**inputs, output_router_logits=False)
    router_logits = "decoder_router_logits" if model.config.is_encoder_decoder else "router_logits"
    aux_loss = "decoder_aux_loss" if model.config.is_encoder_decoder else "aux_loss"
    assert getattr(asked, router_logits) is not None and getattr(asked, aux_loss) is not None
    assert getattr(declined, router_logits) is None and getattr(declined, aux_loss) is None
    assert declined[0] is declined.logits


@pytest.mark.parametrize("model_class", HEADS)
def test_num_key_value_heads_is_the_head_count_unless_given(model_class: type) -> None:
    """transformers' configs fill `num_key_value_heads` with the head count; a given value is kept."""
    config = build(model_class, "paper").config
    assert type(config.num_key_value_heads) is int
    assert config.num_key_value_heads == config.num_attention_heads
    assert build(model_class, "modern").config.num_key_value_heads == 2


# --- AutoModel: the base model of every head's checkpoint ------------------------------------------------------------


@pytest.mark.parametrize("model_class", HEADS)
def test_auto_model_loads_the_trained_base_model_of_every_head(model_class: type, tmp_path) -> None:
    """`AutoModel.from_pretrained` of a head's checkpoint finds every weight of the base model and computes what the
    head's own base model computes (a head-only weight such as the classifier may be left over)."""
    model = build(model_class, "modern")
    model.save_pretrained(tmp_path)
    base, loading = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["mismatched_keys"]
    inputs = padded_inputs(model)
    with torch.no_grad():
        expected = model.model(**inputs).last_hidden_state
        loaded = base.eval()(**inputs).last_hidden_state
    torch.testing.assert_close(loaded, expected)


@pytest.mark.parametrize("model_class", HEADS)
def test_auto_model_refuses_mismatched_sizes_unless_told_to_ignore_them(model_class: type, tmp_path) -> None:
    """A checkpoint whose shapes differ from the config raises, naming `ignore_mismatched_sizes`; with it the
    mismatched weights are reported and initialised at the config's shape."""
    build(model_class, "paper").save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        AutoModel.from_pretrained(tmp_path, vocab_size=80)
    base, loading = AutoModel.from_pretrained(
        tmp_path, vocab_size=80, ignore_mismatched_sizes=True, output_loading_info=True
    )
    assert loading["mismatched_keys"]
    assert base.get_input_embeddings().num_embeddings == 80
