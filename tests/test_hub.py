"""The Hub round trip without network.

Push: `HfApi.create_repo` / `create_commit` and `ModelCard.load` are replaced by an in-memory Hub that keeps the bytes
of every commit, so the tests see exactly the files `push_to_hub` / `push_repository` would send. Pull: the pushed
files are laid out as huggingface_hub stores a downloaded repository, and a fresh Python process in which
`import hf_vanilla_transformer` fails loads them offline through the Auto classes with `trust_remote_code=True`.

Run: python -m pytest -q tests/test_hub.py
"""

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_config
from huggingface_hub import CommitInfo, HfApi, ModelCard, RepoUrl, scan_cache_dir
from huggingface_hub.errors import EntryNotFoundError
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils.sha import git_hash
from safetensors.torch import load
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoModel, PreTrainedTokenizerFast

import hf_vanilla_transformer
from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForMaskedLM,
    VanillaTransformerForQuestionAnswering,
    VanillaTransformerForSequenceClassification,
    VanillaTransformerForTokenClassification,
    VanillaTransformerModel,
    build_model_card,
    push_repository,
    write_model_card,
)

PACKAGE_DIR = Path(hf_vanilla_transformer.__file__).parent
# The Hub's default .gitattributes stores these through LFS; the cache names LFS blobs by sha256, others by git sha1.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".model", ".spm")
WORDS = "the a cat dog sat on mat ran to house red blue big small one two three four five six seven eight".split()

# Head -> the Auto classes its checkpoint must name in config.auto_map.
EXPECTED_AUTO_MAP = {
    # An encoder-decoder base checkpoint also loads into the seq2seq head (its projection is tied), as BART's does.
    VanillaTransformerModel: {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"},
    VanillaTransformerForConditionalGeneration: {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"},
    VanillaTransformerForCausalLM: {  # a causal LM checkpoint also starts a GPT-style classifier
        "AutoConfig",
        "AutoModel",
        "AutoModelForCausalLM",
        "AutoModelForSequenceClassification",
        "AutoModelForTokenClassification",
    },
    **dict.fromkeys(
        [
            VanillaTransformerForMaskedLM,
            VanillaTransformerForSequenceClassification,
            VanillaTransformerForTokenClassification,
            VanillaTransformerForQuestionAnswering,
        ],
        {  # an encoder checkpoint serves every encoder-only head, and AutoModel gives its encoder
            "AutoConfig",
            "AutoModel",
            "AutoModelForMaskedLM",
            "AutoModelForSequenceClassification",
            "AutoModelForTokenClassification",
            "AutoModelForQuestionAnswering",
        },
    ),
}


class FakeHub:
    """The Hub server as far as pushing goes: repositories whose files are the union of their commits."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.commits: list[tuple[str, str, dict[str, bytes]]] = []  # (repo_id, oid, files added)

    def create_repo(self, api, repo_id, **kwargs):
        self.repos.setdefault(repo_id, {})
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(self, api, repo_id, operations, commit_message, **kwargs):
        added = {}
        for operation in operations:
            with operation.as_file() as file:  # read now: push_to_hub deletes its temporary folder afterwards
                added[operation.path_in_repo] = file.read()
        oid = hashlib.sha1(repr(sorted(added.items())).encode()).hexdigest()
        self.repos[repo_id].update(added)
        self.commits.append((repo_id, oid, added))
        return CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/{oid}",
            commit_message=commit_message,
            commit_description="",
            oid=oid,
        )

    def load_card(self, repo_id, **kwargs):
        if "README.md" not in self.repos.get(repo_id, {}):
            raise EntryNotFoundError(f"{repo_id} has no README.md")
        return ModelCard(self.repos[repo_id]["README.md"].decode())


@pytest.fixture
def hub(monkeypatch) -> FakeHub:
    fake = FakeHub()
    monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: fake.create_repo(api, repo_id, **kw))
    monkeypatch.setattr(HfApi, "create_commit", lambda api, **kw: fake.create_commit(api, **kw))
    monkeypatch.setattr(ModelCard, "load", classmethod(lambda cls, repo_id, **kw: fake.load_card(repo_id, **kw)))
    return fake


def word_tokenizer(vocab_size: int, seq2seq: bool) -> PreTrainedTokenizerFast:
    """A WordLevel tokenizer whose ids match tiny_config(): <pad>=0, <s>=1, </s>=2, <unk>=3, then words."""
    vocab = {token: i for i, token in enumerate(["<pad>", "<s>", "</s>", "<unk>", *WORDS])}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if seq2seq:  # the source ends with </s>, as in fairseq/Marian
        backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="right" if seq2seq else "left",  # decoder-only batches are left-padded for generation
    )


def relative_imports(source: str) -> set[str]:
    return set(re.findall(r"^\s*from\s+\.(\w+)\s+import", source, flags=re.MULTILINE))


@pytest.mark.parametrize("head", list(EXPECTED_AUTO_MAP), ids=lambda head: head.__name__)
def test_push_to_hub_sends_weights_code_and_configs(hub, head):
    torch.manual_seed(0)
    model = head(tiny_config())
    model.push_to_hub("org/pushed")
    ((repo_id, _, files),) = hub.commits
    assert repo_id == "org/pushed"

    config = json.loads(files["config.json"])
    assert set(config["auto_map"]) == EXPECTED_AUTO_MAP[head]
    for auto_class, reference in config["auto_map"].items():
        module, class_name = reference.split(".")
        assert f"class {class_name}(" in files[f"{module}.py"].decode(), auto_class

    code = {name: data for name, data in files.items() if name.endswith(".py")}
    for name, data in code.items():  # the flat copy is the package's source, and it is self-contained
        assert data == (PACKAGE_DIR / name).read_bytes()
        assert {f"{module}.py" for module in relative_imports(data.decode())} <= set(code), name
    assert "__init__.py" not in code

    state = load(files["model.safetensors"])
    assert not any(name.endswith(".bin") for name in files)
    reference = model.state_dict()
    assert set(state) <= set(reference)
    for name, tensor in state.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0)
    tied = set(model.get_expanded_tied_weights_keys(all_submodels=True))
    assert set(reference) - set(state) <= tied  # only tied copies are left out

    assert ("generation_config.json" in files) == model.can_generate()
    assert ModelCard(files["README.md"].decode()).data.library_name == "transformers"


@pytest.mark.parametrize("seq2seq", [True, False], ids=["seq2seq", "causal"])
def test_push_repository_is_one_complete_commit(hub, seq2seq):
    torch.manual_seed(0)
    model = (VanillaTransformerForConditionalGeneration if seq2seq else VanillaTransformerForCausalLM)(tiny_config())
    tokenizer = word_tokenizer(model.config.vocab_size, seq2seq)
    card = build_model_card(model, repo_id="org/complete", results={"eval_bleu": 1.5}, dataset="org/data")
    commit = push_repository(model, "org/complete", tokenizer=tokenizer, card=card)

    ((_, oid, files),) = hub.commits
    assert commit.oid == oid
    model_files = {"config.json", "model.safetensors", "generation_config.json", "README.md"}
    tokenizer_files = {"tokenizer.json", "tokenizer_config.json"}
    code_files = {"configuration_vanilla_transformer.py", "modeling_vanilla_transformer.py"}
    assert model_files | tokenizer_files | code_files <= set(files)
    assert files["README.md"].decode() == str(card)
    pushed_card = ModelCard(files["README.md"].decode())
    assert pushed_card.data.eval_results[0].metric_value == 1.5
    # transformers 5 has no pipeline for encoder-decoder generation: the card names no task rather than a dead one.
    assert pushed_card.data.pipeline_tag == (None if seq2seq else "text-generation")


@pytest.mark.parametrize(
    "head, pipeline_tag, stack, auto_class",
    [
        (VanillaTransformerForConditionalGeneration, None, "encoder-decoder", "AutoModelForSeq2SeqLM"),
        (VanillaTransformerForCausalLM, "text-generation", "decoder-only", "AutoModelForCausalLM"),
        (
            VanillaTransformerForSequenceClassification,
            "text-classification",
            "encoder-only",
            "AutoModelForSequenceClassification",
        ),
    ],
)
def test_card_metadata_validates_and_describes_the_variant(tmp_path, head, pipeline_tag, stack, auto_class):
    config = tiny_config(norm_type="rmsnorm", norm_position="pre", ffn_type="swiglu", position_embedding_type="rope")
    model = head(config)
    plot = tmp_path / "loss.png"
    plot.write_bytes(b"\x89PNG")
    args = {"learning_rate": 7e-4, "warmup_steps": 4000, "label_smoothing_factor": 0.1}
    card = write_model_card(
        model,
        tmp_path / "out",
        results={"eval_bleu": 21.0, "eval_loss": 2.5},
        dataset="org/data",
        training_args=args,
        plot_path=plot,
        repo_id="org/variant",
        language="en",
    )
    assert (tmp_path / "out" / "loss.png").read_bytes() == plot.read_bytes()
    assert (tmp_path / "out" / "README.md").read_text() == str(card)

    # Parse the written file as the Hub would; ModelCardData validates model-index while parsing.
    loaded = ModelCard.load(tmp_path / "out" / "README.md", ignore_metadata_errors=False)
    data = loaded.data
    assert (data.library_name, data.pipeline_tag, data.license) == ("transformers", pipeline_tag, "apache-2.0")
    assert {"vanilla-transformer", stack, "rmsnorm", "pre-norm", "ffn-swiglu", "positions-rope"} <= set(data.tags)
    assert data.datasets == ["org/data"] and data.metrics == ["bleu", "loss"]
    assert data.model_name == "variant"
    task = pipeline_tag or "text2text-generation"  # the Hub task of model-index, where no pipeline tag applies
    assert [(r.metric_type, r.metric_value, r.task_type) for r in data.eval_results] == [
        ("bleu", 21.0, task),
        ("loss", 2.5, task),
    ]
    text = loaded.text
    for row in ["| Norm position | `pre` |", "| Feed-forward | `swiglu`", "| Positions | `rope`, theta = 10000 |"]:
        assert row in text
    assert "| `learning_rate` | 0.0007 |" in text and "![Training curves](loss.png)" in text
    assert f'{auto_class}.from_pretrained("org/variant", trust_remote_code=True)' in text
    assert f"{model.num_parameters():,} parameters" in text


def test_card_rejects_what_it_cannot_describe():
    with pytest.raises(ValueError, match="dataset"):
        build_model_card(tiny_config(), results={"bleu": 3.0})
    with pytest.raises(ValueError, match="not a number"):
        build_model_card(tiny_config(), results={"bleu": "high"}, dataset="org/data")
    with pytest.raises(ValueError, match="architectures"):
        build_model_card(tiny_config(is_encoder_decoder=False))
    with pytest.raises(ValueError, match="pipeline_tag"):  # transformers 5 removed the translation pipeline
        build_model_card(tiny_config(), pipeline_tag="translation")
    card = build_model_card(tiny_config(num_experts=4, norm_position="post"))  # a bare config: the paper's seq2seq
    assert card.data.pipeline_tag is None and "mixture-of-experts" in card.data.tags
    assert "warm-up" in card.text and "4 experts, top-2" in card.text


@pytest.mark.parametrize("field, value", [("position_embedding_type", "alibi"), ("classifier_pooling", "max")])
def test_card_names_a_variant_it_has_no_text_for(field, value):
    """A value the config gains later (written past the config's own check here) is named, not described as another
    one or left out."""
    config = tiny_config(architectures=["VanillaTransformerForImageClassification"], image_size=8, patch_size=4)
    vars(config)[field] = value
    with pytest.raises(ValueError, match=re.escape(f"cannot describe {field}={value!r}")):
        build_model_card(config)


# ---- offline pull -----------------------------------------------------------------------------------------------


def write_hub_cache(hub_cache: Path, repo_id: str, files: dict[str, bytes], commit: str) -> None:
    """Store `files` as huggingface_hub's file_download.py does after a download: content in
    `models--org--name/blobs/<etag>`, `snapshots/<commit>/<path>` a relative symlink to its blob, `refs/main` the
    commit hash."""
    storage = hub_cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    for path, data in files.items():
        etag = hashlib.sha256(data).hexdigest() if path.endswith(LFS_SUFFIXES) else git_hash(data)
        blob = storage / "blobs" / etag
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        pointer = storage / "snapshots" / commit / path
        pointer.parent.mkdir(parents=True, exist_ok=True)
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)


PULL_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_vanilla_transformer"] = None  # any `import hf_vanilla_transformer` now raises ImportError
    import transformers

    repo_id, head_class = sys.argv[1], sys.argv[2]
    texts, generate_kwargs = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    try:
        import hf_vanilla_transformer
        sys.exit("hf_vanilla_transformer is importable")
    except ImportError:
        pass
    tokenizer = transformers.AutoTokenizer.from_pretrained(repo_id, trust_remote_code=True)
    model = getattr(transformers, head_class).from_pretrained(repo_id, trust_remote_code=True)
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    generated = model.generate(**inputs, **generate_kwargs)
    if model.config.is_encoder_decoder:
        logits = model(**inputs, decoder_input_ids=generated).logits
    else:
        logits = model(generated).logits
    loading = {}
    for auto_class in model.config.auto_map:
        if auto_class != "AutoConfig":
            loaded, info = getattr(transformers, auto_class).from_pretrained(
                repo_id, trust_remote_code=True, output_loading_info=True
            )
            missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
            loading[auto_class] = [type(loaded).__module__, missing, unexpected]
    print(json.dumps({
        "module": type(model).__module__,
        "generated": generated.tolist(),
        "logits": logits.tolist(),
        "text": tokenizer.batch_decode(generated, skip_special_tokens=True),
        "loading": loading,
    }))
    """
)


@pytest.mark.parametrize("seq2seq", [True, False], ids=["seq2seq", "causal"])
def test_offline_pull_from_hub_cache_without_the_package(hub, tmp_path, seq2seq):
    torch.manual_seed(0)
    head = VanillaTransformerForConditionalGeneration if seq2seq else VanillaTransformerForCausalLM
    model = head(tiny_config()).eval()
    tokenizer = word_tokenizer(model.config.vocab_size, seq2seq)
    push_repository(model, "org/tiny", tokenizer=tokenizer)
    ((_, commit, files),) = hub.commits

    hub_cache = tmp_path / "hf_home" / "hub"
    write_hub_cache(hub_cache, "org/tiny", files, commit)
    (cached_repo,) = scan_cache_dir(hub_cache).repos  # huggingface_hub's own scanner accepts the layout
    assert cached_repo.repo_id == "org/tiny" and {rev.commit_hash for rev in cached_repo.revisions} == {commit}
    assert cached_repo.nb_files == len(files)

    texts = ["the cat sat on the mat", "a big dog ran"]
    generate_kwargs = {"num_beams": 4, "max_new_tokens": 8} if seq2seq else {"do_sample": False, "max_new_tokens": 8}
    inputs = tokenizer(texts, return_tensors="pt", padding=True)
    expected = model.generate(**inputs, **generate_kwargs)
    with torch.no_grad():
        logits = model(**inputs, decoder_input_ids=expected).logits if seq2seq else model(expected).logits

    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.pop("PYTHONPATH", None)
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    head_class = "AutoModelForSeq2SeqLM" if seq2seq else "AutoModelForCausalLM"
    result = subprocess.run(
        [sys.executable, "-c", PULL_SCRIPT, "org/tiny", head_class, json.dumps(texts), json.dumps(generate_kwargs)],
        cwd=tmp_path,  # not the repository root, so the package is not on sys.path through the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    pulled = json.loads(result.stdout.strip().splitlines()[-1])

    assert pulled["module"].startswith("transformers_modules.")
    assert pulled["generated"] == expected.tolist()
    torch.testing.assert_close(torch.tensor(pulled["logits"]), logits, rtol=0, atol=1e-6)
    assert pulled["text"] == tokenizer.batch_decode(expected, skip_special_tokens=True)
    assert set(pulled["loading"]) == EXPECTED_AUTO_MAP[head] - {"AutoConfig"}
    for auto_class, (module, missing, unexpected) in pulled["loading"].items():
        # Every weight of the checkpoint loads; a classifier started from it adds only its new output layer.
        new_layer = ["classifier.bias", "classifier.weight"] if "Classification" in auto_class else []
        assert module.startswith("transformers_modules.") and missing == new_layer and unexpected == [], auto_class


@pytest.mark.parametrize(
    "head, base",
    [
        (VanillaTransformerForConditionalGeneration, "VanillaTransformerModel"),
        (VanillaTransformerForCausalLM, "VanillaTransformerDecoder"),
        (VanillaTransformerForSequenceClassification, "VanillaTransformerEncoder"),
    ],
    ids=["seq2seq", "causal", "classifier"],
)
def test_auto_model_loads_the_trained_base_model_of_every_head(tmp_path, head, base):
    """AutoModel gives the base model a head was trained with, every weight loaded (as LlamaModel from a Llama
    checkpoint); a single-stack checkpoint's base is its stack, saved under the `model.` prefix."""
    torch.manual_seed(0)
    model = head(tiny_config(num_labels=3)).eval()
    model.save_pretrained(tmp_path)
    loaded, info = AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert type(loaded).__name__ == base
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    expected = dict(model.model.named_parameters())
    assert dict(loaded.named_parameters()).keys() == expected.keys()
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, expected[name]), name
    assert type(AutoModel.from_config(model.config)).__name__ == base
