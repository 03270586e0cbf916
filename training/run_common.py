"""What the training scripts share: argument parsing, model arguments, the paper's optimisation recipe, local data
files, training with perplexity, and the output directory's model card with its training plot."""

import dataclasses
import functools
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: the plot only goes to a file
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from accelerate import ParallelismConfig, PartialState  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402
from datasets import DatasetDict, load_dataset  # noqa: E402
import huggingface_hub.constants  # noqa: E402
from huggingface_hub.errors import HFValidationError, StrictDataclassError  # noqa: E402
from huggingface_hub.utils import validate_repo_id  # noqa: E402
from run_control import train_and_evaluate  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.optim.lr_scheduler import LambdaLR  # noqa: E402
from transformers import HfArgumentParser, PreTrainedTokenizerBase, Trainer, set_seed  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

from hf_vanilla_transformer import (  # noqa: E402
    VanillaTransformerConfig,
    VanillaTransformerPreTrainedModel,
    optimize_for_cpu_training,
)
from hf_vanilla_transformer.configuration_vanilla_transformer import PRESETS  # noqa: E402
from hf_vanilla_transformer.model_card_vanilla_transformer import write_model_card  # noqa: E402

logger = logging.getLogger(__name__)

# A model small enough to learn the demo task in a few CPU minutes; a script-level size, not a package preset.
DEMO_PRESET = "demo-small"
DEMO_SIZES = dict(
    d_model=128,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=512,
    decoder_ffn_dim=512,
    dropout=0.1,
)
PRESET_NAMES = [*PRESETS, DEMO_PRESET]

BLEU_PLOT = "bleu_against_minutes.png"

# File extension -> the `datasets` builder that reads it.
DATA_FILE_BUILDERS = {"json": "json", "jsonl": "json", "csv": "csv", "tsv": "csv", "parquet": "parquet", "txt": "text"}


@dataclass
class ModelArguments:
    """Which model to train: a preset with config overrides, or a saved model to fine-tune."""

    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A saved model (directory or Hub id) to fine-tune instead of a new one."}
    )
    preset: str = field(
        default="transformer-base",
        metadata={"help": f"Size of a new model: {PRESET_NAMES} (paper Table 3, or the demo's tiny model)."},
    )
    config_overrides: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated key=value pairs for any VanillaTransformerConfig field of a new model, e.g. "
            "'norm_position=pre,ffn_type=swiglu,encoder_layers=4'. Values are parsed as JSON where possible."
        },
    )
    tokenizer_name: str | None = field(
        default=None,
        metadata={"help": "A pretrained tokenizer (directory or Hub id). Default: the model's, or a new shared BPE."},
    )
    tokenizer_vocab_size: int = field(
        default=8000, metadata={"help": "Vocabulary size of the BPE tokenizer trained on the data (paper: 37000)."}
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow code from the Hub when loading --model_name_or_path or a dataset."}
    )
    tp_size: int = field(
        default=1,
        metadata={
            "help": "Shard --model_name_or_path over this many tensor-parallel ranks at load time (transformers' "
            "DistributedConfig; launch as many processes, e.g. torchrun --nproc_per_node 2). 1: no sharding."
        },
    )


@dataclass
class NoamArguments:
    """The paper's optimiser settings (§5.3) as defaults; mixed into the scripts' TrainingArguments."""

    noam_schedule: bool = field(
        default=True,
        metadata={
            "help": "Use the paper's schedule lr = learning_rate * d_model^-0.5 * min(step^-0.5, "
            "step * warmup_steps^-1.5) (§5.3), where --learning_rate is the scale factor (paper: 1.0). "
            "Set to False for --lr_scheduler_type with --learning_rate as the peak rate."
        },
    )
    learning_rate: float = field(
        default=1.0, metadata={"help": "Noam scale factor (paper: 1.0), or the peak rate without --noam_schedule."}
    )
    warmup_steps: float = field(default=4000, metadata={"help": "Warm-up steps (paper: 4000)."})
    adam_beta2: float = field(default=0.98, metadata={"help": "Adam beta2 (paper: 0.98)."})
    adam_epsilon: float = field(default=1e-9, metadata={"help": "Adam epsilon (paper: 1e-9)."})

    def __post_init__(self):
        if self.noam_schedule and self.warmup_steps <= 0:  # checked here, not when training starts
            raise ValueError(f"The Noam schedule needs --warmup_steps > 0, got {self.warmup_steps}.")
        super().__post_init__()


def noam_learning_rate(step: int, d_model: int, warmup_steps: int, scale: float = 1.0) -> float:
    """§5.3, eq. 3: linear warm-up for `warmup_steps`, then decay with the inverse square root of the step number."""
    step = max(step, 1)
    return scale * d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def noam_scheduler(optimizer, d_model: int, warmup_steps: int) -> LambdaLR:
    """Noam as a LambdaLR: the optimiser's lr is the scale factor. LambdaLR counts from 0 and the paper's step_num
    from 1, so the first update already has a non-zero rate."""
    if warmup_steps <= 0:
        raise ValueError(f"The Noam schedule needs warmup_steps > 0, got {warmup_steps}.")
    return LambdaLR(optimizer, lambda step: noam_learning_rate(step + 1, d_model, warmup_steps))


def warn_if_warmup_outlasts_run(warmup: int, num_training_steps: int) -> None:
    """A warm-up longer than half the run keeps the learning rate below its peak for most of it (a run shorter than
    its warm-up never reaches the peak) and the model learns little: say so before training."""
    if warmup > num_training_steps / 2:
        logger.warning(
            "The learning-rate warm-up (%d steps) is longer than half of this run (%d optimizer steps): the rate stays "
            "below its peak for most of the run and the model may learn little. Pass a shorter --warmup_steps (a value "
            "below 1 is a share of the run, e.g. 0.1) or a larger --max_steps.",
            warmup,
            num_training_steps,
        )


class NoamTrainerMixin(Trainer):
    """A Trainer whose scheduler is the paper's Noam schedule when `args.noam_schedule` is set; either schedule warns
    when its warm-up outlasts half the run."""

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            warn_if_warmup_outlasts_run(self.args.get_warmup_steps(num_training_steps), num_training_steps)
        if not self.args.noam_schedule:
            return super().create_scheduler(num_training_steps, optimizer)
        if self.lr_scheduler is None:
            warmup = self.args.get_warmup_steps(num_training_steps)
            optimizer = self.optimizer if optimizer is None else optimizer
            self.lr_scheduler = noam_scheduler(optimizer, self.model.config.d_model, warmup)
            self._created_lr_scheduler = True
        return self.lr_scheduler


def smoothed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float, num_items_in_batch=None, ignore_index: int = -100
) -> torch.Tensor:
    """transformers' `fixed_cross_entropy` (-100 ignored, summed and divided by `num_items_in_batch` when given) with
    label smoothing (§5.4): (1 - eps) NLL + eps/V sum_v -log p_v, the Trainer's `LabelSmoother` as one cross-entropy,
    in float32. `logits` (N, V), `labels` (N,)."""
    reduction = "mean" if num_items_in_batch is None else "sum"
    total = torch.nn.functional.cross_entropy(
        logits.float(),
        labels.to(logits.device),
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=epsilon,
    )
    return total if num_items_in_batch is None else total / num_items_in_batch


def single_label_problem(config: Any, labels: torch.Tensor) -> None:
    """Label smoothing smooths a class id: refuse the regression and multi-label problems transformers' sequence
    classification loss infers (one label; float targets) or is told (`problem_type`)."""
    problem = config.problem_type
    if problem is None:
        is_class_id = config.num_labels > 1 and labels.dtype in (torch.long, torch.int)
        problem = "single_label_classification" if is_class_id else "regression or multi-label classification"
    if problem != "single_label_classification":
        raise ValueError(
            f"--label_smoothing_factor smooths class ids; this classifier's problem is {problem} "
            f"(num_labels={config.num_labels}, labels of {labels.dtype}): drop it."
        )


def smoothed_token_loss(
    logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100, *, epsilon: float, **kwargs
):
    flat = logits.view(-1, vocab_size), labels.view(-1)
    return smoothed_cross_entropy(*flat, epsilon, num_items_in_batch, ignore_index)


def smoothed_sequence_classification_loss(labels, pooled_logits, config, num_items_in_batch=None, *, epsilon, **kwargs):
    single_label_problem(config, labels)
    flat = pooled_logits.view(-1, config.num_labels), labels.view(-1)
    return smoothed_cross_entropy(*flat, epsilon, num_items_in_batch)


def smoothed_token_classification_loss(
    logits, labels, config, num_items_in_batch=None, ignore_index=-100, *, epsilon: float, **kwargs
):
    flat = logits.view(-1, config.num_labels), labels.view(-1)
    return smoothed_cross_entropy(*flat, epsilon, num_items_in_batch, ignore_index)


def smoothed_question_answering_loss(start_logits, end_logits, start_positions, end_positions, *, epsilon, **kwargs):
    # transformers' ForQuestionAnsweringLoss: positions outside the sequence are clamped to one past it, ignored.
    outside, count = start_logits.size(1), kwargs.get("num_items_in_batch")
    start, end = (
        smoothed_cross_entropy(logits, positions.view(-1).clamp(0, outside), epsilon, count, ignore_index=outside)
        for logits, positions in ((start_logits, start_positions), (end_logits, end_positions))
    )
    return (start + end) / 2


SMOOTHED_LOSSES = {
    "ForMaskedLM": smoothed_token_loss,
    "ForSequenceClassification": smoothed_sequence_classification_loss,
    "ForImageClassification": smoothed_sequence_classification_loss,
    "ForTokenClassification": smoothed_token_classification_loss,
    "ForQuestionAnswering": smoothed_question_answering_loss,
}


def label_smoothed_loss(epsilon: float, loss_type: str = "ForMaskedLM") -> Callable[..., torch.Tensor]:
    """The `loss_function` of a model of transformers' `loss_type` (the heads call each with its own arguments) with
    label smoothing, as `smoothed_cross_entropy`: "ForMaskedLM" (our language models: labels aligned with the
    logits), sequence and image classification, token classification, question answering (start and end smoothed
    alike; the Trainer's `LabelSmoother` would not smooth them, having no `labels` to pop). A partial of a
    module-level function, so the model stays picklable (data-loader workers started by spawn or forkserver)."""
    if loss_type not in SMOOTHED_LOSSES:
        raise ValueError(
            f"--label_smoothing_factor: no label-smoothed loss for a {loss_type} head ({sorted(SMOOTHED_LOSSES)})."
        )
    return functools.partial(SMOOTHED_LOSSES[loss_type], epsilon=epsilon)


class ModelLossMixin(Trainer):
    """The training loss computed inside our models, label smoothing included. transformers' Trainer smooths by
    taking the labels away from the model and scoring the logits of every position afterwards, padding included, in
    the logits' dtype (bfloat16 under --bf16), and shifting them for the causal LMs it knows by name only. Given its
    labels, our model's loss runs in float32 and its causal LM scores the next token; the loss is the same. A training
    step reads only the loss, so it asks our language models for no logits (`skip_logits`, the flag the Trainer gives
    Liger-kernel models). Other models (HF Marian computes its loss without `loss_function`) keep the Trainer's way.
    On a CPU our models train through `optimize_for_cpu_training` (a cheaper dropout mask, SDPA's faster kernel)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        ours = isinstance(self.model, VanillaTransformerPreTrainedModel)
        if ours and self.args.device.type == "cpu":
            optimize_for_cpu_training(self.model)
        if ours and self.label_smoother is not None:  # each head calls its loss with its own arguments
            self.model.loss_function = label_smoothed_loss(self.label_smoother.epsilon, self.model.loss_type)
            self.label_smoother = None
        self.loss_without_logits = ours and "skip_logits" in inspect.signature(self.model.forward).parameters

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_without_logits and not return_outputs and self.compute_loss_func is None:
            inputs = {**inputs, "skip_logits": True}
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def configure_processes() -> None:
    """Call before the TrainingArguments are parsed, on a machine without a GPU or other accelerator.

    `accelerate launch` with the DDP/FSDP configs (and torchrun) start ranks that Accelerate joins into one job on
    CPU (gloo) only when told to use the CPU; each rank would otherwise train alone on its own copy of the data.
    `accelerate launch --cpu --num_processes N` (or --num_processes N without a config on such a machine) starts one
    process, which would train alone: stop and say what starts N. DeepSpeed, which Accelerate imports whenever it is
    installed, logs "Setting accelerator to CPU" unless told the accelerator it would detect.
    """
    if torch.accelerator.is_available():
        return
    if "ACCELERATE_USE_CPU" in os.environ and "MASTER_PORT" in os.environ and "WORLD_SIZE" not in os.environ:
        raise ValueError(
            "`accelerate launch --cpu` starts a single process whatever --num_processes says (its multi-CPU mode "
            "runs through mpirun). For N processes on this machine pass `--multi_gpu --num_processes N` instead of "
            "`--cpu`: without a GPU the ranks run on the CPU (gloo), e.g. `accelerate launch --multi_gpu "
            "--num_processes 2 --mixed_precision no training/train_seq2seq.py ...`."
        )
    if "LOCAL_RANK" in os.environ:
        os.environ.setdefault("ACCELERATE_USE_CPU", "true")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def requested_by_launcher(variable: str) -> bool:
    return os.environ.get(variable, "false").lower() == "true"


@contextmanager
def original_module_class(model: torch.nn.Module) -> Iterator[None]:
    """FSDP2's `fully_shard` gives a module a subclass of its class defined in torch (`FSDP<name>`). save_pretrained
    takes the class's module for the custom code it copies and for `auto_map`, and the model card names the head
    after the class, so around saving the model shows its own class again."""
    sharded_class = type(model)
    if isinstance(model, FSDPModule):
        model.__class__ = next(base for base in sharded_class.__bases__ if base is not FSDPModule)
    try:
        yield
    finally:
        model.__class__ = sharded_class


class CpuParallelismConfig(ParallelismConfig):
    """Accelerate accepts a `ParallelismConfig` on GPU-like devices, with FSDP2 and with DeepSpeed only, so the Trainer
    of a model that transformers sharded at load time (`DistributedConfig(tp_size=...)`) stops on CPU processes,
    although the model runs its own collectives over gloo there. This one checks what matters on CPU: that the mesh
    covers the processes."""

    def _validate_accelerator(self, accelerator) -> None:
        if accelerator.distributed_type != DistributedType.MULTI_CPU:
            super()._validate_accelerator(accelerator)
        elif self.total_size != accelerator.num_processes:
            raise ValueError(
                f"The parallel mesh has {self.total_size} ranks (tp_size={self.tp_size}, dp_shard_size="
                f"{self.dp_shard_size}), but {accelerator.num_processes} processes were launched."
            )


class FsdpTrainerMixin(Trainer):
    """A Trainer whose FSDP runs on CPU processes too and whose saved models are `from_pretrained` folders.

    Accelerate turns an FSDP request (its launcher's ACCELERATE_USE_FSDP, or an fsdp_plugin) into FSDP only on
    GPU-like devices and silently runs CPU processes as DDP, although FSDP2 itself runs on CPU with gloo (which has
    reduce_scatter); the state is promoted right after the Accelerator is built, before the model is wrapped.
    DeepSpeed, which Accelerate drops on CPU processes as well, raises instead of silently training with DDP.

    Trainer.save_model writes no weights under FSDP with sharded checkpoints, and with full ones it saves under
    FSDP2's class; here the full weights are gathered and saved under the model's own class. A model sharded at load
    time (`--tp_size`) gets a `CpuParallelismConfig` on CPU processes, where Accelerate's own refuses to run.
    """

    def create_accelerator_and_postprocess(self) -> None:
        tp_size = getattr(self.model, "tp_size", None) or 1
        if tp_size > 1 and self.args.parallelism_config is None and not torch.accelerator.is_available():
            distributed_config = self.model.config.distributed_config
            # The ranks that each see a distinct batch (transformers 5.23 named them `dp_size`; before, no replicas).
            dp_size = getattr(distributed_config, "dp_size", distributed_config.fsdp_size)
            self.args.parallelism_config = CpuParallelismConfig(tp_size=tp_size, dp_shard_size=dp_size)
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        if state.distributed_type != DistributedType.MULTI_CPU:
            return
        if self.args.deepspeed or requested_by_launcher("ACCELERATE_USE_DEEPSPEED"):
            # DeepSpeed's own engine runs on CPU over gloo, but Accelerate drops it on CPU processes (and without
            # its CPU mode counts one process while DeepSpeed counts all); training on would silently be DDP.
            raise ValueError(
                "DeepSpeed through Accelerate/Trainer does not run on CPU processes: use a GPU, or on CPU the FSDP "
                "config (training/accelerate_configs/fsdp.yaml)."
            )
        if not requested_by_launcher("ACCELERATE_USE_FSDP"):
            return
        plugin_args = self.args.fsdp_plugin_args or {}  # without Trainer FSDP arguments: the launcher's FSDP_* env
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**plugin_args)
        state.distributed_type = DistributedType.FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # as AcceleratorState itself does
        self.is_fsdp_enabled = True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self.is_fsdp_enabled:
            super().save_model(output_dir, _internal_call)
            return
        sharded = "SHARDED" in str(self.accelerator.state.fsdp_plugin.state_dict_type)
        if sharded and _internal_call and output_dir is not None:
            # A checkpoint folder: its weights are the shards saved beside the optimizer's. The config and tokenizer
            # make it as self-contained as other checkpoints (resuming takes the tokenizer from it).
            if self.args.should_save:
                self.model.config.save_pretrained(output_dir)
                self.processing_class.save_pretrained(output_dir)
            return
        state_dict = self.accelerator.get_state_dict(self.model)  # a collective: every rank gathers
        if self.args.should_save:
            with original_module_class(self.model):
                self._save(output_dir, state_dict=state_dict)  # what Trainer.save_model does with the full weights
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def parse_config_overrides(overrides: str | None) -> dict[str, Any]:
    """'a=1,b=pre,c=true' -> {"a": 1, "b": "pre", "c": True}; unknown field names raise ValueError."""
    if not overrides:
        return {}
    known = {f.name for f in dataclasses.fields(VanillaTransformerConfig)}
    parsed = {}
    for item in overrides.split(","):
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--config_overrides item {item!r} is not key=value.")
        if key not in known:
            raise ValueError(f"--config_overrides: {key!r} is not a VanillaTransformerConfig field.")
        raw = raw.strip()
        try:
            parsed[key] = json.loads(raw)
        except json.JSONDecodeError:
            parsed[key] = {"True": True, "False": False, "None": None}.get(raw, raw)
    return parsed


def new_model_config(model_args: ModelArguments, tokenizer: PreTrainedTokenizerBase | None, **fields) -> Any:
    """A config from the preset and overrides, sized to the tokenizer and using its special-token ids (without a
    tokenizer: --tokenizer_vocab_size and train_tokenizer.py's ids, to check the arguments before any data work)."""
    if model_args.preset not in PRESET_NAMES:
        raise ValueError(f"--preset {model_args.preset!r} is not one of {PRESET_NAMES}.")
    if tokenizer is None:
        token_fields = dict(vocab_size=model_args.tokenizer_vocab_size, pad_token_id=0, bos_token_id=1, eos_token_id=2)
        token_fields["decoder_start_token_id"] = 1
    else:
        start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.pad_token_id
        token_fields = dict(
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=start_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=start_id,
        )
    requested = parse_config_overrides(model_args.config_overrides)
    check_overrides_keep_the_script(requested, fields, token_fields["vocab_size"], tokenizer is not None)
    overrides = {**token_fields, **fields, **requested}
    with config_errors_named("--config_overrides" if model_args.config_overrides else "--preset"):
        if model_args.preset == DEMO_PRESET:
            return VanillaTransformerConfig(**{**DEMO_SIZES, **overrides})
        return VanillaTransformerConfig.from_preset(model_args.preset, **overrides)


def check_overrides_keep_the_script(
    requested: dict[str, Any], fields: dict[str, Any], vocab_size: int, tokenizer_known: bool
) -> None:
    """--config_overrides may not change what the script builds (`fields`: a decoder-only model is no encoder-decoder)
    nor give the model fewer token embeddings than the tokenizer has tokens (a step would index past them)."""
    for name, value in requested.items():
        if name in fields and value != fields[name]:
            raise ValueError(
                f"--config_overrides {name}={value}: this script builds a model with {name}={fields[name]}; "
                "another kind of model trains with another script (the classifier's stack: --stack)."
            )
    if tokenizer_known and isinstance(requested.get("vocab_size"), int) and requested["vocab_size"] < vocab_size:
        raise ValueError(
            f"--config_overrides vocab_size={requested['vocab_size']} is below the tokenizer's {vocab_size} tokens: "
            "drop it (the model takes the tokenizer's size) or give a larger one."
        )


@contextmanager
def config_errors_named(flag: str) -> Iterator[None]:
    """A config's refusal as a ValueError naming the flag the user typed (the config names the field)."""
    try:
        yield
    except (ValueError, TypeError, StrictDataclassError) as error:
        raise ValueError(f"{flag}: {error}") from error


def check_model_arguments(model_args: Any, new_model_fields: dict[str, Any]) -> None:
    """A new model's config is built once before any data is read, so a bad --preset or --config_overrides fails
    at once; `new_model_fields` are the fields the script sets itself (e.g. is_encoder_decoder=False)."""
    check_local_sources(model_args)
    if model_args.tp_size > 1 and not model_args.model_name_or_path:
        raise ValueError(
            "--tp_size shards a saved model while it loads: give --model_name_or_path (save a new model first)."
        )
    if model_args.model_name_or_path:
        if model_args.config_overrides:
            raise ValueError("--config_overrides builds a new model; it cannot change --model_name_or_path's config.")
        return
    if isinstance(model_args, ModelArguments):  # the text scripts' new model, from --preset (the image script: its own)
        new_model_config(model_args, None, **new_model_fields)


SOURCE_FLAGS = ("model_name_or_path", "tokenizer_name", "image_processor_name")


def check_local_sources(model_args: Any) -> None:
    """A model, tokenizer or image processor named by a path that does not exist is refused naming its flag; only a
    name that can be a Hub repository id ("org/name") goes on to the Hub, and not in offline mode (HF_HUB_OFFLINE)."""
    for flag in SOURCE_FLAGS:
        source = getattr(model_args, flag, None)
        if source is None or Path(source).exists():
            continue
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            raise ValueError(f"--{flag} {source}: no such folder (and the Hub is off: HF_HUB_OFFLINE).")
        try:
            validate_repo_id(source)
        except HFValidationError:
            raise ValueError(f"--{flag} {source}: no such folder (nor a Hub repository id).") from None


def pretrained_model_kwargs(model_args: Any) -> dict[str, Any]:
    """The `from_pretrained` keyword arguments for --model_name_or_path: remote code, and the tensor-parallel
    sharding of --tp_size."""
    kwargs: dict[str, Any] = {"trust_remote_code": model_args.trust_remote_code}
    if model_args.tp_size > 1:
        kwargs["distributed_config"] = DistributedConfig(tp_size=model_args.tp_size)
    return kwargs


@dataclass(frozen=True)
class Bound:
    """The values a numeric argument may take: from `low` to `high`, each end included where `ends` has a bracket
    ("[)": low included, high not); never NaN or infinite. `why` ends the refusal's message."""

    low: float = -math.inf
    high: float = math.inf
    ends: str = "[]"
    why: str = ""

    def holds(self, value: float) -> bool:
        above = value >= self.low if self.ends[0] == "[" else value > self.low
        below = value <= self.high if self.ends[1] == "]" else value < self.high
        return above and below and math.isfinite(value)

    def __str__(self) -> str:
        if self.high < math.inf:
            return f"in {self.ends[0]}{self.low:g}, {self.high:g}{self.ends[1]}"
        if self.low == -math.inf:
            return "a finite number"
        return f"{self.low:g} or more" if self.ends[0] == "[" else f"above {self.low:g}"


AT_LEAST_ONE = Bound(1)
NOT_NEGATIVE = Bound(0)
SHARE = Bound(0, 1, "[)")
NO_TRUNCATION = "tokens; the tokenizer reads 0 as no truncation"
# Every numeric argument of the scripts that can be wrong and that nothing else refuses before training begins:
# the Trainer reads most of these only in its first step, at evaluation or at saving, after --overwrite_output_dir
# has emptied the folder; data work would fail later on others, or silently read 0 as "no limit". None: not set.
ARGUMENT_BOUNDS = {
    # The Trainer's (transformers' TrainingArguments and Seq2SeqTrainingArguments)
    "label_smoothing_factor": Bound(0, 1, "[)", "the share of each target spread over all classes"),
    "learning_rate": Bound(0, ends="(]"),
    "weight_decay": NOT_NEGATIVE,
    "max_grad_norm": Bound(0, why="0 turns clipping off"),
    "per_device_train_batch_size": AT_LEAST_ONE,
    "per_device_eval_batch_size": AT_LEAST_ONE,
    "gradient_accumulation_steps": AT_LEAST_ONE,
    "eval_accumulation_steps": AT_LEAST_ONE,
    "save_total_limit": AT_LEAST_ONE,
    "dataloader_num_workers": NOT_NEGATIVE,
    "dataloader_prefetch_factor": Bound(1, why="batches each worker loads ahead"),
    "adam_beta1": Bound(0, 1, "[)", "the decay of Adam's moment estimates"),
    "adam_beta2": Bound(0, 1, "[)", "the decay of Adam's moment estimates"),
    "adam_epsilon": NOT_NEGATIVE,
    "neftune_noise_alpha": Bound(0, why="the scale of NEFTune's noise"),
    "warmup_steps": Bound(0, why="steps, or below 1 a share of the run"),
    "generation_max_length": Bound(2, why="the decoder's start token and at least one generated token"),
    "generation_num_beams": AT_LEAST_ONE,
    # The scripts' own
    "gnmt_alpha": Bound(),
    "max_new_tokens_over_source": NOT_NEGATIVE,
    "max_source_length": Bound(1, why=NO_TRUNCATION),
    "max_target_length": Bound(1, why=NO_TRUNCATION),
    "max_seq_length": Bound(1, why=NO_TRUNCATION),
    "block_size": Bound(2, why="a block's first token predicts the second"),
    "max_train_samples": Bound(1, why="examples; the script reads 0 as every example"),
    "max_eval_samples": Bound(1, why="examples; the script reads 0 as every example"),
    "demo_train_size": AT_LEAST_ONE,
    "demo_validation_size": AT_LEAST_ONE,
    "tokenizer_vocab_size": AT_LEAST_ONE,
    "tp_size": AT_LEAST_ONE,
    "mlm_probability": Bound(0, 1, "()"),
    "train_val_split": SHARE,
    "rotation_degrees": NOT_NEGATIVE,
    "scale_jitter": Bound(0, 1, "[)", "zooms are drawn from [1 - s, 1 + s]"),
    "translate": Bound(0, 1, why="the largest shift, as a share of the image"),
}


def check_argument_bounds(groups: tuple[Any, ...]) -> None:
    """Every argument of the parsed dataclasses that ARGUMENT_BOUNDS knows, refused by name outside its bounds."""
    for group in groups:
        for argument in dataclasses.fields(group):
            bound, value = ARGUMENT_BOUNDS.get(argument.name), getattr(group, argument.name)
            if bound is None or value is None or bound.holds(value):
                continue
            why = f" ({bound.why})" if bound.why else ""
            raise ValueError(f"--{argument.name} must be {bound}, got {value}{why}.")


def check_trainer_values(training_args: Any) -> None:
    """The Trainer's step counts where its strategy reads them (a count, or below 1 a share of the run): a run that
    trains no step, or logs, saves or evaluates at a negative interval, is refused before it starts. So is
    --label_names naming other fields than the scripts' batches carry their targets in: evaluation would find none
    and report no loss."""
    if training_args.label_names not in (None, ["labels"]):
        raise ValueError(
            f"--label_names {training_args.label_names}: the scripts' batches hold their targets in labels."
        )
    if training_args.optim_args and not all("=" in pair for pair in training_args.optim_args.split(",")):
        raise ValueError(f"--optim_args {training_args.optim_args!r} must be comma-separated key=value pairs.")
    if training_args.max_steps <= 0 and not training_args.num_train_epochs > 0:
        raise ValueError(
            f"--num_train_epochs must be above 0 without --max_steps, got {training_args.num_train_epochs}: the run "
            "would train no step."
        )
    for name in ("logging", "save", "eval"):
        steps, strategy = getattr(training_args, f"{name}_steps"), getattr(training_args, f"{name}_strategy")
        if strategy == "steps" and steps is not None and not steps > 0:
            raise ValueError(f"--{name}_steps must be above 0 with --{name}_strategy steps, got {steps}.")


def parse_script_arguments(
    dataclass_types: tuple[type, ...], argv: list[str] | None, **new_model_fields: Any
) -> tuple[Any, ...]:
    """A training script's argument dataclasses (model, data, training) from `argv`, the command line by default,
    with the processes configured and every argument checked that can be on its own (`ARGUMENT_BOUNDS`,
    `check_trainer_values`, the model arguments); then the logging set up and every random generator seeded with
    `--seed`."""
    configure_processes()
    model_args, *other_args = HfArgumentParser(dataclass_types).parse_args_into_dataclasses(args=argv)
    check_argument_bounds((model_args, *other_args))
    check_trainer_values(other_args[-1])
    check_model_arguments(model_args, new_model_fields)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    transformers.utils.logging.set_verbosity_warning()
    set_seed(other_args[-1].seed)
    return (model_args, *other_args)


def train_then_evaluate_perplexity(trainer: Trainer) -> dict[str, float]:
    """`--do_train` and the weights to keep (run_control.train_and_evaluate), then `--do_eval` with the perplexity
    beside the loss: exp(mean cross-entropy over the predicted tokens), how many words the model still hesitates
    between."""

    def evaluate_with_perplexity() -> dict[str, float]:
        metrics = trainer.evaluate()
        metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 700.0))  # exp overflows float64 past ~709
        trainer.log({"eval_perplexity": metrics["eval_perplexity"]})
        return metrics

    metrics = train_and_evaluate(trainer, evaluate_with_perplexity)
    trainer.log_metrics("all", metrics)
    return metrics


def check_data_file(flag: str, path: str) -> None:
    """A missing or empty file fails here with its flag, before `datasets` fails deep inside with a bare error."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{flag} {path}: no such file.")
    with file.open("rb") as stream:  # reads up to the first character that is not white space
        while chunk := stream.read(1 << 16):
            if chunk.strip():
                return
    raise ValueError(f"{flag} {path} is empty.")


def load_local_files(train_file: str | None, validation_file: str | None, test_file: str | None = None) -> DatasetDict:
    """json/jsonl/csv/tsv/parquet/txt files as a DatasetDict with `train`, `validation` and/or `test` splits."""
    named = [("train", train_file), ("validation", validation_file), ("test", test_file)]
    files = {split: path for split, path in named if path}
    for split, path in files.items():
        check_data_file(f"--{split}_file", path)
    extensions = {path.rsplit(".", 1)[-1].lower() for path in files.values()}
    if len(extensions) != 1 or next(iter(extensions)) not in DATA_FILE_BUILDERS:
        raise ValueError(f"Data files must share one extension out of {sorted(DATA_FILE_BUILDERS)}, got {files}.")
    extension = extensions.pop()
    options = {"delimiter": "\t"} if extension == "tsv" else {}
    return load_dataset(DATA_FILE_BUILDERS[extension], data_files=files, **options)


def plot_training_curves(log_history: list[dict[str, float]], path: str | Path) -> Path | None:
    """Training loss (and the evaluation metrics logged during training) against the step, as a PNG."""
    train = [(entry["step"], entry["loss"]) for entry in log_history if "loss" in entry]
    evals = [entry for entry in log_history if any(key.startswith("eval_") for key in entry)]
    if not train:
        return None
    figure, loss_axis = plt.subplots(figsize=(6, 4))
    loss_axis.plot(*zip(*train), label="train loss")
    eval_loss = [(entry["step"], entry["eval_loss"]) for entry in evals if "eval_loss" in entry]
    if eval_loss:
        loss_axis.plot(*zip(*eval_loss), "o-", label="eval loss")
    loss_axis.set_xlabel("step")
    loss_axis.set_ylabel("loss")
    metric_names = [name for name in ("eval_bleu", "eval_chrf", "eval_perplexity") if any(name in e for e in evals)]
    if metric_names:
        metric_axis = loss_axis.twinx()
        for name, style in zip(metric_names, ("s--", "^--", "d--")):
            points = [(entry["step"], entry[name]) for entry in evals if name in entry]
            metric_axis.plot(*zip(*points), style, color=f"C{2 + metric_names.index(name)}", label=name[5:])
        metric_axis.set_ylabel(", ".join(name[5:] for name in metric_names))
        metric_axis.legend(loc="center right")
    loss_axis.legend(loc="upper right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return Path(path)


def plot_bleu_against_minutes(
    log_history: list[dict[str, float]], metrics: dict[str, float], path: Path
) -> Path | None:
    """Validation BLEU of the evaluations during training and of the kept weights against the training minutes, and
    the test BLEU of the kept weights at the end, as a PNG; None without evaluations during training."""
    end = next((i for i, entry in enumerate(log_history) if "train_runtime" in entry), len(log_history))
    points = [(entry["train_minutes"], entry["eval_bleu"]) for entry in log_history[:end] if "eval_bleu" in entry]
    if not points:
        return None
    if "eval_bleu" in metrics and "train_minutes" in metrics:  # the kept weights, after training
        points.append((metrics["train_minutes"], metrics["eval_bleu"]))
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot(*zip(*points), "o-", label="validation BLEU during training")
    if "test_bleu" in metrics:
        label = f"test BLEU of the kept weights ({metrics['test_bleu']:.1f})"
        axis.plot(
            [metrics.get("train_minutes", points[-1][0])], [metrics["test_bleu"]], "*", markersize=12, label=label
        )
    axis.set_xlabel("training minutes")
    axis.set_ylabel("sacreBLEU (cased)")
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def schedule_description(training_args: Any) -> str:
    """The learning-rate schedule of a run, for its model card: the Noam schedule (§5.3) or the Trainer's."""
    if training_args.noam_schedule:
        return f"Noam, scale {training_args.learning_rate}, warm-up {training_args.warmup_steps}"
    return f"{training_args.lr_scheduler_type}, peak {training_args.learning_rate}"


def save_run(trainer: Trainer, metrics: dict[str, float], dataset: str, card_args: dict[str, Any]) -> None:
    """Model, tokenizer, code files and trainer state, then the model card with metrics and the training plots (main
    process): the test split's metrics when there are any, else the validation split's."""
    trainer.save_model()
    trainer.save_state()  # trainer_state.json: the whole log history (losses, evaluations with their minutes)
    if not trainer.is_world_process_zero():
        return
    output_dir = Path(trainer.args.output_dir)
    plot = plot_training_curves(trainer.state.log_history, output_dir / "training_curves.png")
    if plot_bleu_against_minutes(trainer.state.log_history, metrics, output_dir / BLEU_PLOT):
        card_args["description"] += f"\n\nBLEU against training minutes:\n\n![BLEU against minutes]({BLEU_PLOT})"
    split = "test" if any(name.startswith("test_") for name in metrics) else "eval"  # the card reports one split
    keep = [f"{split}_{name}" for name in ("bleu", "bleu_lowercase", "chrf", "loss", "perplexity")]
    results = {name: metrics[name] for name in keep if name in metrics and math.isfinite(metrics[name])}
    # Any seq2seq checkpoint trains here (HF Marian too, for comparisons); the card describes this package's models.
    if trainer.model.config.model_type == VanillaTransformerConfig.model_type:
        with original_module_class(trainer.model):
            write_model_card(trainer.model, output_dir, results=results, dataset=dataset, plot_path=plot, **card_args)
    with open(os.path.join(output_dir, "all_results.json"), "w") as file:
        json.dump(metrics, file, indent=2)


def finish_run(trainer: Trainer) -> None:
    """Push to the Hub if asked, then end the job as accelerate asks every script to (`end_training`): the ranks wait
    for the main one's writes and leave the process group together. A rank that exits with its process group alive
    can abort while its communication threads are torn down (seen in CI on gloo: "terminate called without an
    active exception", which ended the other rank while it wrote the model)."""
    if trainer.args.push_to_hub:
        trainer.push_to_hub()
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


@dataclass
class TextDataArguments:
    """Where the texts of the masked-LM and classifier scripts come from, and how long they may be."""

    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset, e.g. imdb (needs network)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's config."})
    train_file: str | None = field(default=None, metadata={"help": "Local training data: csv/tsv/json/jsonl/parquet."})
    validation_file: str | None = field(default=None, metadata={"help": "Local validation data, same format."})
    validation_split: str = field(
        default="validation", metadata={"help": "The split to evaluate on (e.g. 'test' for Hub datasets without one)."}
    )
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    max_seq_length: int = field(default=128, metadata={"help": "Texts are truncated to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only this many training examples."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use only this many validation examples."})
    demo_train_size: int = field(default=20000, metadata={"help": "Training examples generated for the demo data."})
    demo_validation_size: int = field(default=500, metadata={"help": "Validation examples for the demo data."})

    def __post_init__(self):
        refuse_training_split_as_validation(self.validation_split)


def refuse_training_split_as_validation(split: str) -> None:
    if split == "train":
        raise ValueError("--validation_split train would score the training data as validation: name a held-out split.")


def load_text_data(
    data_args: TextDataArguments, demo: Callable[[int, int], DatasetDict], demo_label: str
) -> tuple[DatasetDict, str]:
    """(train/validation DatasetDict, what to call the data in the model card): a Hub dataset, local files, or with
    neither the built-in demo data, each split cut to its --max_*_samples."""
    if data_args.dataset_name:
        raw, label = load_dataset(data_args.dataset_name, data_args.dataset_config_name), data_args.dataset_name
    elif data_args.train_file or data_args.validation_file:
        raw, label = load_local_files(data_args.train_file, data_args.validation_file), "local files"
    else:
        raw, label = demo(data_args.demo_train_size, data_args.demo_validation_size), demo_label
    splits = {}
    for name, source, limit in [
        ("train", "train", data_args.max_train_samples),
        ("validation", data_args.validation_split, data_args.max_eval_samples),
    ]:
        if source in raw:
            splits[name] = raw[source].select(range(min(limit, len(raw[source])))) if limit else raw[source]
    for split in splits.values():
        if data_args.text_column not in split.column_names:
            raise ValueError(
                f"--text_column {data_args.text_column!r} is not in the data; it has {split.column_names}."
            )
    return DatasetDict(splits), label


def required_split(data: DatasetDict, split: str, flag: str) -> Any:
    if split not in data:
        raise ValueError(f"{flag} needs a {split} split; the data has {list(data)}.")
    return data[split]


def position_limit(config: Any) -> int | None:
    """The most positions the model embeds, or None without a limit: this package's learned positions (its
    sinusoids, rotary and no positions extrapolate to any length); transformers' models' max_position_embeddings
    (HF Marian's sinusoids are a table of that many rows)."""
    if config.model_type == VanillaTransformerConfig.model_type:
        return config.max_position_embeddings if config.position_embedding_type == "learned" else None
    return getattr(config, "max_position_embeddings", None)


def round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def longest(data: Any, column: str = "input_ids") -> int:
    return max(map(len, data[column]), default=0)


def check_positions(config: Any, needs: Callable[[], dict[str, int]], remedy: str) -> None:
    """Each of `needs()` (what needs positions: how many) fits the model's `position_limit`, so that no step fails
    on a position past it; `needs` reads the data only when the model has a limit."""
    limit = position_limit(config)
    if limit is None:
        return
    for what, positions in needs().items():
        if positions > limit:
            raise ValueError(
                f"{what} needs {positions} positions, more than the model has (max_position_embeddings={limit}): "
                f"{remedy}."
            )


def check_text_positions(config: Any, splits: dict[str, Any]) -> None:
    """Each split's longest tokenized text (a batch is padded to its longest) fits the model's positions."""

    def needs() -> dict[str, int]:
        return {f"The {name} split's longest text": longest(split) for name, split in splits.items()}

    check_positions(config, needs, "lower --max_seq_length or give the model more positions")


def check_batches(splits: dict[str, Any], training_args: Any, hint: str = "") -> None:
    """Every split fills a batch once prepared (with --dataloader_drop_last, a whole one on every process): with
    none, the Trainer would train no step, or evaluate nothing after training; refused now, naming the split."""
    by_tokens = getattr(training_args, "max_tokens", None) is not None  # the seq2seq script's own training batches
    for name, split in splits.items():
        if len(split) == 0:
            raise ValueError(f"The {name} split has no example once prepared{hint}.")
        if not training_args.dataloader_drop_last or (name == "train" and by_tokens):
            continue
        per_device = getattr(training_args, f"per_device_{'train' if name == 'train' else 'eval'}_batch_size")
        if len(split) < per_device * training_args.world_size:
            raise ValueError(
                f"The {name} split holds {len(split)} examples, fewer than one batch of {per_device} per device on "
                f"{training_args.world_size} process(es), which --dataloader_drop_last drops: it would yield none."
            )


def evaluates_during_training(training_args: Any) -> bool:
    return training_args.eval_strategy != "no" or training_args.eval_every_minutes is not None


def check_predictions_kept(training_args: Any) -> None:
    """The classifier scripts predict the validation set after training (accuracy, the confusion matrix):
    --prediction_loss_only would leave them no predictions there."""
    if training_args.do_eval and training_args.prediction_loss_only:
        raise ValueError("--prediction_loss_only drops the predictions the classifier's evaluation scores: drop it.")


def check_metric_for_best_model(training_args: Any, reported: set[str]) -> None:
    """--metric_for_best_model must name a metric the evaluations report (`reported`, without the eval_ prefix):
    the Trainer reads it after each evaluation during training, and --average_last_checkpoints after training."""
    metric = training_args.metric_for_best_model
    if metric is None or not training_args.do_eval:
        return
    if metric.removeprefix("eval_") not in reported:
        raise ValueError(
            f"--metric_for_best_model {metric!r} is not a metric this script's evaluation reports: {sorted(reported)}."
        )


def perplexity_metrics(training_args: Any) -> set[str]:
    """What the language-model scripts' evaluations report: the loss, and the perplexity where every evaluation is
    the script's own (after training); the Trainer's evaluations during training report the loss only."""
    return {"loss"} if evaluates_during_training(training_args) else {"loss", "perplexity"}
