"""The end-of-run choices of the Multi30k recipe, on the validation set: how many of a finished run's last checkpoints
to average, the beam size and the GNMT length penalty alpha. Every combination is decoded and scored with sacreBLEU
(cased, as the recipe chooses) against the run's own decoded references, as the recipe's evaluation scores them;
the test set is never read.

    python benchmarks/multi30k_decoding_choices.py RUN_DIR DATA_DIR --average 1 5 10 --beams 4 --alphas 0.6
    python benchmarks/multi30k_decoding_choices.py RUN_DIR DATA_DIR --average 10 --beams 4 6 8 --alphas 0.6 1.0

RUN_DIR: a run of `training/recipes/multi30k.sh` that kept its checkpoints (e.g. `EXTRA_ARGS="--save_total_limit
40"`; the recipe keeps 6). `--average 1` is the last checkpoint's weights. Each row has the decoding's seconds too: the
recipe's decodes count in its hour.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import sacrebleu
import torch
from measure import environment, write_results
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

REPOSITORY = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPOSITORY / "training"))
from average_checkpoints import averaged_weights, last_checkpoints  # noqa: E402
from run_control import load_weights  # noqa: E402
from train_seq2seq import decode  # noqa: E402

import hf_vanilla_transformer  # noqa: E402, F401  (registers the Auto classes)


def validation_pairs(data_dir: Path, source: str, target: str) -> tuple[list[str], list[str]]:
    lines = (data_dir / "validation.jsonl").read_text().splitlines()
    pairs = [json.loads(line)["translation"] for line in lines if line.strip()]
    return [pair[source] for pair in pairs], [pair[target] for pair in pairs]


def translate(model, tokenizer, sources: list[str], beams: int, alpha: float, args) -> list[str]:
    """The recipe's evaluation decoding: batches in the data's order, at most the padded source length + 50 tokens."""
    hypotheses = []
    for start in range(0, len(sources), args.batch_size):
        batch = tokenizer(sources[start : start + args.batch_size], padding=True, return_tensors="pt")
        max_length = 1 + batch["input_ids"].shape[1] + args.max_new_tokens_over_source
        with torch.inference_mode():
            output = model.generate(
                **batch, num_beams=beams, length_penalty=alpha, length_penalty_type="gnmt", max_length=max_length
            )
        hypotheses += decode(tokenizer, output.numpy())
    return hypotheses


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("data_dir", type=Path)
    parser.add_argument("--pair", default="en-de", help="SOURCE-TARGET keys of the translation dicts")
    parser.add_argument("--average", type=int, nargs="+", default=[1, 5], help="how many last checkpoints")
    parser.add_argument("--beams", type=int, nargs="+", default=[4])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6])
    parser.add_argument("--batch_size", type=int, default=100, help="the recipe's evaluation batch")
    parser.add_argument("--max_new_tokens_over_source", type=int, default=50, help="as train_seq2seq.py's")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)

    source, target = args.pair.split("-")
    tokenizer = AutoTokenizer.from_pretrained(args.run_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.run_dir).eval()
    sources, targets = validation_pairs(args.data_dir, source, target)
    # The recipe scores against its references as the tokenizer gives them back (the labels decoded).
    references = [decode(tokenizer, np.array([ids]))[0] for ids in tokenizer(text_target=targets)["input_ids"]]
    rows = []
    for average in args.average:
        checkpoints = last_checkpoints(args.run_dir, average)
        load_weights(model, averaged_weights(checkpoints))
        for beams in args.beams:
            for alpha in args.alphas:
                start = time.perf_counter()
                hypotheses = translate(model, tokenizer, sources, beams, alpha, args)
                row = {
                    "averaged_checkpoints": [path.name for path in checkpoints],
                    "beams": beams,
                    "alpha": alpha,
                    "bleu": round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
                    "bleu_lowercase": round(sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True).score, 2),
                    "chrf": round(sacrebleu.corpus_chrf(hypotheses, [references]).score, 2),
                    "seconds": round(time.perf_counter() - start, 1),
                }
                rows.append(row)
                print(f"average {average:>2} beams {beams} alpha {alpha}: BLEU {row['bleu']} ({row['seconds']} s)")
    results = {"run_dir": str(args.run_dir), "pair": args.pair, "environment": environment(torch.device("cpu"))}
    write_results(results | {"rows": rows}, args.output, "multi30k-decoding-choices")
    return rows


if __name__ == "__main__":
    main()
