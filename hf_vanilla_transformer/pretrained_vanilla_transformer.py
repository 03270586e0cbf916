"""How the models load, save and shard: the `PreTrainedModel` methods they override, apart from the model code.

load    an encoder-decoder checkpoint is refused by the heads on one stack; a tied source missing from the
        checkpoint stays missing (and is initialised)
save    `auto_map` names every head that can load the checkpoint, and the code of each is copied beside it (a
        model loaded as remote code fetches the heads' code its load did not copy from its checkpoint)
shard   the parallelism plans keep the rules that name a module of the model; what transformers' engine cannot
        shard is refused before any weight is read; tied weights gathered from shards are saved once
"""

import re
import shutil
from itertools import chain
from pathlib import Path

from huggingface_hub.errors import HFValidationError
from transformers import PreTrainedConfig
from transformers.dynamic_module_utils import HF_MODULES_CACHE, get_cached_module_file, get_relative_import_files
from transformers.modeling_utils import PreTrainedModel
from transformers.utils import logging

from .auto_vanilla_transformer import HEADS, auto_map, loaders
from .compat_vanilla_transformer import PIPELINE_IDENTITY_LAYER, fits, overrides, refuse_unfit

logger = logging.get_logger(__name__)

# The from_pretrained arguments that say where a checkpoint is, to read its config before choosing the class.
HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "trust_remote_code")
# The from_pretrained arguments that ask for a distributed load.
DISTRIBUTED_KWARGS = ("distributed_config", "tp_plan", "tp_size")

# The hooks whose fallback is a refusal at load (compat_vanilla_transformer).
MAYBE_DISTRIBUTE_MODEL = "PreTrainedModel.maybe_distribute_model"
TIED_WEIGHTS_KEYS = "PreTrainedModel.get_expanded_tied_weights_keys"


# A layer's number in a module name (`layers.3.mlp`), written `*` in the parallelism plans' rules (`layers.*.mlp`).
LAYER_NUMBER = re.compile(r"\.\d+(\.|$)")


class LoadSaveShardMixin:
    """Put before `PreTrainedModel` in a model's bases: each method adjusts transformers' own and calls it."""

    @classmethod
    def checkpoint_config(cls, pretrained_model_name_or_path, config, kwargs: dict) -> PreTrainedConfig:
        """The config `from_pretrained` will use: the one given, else the checkpoint's, read before any weight."""
        if isinstance(config, PreTrainedConfig):
            return config
        hub_kwargs = {key: kwargs[key] for key in HUB_KWARGS if key in kwargs}
        return cls.config_class.from_pretrained(pretrained_model_name_or_path, **hub_kwargs)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        if any(kwargs.get(key) is not None for key in DISTRIBUTED_KWARGS):
            refuse_unfit(MAYBE_DISTRIBUTE_MODEL, "a distributed load (distributed_config, tp_plan, tp_size)")
        if not fits(TIED_WEIGHTS_KEYS):
            refuse_tying_unlike_transformers(cls.checkpoint_config(pretrained_model_name_or_path, config, kwargs))
        declared = HEADS.get(cls.__name__)
        if (
            declared is not None
            and "encoder-decoder" not in declared.checkpoint_kinds
            and cls.checkpoint_config(pretrained_model_name_or_path, config, kwargs).is_encoder_decoder
        ):
            # Its weights sit under model.encoder / model.decoder, which a single-stack head's `model` does not have:
            # every layer would be newly initialised, silently but for a warning.
            raise ValueError(
                f"{pretrained_model_name_or_path} is an encoder-decoder checkpoint (is_encoder_decoder=True): "
                f"{cls.__name__} runs one stack and cannot load it. Load it with AutoModelForSeq2SeqLM "
                "(VanillaTransformerForConditionalGeneration)."
            )
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    @overrides("PreTrainedModel.mark_tied_weights_as_initialized")
    def mark_tied_weights_as_initialized(self, loading_info) -> None:
        # transformers marks every tied parameter as loaded before tying it to its source; a tied name that is the
        # source's own parameter (the stacks hold the `shared` embedding module itself) would mark the source too, and
        # a source missing from the checkpoint would then be neither loaded nor initialised: left on the meta device.
        missing_aliased_sources = {
            source
            for target, source in self.all_tied_weights_keys.items()
            if source in loading_info.missing_keys and self.get_parameter(target) is self.get_parameter(source)
        }
        super().mark_tied_weights_as_initialized(loading_info)
        loading_info.missing_keys |= missing_aliased_sources

    def save_pretrained(self, save_directory, *args, **kwargs) -> None:
        # transformers writes the saved class's own Auto class into `auto_map` and copies its module (and the modules
        # it imports); a checkpoint here also names every head that can load it (a causal LM's loads as a GPT-style
        # classifier), so each of their modules is copied too, with the modules it imports. `auto_map` names only
        # the heads whose code is copied: a checkpoint never names code it lacks.
        model_class = type(self).__name__
        modules = {head.module for head in loaders(self.config, model_class).values()}
        module_files = {module: sibling_module_file(module, self.config) for module in modules}
        lacking = {module for module, file in module_files.items() if file is None}
        self.config.auto_map = {
            auto_class: reference
            for auto_class, reference in auto_map(self.config, model_class).items()
            if reference.split(".")[0] not in lacking
        }
        super().save_pretrained(save_directory, *args, **kwargs)
        if self.is_remote_code():
            for module_file in filter(None, module_files.values()):
                for file in (module_file, *get_relative_import_files(module_file)):
                    shutil.copyfile(file, Path(save_directory) / Path(file).name)

    @overrides("PreTrainedModel.init_parallel_plans")
    def init_parallel_plans(self) -> None:
        """transformers' parallelism plans, keeping the rules that name a module or parameter of this model. The
        config's plans name the modules of every variant (dense or gated FFN, experts with or without biases,
        cross-attention) of one stack, which an encoder-decoder holds twice under other names (`encoder.layers.*`):
        every other rule would match nothing and be reported as such at load time."""
        super().init_parallel_plans()
        names = chain(self.named_modules(), self.named_parameters())
        names = {LAYER_NUMBER.sub(r".*\1", name) for name, _ in names}
        for plan in ("_tp_plan", "_ep_plan", "_pp_plan"):
            setattr(self, plan, {rule: value for rule, value in getattr(self, plan).items() if rule in names})

    @overrides("PreTrainedModel.gather_sharded_state_dict_for_save")
    def gather_sharded_state_dict_for_save(self, model_to_save, state_dict, distributed_config, **kwargs) -> dict:
        # transformers gathers each key of a sharded model on its own, so tied weights come back as copies, which
        # save_pretrained would all write (the shared embedding four times); gathered once, they are saved once.
        gathered = super().gather_sharded_state_dict_for_save(model_to_save, state_dict, distributed_config, **kwargs)
        for target, source in model_to_save.all_tied_weights_keys.items():
            if target in gathered and source in gathered:
                gathered[target] = gathered[source]
        return gathered

    @overrides(MAYBE_DISTRIBUTE_MODEL)
    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        if distributed_config is not None:
            check_parallelism(model, distributed_config)
        return super().maybe_distribute_model(model, distributed_config, mesh_manager)


def sibling_module_file(module: str, config: PreTrainedConfig) -> Path | None:
    """The file of a sibling module: beside this one (the package, or transformers' copy of a checkpoint's code, which
    holds only the modules the loaded class imports), else fetched by transformers from the checkpoint the model was
    loaded from (`config.name_or_path`); None, with a warning, where neither has it."""
    beside = Path(__file__).with_name(f"{module}.py")
    if beside.is_file():
        return beside
    # transformers keeps a Hub checkpoint's code in a folder named after its commit: the other heads' code comes from
    # the same commit (a local checkpoint's folder is named after a hash of its files, and its load ignores revisions).
    source, revision = config.name_or_path, beside.parent.name
    try:
        return Path(HF_MODULES_CACHE) / get_cached_module_file(source, f"{module}.py", revision=revision)
    except (OSError, HFValidationError) as error:  # not there; a folder that is gone is no Hub name either
        logger.warning(
            "%s.py is neither beside %s nor in %r (%s): the saved auto_map leaves out its heads",
            module, beside.parent, source, error,
        )  # fmt: skip
        return None


def refuse_tying_unlike_transformers(config: PreTrainedConfig) -> None:
    """Where the models' tying cannot replace transformers' (`TIED_WEIGHTS_KEYS` does not fit), refuse the
    encoder-decoders that transformers' would tie otherwise: it shares the source embedding as `tie_word_embeddings`
    says, not as `share_encoder_decoder_embeddings` does."""
    if config.is_encoder_decoder and config.share_encoder_decoder_embeddings != config.tie_word_embeddings:
        refuse_unfit(
            TIED_WEIGHTS_KEYS,
            f"share_encoder_decoder_embeddings={config.share_encoder_decoder_embeddings} with "
            f"tie_word_embeddings={config.tie_word_embeddings}",
        )


def check_parallelism(model: PreTrainedModel, distributed_config) -> None:
    """Refuse, before any weight is read, what transformers' distributed engine cannot shard (transformers 5.23).
    Tensor parallelism gives each rank whole attention heads and whole K/V head groups. The pipeline engine splits
    `model.layers` of a decoder-only language model into consecutive slices, one per rank, and returns logits only."""
    config, tp_size = model.config, distributed_config.tp_size
    for stack in config.stacks if tp_size > 1 else ():
        heads = getattr(config, f"{stack}_attention_heads")
        counts = {f"{stack}_attention_heads": heads, "num_key_value_heads": config.key_value_heads(heads)}
        for name, count in counts.items():
            if count % tp_size:
                raise ValueError(
                    f"tp_size={tp_size} does not divide {name}={count}: tensor parallelism gives each rank whole "
                    "attention heads (and whole groups of query heads sharing a key/value head)."
                )
    if distributed_config.pp_size > 1:
        refuse_unfit(PIPELINE_IDENTITY_LAYER, "pipeline parallelism (pp_size > 1)")
    if distributed_config.pp_size > 1 and not type(model)._pp_plan:
        raise ValueError(
            f"pp_size > 1 (pipeline parallelism) is not supported for {type(model).__name__}: transformers' pipeline "
            "engine runs decoder-only language models (VanillaTransformerForCausalLM), not an encoder, an "
            "encoder-decoder or a classifier. Tensor and expert parallelism (tp_size, ep_size) shard every head."
        )


__all__ = ["LoadSaveShardMixin", "check_parallelism"]
