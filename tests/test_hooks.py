"""Every place the package relies on transformers' or torch's code beyond their public API is listed in
docs/transformers-releases.md and checked at import; where a release lacks or changes it, the package warns, naming
the release, and falls back to transformers' own behaviour or refuses before any weight is read."""

import ast
import inspect
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel

from hf_vanilla_transformer import compat_vanilla_transformer as compat
from hf_vanilla_transformer.compat_vanilla_transformer import HOOKS, check_hooks
from hf_vanilla_transformer.eager_attention_vanilla_transformer import apply_rotary_pos_emb, eager_attention_forward

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_vanilla_transformer"
DOCS = ROOT / "docs" / "transformers-releases.md"
HOOKS_SECTION = "## Hooks into transformers and torch"

# The classes whose methods a model overrides: each override is a hook, public or not, and the docs name it.
OVERRIDDEN = {cls.__name__: cls for cls in (PreTrainedModel, GenerationMixin, PreTrainedConfig)}
# The modules of transformers that its own modeling files import their building blocks from, and which it documents:
# a name imported from any other module of transformers (another model's, an integration's, a utility's) is a hook.
PUBLIC_TRANSFORMERS_MODULES = {
    "transformers",
    "transformers.activations",
    "transformers.cache_utils",
    "transformers.generation",
    "transformers.masking_utils",
    "transformers.modeling_layers",
    "transformers.modeling_outputs",
    "transformers.modeling_rope_utils",
    "transformers.modeling_utils",
    "transformers.pipelines",
    "transformers.processing_utils",
    "transformers.utils",
}
# torch's nn.Module internals the package could read instead of its public methods.
MODULE_INTERNALS = {"_modules", "_parameters", "_buffers"}


def documented_hooks() -> set[str]:
    """The names the docs' hooks section gives in backticks, up to the next section."""
    text = DOCS.read_text()
    section = text[text.index(HOOKS_SECTION) + len(HOOKS_SECTION) :].split("\n## ")[0]
    return set(re.findall(r"`([\w.]+)`", section))


def overrides_in(tree: ast.Module) -> set[tuple[str, ...]]:
    """Each method of a class of the package that transformers' model, generation or config classes define (not
    torch's nn.Module, not Python's own), as the spellings that name it: `PreTrainedModel.save_pretrained`, ..."""
    found = set()
    for node in ast.walk(tree):
        for item in node.body if isinstance(node, ast.ClassDef) else ():
            name = getattr(item, "name", "")
            if not isinstance(item, ast.FunctionDef) or name.startswith("__") or hasattr(nn.Module, name):
                continue
            owners = tuple(f"{owner}.{name}" for owner, cls in OVERRIDDEN.items() if hasattr(cls, name))
            found |= {owners} if owners else set()
    return found


def imports_in(tree: ast.Module) -> set[tuple[str, ...]]:
    """Each private name imported from transformers or torch, and each name imported from a module of transformers
    that is not among the public ones."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or (node.module or "").split(".")[0] not in ("transformers", "torch"):
            continue
        internal = node.module.startswith("transformers") and node.module not in PUBLIC_TRANSFORMERS_MODULES
        found |= {(f"{node.module}.{a.name}",) for a in node.names if internal or a.name.startswith("_")}
    return found


def private_attributes_in(tree: ast.Module) -> set[tuple[str, ...]]:
    """`torch._x` (torch's private functions) and nn.Module's own dictionaries read directly (`layers._modules`)."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")  # `torch.__version__` is public
        if isinstance(node.value, ast.Name) and node.value.id == "torch" and private:
            found.add((f"torch.{node.attr}",))
        elif node.attr in MODULE_INTERNALS:
            found.add((f"nn.Module.{node.attr}",))
    return found


def package_hooks() -> dict[tuple[str, ...], list[str]]:
    """Every hook the package's source holds -> the modules holding it."""
    hooks: dict[tuple[str, ...], list[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text())
        for hook in overrides_in(tree) | imports_in(tree) | private_attributes_in(tree):
            hooks.setdefault(hook, []).append(path.name)
    return hooks


def test_every_hook_in_the_source_is_in_the_docs_list():
    documented = documented_hooks()
    missing = {hook: where for hook, where in package_hooks().items() if not documented.intersection(hook)}
    assert not missing, f"hooks missing from {DOCS.name}'s '{HOOKS_SECTION}': {missing}"


def test_the_scan_finds_hooks_of_each_kind():
    """The scan is what the docs are held to: it must see an override, an internal import and a private attribute
    (each known to be in the package), or the test above would pass on nothing."""
    found = {spelling for hook in package_hooks() for spelling in hook}
    assert {"PreTrainedModel.mark_tied_weights_as_initialized", "torch._assert_async"} <= found
    assert any(spelling.startswith("transformers.models.bart.") for spelling in found)


def test_every_checked_hook_is_in_the_docs_list():
    assert set(HOOKS) <= documented_hooks()


def test_every_hook_fits_the_installed_releases():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_hooks(HOOKS) == frozenset()


def installed_release(hook: compat.Hook) -> str:
    library = transformers if hook.owner.startswith("transformers") else torch
    return f"{library.__name__} {library.__version__.split('+')[0]}"


def owner_of(hook: compat.Hook):
    """The module or class that defines the hook (a base class of `PreTrainedModel` for some methods)."""
    module, _, class_name = hook.owner.partition(":")
    if not class_name:
        return sys.modules[module]
    return next(cls for cls in getattr(sys.modules[module], class_name).__mro__ if hook.name in vars(cls))


@pytest.mark.parametrize("key", sorted(HOOKS))
def test_a_missing_hook_is_reported_with_the_release(key, monkeypatch):
    hook = HOOKS[key]
    monkeypatch.delattr(owner_of(hook), hook.name)
    with pytest.warns(UserWarning, match=re.escape(installed_release(hook))):
        assert check_hooks({key: hook}) == {key}


@pytest.mark.parametrize("key", sorted(key for key, hook in HOOKS.items() if hook.parameters))
def test_a_hook_without_a_parameter_the_package_uses_is_reported(key, monkeypatch):
    hook = HOOKS[key]
    original = inspect.getattr_static(owner_of(hook), hook.name)

    def renamed(*args, **kwargs):  # what a release that renamed every parameter would hold
        return original(*args, **kwargs)

    monkeypatch.setattr(owner_of(hook), hook.name, renamed)
    with pytest.warns(UserWarning, match=re.escape(installed_release(hook))):
        assert check_hooks({key: hook}) == {key}


def test_a_hook_requiring_a_parameter_the_package_does_not_pass_is_reported(monkeypatch):
    key = "PreTrainedModel.init_parallel_plans"
    monkeypatch.setattr(PreTrainedModel, "init_parallel_plans", lambda self, plans: None)
    with pytest.warns(UserWarning, match=re.escape(installed_release(HOOKS[key]))):
        assert check_hooks({key: HOOKS[key]}) == {key}


# A release that changed the hooks, simulated before the package is imported: each method keeps transformers'
# behaviour for transformers' own calls but no longer takes the parameters by the names the package uses; the
# pipeline identity layer and torch's device-side assert are gone.
SIMULATED_RELEASE = """
import inspect, warnings, torch, transformers.distributed.pipeline_parallel as pipeline
from transformers.modeling_utils import PreTrainedModel

def renamed(name):
    original = inspect.getattr_static(PreTrainedModel, name)
    if isinstance(original, classmethod):
        function = original.__func__
        setattr(PreTrainedModel, name, classmethod(lambda cls, *args, **kwargs: function(cls, *args, **kwargs)))
    else:
        setattr(PreTrainedModel, name, lambda self, *args, **kwargs: original(self, *args, **kwargs))

CHANGED = ["mark_tied_weights_as_initialized", "gather_sharded_state_dict_for_save", "maybe_distribute_model",
           "_from_config", "get_expanded_tied_weights_keys"]
for name in CHANGED:
    renamed(name)
del pipeline.PipelineIdentityLayer
del torch._assert_async
"""

FALLBACKS = """
import json, tempfile
from transformers.distributed import DistributedConfig
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from hf_vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration
    from hf_vanilla_transformer.inputs_vanilla_transformer import require
    from hf_vanilla_transformer.pretrained_vanilla_transformer import check_parallelism
reported = sorted(key for key in HOOKS_KEYS if any(key in str(w.message) for w in caught))

def refusal(call):
    try:
        call()
    except ValueError as error:
        return str(error)
    return None

config = dict(vocab_size=32, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
              decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, pad_token_id=0,
              decoder_start_token_id=1, eos_token_id=2)
results = {"reported": reported}
with tempfile.TemporaryDirectory() as folder:
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(VanillaTransformerConfig(**config)).eval()
    model.save_pretrained(folder)
    ids = torch.tensor([[5, 6, 7, 2]])
    loaded = VanillaTransformerForConditionalGeneration.from_pretrained(folder).eval()
    with torch.no_grad():
        results["round_trip"] = torch.equal(model(ids, decoder_input_ids=ids).logits,
                                            loaded(ids, decoder_input_ids=ids).logits)
    load = VanillaTransformerForConditionalGeneration.from_pretrained
    results["distributed"] = refusal(lambda: load(folder, tp_size=2))
    results["pipeline"] = refusal(lambda: check_parallelism(model, DistributedConfig(pp_size=2)))
with tempfile.TemporaryDirectory() as folder:  # the config alone: a refusal must come before any weight is read
    tied_unlike_transformers = dict(share_encoder_decoder_embeddings=False, tie_word_embeddings=True)
    VanillaTransformerConfig(**config, **tied_unlike_transformers).save_pretrained(folder)
    results["tying"] = refusal(lambda: VanillaTransformerForConditionalGeneration.from_pretrained(folder))
results["require_false"] = refusal(lambda: require(torch.tensor(False), "the condition failed"))
results["require_true"] = refusal(lambda: require(torch.tensor(True), "the condition failed"))
print(json.dumps(results))
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT, check=False
    )


@pytest.fixture(scope="module")
def changed_release() -> dict:
    keys = ["PreTrainedModel." + name for name in ("mark_tied_weights_as_initialized",
            "gather_sharded_state_dict_for_save", "maybe_distribute_model", "_from_config",
            "get_expanded_tied_weights_keys")]  # fmt: skip
    keys += [compat.PIPELINE_IDENTITY_LAYER, "torch._assert_async"]
    code = SIMULATED_RELEASE + f"HOOKS_KEYS = {keys!r}\n" + FALLBACKS
    finished = run_python(code)
    assert finished.returncode == 0, finished.stderr[-3000:]
    return {"keys": keys, **json.loads(finished.stdout.strip().splitlines()[-1])}


def test_a_changed_release_is_reported_once_per_hook(changed_release):
    assert changed_release["reported"] == sorted(changed_release["keys"])


def test_without_the_load_hooks_transformers_own_loading_round_trips(changed_release):
    assert changed_release["round_trip"]


def test_without_the_distribution_hook_a_distributed_load_is_refused(changed_release):
    assert "maybe_distribute_model" in changed_release["distributed"]


def test_without_the_pipeline_layer_pipeline_parallelism_is_refused(changed_release):
    assert "pp_size" in changed_release["pipeline"]


def test_without_the_tying_hook_embeddings_tied_unlike_transformers_are_refused_before_the_weights(changed_release):
    assert "share_encoder_decoder_embeddings=False" in changed_release["tying"]


def test_without_the_device_assert_the_checks_read_the_value_and_still_refuse(changed_release):
    assert changed_release["require_false"] == "the condition failed"
    assert changed_release["require_true"] is None


def test_without_output_capturing_the_package_refuses_to_import_naming_the_release():
    finished = run_python(  # transformers imports OutputRecorder itself: the simulated release changed it instead
        "import transformers.utils.output_capturing as capturing\n"
        "class OutputRecorder(capturing.OutputRecorder):\n"
        "    def __init__(self, target_class, index=0):\n"
        "        super().__init__(target_class, index)\n"
        "capturing.OutputRecorder = OutputRecorder\n"
        "import hf_vanilla_transformer.modeling_vanilla_transformer\n"
    )
    assert finished.returncode != 0
    assert f"transformers {transformers.__version__}" in finished.stderr.splitlines()[-1]
    assert "ImportError" in finished.stderr.splitlines()[-1]


def test_the_local_attention_helpers_compute_what_llamas_do():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    torch.manual_seed(0)
    query, key = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    value, mask = torch.randn(2, 2, 5, 8), torch.randn(2, 1, 5, 5)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    rotated = zip(apply_rotary_pos_emb(query, key, cos, sin), llama.apply_rotary_pos_emb(query, key, cos, sin))
    for ours, theirs in rotated:
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    module = nn.Module()
    module.num_key_value_groups = 2
    for ours, theirs in zip(
        eager_attention_forward(module, query, key, value, mask, scaling=0.3),
        llama.eager_attention_forward(module, query, key, value, mask, scaling=0.3),
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_an_override_left_out_lets_the_overridden_method_run(monkeypatch):
    """The fallback of an override whose hook does not fit, on classes built for the purpose."""

    class Base:
        def method(self) -> str:
            return "transformers' own"

    unfit_key = next(iter(HOOKS))
    monkeypatch.setattr(compat, "UNFIT", frozenset({unfit_key}))

    class Model(Base):
        @compat.overrides(unfit_key)
        def method(self) -> str:
            return "the override"

    assert Model().method() == "transformers' own"

