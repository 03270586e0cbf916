"""One declaration per head (auto_vanilla_transformer.HEADS): registration, every checkpoint's auto_map and the
model card derive from it; and the output class each model returns, dense and with experts."""

import dataclasses
import importlib
import json

import pytest
import torch
import transformers
from conftest import tiny_config
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    ImageClassifierOutput,
    MaskedLMOutput,
    MoeCausalLMOutputWithPast,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
    Seq2SeqMoEModelOutput,
    Seq2SeqMoEOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.pipelines import get_supported_tasks

import hf_vanilla_transformer
from hf_vanilla_transformer import VanillaTransformerConfig, build_model_card
from hf_vanilla_transformer.auto_vanilla_transformer import HEADS, auto_map, checkpoint_kind
from hf_vanilla_transformer.modeling_vanilla_transformer import (
    VanillaTransformerDecoder,
    VanillaTransformerEncoder,
    VanillaTransformerModel,
)

# A tiny config of each kind of checkpoint (auto_vanilla_transformer.CheckpointKind): the overrides of tiny_config.
KIND_CONFIGS = {
    "encoder-decoder": {},
    "decoder-only": dict(is_encoder_decoder=False, is_decoder=True),
    "encoder-only": dict(is_encoder_decoder=False, is_decoder=False),
    "image-encoder": dict(
        is_encoder_decoder=False,
        is_decoder=False,
        vocab_size=1,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        decoder_start_token_id=None,
        image_size=8,
        patch_size=4,
    ),
}


def declared_class(name: str) -> type:
    return getattr(importlib.import_module(f"hf_vanilla_transformer.{HEADS[name].module}"), name)


@pytest.mark.parametrize("name", list(HEADS))
def test_every_declared_class_is_public_and_registered_with_its_auto_class(name):
    head = declared_class(name)
    assert getattr(hf_vanilla_transformer, name) is head and name in hf_vanilla_transformer.__all__
    auto_class = getattr(transformers, HEADS[name].auto_class)
    assert auto_class._model_mapping[VanillaTransformerConfig] is head
    assert head._auto_class == HEADS[name].auto_class


@pytest.mark.parametrize("kind", list(KIND_CONFIGS))
def test_a_checkpoint_names_every_head_that_can_load_it_and_carries_its_code(tmp_path, kind):
    torch.manual_seed(0)
    config = tiny_config(**KIND_CONFIGS[kind])
    loaders = [
        name for name, head in HEADS.items() if kind in head.checkpoint_kinds and name != "VanillaTransformerModel"
    ]
    saved = declared_class(loaders[0])(config)
    saved.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert written == auto_map(saved.config, type(saved).__name__)
    base = {"AutoModel"} if kind != "image-encoder" else set()  # AutoModel would give an image the text encoder
    assert {HEADS[name].auto_class for name in loaders} | {"AutoConfig"} | base == set(written)
    for reference in written.values():
        module, class_name = reference.split(".")
        assert f"class {class_name}(" in (tmp_path / f"{module}.py").read_text()
    for name in loaders:  # each of them loads the checkpoint (the single-stack heads: its stack, a new output layer)
        loaded = getattr(transformers, HEADS[name].auto_class).from_pretrained(tmp_path)
        assert type(loaded) is declared_class(name) and checkpoint_kind(loaded.config, name) == kind


@pytest.mark.parametrize("name", list(HEADS))
def test_model_card_tags_are_tasks_transformers_has_a_pipeline_for(name):
    head = HEADS[name]
    assert head.pipeline_tag is None or head.pipeline_tag in get_supported_tasks()
    config = tiny_config(**KIND_CONFIGS[head.checkpoint_kinds[0]], architectures=[name])
    card = build_model_card(config)
    assert card.data.pipeline_tag == head.pipeline_tag
    assert f"{head.auto_class}.from_pretrained(" in card.text and head.usage.splitlines()[0] in card.text


# What each model returns, dense and with experts: transformers' output class for its task (with experts a seq2seq
# model's are NLLB-MoE's and Switch's, a causal LM's Mixtral's, a stack's its dense class with `router_logits` added);
# the heads with one output per sequence or token have no MoE variant in transformers and return the dense class.
OUTPUTS = {
    "VanillaTransformerModel": (Seq2SeqModelOutput, Seq2SeqMoEModelOutput),
    "VanillaTransformerForConditionalGeneration": (Seq2SeqLMOutput, Seq2SeqMoEOutput),
    "VanillaTransformerForCausalLM": (CausalLMOutputWithPast, MoeCausalLMOutputWithPast),
    "VanillaTransformerForMaskedLM": (MaskedLMOutput, MaskedLMOutput),
    "VanillaTransformerForSequenceClassification": (SequenceClassifierOutput, SequenceClassifierOutput),
    "VanillaTransformerForTokenClassification": (TokenClassifierOutput, TokenClassifierOutput),
    "VanillaTransformerForQuestionAnswering": (QuestionAnsweringModelOutput, QuestionAnsweringModelOutput),
    "VanillaTransformerForImageClassification": (ImageClassifierOutput, ImageClassifierOutput),
    "VanillaTransformerEncoder": (BaseModelOutput, BaseModelOutput),
    "VanillaTransformerDecoder": (BaseModelOutputWithPastAndCrossAttentions,) * 2,
}
STACKS = {
    "VanillaTransformerEncoder": (VanillaTransformerEncoder, "encoder-only"),
    "VanillaTransformerDecoder": (VanillaTransformerDecoder, "decoder-only"),
}
# The models whose outputs with experts carry router logits, and the fields that hold them.
ROUTED = {
    "VanillaTransformerModel", "VanillaTransformerForConditionalGeneration", "VanillaTransformerForCausalLM", *STACKS
}  # fmt: skip
ROUTER_LOGITS = {"router_logits", "encoder_router_logits", "decoder_router_logits"}


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
@pytest.mark.parametrize("name", [*HEADS, *STACKS])
def test_each_model_returns_its_tasks_output_class_dense_and_with_experts(name, experts):
    """A dense model returns the dense class itself, with no router logits; with experts and `output_router_logits`
    the MoE class, whose router logits hold one tensor per layer of each stack."""
    model_class, kind = STACKS[name] if name in STACKS else (declared_class(name), HEADS[name].checkpoint_kinds[0])
    config = tiny_config(**KIND_CONFIGS[kind], num_experts=experts, output_router_logits=experts > 0)
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (2, 5))
    inputs = dict(input_ids=ids, decoder_input_ids=ids) if kind == "encoder-decoder" else dict(input_ids=ids)
    if kind == "image-encoder":
        inputs = dict(pixel_values=torch.randn(2, config.num_channels, 8, 8))
    with torch.no_grad():
        outputs = model_class(config).eval()(**inputs)
    dense, with_experts = OUTPUTS[name]
    router_fields = ROUTER_LOGITS & {field.name for field in dataclasses.fields(outputs)}
    if not experts:
        assert type(outputs) is dense and not router_fields
        return
    assert isinstance(outputs, with_experts)
    assert bool(router_fields) == (name in ROUTED)
    for field in router_fields:
        assert len(getattr(outputs, field)) == 2, field  # tiny_config: 2 layers per stack, every one sparse


@pytest.mark.parametrize("kind", ["encoder-decoder", "decoder-only"])
def test_router_logits_follow_the_config_and_an_explicit_argument_wins(kind):
    torch.manual_seed(0)
    seq2seq = kind == "encoder-decoder"
    head = declared_class("VanillaTransformerForConditionalGeneration" if seq2seq else "VanillaTransformerForCausalLM")
    model = head(tiny_config(**KIND_CONFIGS[kind], num_experts=4, num_experts_per_tok=2)).eval()
    field = "decoder_router_logits" if kind == "encoder-decoder" else "router_logits"
    inputs = dict(input_ids=torch.randint(3, 64, (2, 5)))
    if kind == "encoder-decoder":
        inputs["decoder_input_ids"] = torch.randint(3, 64, (2, 4))
    with torch.no_grad():
        assert not getattr(model(**inputs), field)
        model.config.output_router_logits = True
        assert len(getattr(model(**inputs), field)) == model.config.decoder_layers
        assert not getattr(model(**inputs, output_router_logits=False), field)
    dense = head(tiny_config(**KIND_CONFIGS[kind]))
    assert not hasattr(dense(**inputs), field)  # a dense model returns the dense output class


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_every_model_sets_its_attention_implementation_dynamically(implementation):
    """`set_attn_implementation` works on the base model and a single stack too (transformers decides from the source
    of the file defining a model class whether it may: there an attention class must look up its function with
    `ALL_ATTENTION_FUNCTIONS.get_interface`), and the forward runs the implementation set: eager attention returns
    its weights."""
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (2, 5))
    for model, inputs in (
        (VanillaTransformerModel(tiny_config()), dict(input_ids=ids, decoder_input_ids=ids)),
        (VanillaTransformerEncoder(tiny_config()), dict(input_ids=ids)),
    ):
        model.set_attn_implementation(implementation)
        assert model.config._attn_implementation == implementation
        outputs = model.eval()(**inputs, output_attentions=implementation == "eager")
        if implementation == "eager":
            weights = getattr(outputs, "encoder_attentions", None) or outputs.attentions
            assert weights and all(w is not None for w in weights)
