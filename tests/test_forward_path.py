"""How far one forward travels through the package, and what a decoding step costs the host: a training forward of
the seq2seq head stays within a few files and functions, as transformers' own models do (their forward stays in one
modeling file), and greedy decoding makes no more Python calls per token than HF Marian on the same weights."""

import collections
import os
import sys

import pytest
import torch
from conftest import tiny_config
from transformers import MarianConfig, MarianMTModel

import hf_vanilla_transformer
from hf_vanilla_transformer import DataCollatorForSeq2SeqWithFlattening, VanillaTransformerForConditionalGeneration
from hf_vanilla_transformer.convert_marian_vanilla_transformer import convert_marian_to_vanilla_transformer

PACKAGE = os.path.dirname(os.path.realpath(hf_vanilla_transformer.__file__)) + os.sep
COMPREHENSIONS = ("<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>", "<lambda>")


def package_functions(run) -> tuple[set[tuple[str, str]], list[str]]:
    """The package functions `run()` calls (comprehensions not counted), and the file of each call in order."""
    calls = []

    def profile(frame, event, arg):
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE) and code.co_name not in COMPREHENSIONS:
            calls.append((os.path.basename(code.co_filename), code.co_qualname))

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return set(calls), [file for file, _ in calls]


def translation_batch(layout: str, model) -> dict:
    pairs = [
        {"input_ids": list(range(4, 4 + s)) + [2], "labels": list(range(5, 5 + t)) + [2]}
        for s, t in zip([5, 9, 3, 7], [6, 4, 8, 5])
    ]
    if layout == "flattened":
        return DataCollatorForSeq2SeqWithFlattening(model)(pairs)
    # The same sentences padded, as transformers' DataCollatorForSeq2Seq(model=model) gives them.
    longest_source, longest_target = max(len(p["input_ids"]) for p in pairs), max(len(p["labels"]) for p in pairs)
    input_ids = torch.tensor([p["input_ids"] + [0] * (longest_source - len(p["input_ids"])) for p in pairs])
    labels = torch.tensor([p["labels"] + [-100] * (longest_target - len(p["labels"])) for p in pairs])
    return dict(input_ids=input_ids, attention_mask=(input_ids != 0).long(), labels=labels,
                decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels),
                decoder_attention_mask=(labels != -100).long())  # fmt: skip


def python_calls_per_token(model, inputs: torch.Tensor, new_tokens: int) -> float:
    counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            counter["calls"] += 1

    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, num_beams=1)
    with torch.no_grad():
        model.generate(inputs, **options)
        sys.setprofile(profile)
        try:
            tokens = model.generate(inputs, **options)
        finally:
            sys.setprofile(None)
    return counter["calls"] / new_tokens, tokens


def test_greedy_decoding_makes_no_more_python_calls_per_token_than_marian():
    """Where the host is the bottleneck (batch 1 on a GPU, a small model on a CPU), a decoding step's cost is its
    Python calls: all of them, transformers' and torch's included, over 32 greedy tokens from Marian's weights."""
    torch.manual_seed(0)
    marian = MarianMTModel(MarianConfig(
        vocab_size=1000, decoder_vocab_size=1000, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        activation_function="relu", scale_embedding=True, share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True, dropout=0.0, max_position_embeddings=256, pad_token_id=0, eos_token_id=2,
        decoder_start_token_id=0, forced_eos_token_id=None)).eval()  # fmt: skip
    ours = convert_marian_to_vanilla_transformer(marian).eval()
    for model in (marian, ours):
        model.set_attn_implementation("sdpa")
    inputs = torch.randint(3, 1000, (1, 12))
    theirs, their_tokens = python_calls_per_token(marian, inputs, 32)
    our_calls, our_tokens = python_calls_per_token(ours, inputs, 32)
    assert torch.equal(our_tokens, their_tokens)
    assert our_calls <= theirs, (our_calls, theirs)
