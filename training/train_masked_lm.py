"""Pretrain the encoder-only Transformer as a masked language model (BERT-style; VanillaTransformerForMaskedLM).

Each text is truncated to --max_seq_length tokens; `DataCollatorForLanguageModeling` picks --mlm_probability of the
tokens, replaces 80 % of them by the mask token, 10 % by a random token and keeps 10 % (BERT §3.1), and the model
predicts the originals. Data: a Hub dataset (--dataset_name), local csv/json/jsonl/parquet/txt files
(--train_file/--validation_file, column --text_column), or with neither the built-in topic language
(training/demo_text_data.py). The saved folder is a checkpoint that `train_classifier.py` (or
`AutoModelForSequenceClassification.from_pretrained`) fine-tunes.

    python training/train_masked_lm.py --output_dir out/mlm --preset demo-small --do_train --do_eval --max_steps 500 \
        --warmup_steps 100
"""

import sys
from dataclasses import dataclass, field

from demo_text_data import unlabelled_text, word_tokenizer
from run_common import (
    ModelArguments,
    TextDataArguments,
    check_batches,
    check_metric_for_best_model,
    check_text_positions,
    finish_run,
    load_text_data,
    new_model_config,
    parse_script_arguments,
    perplexity_metrics,
    required_split,
    save_run,
    schedule_description,
    train_then_evaluate_perplexity,
)
from run_control import check_output_dir, keeps_the_previous_run
from train_causal_lm import PaperTrainer, PaperTrainingArguments
from train_tokenizer import train_bpe_tokenizer
from transformers import (
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerBase,
)

import hf_vanilla_transformer  # noqa: F401  (registers the Auto classes)

DEMO_DATASET = "synthetic topic language (built-in demo, training/demo_text_data.py)"
MASK_TOKEN = "<mask>"


@dataclass
class MaskedLMDataArguments(TextDataArguments):
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of tokens to predict per text (BERT: 0.15)."})


def masked_lm_tokenizer(
    model_args: ModelArguments, data_args: MaskedLMDataArguments, train_texts
) -> PreTrainedTokenizerBase:
    """The given tokenizer, else the demo's word-level one on the demo data, else a BPE tokenizer trained on the
    texts; any of them gets a mask token if it has none."""
    source = model_args.tokenizer_name or model_args.model_name_or_path
    if source is not None:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=model_args.trust_remote_code)
    elif not (data_args.dataset_name or data_args.train_file):
        tokenizer = word_tokenizer()
    else:
        tokenizer = train_bpe_tokenizer(train_texts, model_args.tokenizer_vocab_size)
    if tokenizer.mask_token is None:
        tokenizer.add_special_tokens({"mask_token": MASK_TOKEN})
    return tokenizer


@keeps_the_previous_run
def main(argv: list[str] | None = None) -> dict[str, float]:
    arguments = parse_script_arguments(
        (ModelArguments, MaskedLMDataArguments, PaperTrainingArguments), argv, is_encoder_decoder=False
    )
    model_args, data_args, training_args = arguments
    folder = check_output_dir(arguments)

    raw, dataset_label = load_text_data(data_args, unlabelled_text, DEMO_DATASET)
    train_texts = (text for batch in raw["train"].iter(batch_size=1000) for text in batch[data_args.text_column])
    tokenizer = masked_lm_tokenizer(model_args, data_args, train_texts)
    if model_args.model_name_or_path:
        model = AutoModelForMaskedLM.from_pretrained(
            model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code
        )
    else:
        config = new_model_config(model_args, tokenizer, is_encoder_decoder=False, is_decoder=False)
        model = AutoModelForMaskedLM.from_config(config)
    if model_args.model_name_or_path and len(tokenizer) > model.config.vocab_size:  # a mask token added to it
        model.resize_token_embeddings(len(tokenizer))

    def tokenize(batch):
        return tokenizer(batch[data_args.text_column], truncation=True, max_length=data_args.max_seq_length)

    splits = {}
    for split, flag in [("train", "--do_train"), ("validation", "--do_eval")]:
        if getattr(training_args, flag[2:]):
            with training_args.main_process_first(desc=f"tokenizing {split}"):
                data = required_split(raw, split, flag)
                splits[split] = data.map(tokenize, batched=True, remove_columns=data.column_names)
    check_batches(splits, training_args)
    check_text_positions(model.config, splits)
    check_metric_for_best_model(training_args, perplexity_metrics(training_args))

    trainer = PaperTrainer(
        model=model,
        args=training_args,
        run_folder=folder,  # prepared when training begins, after every check
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(
            tokenizer, mlm_probability=data_args.mlm_probability, seed=training_args.seed
        ),
    )
    metrics = train_then_evaluate_perplexity(trainer)
    recipe = {
        "preset": model_args.model_name_or_path or model_args.preset,
        "config_overrides": model_args.config_overrides,
        "max_seq_length": data_args.max_seq_length,
        "mlm_probability": data_args.mlm_probability,
        "schedule": schedule_description(training_args),
        "steps": trainer.state.global_step,
    }
    description = "Pretrained as a masked language model with `training/train_masked_lm.py` of hf_vanilla_transformer."
    save_run(trainer, metrics, dataset_label, dict(training_args=recipe, description=description))
    finish_run(trainer)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
