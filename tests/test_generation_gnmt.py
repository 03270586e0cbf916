"""GNMT length penalty in beam search (hf_vanilla_transformer/generation_vanilla_transformer.py).

Run: python -m pytest -q tests/test_generation_gnmt.py
"""

import math

import pytest
import torch
from conftest import tiny_config

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration
from hf_vanilla_transformer.generation_vanilla_transformer import gnmt_length_penalty

# A model whose next-token distribution is the same at every step: token 3 with log-prob LOG_P_TOKEN, EOS (id 2)
# with LOG_P_EOS, the six other ids share the rest. The hypothesis "3^(L-1) EOS" then has log-prob
# (L-1)*LOG_P_TOKEN + LOG_P_EOS = -(c + b*L), linear in L, and the best length is where that sum divided by the
# penalty peaks: for lp = L^alpha near alpha*c / ((1-alpha)*b) (= 17 here), for the GNMT penalty 5 / (1-alpha) = 12.5
# tokens earlier.
LOG_P_TOKEN, LOG_P_EOS, ALPHA, MAX_NEW_TOKENS = -0.2, -2.5, 0.6, 64
EOS, TOKEN = 2, 3


def constant_distribution_model() -> VanillaTransformerForConditionalGeneration:
    model = VanillaTransformerForConditionalGeneration(
        tiny_config(
            vocab_size=8,
            encoder_layers=1,
            decoder_layers=1,
            max_position_embeddings=128,
            lm_head_bias=True,
            tie_word_embeddings=False,
        )
    ).eval()
    rest = math.log((1 - math.exp(LOG_P_TOKEN) - math.exp(LOG_P_EOS)) / 6)
    log_probs = torch.full((8,), rest)
    log_probs[TOKEN], log_probs[EOS] = LOG_P_TOKEN, LOG_P_EOS
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.copy_(log_probs)
    return model


def expected_best(penalty) -> tuple[int, float]:
    """The length transformers' beam search must return under `penalty`, and its score. At the length limit the
    hypotheses are cut there, so the best one of that length is "3^MAX_NEW_TOKENS" without an EOS (the limit is far
    enough for that one to lose under both penalties)."""
    scores = {length: ((length - 1) * LOG_P_TOKEN + LOG_P_EOS) / penalty(length) for length in range(1, MAX_NEW_TOKENS)}
    scores[MAX_NEW_TOKENS] = MAX_NEW_TOKENS * LOG_P_TOKEN / penalty(MAX_NEW_TOKENS)
    best = max(scores, key=scores.get)
    return best, scores[best]


def beam_search(model, **kwargs):
    input_ids = torch.tensor([[5, 6, 7, EOS]])
    return model.generate(
        input_ids,
        num_beams=4,
        length_penalty=ALPHA,
        early_stopping="never",
        max_new_tokens=MAX_NEW_TOKENS,
        return_dict_in_generate=True,
        output_scores=True,
        **kwargs,
    )


def generated_length(sequence: torch.Tensor) -> int:
    """Tokens after the decoder start token, up to and including EOS."""
    tokens = sequence[1:].tolist()
    return tokens.index(EOS) + 1 if EOS in tokens else len(tokens)


def test_gnmt_and_power_penalties_rank_differently_and_each_as_its_formula_says():
    model = constant_distribution_model()
    gnmt_length, gnmt_score = expected_best(lambda length: gnmt_length_penalty(length, ALPHA))
    power_length, power_score = expected_best(lambda length: length**ALPHA)
    assert gnmt_length != power_length  # the construction really separates the two rankings

    gnmt = beam_search(model, length_penalty_type="gnmt")
    assert generated_length(gnmt.sequences[0]) == gnmt_length
    assert gnmt.sequences[0, 1:gnmt_length].eq(TOKEN).all()
    torch.testing.assert_close(gnmt.sequences_scores[0].item(), gnmt_score, rtol=1e-4, atol=1e-4)

    power = beam_search(model)  # transformers' own |Y|^alpha, the default
    assert generated_length(power.sequences[0]) == power_length
    torch.testing.assert_close(power.sequences_scores[0].item(), power_score, rtol=1e-4, atol=1e-4)


def test_gnmt_from_the_generation_config_and_scores_sorted():
    model = constant_distribution_model()
    model.generation_config.length_penalty_type = "gnmt"
    out = beam_search(model, num_return_sequences=4)
    assert generated_length(out.sequences[0]) == expected_best(lambda n: gnmt_length_penalty(n, ALPHA))[0]
    # Every returned hypothesis carries log P / lp(Y), and they come best first.
    for sequence, score in zip(out.sequences, out.sequences_scores):
        length = generated_length(sequence)
        log_prob = sum(LOG_P_TOKEN if t == TOKEN else LOG_P_EOS for t in sequence[1 : length + 1].tolist())
        torch.testing.assert_close(score.item(), log_prob / gnmt_length_penalty(length, ALPHA), rtol=1e-4, atol=1e-4)
    assert torch.all(out.sequences_scores[:-1] >= out.sequences_scores[1:])


def test_unknown_length_penalty_type_is_a_value_error():
    model = constant_distribution_model()
    with pytest.raises(ValueError, match="length_penalty_type"):
        model.generate(torch.tensor([[5, EOS]]), num_beams=2, max_new_tokens=3, length_penalty_type="bogus")
