"""Where the package relies on transformers' or torch's code beyond their public API, each place checked once, here.

`HOOKS` lists every such method the models override and every such name the package imports, with the parameters it
passes (or, for a class, builds it with) and what the package does where the installed release lacks it
(docs/transformers-releases.md gives the reasons). At import each is looked up: one that is missing, or whose signature
lacks a parameter the package uses or requires one it does not pass, is named in a warning with the installed
release, and the package falls back:
- an override marked `@overrides(key)` is left out of its class: transformers' own method runs;
- a name taken with `imported(key, fallback)` is the given fallback instead;
- where there is no fallback, `refuse_unfit(key, why)` raises, before any weight is read, naming the release.
"""

import importlib
import inspect
import warnings
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

PRETRAINED_MODEL = "transformers.modeling_utils:PreTrainedModel"


@dataclass(frozen=True)
class Hook:
    owner: str  # the module holding it, or `module:Class`
    name: str
    parameters: tuple[str, ...]  # the parameters the package passes, or builds the class with
    fallback: str  # what the package does where the installed release lacks it

    @property
    def key(self) -> str:
        """Its name in docs/transformers-releases.md: `PreTrainedModel.init_parallel_plans`, `torch._assert_async`."""
        return f"{self.owner.split(':')[-1]}.{self.name}"

    @property
    def release(self) -> str:
        library = self.owner.split(".")[0]
        return f"{library} {version(library)}"

    def lookup(self) -> Any:
        """The installed release's object, or None where it has none."""
        module, _, class_name = self.owner.partition(":")
        try:
            found = importlib.import_module(module)
        except ImportError:
            return None
        if class_name:
            found = getattr(found, class_name, None)
        return getattr(found, self.name, None)

    def fits(self) -> bool:
        """There, taking every parameter the package uses, and requiring none that it does not pass."""
        found = self.lookup()
        if found is None:
            return False
        try:
            parameters = inspect.signature(found).parameters.values()
        except ValueError:  # a builtin without a signature (torch's ops): being there is what can be checked
            return True
        variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        required = {p.name for p in parameters if p.default is p.empty and p.kind not in variadic} - {"self", "cls"}
        return set(self.parameters) <= {p.name for p in parameters} and required <= set(self.parameters)


def pretrained_model_hook(name: str, parameters: tuple[str, ...], fallback: str) -> Hook:
    return Hook(PRETRAINED_MODEL, name, parameters, fallback)


HOOKS: dict[str, Hook] = {
    hook.key: hook
    for hook in (
        pretrained_model_hook(
            "mark_tied_weights_as_initialized",
            ("loading_info",),
            "a checkpoint lacking the shared embedding leaves it uninitialised where a stack holds it itself",
        ),
        pretrained_model_hook(
            "init_parallel_plans",
            (),
            "the parallelism plans keep the rules naming modules this model lacks, which a distributed load reports",
        ),
        pretrained_model_hook(
            "gather_sharded_state_dict_for_save",
            ("model_to_save", "state_dict", "distributed_config"),
            "a sharded model saves each tied weight as a copy of its own",
        ),
        pretrained_model_hook(
            "maybe_distribute_model",
            ("model", "distributed_config", "mesh_manager"),
            "a distributed load (distributed_config, tp_plan, tp_size) is refused",
        ),
        pretrained_model_hook(
            "_from_config",
            ("config",),
            "AutoModel.from_config builds the encoder-decoder VanillaTransformerModel for every config: build "
            "VanillaTransformerEncoder or VanillaTransformerDecoder for a single stack",
        ),
        pretrained_model_hook(
            "get_expanded_tied_weights_keys",
            ("all_submodels",),
            "an encoder-decoder ties its embeddings as tie_word_embeddings says: one whose "
            "share_encoder_decoder_embeddings differs is refused",
        ),
        Hook(
            "transformers.utils.output_capturing",
            "capture_outputs",
            ("func",),
            "the package does not import: the stacks return their hidden states, attentions and router logits "
            "through it",
        ),
        Hook(
            "transformers.utils.output_capturing",
            "OutputRecorder",
            ("target_class", "index", "layer_name"),
            "the package does not import: the stacks return their attentions and router logits through it",
        ),
        Hook(
            "transformers.distributed.pipeline_parallel",
            "PipelineIdentityLayer",
            (),
            "pipeline parallelism (pp_size > 1) is refused",
        ),
        Hook(
            "torch",
            "_assert_async",
            (),
            "the checks of the inputs' values read them on the host, which waits for an accelerator",
        ),
    )
}


def check_hooks(hooks: dict[str, Hook]) -> frozenset[str]:
    """The keys of the hooks the installed releases lack, each named in a warning."""
    unfit = frozenset(key for key, hook in hooks.items() if not hook.fits())
    for key in sorted(unfit):
        hook = hooks[key]
        warnings.warn(
            f"{hook.release} has no {key} taking the parameters {hook.parameters} that this package uses: "
            f"{hook.fallback}.",
            stacklevel=2,
        )
    return unfit


UNFIT = check_hooks(HOOKS)


def fits(key: str) -> bool:
    return key not in UNFIT


class _LeftOut:
    """An override left out of its class where the method it overrides does not fit: transformers' own runs."""

    def __set_name__(self, owner: type, name: str) -> None:
        delattr(owner, name)


def overrides(key: str):
    """Decorate a method overriding the hook `key`: kept where the installed release's fits, else left out."""
    return lambda method: method if fits(key) else _LeftOut()


def imported(key: str, fallback: Any = None) -> Any:
    """The hook `key` itself where it fits, else `fallback`."""
    return HOOKS[key].lookup() if fits(key) else fallback


def unfit_message(key: str, why: str) -> str:
    hook = HOOKS[key]
    return f"{why} needs {key}, which {hook.release} lacks or has changed: {hook.fallback}."


def refuse_unfit(key: str, why: str) -> None:
    """Raise where the hook `key` does not fit: `why` is what needed it."""
    if not fits(key):
        raise ValueError(unfit_message(key, why))


def required(key: str) -> Any:
    """The hook `key`, which the package cannot do without: where it does not fit, the package does not import."""
    if not fits(key):
        raise ImportError(unfit_message(key, "hf_vanilla_transformer"))
    return HOOKS[key].lookup()


class NoPipelineLayer:
    """Stands for transformers' pipeline identity layer where the installed release has none: no layer is one."""


OUTPUT_CAPTURING = "transformers.utils.output_capturing"
capture_outputs = required(f"{OUTPUT_CAPTURING}.capture_outputs")
OutputRecorder = required(f"{OUTPUT_CAPTURING}.OutputRecorder")
PIPELINE_IDENTITY_LAYER = "transformers.distributed.pipeline_parallel.PipelineIdentityLayer"
PipelineIdentityLayer = imported(PIPELINE_IDENTITY_LAYER, NoPipelineLayer)


__all__ = [
    "HOOKS",
    "Hook",
    "OutputRecorder",
    "PipelineIdentityLayer",
    "capture_outputs",
    "check_hooks",
    "fits",
    "imported",
    "overrides",
    "refuse_unfit",
    "required",
]
