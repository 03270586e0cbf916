"""Load a trained translation model through the Auto classes and decode demo validation sentences the paper's way
(beam 4, GNMT length penalty 0.6, max length = source length + 50), printing examples and the corpus BLEU/chrF.

    python training/show_examples.py --model_dir out/demo --num_sentences 200 --show 5
"""

import argparse

import sacrebleu
import torch
from demo_data import number_translation_dataset
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer


def translate(model, tokenizer, sources: list[str], batch_size: int = 32, num_beams: int = 4) -> list[str]:
    """Beam search with the GNMT penalty (alpha from the model's generation config, 0.6 by default)."""
    outputs = []
    for start in range(0, len(sources), batch_size):
        batch = tokenizer(sources[start : start + batch_size], return_tensors="pt", padding=True)
        with torch.no_grad():
            generated = model.generate(
                **batch,
                num_beams=num_beams,
                length_penalty_type="gnmt",
                # §6.1: at most input length + 50 output tokens (+1 for the decoder start token); max_length rather
                # than max_new_tokens so that it replaces the saved generation config's bound instead of clashing.
                max_length=1 + batch["input_ids"].shape[1] + 50,
            )
        outputs += [text.strip() for text in tokenizer.batch_decode(generated, skip_special_tokens=True)]
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="A directory saved by train_seq2seq.py (or a Hub id).")
    parser.add_argument("--num_sentences", type=int, default=200, help="Demo validation sentences to score.")
    parser.add_argument("--show", type=int, default=5, help="How many examples to print.")
    parser.add_argument("--demo_validation_size", type=int, default=500, help="As passed to train_seq2seq.py.")
    args = parser.parse_args()

    # trust_remote_code: the code is read from the saved directory, so this works without the package installed.
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir, trust_remote_code=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_dir, trust_remote_code=True).eval()
    # Same generator and seed as training: these sentences were held out from the training split.
    pairs = number_translation_dataset(num_train=0, num_validation=args.demo_validation_size)["validation"]
    pairs = pairs.select(range(min(args.num_sentences, len(pairs))))["translation"]
    sources, references = [p["en"] for p in pairs], [p["de"] for p in pairs]
    hypotheses = translate(model, tokenizer, sources)
    for source, reference, hypothesis in list(zip(sources, references, hypotheses))[: args.show]:
        print(f"EN   {source}\nREF  {reference}\nOUT  {hypothesis}\n")
    bleu = sacrebleu.corpus_bleu(hypotheses, [references])
    chrf = sacrebleu.corpus_chrf(hypotheses, [references])
    exact = sum(h == r for h, r in zip(hypotheses, references)) / len(references)
    print(f"BLEU {bleu.score:.1f}  chrF {chrf.score:.1f}  exact match {exact:.1%}  ({len(references)} sentences)")


if __name__ == "__main__":
    main()
