"""The package and the code every checkpoint carries, on each transformers release the package declares.

transformers 5.24 renamed the decoder cache from `past_key_values` to `cache` (in `generate`, in the masks and in the
output classes). The models take either name, without a warning, and return the cache under the installed release's
name. A checkpoint saved with its code under one release (tests/fixtures/seq2seq-saved-with-transformers-*, made by
tests/release_checkpoints.py under the oldest and the newest declared release) loads under the installed one, into
the package's classes and from its own code files alone, and decodes the tokens it decoded where it was saved. CI
runs this module under both releases, so each loads the other's checkpoint.
"""

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
from conftest import padded_batch, run_without_package, tiny_config
from release_checkpoints import DECODING, FIXTURES, PREFIX, generate
from transformers import AutoModelForSeq2SeqLM
from transformers.cache_utils import Cache
from transformers.modeling_outputs import Seq2SeqLMOutput

from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerModel,
)

RELEASE_CHECKPOINTS = sorted(FIXTURES.glob(f"{PREFIX}*"))
# Saved under transformers 5.23 by the code before this package took 5.24's names: its own files cannot decode under
# 5.24 (that code passes the cache positionally into transformers' `prepare_inputs_for_generation`).
SAVED_BEFORE_THE_NAMES = FIXTURES / "seq2seq-saved-before-transformers-5.24-names"
# The name the installed release's output classes give the cache.
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"

LOAD_REMOTE_CODE = """
import json, sys
sys.modules["hf_vanilla_transformer"] = None  # importing it now fails: only the saved code files can be used
sys.path.insert(0, sys.argv[2])
from release_checkpoints import DECODING, generate
from transformers import AutoModelForSeq2SeqLM

model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
tokens = {mode: generate(model, mode) for mode in DECODING}
print(json.dumps({"module": type(model).__module__, "tokens": tokens}))
"""


class Warnings(logging.Handler):
    """Python warnings and transformers' logged warnings (`warning_once` included) raised while it is active."""

    def __enter__(self):
        self.messages = []
        self.logger = logging.getLogger("transformers")
        self.logger.addHandler(self)
        self.caught = warnings.catch_warnings(record=True)
        self.recorded = self.caught.__enter__()
        warnings.simplefilter("always")
        return self

    def emit(self, record):
        if record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())

    def __exit__(self, *exc):
        self.caught.__exit__(*exc)
        self.logger.removeHandler(self)
        self.messages += [str(warning.message) for warning in self.recorded]


def decode_two_steps(model, first: dict, cache_name: str):
    """A forward over the first target tokens, then one step that takes its cache under `cache_name`."""
    with torch.no_grad():
        outputs = model(**first, use_cache=True)
        next_token = outputs.logits[:, -1:].argmax(-1)
        if "decoder_input_ids" in first:
            step = dict(first, decoder_input_ids=next_token)
        else:
            step = dict(input_ids=next_token, attention_mask=torch.ones_like(first["input_ids"][:, :1]).repeat(1, 7))
        return model(**step, **{cache_name: outputs[CACHE_FIELD]})


@pytest.mark.parametrize("head", ["seq2seq", "causal"])
def test_the_cache_goes_in_under_either_name_without_a_warning(head):
    torch.manual_seed(0)
    input_ids, attention_mask = padded_batch(batch=2, length=6)
    if head == "seq2seq":
        model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
        first = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :3])
    else:
        model = VanillaTransformerForCausalLM(tiny_config(is_encoder_decoder=False)).eval()
        first = dict(input_ids=input_ids[:1], attention_mask=attention_mask[:1])
    results = {}
    for name in ("cache", "past_key_values"):
        with Warnings() as caught:
            outputs = decode_two_steps(model, first, name)
            returned = outputs[CACHE_FIELD]
        assert caught.messages == [], (name, caught.messages)
        assert isinstance(returned, Cache)
        results[name] = outputs.logits
    torch.testing.assert_close(results["cache"], results["past_key_values"], rtol=0, atol=0)


def test_the_base_model_returns_the_cache_under_the_releases_name_without_a_warning():
    torch.manual_seed(0)
    model = VanillaTransformerModel(tiny_config()).eval()
    input_ids, attention_mask = padded_batch(batch=2, length=6)
    with Warnings() as caught, torch.no_grad():
        outputs = model(input_ids, attention_mask, decoder_input_ids=input_ids[:, :2], use_cache=True)
        step = model(input_ids, attention_mask, decoder_input_ids=input_ids[:, 2:3], cache=outputs[CACHE_FIELD])
    assert caught.messages == []
    assert step[CACHE_FIELD].get_seq_length() == 3


def test_a_cache_given_under_both_names_is_refused():
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    input_ids, attention_mask = padded_batch(batch=2, length=6)
    with torch.no_grad():
        cache = model(input_ids, attention_mask, decoder_input_ids=input_ids[:, :2], use_cache=True)[CACHE_FIELD]
        with pytest.raises(ValueError, match="`cache` or as `past_key_values`, not both"):
            model(input_ids, attention_mask, decoder_input_ids=input_ids[:, 2:3], cache=cache, past_key_values=cache)


def test_checkpoints_were_saved_under_the_oldest_and_the_newest_declared_release():
    saved_with = {json.loads((folder / "expected.json").read_text())["transformers"] for folder in RELEASE_CHECKPOINTS}
    assert len(saved_with) >= 2, saved_with


@pytest.mark.parametrize("folder", RELEASE_CHECKPOINTS, ids=lambda folder: folder.name.removeprefix(PREFIX))
def test_a_checkpoint_saved_under_another_release_decodes_the_same_tokens(folder: Path, tmp_path):
    expected = json.loads((folder / "expected.json").read_text())["tokens"]
    assert set(expected) == set(DECODING)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()  # the package's classes
    assert type(model).__module__.startswith("hf_vanilla_transformer.")
    assert {mode: generate(model, mode) for mode in DECODING} == expected

    report = run_without_package(LOAD_REMOTE_CODE, str(folder), str(Path(__file__).parent), tmp_path=tmp_path)
    assert report["module"].startswith("transformers_modules.")  # the checkpoint's own code files
    assert report["tokens"] == expected


def test_a_checkpoint_saved_before_the_new_names_decodes_through_the_package_and_saved_again_alone(tmp_path):
    """The way docs/transformers-releases.md gives for checkpoints whose code predates transformers 5.24: loaded with
    the package (no `trust_remote_code`), it decodes what it decoded when saved; saved again, it carries code that
    decodes the same from its own files under the installed release."""
    expected = json.loads((SAVED_BEFORE_THE_NAMES / "expected.json").read_text())["tokens"]
    model = AutoModelForSeq2SeqLM.from_pretrained(SAVED_BEFORE_THE_NAMES).eval()
    assert type(model).__module__.startswith("hf_vanilla_transformer.")
    assert {mode: generate(model, mode) for mode in DECODING} == expected
    model.save_pretrained(tmp_path / "saved-again")
    report = run_without_package(
        LOAD_REMOTE_CODE, str(tmp_path / "saved-again"), str(Path(__file__).parent), tmp_path=tmp_path
    )
    assert report["tokens"] == expected
