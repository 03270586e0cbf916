"""CPU decoding side by side: HF Marian, this project (float32, bfloat16, int8 through `optimize_for_cpu_inference`)
and CTranslate2 (float32, int8), all holding the same transformer-base weights.

Every system decodes exactly `new_tokens` tokens per sentence (HF: no end-of-sequence token; CTranslate2:
`min_decoding_length = max_decoding_length`), so tokens/s compare the same work. Timed in rotating rounds, once on
1 thread with process CPU time and once on 2 threads with wall time. Beside the speeds: the memory bandwidth measured
in the same run, the weight bytes one decoding step reads in each precision, and the tokens/s those two allow
(`limit`), so each system's distance to the memory wall is visible.

    python benchmarks/cpu_decoding.py            # all four shapes, both thread settings (about 15 minutes)
    python benchmarks/cpu_decoding.py --quick    # a smoke run
"""

import argparse
import copy
import importlib.util
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from marian_twin import build_pair
from measure import environment, memory_bandwidth, time_round_robin, write_results

from hf_vanilla_transformer.cpu_inference_vanilla_transformer import optimize_for_cpu_inference

# The paper's transformer-base with a 32000-token vocabulary (d_model, layers, heads, ffn_dim, vocab_size).
SIZE = "transformer-base-32k"
PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}
SHAPES = [(1, 1), (8, 1), (1, 4), (8, 4)]  # (batch, beams)
# Thread settings: (threads, clock). One thread on CPU time is the steady figure on a shared machine.
THREAD_SETTINGS = [(1, "cpu"), (2, "wall")]


def step_weight_bytes(config, precision: str) -> int:
    """Weight bytes one decoding step reads: per decoder layer self-attention q/k/v/o, cross-attention q/o (the
    encoder's K/V are cached once) and the FFN, plus the output projection. int8 adds one float32 scale per row."""
    d, f, v = config.d_model, config.decoder_ffn_dim, config.vocab_size
    matrices = [(d, d)] * 6 + [(f, d), (d, f)]  # (out, in)
    per_layer = sum(out * inp for out, inp in matrices)
    weights = config.decoder_layers * per_layer + v * d
    rows = config.decoder_layers * (6 * d + f + d) + v
    bytes_per_weight = PRECISION_BYTES[precision]
    return weights * bytes_per_weight + (rows * 4 if precision == "int8" else 0)


def ctranslate2_translators(marian, threads: int, directory: Path) -> dict[str, object]:
    """The Marian twin converted by CTranslate2's own converter, one translator per compute type."""
    import ctranslate2
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    config = marian.config
    vocabulary = {token_name(i, config): i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocabulary, unk_token="<unk>")),
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    hf_dir, translators = directory / "marian", {}
    marian.save_pretrained(hf_dir)
    tokenizer.save_pretrained(hf_dir)
    for quantization in ("float32", "int8"):
        output = directory / f"ct2-{quantization}"
        if not output.exists():
            ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(output), quantization=quantization)
        translators[quantization] = ctranslate2.Translator(
            str(output), device="cpu", compute_type=quantization, intra_threads=threads, inter_threads=1
        )
    return translators


def token_name(token_id: int, config) -> str:
    """Token strings for the converter. Its Marian loader drops the last vocabulary row as Marian's appended "<pad>"
    (Marian decoders start from a zero embedding instead), so the last id is named "<pad>" and never used."""
    special = {config.vocab_size - 1: "<pad>", config.eos_token_id: "</s>", config.bos_token_id: "<unk>"}
    return special.get(token_id, f"t{token_id}")


def hf_runner(model, source: torch.Tensor, beams: int, new_tokens: int) -> Callable[[], object]:
    # No end-of-sequence token: every hypothesis runs the full length without a per-step logits processor masking
    # the end token (`min_new_tokens`), whose cost over the 32000-wide logits would be the benchmark's, not the model's.
    options = {"max_new_tokens": new_tokens, "eos_token_id": None, "num_beams": beams, "do_sample": False}

    @torch.inference_mode()
    def run():
        return model.generate(input_ids=source, attention_mask=torch.ones_like(source), **options)

    return run


def ct2_runner(translator, source_tokens: list[list[str]], beams: int, new_tokens: int) -> Callable[[], object]:
    def run():
        return translator.translate_batch(
            source_tokens,
            beam_size=beams,
            max_decoding_length=new_tokens,
            min_decoding_length=new_tokens,
            max_batch_size=len(source_tokens),
        )

    return run


def cpu_decoding_section(repeats: int, new_tokens: int = 64, source_len: int = 24, quick: bool = False) -> dict:
    """Tokens/s of every system at each (batch, beams) and thread setting, with the bandwidth and the limits."""
    threads_before = torch.get_num_threads()
    ours, marian = build_pair(SIZE, 0.0, torch.float32, torch.device("cpu"), "sdpa")
    ours.eval(), marian.eval()
    systems = {"hf_marian_float32": marian}
    for precision in PRECISION_BYTES:
        systems[f"ours_{precision}"] = optimize_for_cpu_inference(copy.deepcopy(ours), precision)
    del ours
    shapes = SHAPES[:2] if quick else SHAPES
    settings = THREAD_SETTINGS[:1] if quick else THREAD_SETTINGS
    results: dict = {"size": SIZE, "new_tokens": new_tokens, "source_len": source_len, "runs": []}
    results["step_weight_bytes"] = {p: step_weight_bytes(marian.config, p) for p in PRECISION_BYTES}
    with tempfile.TemporaryDirectory() as directory:
        for threads, clock in settings:
            torch.set_num_threads(threads)
            bandwidth = memory_bandwidth(clock)
            # CTranslate2 is an optional extra: without it the table has the torch rows only.
            has_ct2 = importlib.util.find_spec("ctranslate2") is not None
            translators = ctranslate2_translators(marian, threads, Path(directory)) if has_ct2 else {}
            for batch, beams in shapes:
                source = torch.randint(
                    3, marian.config.vocab_size - 1, (batch, source_len), generator=torch.Generator().manual_seed(5)
                )
                source_tokens = [[token_name(i, marian.config) for i in row] for row in source.tolist()]
                runs = {name: hf_runner(model, source, beams, new_tokens) for name, model in systems.items()}
                runs |= {f"ct2_{q}": ct2_runner(t, source_tokens, beams, new_tokens) for q, t in translators.items()}
                reference = runs["ours_float32"]()
                same_tokens = bool(torch.equal(reference, runs["hf_marian_float32"]()))
                print(f"timing batch {batch}, beams {beams}, {threads} thread(s) ...", flush=True)
                seconds = time_round_robin(runs, repeats, clock)
                tokens = batch * new_tokens
                speed = {name: tokens / statistics.median(times) for name, times in seconds.items()}
                results["runs"].append(
                    {
                        "threads": threads,
                        "clock": clock,
                        "batch": batch,
                        "num_beams": beams,
                        "memory_bandwidth_bytes_per_s": bandwidth,
                        # Tokens/s if a step cost only the reading of its weights at the measured bandwidth.
                        "limit_tokens_per_s": {
                            p: batch * bandwidth / b for p, b in results["step_weight_bytes"].items()
                        },
                        "ours_float32_same_tokens_as_marian": same_tokens,
                        "tokens_per_s": speed,
                        "speed_vs_hf_marian": {name: s / speed["hf_marian_float32"] for name, s in speed.items()},
                        "seconds": seconds,
                    }
                )
            del translators
    torch.set_num_threads(threads_before)
    return results


def print_cpu_decoding(section: dict) -> None:
    print(f"\nCPU decoding, {section['size']}, {section['new_tokens']} new tokens per sentence")
    print(
        "weight bytes per step: " + ", ".join(f"{p} {b / 1e6:.0f} MB" for p, b in section["step_weight_bytes"].items())
    )
    for run in section["runs"]:
        mode = "greedy" if run["num_beams"] == 1 else f"beam{run['num_beams']}"
        limits = ", ".join(f"{p} {v:.0f}" for p, v in run["limit_tokens_per_s"].items())
        print(
            f"\n{mode} b{run['batch']}, {run['threads']} thread(s), {run['clock']} clock: bandwidth "
            f"{run['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s -> weight-read limit tok/s: {limits}"
        )
        for name, speed in run["tokens_per_s"].items():
            print(f"  {name:<20} {speed:8.1f} tok/s  {run['speed_vs_hf_marian'][name]:5.2f}x HF Marian")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 8 greedy and batch 1 greedy, 1 thread, 32 tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (the reported figure is their median)")
    parser.add_argument("--new_tokens", type=int, default=None, help="tokens decoded per sentence (default 64)")
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()
    new_tokens = args.new_tokens or (32 if args.quick else 64)
    section = cpu_decoding_section(args.repeats, new_tokens=new_tokens, quick=args.quick)
    results = {"environment": environment(torch.device("cpu")), "cpu_decoding": section}
    print_cpu_decoding(section)
    write_results(results, args.output, "cpu-decoding")


if __name__ == "__main__":
    main()
