"""Train or fine-tune the decoder-only Transformer (VanillaTransformerForCausalLM) on text, reporting perplexity.

Texts are tokenized, each ended with </s>, concatenated and cut into blocks of --block_size tokens (packing, as in
transformers' run_clm.py), so no compute is spent on padding. The saved tokenizer ends nothing with </s>: a prompt
given to `pipeline("text-generation")` is continued, not closed. Data: a Hub dataset (--dataset_name), local
text/json/csv files (--train_file/--validation_file, column --text_column), or with neither the built-in corpus of
English arithmetic sentences (training/demo_data.py). Optimisation defaults to the paper's Adam and Noam schedule
(§5.3).

    python training/train_causal_lm.py --output_dir out/lm --preset demo-small --do_train --do_eval --max_steps 500 \
        --warmup_steps 100
"""

import sys
from dataclasses import dataclass, field
from itertools import chain

from datasets import DatasetDict, load_dataset
from demo_data import arithmetic_text_dataset
from run_common import (
    FsdpTrainerMixin,
    ModelArguments,
    ModelLossMixin,
    NoamArguments,
    NoamTrainerMixin,
    check_batches,
    check_metric_for_best_model,
    check_positions,
    finish_run,
    load_local_files,
    new_model_config,
    parse_script_arguments,
    perplexity_metrics,
    pretrained_model_kwargs,
    save_run,
    schedule_description,
    train_then_evaluate_perplexity,
)
from run_control import RunArguments, RunTrainerMixin, check_output_dir, keeps_the_previous_run
from train_tokenizer import train_bpe_tokenizer
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
    default_data_collator,
)

import hf_vanilla_transformer  # noqa: F401  (registers the Auto classes)

DEMO_DATASET = "num2words arithmetic sentences (built-in demo, training/demo_data.py)"


@dataclass
class DataArguments:
    """Where the text comes from and how it is packed."""

    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. wikitext (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    train_file: str | None = field(default=None, metadata={"help": "Local training text: txt/json/jsonl/csv/parquet."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation text, same format."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    block_size: int = field(default=128, metadata={"help": "Training sequences are packed to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training blocks."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only this many validation blocks."})
    demo_train_size: int = field(default=20000, metadata={"help": "Sentences generated for the demo corpus."})
    demo_validation_size: int = field(default=500, metadata={"help": "Validation sentences for the demo corpus."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenization."})


@dataclass
class PaperTrainingArguments(RunArguments, NoamArguments, TrainingArguments):
    """TrainingArguments with the paper's optimiser and schedule as defaults, and the run's folder and time options."""


class PaperTrainer(RunTrainerMixin, NoamTrainerMixin, ModelLossMixin, FsdpTrainerMixin, Trainer):
    """Trainer with the Noam schedule and the run's tracker."""


def load_raw_datasets(data_args: DataArguments) -> tuple[DatasetDict, str]:
    if data_args.dataset_name:
        return load_dataset(data_args.dataset_name, data_args.dataset_config_name), data_args.dataset_name
    if data_args.train_file or data_args.validation_file:
        return load_local_files(data_args.train_file, data_args.validation_file), "local files"
    return arithmetic_text_dataset(data_args.demo_train_size, data_args.demo_validation_size), DEMO_DATASET


def prompt_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """The tokenizer without the </s> it may end every text with (train_tokenizer.py's does, for seq2seq sources):
    a language model given a prompt ending with </s> starts a new text instead of continuing the prompt. A leading
    <s> stays. Raises where the tokenizer cannot be told (no `add_eos_token`)."""
    sample = tokenizer("a")["input_ids"]
    if sample[-1] != tokenizer.eos_token_id:
        return tokenizer
    if hasattr(tokenizer, "update_post_processor"):  # transformers' tokenizers-backed class rebuilds its template
        tokenizer.add_bos_token = tokenizer.bos_token_id is not None and sample[0] == tokenizer.bos_token_id
        tokenizer.add_eos_token = False
    if tokenizer("a")["input_ids"][-1] == tokenizer.eos_token_id:
        raise ValueError(
            f"The tokenizer ({type(tokenizer).__name__}) ends every text with {tokenizer.eos_token} and cannot be told "
            "not to, so text generation would not continue prompts: pass another --tokenizer_name."
        )
    return tokenizer


def pack_into_blocks(examples: dict[str, list], block_size: int) -> dict[str, list]:
    """Concatenate the tokenized texts and cut them into `block_size` blocks; the remainder is dropped."""
    concatenated = {key: list(chain.from_iterable(examples[key])) for key in examples}
    usable = (len(concatenated["input_ids"]) // block_size) * block_size
    blocks = {key: [ids[i : i + block_size] for i in range(0, usable, block_size)] for key, ids in concatenated.items()}
    blocks["labels"] = [list(ids) for ids in blocks["input_ids"]]  # the model shifts labels inside its loss
    return blocks


@keeps_the_previous_run
def main(argv: list[str] | None = None) -> dict[str, float]:
    arguments = parse_script_arguments(
        (ModelArguments, DataArguments, PaperTrainingArguments), argv, is_encoder_decoder=False, is_decoder=True
    )
    model_args, data_args, training_args = arguments
    folder = check_output_dir(arguments)

    raw, dataset_label = load_raw_datasets(data_args)
    column_names = raw[next(iter(raw))].column_names
    if data_args.text_column not in column_names:
        raise ValueError(f"--text_column {data_args.text_column!r} is not in the data; it has {column_names}.")

    tokenizer_source = model_args.tokenizer_name or model_args.model_name_or_path
    if tokenizer_source is None and isinstance(training_args.resume_from_checkpoint, str):
        tokenizer_source = training_args.resume_from_checkpoint
    if tokenizer_source is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=model_args.trust_remote_code)
    else:
        texts = (text for batch in raw["train"].iter(batch_size=1000) for text in batch[data_args.text_column])
        tokenizer = train_bpe_tokenizer(texts, model_args.tokenizer_vocab_size)
    tokenizer = prompt_tokenizer(tokenizer)
    if model_args.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, **pretrained_model_kwargs(model_args)
        )
    else:
        config = new_model_config(model_args, tokenizer, is_encoder_decoder=False, is_decoder=True)
        model = AutoModelForCausalLM.from_config(config)

    def tokenize(batch):  # </s> after each text separates the texts packed into one block
        encoded = tokenizer(batch[data_args.text_column])["input_ids"]
        return {"input_ids": [ids + [tokenizer.eos_token_id] for ids in encoded]}

    splits = {}
    for split, wanted, limit in [
        ("train", training_args.do_train, data_args.max_train_samples),
        ("validation", training_args.do_eval, data_args.max_eval_samples),
    ]:
        if not wanted:
            continue
        if split not in raw:
            raise ValueError(f"--do_{'train' if split == 'train' else 'eval'} needs a {split} split; got {list(raw)}.")
        with training_args.main_process_first(desc=f"tokenizing {split}"):
            tokenized = raw[split].map(
                tokenize, batched=True, remove_columns=column_names, num_proc=data_args.preprocessing_num_workers
            )
            blocks = tokenized.map(
                pack_into_blocks,
                batched=True,
                fn_kwargs={"block_size": data_args.block_size},
                num_proc=data_args.preprocessing_num_workers,
                desc=f"Packing {split} into blocks of {data_args.block_size}",
            )
        splits[split] = blocks.select(range(min(limit, len(blocks)))) if limit else blocks
    check_batches(splits, training_args, f" (its texts hold fewer than --block_size {data_args.block_size} tokens)")
    block = {f"--block_size {data_args.block_size}": data_args.block_size}
    check_positions(model.config, lambda: block, "lower --block_size or give the model more positions")
    check_metric_for_best_model(training_args, perplexity_metrics(training_args))

    trainer = PaperTrainer(
        model=model,
        args=training_args,
        run_folder=folder,  # prepared when training begins, after every check
        train_dataset=splits.get("train"),
        eval_dataset=splits.get("validation"),
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    metrics = train_then_evaluate_perplexity(trainer)
    recipe = {
        "preset": model_args.model_name_or_path or model_args.preset,
        "config_overrides": model_args.config_overrides,
        "block_size": data_args.block_size,
        "optimizer": f"Adam(beta1={training_args.adam_beta1}, beta2={training_args.adam_beta2}, "
        f"eps={training_args.adam_epsilon})",
        "schedule": schedule_description(training_args),
        "steps": trainer.state.global_step,
    }
    description = "Trained with `training/train_causal_lm.py` of hf_vanilla_transformer."
    save_run(trainer, metrics, dataset_label, dict(training_args=recipe, description=description))
    finish_run(trainer)
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
