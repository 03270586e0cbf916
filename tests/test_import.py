"""The package imports with only its declared dependencies, and loads converters on first use.

Each check runs in a fresh interpreter: this process has long imported everything the other tests use.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_vanilla_transformer

ROOT = Path(__file__).resolve().parents[1]

# Hides every installed distribution outside the closure of the package's declared (install) dependencies: a None
# entry in sys.modules makes `import x` raise ModuleNotFoundError and `importlib.util.find_spec(x)` report it
# missing, which is how transformers probes optional packages.
HIDE_UNDECLARED = """
import importlib.metadata as metadata
import sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

def install_closure(requirements):
    allowed, pending = set(), list(requirements)
    while pending:
        requirement = Requirement(pending.pop())
        name = canonicalize_name(requirement.name)
        if name in allowed or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        allowed.add(name)
        try:
            pending.extend(metadata.requires(requirement.name) or [])
        except metadata.PackageNotFoundError:
            pass
    return allowed

allowed = install_closure(["hf_vanilla_transformer"])
hidden = sorted(
    top
    for top, distributions in metadata.packages_distributions().items()
    if top not in sys.stdlib_module_names and not any(canonicalize_name(d) in allowed for d in distributions)
)
for top in hidden:
    sys.modules[top] = None
"""

# Modules the package needs only for converters: they must not load with the package.
CONVERTER_ONLY_MODULES = [
    "hf_vanilla_transformer.conversion_vanilla_transformer",
    "hf_vanilla_transformer.convert_llama_vanilla_transformer",
    "hf_vanilla_transformer.convert_marian_vanilla_transformer",
    "hf_vanilla_transformer.convert_mixtral_vanilla_transformer",
    "hf_vanilla_transformer.convert_vit_vanilla_transformer",
    "hf_vanilla_transformer.ctranslate2_vanilla_transformer",
    "hf_vanilla_transformer.cpu_inference_vanilla_transformer",
    "ctranslate2",
    "transformers.models.marian.modeling_marian",
    "transformers.models.marian.tokenization_marian",
    "sentencepiece",
]


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter importing this checkout's package; it prints one JSON object."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRANSFORMERS_VERBOSITY": "error"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_imports_with_only_declared_dependencies_and_converters_load_on_first_use():
    report = run_python(
        HIDE_UNDECLARED
        + """
import json
import hf_vanilla_transformer
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
loaded_with_package = [name for name in %r if sys.modules.get(name) is not None]
config_class = type(AutoConfig.for_model("vanilla_transformer"))
llama = hf_vanilla_transformer.convert_llama_to_vanilla_transformer
try:
    hf_vanilla_transformer.convert_marian_to_vanilla_transformer
    marian_error = None
except ImportError as err:
    marian_error = str(err)
print(json.dumps(dict(
    hidden=hidden,
    package_file=hf_vanilla_transformer.__file__,
    loaded_with_package=loaded_with_package,
    registered=[config_class.__name__, MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__name__],
    llama_module=llama.__module__,
    marian_error=marian_error,
)))
"""
        % CONVERTER_ONLY_MODULES
    )
    assert "sentencepiece" in report["hidden"]  # the test extra installs it; the package must not need it
    assert Path(report["package_file"]).is_relative_to(ROOT)
    assert report["loaded_with_package"] == []
    assert report["registered"] == ["VanillaTransformerConfig", "VanillaTransformerForCausalLM"]
    assert report["llama_module"] == "hf_vanilla_transformer.convert_llama_vanilla_transformer"
    assert "SentencePiece" in report["marian_error"]  # only the Marian converter needs it, and says so


def test_every_lazy_name_resolves_to_its_module():
    for name, module in hf_vanilla_transformer.LAZY_NAMES.items():
        value = getattr(hf_vanilla_transformer, name)
        assert value.__module__ == f"hf_vanilla_transformer.{module}"
        assert name in dir(hf_vanilla_transformer) and name in hf_vanilla_transformer.__all__


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError, match="convert_gpt2_to_vanilla_transformer"):
        hf_vanilla_transformer.convert_gpt2_to_vanilla_transformer  # noqa: B018
