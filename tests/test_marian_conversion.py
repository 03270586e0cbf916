"""MarianMTModel -> VanillaTransformerForConditionalGeneration: same logits, same beam search, usable tokenizer.

Run: python -m pytest -q tests/test_marian_conversion.py
"""

import json

import pytest
import sentencepiece as spm
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, MarianConfig, MarianMTModel, MarianTokenizer

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration, convert_marian_to_vanilla_transformer
from hf_vanilla_transformer.convert_marian_vanilla_transformer import main

CORPUS = [
    "the cat sat on the mat",
    "a dog ran to the house",
    "one two three four five",
    "the red house is big",
    "small blue birds sing",
]


def tiny_marian(vocab_size: int = 48, seed: int = 0, **overrides) -> MarianMTModel:
    """A random Marian with OPUS-MT's conventions (</s>=0, <unk>=1, <pad>=last=decoder start), every weight random."""
    fields = dict(
        vocab_size=vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=vocab_size - 1,
        decoder_start_token_id=vocab_size - 1,
        eos_token_id=0,
        forced_eos_token_id=0,
        dropout=0.1,
    )
    torch.manual_seed(seed)
    marian = MarianMTModel(MarianConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():  # layer norms at 1/0 and a zero logits bias would hide a wrong mapping
        for name, parameter in marian.named_parameters():
            if "embed_positions" not in name:
                parameter.normal_(0.0, 0.3)
        marian.final_logits_bias.normal_(0.0, 1.0)
    return marian


def source_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, vocab_size - 1, (3, 11), generator=generator)
    input_ids[:, -1] = 0  # </s>
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 7:] = 0
    attention_mask[2, 4:] = 0
    return input_ids.masked_fill(attention_mask == 0, vocab_size - 1), attention_mask


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # OPUS-MT: swish, scaled, one shared and tied embedding
        dict(activation_function="gelu", scale_embedding=False, share_encoder_decoder_embeddings=False),
        dict(activation_function="relu", tie_word_embeddings=False),
    ],
    ids=["opus-mt", "gelu-separate-embeddings", "relu-untied"],
)
def test_converted_marian_gives_identical_logits_and_beams(overrides):
    marian = tiny_marian(**overrides)
    model = convert_marian_to_vanilla_transformer(marian)
    assert isinstance(model, VanillaTransformerForConditionalGeneration) and not model.training
    assert model.config.sinusoidal_layout == "concatenated" and model.config.lm_head_bias

    input_ids, attention_mask = source_batch(marian.config.vocab_size)
    decoder_input_ids = torch.randint(0, marian.config.vocab_size - 1, (3, 9), generator=torch.Generator())
    decoder_input_ids[:, 0] = marian.config.decoder_start_token_id
    with torch.no_grad():
        expected = marian(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
        logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)

    generate_kwargs = dict(attention_mask=attention_mask, num_beams=4, max_new_tokens=12)
    expected_beams = marian.generate(input_ids, **generate_kwargs)
    assert expected_beams.shape[1] > 3  # a real search, not an immediate </s>
    assert torch.equal(model.generate(input_ids, **generate_kwargs), expected_beams)


def test_unsupported_marian_options_raise():
    with pytest.raises(ValueError, match="activation_function='tanh'"):
        convert_marian_to_vanilla_transformer(tiny_marian(activation_function="tanh"))
    with pytest.raises(ValueError, match="decoder_vocab_size=56"):
        convert_marian_to_vanilla_transformer(
            tiny_marian(decoder_vocab_size=56, share_encoder_decoder_embeddings=False)
        )


def marian_tokenizer(folder) -> MarianTokenizer:
    """A real MarianTokenizer: one sentencepiece model for both sides and Marian's vocab.json (</s>=0, <pad>=last)."""
    (folder / "corpus.txt").write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"),
        model_prefix=str(folder / "spm"),
        vocab_size=30,
        model_type="unigram",
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        minloglevel=2,
    )
    pieces = [line.split("\t")[0] for line in (folder / "spm.vocab").read_text().splitlines()]
    vocab = {"</s>": 0, "<unk>": 1, **{piece: i + 2 for i, piece in enumerate(pieces[1:])}}
    vocab["<pad>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    return MarianTokenizer(str(folder / "spm.model"), str(folder / "spm.model"), str(folder / "vocab.json"))


def test_command_line_converts_a_saved_checkpoint_and_keeps_its_tokenizer(tmp_path):
    tokenizer = marian_tokenizer(tmp_path)
    marian = tiny_marian(vocab_size=len(tokenizer))
    src, dst = tmp_path / "marian", tmp_path / "converted"
    marian.save_pretrained(src)
    tokenizer.save_pretrained(src)

    main([str(src), str(dst)])

    reloaded_tokenizer = AutoTokenizer.from_pretrained(dst)
    assert type(reloaded_tokenizer).__name__ == "MarianTokenizer"
    batch = reloaded_tokenizer(CORPUS[:2], return_tensors="pt", padding=True)
    assert batch.input_ids.tolist() == tokenizer(CORPUS[:2], return_tensors="pt", padding=True).input_ids.tolist()

    model = AutoModelForSeq2SeqLM.from_pretrained(dst)
    assert isinstance(model, VanillaTransformerForConditionalGeneration)
    assert json.loads((dst / "config.json").read_text())["auto_map"]["AutoModelForSeq2SeqLM"]
    expected = marian.generate(**batch, num_beams=4, max_new_tokens=8)
    generated = model.generate(**batch, num_beams=4, max_new_tokens=8)
    assert torch.equal(generated, expected)
    assert reloaded_tokenizer.batch_decode(generated) == tokenizer.batch_decode(expected)

    with pytest.raises(ValueError, match="not empty"):
        main([str(src), str(dst)])
