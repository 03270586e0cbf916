"""Checkpoints saved under one transformers release, for tests/test_transformers_releases.py to load under another.

`python tests/release_checkpoints.py` saves, under the installed transformers, a tiny translation model with its code
(`save_pretrained` of a class registered for the Auto classes) into
tests/fixtures/seq2seq-saved-with-transformers-<version>/, beside `expected.json`: the source, and the tokens each way
of decoding gives there. CI runs the suite under the oldest and the newest release the package declares, so each
loads the other's checkpoint. The decoding settings are here, used by the saving run and by the test alike.
"""

import json
import sys
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures"
PREFIX = "seq2seq-saved-with-transformers-"

# Each way of decoding a user picks (greedy, beam search with either length penalty, sampling, prompt lookup), with
# a length such that every row decodes to its limit or to EOS without ties between candidates.
DECODING = {
    "greedy": dict(do_sample=False),
    "beam": dict(num_beams=4, length_penalty=0.6, do_sample=False),
    "beam_gnmt": dict(num_beams=4, length_penalty=0.6, length_penalty_type="gnmt", do_sample=False),
    "sample": dict(do_sample=True, top_k=20, temperature=0.9),
    "prompt_lookup": dict(do_sample=False, prompt_lookup_num_tokens=3),
}
SOURCE = [[5, 9, 14, 22, 31, 40, 2], [7, 7, 12, 19, 2, 0, 0]]  # the second row padded


def generate(model, mode: str) -> list[list[int]]:
    """The tokens `model` decodes from SOURCE in `mode` (sampling from seed 0; prompt lookup, which transformers runs
    on one sequence only, from the first)."""
    input_ids = torch.tensor(SOURCE[:1] if mode == "prompt_lookup" else SOURCE)
    torch.manual_seed(0)
    with torch.no_grad():
        tokens = model.generate(input_ids, attention_mask=(input_ids != 0).long(), max_new_tokens=10, **DECODING[mode])
    return tokens.tolist()


def save(folder: Path) -> None:
    import transformers

    from hf_vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

    torch.manual_seed(0)
    config = VanillaTransformerConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, max_position_embeddings=64,
    )  # fmt: skip
    model = VanillaTransformerForConditionalGeneration(config).eval()
    model.save_pretrained(folder)
    expected = {"transformers": transformers.__version__, "source": SOURCE}
    expected["tokens"] = {mode: generate(model, mode) for mode in DECODING}
    (folder / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    import transformers

    target = FIXTURES / f"{PREFIX}{transformers.__version__}"
    save(target)
    print(target, file=sys.stderr)
