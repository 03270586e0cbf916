"""Train a byte-level BPE tokenizer on the training text and wrap it so that `AutoTokenizer` loads it with the model.

The paper shares one BPE vocabulary between source and target (§5.1, 37000 tokens for En-De), which is what lets the
encoder, decoder and pre-softmax projection share one embedding matrix (§3.4). Special tokens get the ids the model
config expects: <pad>=0, <s>=1 (= decoder_start_token_id), </s>=2, <unk>=3. Every encoded text ends with </s>, for
sources and targets alike.

Usage (a JSON-lines file with a "text" field, or any text file):
    python training/train_tokenizer.py --files corpus.txt --vocab_size 8000 --output_dir my_tokenizer
"""

import argparse
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> PreTrainedTokenizerFast:
    """A shared BPE tokenizer trained on `texts`; special token ids are 0-3 in the order <pad>, <s>, </s>, <unk>."""
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be 0 or more, got {min_frequency}.")
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} leaves no room beyond the {len(SPECIAL_TOKENS)} special tokens.")
    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
    # Byte-level: every string is encodable (no <unk> for unseen characters such as "ß" or "ü").
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos = SPECIAL_TOKENS["eos_token"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {eos}", pair=f"$A {eos} $B {eos}", special_tokens=[(eos, tokenizer.token_to_id(eos))]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)


def _read_lines(paths: list[str]) -> Iterable[str]:
    for path in paths:
        with open(path, encoding="utf-8") as file:
            yield from (line.rstrip("\n") for line in file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", required=True, help="Plain-text files, one sentence per line.")
    parser.add_argument("--vocab_size", type=int, default=37000, help="Vocabulary size (paper, En-De: 37000).")
    parser.add_argument("--min_frequency", type=int, default=2, help="Minimum pair frequency for a merge.")
    parser.add_argument("--output_dir", required=True, help="Where to save; AutoTokenizer.from_pretrained loads it.")
    args = parser.parse_args()
    if args.min_frequency < 0:
        parser.error(f"--min_frequency must be 0 or more, got {args.min_frequency}.")
    if Path(args.output_dir).exists() and not Path(args.output_dir).is_dir():
        parser.error(f"--output_dir {args.output_dir} is a file; give a folder.")
    tokenizer = train_bpe_tokenizer(_read_lines(args.files), args.vocab_size, args.min_frequency)
    tokenizer.save_pretrained(args.output_dir)
    print(f"Saved a {len(tokenizer)}-token BPE tokenizer to {args.output_dir}")


if __name__ == "__main__":
    main()
