"""Routes to fast CPU decoding, side by side: this project's `optimize_for_cpu_inference` against the public ones
(`torch.compile` with inductor's freezing, torchao's int8 through transformers' `TorchAoConfig`, with and without
compile), for our model and for HF Marian holding the same transformer-base weights, in float32, bfloat16 and int8.

Each precision is one group, timed in rotating rounds (so every system of a group sees the same load), and every group
holds HF Marian float32 eager, the anchor its ratios are taken against. Tokens/s come from the fastest of the rounds
(the machine is shared: the minimum is the run least disturbed by others), 1 thread, process CPU time. Every system
decodes exactly `new_tokens` tokens (no end-of-sequence token); compiled systems decode with a static cache (one graph
per batch x beams shape, compiled before timing, its compile time recorded). Beside each speed: the share of its
tokens equal to our float32 eager model's.

    python benchmarks/cpu_inference_routes.py                     # batch 1 and 8 greedy, beam 4 at batch 1
    python benchmarks/cpu_inference_routes.py --shapes 1x1 8x1 1x4 8x4 --repeats 5
    python benchmarks/cpu_inference_routes.py --size small --repeats 2 --new_tokens 8   # a smoke run
"""

import argparse
import copy
import functools
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from marian_twin import build_pair
from measure import environment, time_round_robin, write_results
from transformers import MarianMTModel, TorchAoConfig

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration
from hf_vanilla_transformer.cpu_inference_vanilla_transformer import optimize_for_cpu_inference

ANCHOR = "marian_float32_eager"
MODEL_CLASSES = {"ours": VanillaTransformerForConditionalGeneration, "marian": MarianMTModel}


def compiled(model):
    """`torch.compile` of the forward with inductor's freezing: the weights become constants, which inductor folds
    and prepacks (oneDNN's blocked layouts) once, at compile time. Shapes are static: one graph per decoding shape."""
    model.forward = torch.compile(model.forward, dynamic=False, options={"freezing": True})
    return model


def torchao_loaded(name: str, folder: Path, config_name: str):
    """The model loaded from its saved folder with transformers' `TorchAoConfig`: torchao quantizes every Linear at
    load (the embeddings stay float32)."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    quant_type = {"int8_weight_only": Int8WeightOnlyConfig, "int8_dynamic": Int8DynamicActivationInt8WeightConfig}
    config = TorchAoConfig(quant_type[config_name]())
    return MODEL_CLASSES[name].from_pretrained(folder / name, quantization_config=config).eval()


def float32_group(models: dict, folder: Path) -> dict[str, Callable[[], object]]:
    ours, marian = models["ours"], models["marian"]
    return {
        ANCHOR: lambda: marian,
        "ours_float32_eager": lambda: ours,
        "ours_float32_optimize_for_cpu_inference": lambda: optimize_for_cpu_inference(copy.deepcopy(ours), "float32"),
        "marian_float32_compile": lambda: compiled(copy.deepcopy(marian)),
        "ours_float32_compile": lambda: compiled(copy.deepcopy(ours)),
    }


def bfloat16_group(models: dict, folder: Path) -> dict[str, Callable[[], object]]:
    ours, marian = models["ours"], models["marian"]
    return {
        ANCHOR: lambda: marian,
        "marian_bfloat16_eager": lambda: copy.deepcopy(marian).to(torch.bfloat16),
        "ours_bfloat16_eager": lambda: copy.deepcopy(ours).to(torch.bfloat16),
        "ours_bfloat16_optimize_for_cpu_inference": lambda: optimize_for_cpu_inference(copy.deepcopy(ours), "bfloat16"),
        "marian_bfloat16_compile": lambda: compiled(copy.deepcopy(marian).to(torch.bfloat16)),
        "ours_bfloat16_compile": lambda: compiled(copy.deepcopy(ours).to(torch.bfloat16)),
    }


def int8_group(models: dict, folder: Path) -> dict[str, Callable[[], object]]:
    ours = models["ours"]
    group = {
        ANCHOR: lambda: models["marian"],
        "ours_int8_optimize_for_cpu_inference": lambda: optimize_for_cpu_inference(copy.deepcopy(ours), "int8"),
    }
    for config_name in ("int8_weight_only", "int8_dynamic"):
        for name in MODEL_CLASSES:
            load = functools.partial(torchao_loaded, name, folder, config_name)
            group[f"{name}_torchao_{config_name}_eager"] = load
            group[f"{name}_torchao_{config_name}_compile"] = lambda load=load: compiled(load())
    return group


GROUPS = {"float32": float32_group, "bfloat16": bfloat16_group, "int8": int8_group}


def decoder(model, source: torch.Tensor, beams: int, new_tokens: int, static: bool) -> Callable[[], torch.Tensor]:
    options = {"max_new_tokens": new_tokens, "eos_token_id": None, "num_beams": beams, "do_sample": False}
    if static:  # a compiled forward runs one graph per shape only with a cache of fixed size
        options["cache_implementation"] = "static"

    @torch.inference_mode()
    def run():
        return model.generate(input_ids=source, attention_mask=torch.ones_like(source), **options)

    return run


def time_group(precision: str, models: dict, folder: Path, shapes, args) -> dict:
    routes = GROUPS[precision](models, folder).items()
    systems = {name: build() for name, build in routes if name == ANCHOR or not args.systems or name in args.systems}
    vocab_size = models["ours"].config.vocab_size
    results = {"load_average_before": os.getloadavg(), "shapes": []}
    for batch, beams in shapes:
        source = torch.randint(3, vocab_size - 1, (batch, args.source_len), generator=torch.Generator().manual_seed(5))
        reference = decoder(models["ours"], source, beams, args.new_tokens, static=False)()
        runs = {
            name: decoder(model, source, beams, args.new_tokens, static=name.endswith("_compile"))
            for name, model in systems.items()
        }
        first_call_seconds, same_tokens = {}, {}
        for name, run in runs.items():  # compiles the compiled systems' graph for this shape
            start = time.perf_counter()
            tokens = run()
            first_call_seconds[name] = time.perf_counter() - start
            same_tokens[name] = (tokens == reference).float().mean().item()
        print(f"timing {precision}, batch {batch}, beams {beams} ...", flush=True)
        seconds = time_round_robin(runs, args.repeats, clock="cpu")
        speed = {name: batch * args.new_tokens / min(times) for name, times in seconds.items()}
        results["shapes"].append(
            {
                "batch": batch,
                "num_beams": beams,
                "tokens_per_s": speed,
                "speed_vs_anchor": {name: s / speed[ANCHOR] for name, s in speed.items()},
                # The ratio to the anchor within each round, median over rounds: steadier under a drifting load.
                "median_round_ratio_vs_anchor": {
                    name: statistics.median(a / t for a, t in zip(seconds[ANCHOR], times))
                    for name, times in seconds.items()
                },
                "share_of_tokens_equal_to_ours_float32_eager": same_tokens,
                "first_call_seconds_wall": first_call_seconds,
                "seconds": seconds,
            }
        )
    results["load_average_after"] = os.getloadavg()
    return results


def print_group(precision: str, group: dict) -> None:
    for shape in group["shapes"]:
        mode = "greedy" if shape["num_beams"] == 1 else f"beam{shape['num_beams']}"
        print(f"\n{precision}, {mode} b{shape['batch']} (tokens/s, x {ANCHOR}, tokens equal to ours float32 eager)")
        for name, speed in shape["tokens_per_s"].items():
            equal = shape["share_of_tokens_equal_to_ours_float32_eager"][name]
            print(f"  {name:<44} {speed:8.1f}  {shape['speed_vs_anchor'][name]:5.2f}x  {equal:6.1%}")


def parse_shape(text: str) -> tuple[int, int]:
    batch, beams = text.split("x")
    return int(batch), int(beams)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="transformer-base-32k", help="a size of marian_twin.py")
    parser.add_argument("--precisions", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1, 1), (8, 1), (1, 4)], help="BATCHxBEAMS")
    parser.add_argument("--systems", nargs="*", default=[], help="only these systems (and the anchor); default all")
    parser.add_argument("--repeats", type=int, default=4, help="timed rounds (tokens/s from the fastest)")
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--source_len", type=int, default=24)
    parser.add_argument("--output", type=Path, default=None, help="JSON path (default benchmarks/results/<date>.json)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    # Every compiled model's forward is the same code object to dynamo: room for each model and shape.
    torch._dynamo.config.cache_size_limit = torch._dynamo.config.recompile_limit = 256
    ours, marian = build_pair(args.size, 0.0, torch.float32, torch.device("cpu"), "sdpa")
    models = {"ours": ours.eval(), "marian": marian.eval()}
    results = {"environment": environment(torch.device("cpu")), "size": args.size, "new_tokens": args.new_tokens}
    results |= {"source_len": args.source_len, "repeats": args.repeats, "groups": {}}
    with tempfile.TemporaryDirectory() as folder:
        for name, model in models.items():
            model.save_pretrained(Path(folder) / name)
        for precision in args.precisions:
            group = time_group(precision, models, Path(folder), args.shapes, args)
            results["groups"][precision] = group
            print_group(precision, group)
            torch._dynamo.reset()
    write_results(results, args.output, "cpu-inference-routes")


if __name__ == "__main__":
    main()
