"""What a decoding step costs the host, ours against HF Marian on the same weights: Python calls per generated token.

    python benchmarks/decoding_calls.py          # prints the table, writes benchmarks/results/decoding-calls.json

Where the host is the bottleneck (batch 1 on a GPU, a small model on a CPU), a decoding step's cost is its Python
calls. Two counts, each the difference between a long and a short `generate` run divided by the steps between them,
so that what runs once per call drops out:
  * every Python call per token, transformers' and torch's included (greedy, batch 1, d_model 64, 2+2 layers);
  * the calls made on behalf of transformers' generation code (the nearest caller in transformers' generation
    package, our generation file, our package or Marian's modeling file decides whose a call is), greedy, beam search
    and a static cache: `generate` must not do more for our heads than for Marian.
The target (the project's issue 55): calls per token within 10 % of Marian's. These are counts, not timings: they do
not vary from run to run on one set of releases. Time is measured by run_benchmarks.py (`--sections decode`).
"""

import argparse
import collections
import inspect
import json
import os
import sys
from pathlib import Path

import torch
import transformers
from transformers import MarianConfig, MarianMTModel

import hf_vanilla_transformer
from hf_vanilla_transformer.convert_marian_vanilla_transformer import convert_marian_to_vanilla_transformer
from hf_vanilla_transformer.generation_vanilla_transformer import VanillaTransformerGenerationMixin

PACKAGE = os.path.dirname(os.path.realpath(hf_vanilla_transformer.__file__)) + os.sep
GENERATION = os.path.dirname(os.path.realpath(transformers.__file__)) + os.sep + "generation" + os.sep
MARIAN = os.path.realpath(inspect.getfile(MarianMTModel))
OUR_GENERATION = os.path.realpath(inspect.getfile(VanillaTransformerGenerationMixin))
SHORT, LONG = 8, 40  # new tokens of the two runs whose difference is LONG - SHORT steps


def marian_and_twin(d_model: int = 64, vocab_size: int = 1000) -> tuple[MarianMTModel, torch.nn.Module]:
    torch.manual_seed(0)
    marian = MarianMTModel(MarianConfig(
        vocab_size=vocab_size, decoder_vocab_size=vocab_size, d_model=d_model, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model, activation_function="relu", scale_embedding=True,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True, dropout=0.0, max_position_embeddings=256,
        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, forced_eos_token_id=None)).eval()  # fmt: skip
    twin = convert_marian_to_vanilla_transformer(marian).eval()
    for model in (marian, twin):
        model.set_attn_implementation("sdpa")
    return marian, twin


def owner(frame, files: dict[str, str], seen: dict[str, str | None]) -> str:
    """Whose code a call is made for: the nearest frame, this one or a caller, in one of `files` (path prefix ->
    owner name); "other" when none is on the stack."""
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename not in seen:
            path = os.path.realpath(filename)
            seen[filename] = next((name for prefix, name in files.items() if path.startswith(prefix)), None)
        if seen[filename] is not None:
            return seen[filename]
        frame = frame.f_back
    return "other"


def calls(model, source: torch.Tensor, new_tokens: int, **options) -> tuple[collections.Counter, torch.Tensor]:
    """Python calls of one `generate`: "all", and by owner ("generation": transformers' generation package and our
    generation file, "model": the rest of our package or Marian's file, "other"); and the generated tokens."""
    files = {OUR_GENERATION: "generation", GENERATION: "generation", PACKAGE: "model", MARIAN: "model"}
    counts, seen = collections.Counter(), {}

    def profile(frame, event, arg):
        if event == "call":
            counts["all"] += 1
            counts[owner(frame, files, seen)] += 1

    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **options)
    with torch.no_grad():
        sys.setprofile(profile)
        try:
            tokens = model.generate(source, **options)
        finally:
            sys.setprofile(None)
    return counts, tokens


def per_token(model, source: torch.Tensor, **options) -> tuple[dict[str, float], torch.Tensor]:
    with torch.no_grad():
        model.generate(source, max_new_tokens=2, **options)  # warm: first-call work (lazy imports, caches) drops out
    short, _ = calls(model, source, SHORT, **options)
    long, tokens = calls(model, source, LONG, **options)
    return {key: (long[key] - short[key]) / (LONG - SHORT) for key in long | short}, tokens


CASES = {
    "greedy, batch 1": (1, dict(num_beams=1)),
    "beam 3, batch 2": (2, dict(num_beams=3)),
    "greedy, batch 1, static cache": (1, dict(num_beams=1, cache_implementation="static")),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "decoding-calls.json")
    args = parser.parse_args()
    marian, twin = marian_and_twin()
    rows = {}
    for name, (batch, options) in CASES.items():
        source = torch.randint(3, 1000, (batch, 12), generator=torch.Generator().manual_seed(3))
        theirs, their_tokens = per_token(marian, source, **options)
        ours, our_tokens = per_token(twin, source, **options)
        rows[name] = {
            "same_tokens": bool(torch.equal(our_tokens, their_tokens)),
            "ours": {key: round(value, 1) for key, value in sorted(ours.items())},
            "marian": {key: round(value, 1) for key, value in sorted(theirs.items())},
            "ratio_all": round(ours["all"] / theirs["all"], 3),
        }
    print(f"{'case':32} {'ours':>8} {'Marian':>8} {'ratio':>6} {'generate: ours / Marian':>24}")
    for name, row in rows.items():
        ours, theirs = row["ours"], row["marian"]
        generation = f"{ours.get('generation', 0):.0f} / {theirs.get('generation', 0):.0f}"
        print(f"{name:32} {ours['all']:8.0f} {theirs['all']:8.0f} {row['ratio_all']:6.3f} {generation:>24}")
    output = args.output
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    output.write_text(json.dumps({**versions, "rows": rows}, indent=2) + "\n")
    print(f"wrote {output}")
    return 0 if all(row["same_tokens"] for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
