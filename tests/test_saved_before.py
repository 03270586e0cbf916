"""A checkpoint saved before the forward moved into one modeling file (tests/fixtures/seq2seq-saved-before-one-
modeling-file: a tiny translation model saved by commit 82997b0, its weights, config and the logits that code
computed) loads into the present classes with the same parameter names and computes the same logits; saved again,
it ships the code files the model now needs, and loads from them alone in a process without the package."""

import json
from pathlib import Path

import torch
from conftest import run_without_package
from transformers import AutoModelForSeq2SeqLM

import hf_vanilla_transformer  # noqa: F401  (registers the Auto classes)

SAVED_BEFORE = Path(__file__).parent / "fixtures" / "seq2seq-saved-before-one-modeling-file"
REMOVED_MODULES = {"layers", "norms", "feed_forward", "positions", "dropout", "moe"}

LOAD_REMOTE_CODE = """
import json, sys
sys.modules["hf_vanilla_transformer"] = None  # importing it now fails: only the saved code files can be used
import torch
from transformers import AutoModelForSeq2SeqLM

case = json.loads(open(sys.argv[2]).read())
model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
input_ids = torch.tensor(case["input_ids"])
with torch.no_grad():
    logits = model(input_ids=input_ids, attention_mask=(input_ids != 0).long(),
                   decoder_input_ids=torch.tensor(case["decoder_input_ids"])).logits
print(json.dumps({"module": type(model).__module__, "logits": logits.tolist()}))
"""


def logits_of(model, case: dict) -> torch.Tensor:
    input_ids = torch.tensor(case["input_ids"])
    with torch.no_grad():
        return model(
            input_ids=input_ids,
            attention_mask=(input_ids != 0).long(),
            decoder_input_ids=torch.tensor(case["decoder_input_ids"]),
        ).logits


def test_a_checkpoint_saved_before_loads_and_computes_what_it_did(tmp_path):
    case = json.loads((SAVED_BEFORE / "expected.json").read_text())
    model = AutoModelForSeq2SeqLM.from_pretrained(SAVED_BEFORE).eval()
    assert type(model).__module__.startswith("hf_vanilla_transformer.")  # the package's classes, not saved code
    torch.testing.assert_close(logits_of(model, case), torch.tensor(case["logits"]), rtol=1e-5, atol=1e-6)

    resaved = tmp_path / "resaved"
    model.save_pretrained(resaved)
    shipped = {path.stem.removesuffix("_vanilla_transformer") for path in resaved.glob("*.py")}
    assert {"modeling", "language_modeling", "inputs", "packing", "configuration"} <= shipped
    assert not shipped & REMOVED_MODULES
    report = run_without_package(LOAD_REMOTE_CODE, str(resaved), str(SAVED_BEFORE / "expected.json"), tmp_path=tmp_path)
    assert report["module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(report["logits"]), torch.tensor(case["logits"]), rtol=1e-5, atol=1e-6)
