"""How `generate()` runs this package's heads (hf_vanilla_transformer/generation_vanilla_transformer.py): transformers'
generation path as for its own models, the same tokens as HF Marian on the same weights, and the code files still
saved after it. What a step costs in Python calls beside Marian is a benchmark: benchmarks/decoding_calls.py.

Run: python -m pytest -q tests/test_generation_overhead.py
"""

import inspect
import os

import pytest
import torch
import transformers
from conftest import tiny_config
from transformers import MarianConfig, MarianMTModel

from hf_vanilla_transformer import VanillaTransformerForCausalLM, VanillaTransformerForConditionalGeneration
from hf_vanilla_transformer import generation_vanilla_transformer as generation_module
from hf_vanilla_transformer.convert_marian_vanilla_transformer import convert_marian_to_vanilla_transformer



def marian_and_twin() -> tuple[MarianMTModel, VanillaTransformerForConditionalGeneration]:
    torch.manual_seed(0)
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=200,
            decoder_vocab_size=200,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            activation_function="relu",
            scale_embedding=True,
            share_encoder_decoder_embeddings=True,
            tie_word_embeddings=True,
            dropout=0.0,
            max_position_embeddings=64,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=0,
            forced_eos_token_id=None,
        )
    ).eval()
    twin = convert_marian_to_vanilla_transformer(marian).eval()
    for model in (marian, twin):
        model.set_attn_implementation("sdpa")
    return marian, twin


@pytest.mark.parametrize(
    "batch, options",
    [(1, dict(num_beams=1)), (2, dict(num_beams=3)), (1, dict(num_beams=1, cache_implementation="static"))],
    ids=["greedy", "beam_search", "greedy_static_cache"],
)
def test_generate_gives_marians_tokens(batch, options):
    """Greedy, beam search and a static cache: the steps run through transformers' generation path as Marian's do
    (`prepare_inputs_for_generation` answers once that the forward takes no `cache_position`), with its tokens."""
    marian, twin = marian_and_twin()
    source = torch.randint(3, 200, (batch, 10), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, **options)
    with torch.no_grad():
        assert torch.equal(twin.generate(source, **options), marian.generate(source, **options))


def test_beam_search_keeps_transformers_penalty_with_a_warning_where_the_gnmt_hooks_do_not_fit(monkeypatch):
    """A transformers release whose beam search no longer has the methods the GNMT penalty hooks into: beam search
    runs, ranks with transformers' own penalty (Marian's tokens), and says which feature is lost under which release.
    (Where the hooks fit, tests/test_generation_gnmt.py checks the ranking against the formula.)"""
    marian, twin = marian_and_twin()
    source = torch.randint(3, 200, (2, 10), generator=torch.Generator().manual_seed(4))
    options = dict(num_beams=3, length_penalty=0.6, max_new_tokens=8, do_sample=False)
    monkeypatch.setattr(generation_module, "GNMT_HOOKS_FIT", False)
    with torch.no_grad(), pytest.warns(UserWarning, match=transformers.__version__.replace(".", r"\.")) as warned:
        gnmt = twin.generate(source, length_penalty_type="gnmt", **options)
    assert any("gnmt" in str(warning.message) for warning in warned)
    with torch.no_grad():
        assert torch.equal(gnmt, marian.generate(source, **options))


@pytest.mark.parametrize("head", [VanillaTransformerForConditionalGeneration, VanillaTransformerForCausalLM])
def test_the_heads_take_no_cache_position(head):
    """The override rests on this: transformers' per-step question (does the forward take `cache_position`?) has the
    answer no for every head that generates."""
    assert "cache_position" not in inspect.signature(head.forward).parameters


def test_a_decoder_only_model_generates_from_embeddings():
    """`generate` reads the parameters of `prepare_inputs_for_generation`: without `inputs_embeds` among them it
    refuses to start a decoder-only model from embeddings."""
    torch.manual_seed(0)
    model = VanillaTransformerForCausalLM(tiny_config(is_encoder_decoder=False, eos_token_id=None)).eval()
    input_ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        from_ids = model.generate(input_ids, max_new_tokens=4, do_sample=False)
        from_embeds = model.generate(
            inputs_embeds=model.get_input_embeddings()(input_ids), max_new_tokens=4, do_sample=False
        )
    assert torch.equal(from_embeds, from_ids[:, input_ids.shape[1] :])


def test_after_generate_the_model_is_remote_code_again_and_saves_its_code(tmp_path):
    """The instance attribute that answers `is_remote_code` during a step is gone after it: `save_pretrained` still
    ships the code files that `register_for_auto_class` asks for."""
    _, twin = marian_and_twin()
    with torch.no_grad():
        twin.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3)
    assert "is_remote_code" not in vars(twin)
    assert twin.is_remote_code()
    twin.save_pretrained(tmp_path)
    assert (tmp_path / os.path.basename(inspect.getfile(type(twin)))).is_file()


def test_a_subclass_whose_forward_takes_cache_position_still_gets_it():
    """transformers builds `cache_position` for remote code that asks for it; a subclass that does keeps that."""

    seen = []

    class WithCachePosition(VanillaTransformerForConditionalGeneration):
        def forward(self, *args, cache_position=None, **kwargs):
            seen.append(cache_position)
            return super().forward(*args, **kwargs)

    WithCachePosition.register_for_auto_class("AutoModelForSeq2SeqLM")
    assert WithCachePosition._forward_takes_cache_position
    _, twin = marian_and_twin()
    model = WithCachePosition(twin.config).eval()
    with torch.no_grad():
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3, min_new_tokens=3)
    assert [position.tolist() for position in seen[1:]] == [[1], [2]]


def test_a_source_without_padding_decodes_without_a_cross_attention_mask():
    """The source's padding mask reaches every decoding step for cross-attention; where the sources have no padding
    it is dropped before the encoder runs (one read per `generate` call, none per step): decoding then runs the
    operations of decoding without a mask, with its tokens. A padded source keeps its mask: each of its sequences
    decodes as it does alone, unpadded."""
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    source = torch.randint(4, 64, (2, 7))
    options = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, num_beams=2)
    with torch.no_grad():
        tokens = model.generate(source, **options)
        with_ones_tokens = model.generate(source, attention_mask=torch.ones_like(source), **options)
        assert torch.equal(with_ones_tokens, tokens)
        padded_mask = torch.ones_like(source)
        padded_mask[1, 5:] = 0  # the second source is 5 tokens long
        padded = model.generate(source, attention_mask=padded_mask, **options)
        alone = model.generate(source[1:, :5], **options)
    assert torch.equal(padded[1], alone[0])
