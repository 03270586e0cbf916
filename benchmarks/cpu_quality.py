"""Translation quality of `optimize_for_cpu_inference` precisions on a trained model: BLEU of float32 (plain and
optimized), bfloat16 and int8 on the held-out demo sentences, and the share of outputs identical to plain float32.

    bash training/run_demo.sh                           # trains out/demo (the paper's recipe, demo-small)
    python benchmarks/cpu_quality.py --model_dir out/demo

Decodes as training/show_examples.py does (beam 4, GNMT length penalty, max length = source length + 50).
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import sacrebleu
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
from demo_data import number_translation_dataset
from show_examples import translate

from hf_vanilla_transformer.cpu_inference_vanilla_transformer import PRECISIONS, optimize_for_cpu_inference


def quality(model_dir: str, num_sentences: int, validation_size: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    pairs = number_translation_dataset(num_train=0, num_validation=validation_size)["validation"]
    pairs = pairs.select(range(min(num_sentences, len(pairs))))["translation"]
    sources, references = [p["en"] for p in pairs], [p["de"] for p in pairs]
    candidates = {"plain_float32": model}
    candidates |= {f"ours_{p}": optimize_for_cpu_inference(copy.deepcopy(model), p) for p in PRECISIONS}
    outputs, rows = {}, {}
    for name, candidate in candidates.items():
        start = time.process_time()
        outputs[name] = translate(candidate, tokenizer, sources)
        rows[name] = {
            "bleu": sacrebleu.corpus_bleu(outputs[name], [references]).score,
            "identical_to_float32": sum(a == b for a, b in zip(outputs[name], outputs["plain_float32"])) / len(sources),
            "exact_match_reference": sum(a == r for a, r in zip(outputs[name], references)) / len(sources),
            "cpu_seconds": time.process_time() - start,
        }
    return {"model_dir": model_dir, "sentences": len(sources), "threads": torch.get_num_threads(), "results": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_dir", default="out/demo")
    parser.add_argument("--num_sentences", type=int, default=200)
    parser.add_argument("--demo_validation_size", type=int, default=500, help="As passed to train_seq2seq.py.")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "cpu-quality-demo.json")
    args = parser.parse_args()
    report = quality(args.model_dir, args.num_sentences, args.demo_validation_size)
    for name, row in report["results"].items():
        print(
            f"{name:<14} BLEU {row['bleu']:5.2f}  identical to float32 {row['identical_to_float32']:6.1%}  "
            f"exact match {row['exact_match_reference']:6.1%}  {row['cpu_seconds']:.1f} CPU s"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
