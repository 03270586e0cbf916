"""What a decoding step costs the host: greedy decoding makes no more Python calls per token than HF Marian on the
same weights (where the host is the bottleneck, a step's cost is its Python calls)."""

import collections
import sys

import torch
from transformers import MarianConfig, MarianMTModel

from hf_vanilla_transformer.convert_marian_vanilla_transformer import convert_marian_to_vanilla_transformer


def python_calls_per_token(model, inputs: torch.Tensor, new_tokens: int) -> tuple[float, torch.Tensor]:
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
