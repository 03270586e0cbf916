"""A model loaded as remote code saves again: transformers copies only the code of the class it loads (and what that
imports), while a checkpoint's `auto_map` names every head that can load it. Re-saved in a fresh process where
hf_vanilla_transformer cannot be imported, the other heads' code comes from the checkpoint the model was loaded from;
where that checkpoint is gone, `auto_map` leaves those heads out, so that it never names code the folder lacks.

Run: python -m pytest -q tests/test_resaving.py
"""

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import tiny_config

from hf_vanilla_transformer import VanillaTransformerForCausalLM

CLASSIFIER_MODULE = "classification_vanilla_transformer"

RESAVE_SCRIPT = """
import json, shutil, sys
from pathlib import Path

sys.modules["hf_vanilla_transformer"] = None  # importing it now fails: only the saved code files can be used
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

source, moved, resaved, resaved_without_source = map(Path, sys.argv[1:])
ids = torch.tensor([[3, 4, 5, 6]])
model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
loaded_code = Path(sys.modules[type(model).__module__].__file__).parent
model.save_pretrained(resaved)
classifier = AutoModelForSequenceClassification.from_pretrained(resaved, trust_remote_code=True)
again = AutoModelForCausalLM.from_pretrained(resaved, trust_remote_code=True)

shutil.copytree(source, moved)
moved_model = AutoModelForCausalLM.from_pretrained(moved, trust_remote_code=True)
shutil.rmtree(moved)  # the checkpoint it came from is gone: the classifier's code is nowhere
moved_model.save_pretrained(resaved_without_source)
print(json.dumps({
    "loaded_code": sorted(path.name for path in loaded_code.glob("*.py")),
    "classes": [type(model).__module__, type(classifier).__name__],
    "logits": [model(ids).logits.tolist(), again(ids).logits.tolist()],
}))
"""


def auto_map(folder: Path) -> dict[str, str]:
    return json.loads((folder / "config.json").read_text())["auto_map"]


def test_a_model_loaded_as_remote_code_saves_again_with_every_heads_code(tmp_path):
    torch.manual_seed(0)
    saved = tmp_path / "saved"
    VanillaTransformerForCausalLM(tiny_config(is_encoder_decoder=False, is_decoder=True)).save_pretrained(saved)
    assert f"{CLASSIFIER_MODULE}.VanillaTransformerForSequenceClassification" in auto_map(saved).values()
    folders = [saved, tmp_path / "moved", tmp_path / "resaved", tmp_path / "resaved_without_source"]
    result = subprocess.run(
        [sys.executable, "-c", RESAVE_SCRIPT, *map(str, folders)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": ""},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert f"{CLASSIFIER_MODULE}.py" not in report["loaded_code"]  # the case: its code was not loaded with the model
    assert report["classes"] == [report["classes"][0], "VanillaTransformerForSequenceClassification"]
    assert report["classes"][0].startswith("transformers_modules.")
    assert report["logits"][0] == report["logits"][1]

    resaved, resaved_without_source = folders[2:]
    assert auto_map(resaved) == auto_map(saved)
    assert sorted(path.name for path in resaved.glob("*.py")) == sorted(path.name for path in saved.glob("*.py"))
    kept = {
        name: reference for name, reference in auto_map(saved).items() if not reference.startswith(CLASSIFIER_MODULE)
    }
    assert auto_map(resaved_without_source) == kept and len(kept) < len(auto_map(saved))
    for reference in kept.values():
        assert (resaved_without_source / f"{reference.split('.')[0]}.py").is_file()
    assert f"{CLASSIFIER_MODULE}.py is neither beside" in result.stderr
