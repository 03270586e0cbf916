"""The BERT- and GPT-style task heads: masked LM, sequence and token classification, extractive QA.

Checks: the masked-LM loss against cross-entropy over the masked positions, training from
`DataCollatorForLanguageModeling`; classifiers built from masked-LM and causal-LM checkpoints reuse every transformer
weight bit for bit and report only their new head as newly initialised; the causal classifier pools the last real
token under left and right padding and never reads tokens after it; exact save/load; the remote-code path in a fresh
process; LoRA on the attention projections; the fill-mask, token- and text-classification pipelines.

Run: python -m pytest -q tests/test_task_heads.py
"""

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    pipeline,
)
from transformers.utils import logging as transformers_logging

from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForMaskedLM,
    VanillaTransformerForQuestionAnswering,
    VanillaTransformerForSequenceClassification,
    VanillaTransformerForTokenClassification,
)
from hf_vanilla_transformer.modeling_vanilla_transformer import VanillaTransformerDecoder, VanillaTransformerEncoder

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[MASK]", "[UNK]", "[SEP]"]  # ids 0, 1, 2 = the config's pad, bos, eos
WORDS = "the a cat dog sat on mat ran to house red blue big small one two who what where".split()
TASK_HEADS = [
    (VanillaTransformerForSequenceClassification, AutoModelForSequenceClassification),
    (VanillaTransformerForTokenClassification, AutoModelForTokenClassification),
    (VanillaTransformerForQuestionAnswering, AutoModelForQuestionAnswering),
]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer built locally, BERT's layout: "[BOS] a [SEP] b [EOS]" for pairs."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]",
        pair="[BOS] $A [SEP] $B:1 [EOS]:1",
        special_tokens=[(token, vocab[token]) for token in ("[BOS]", "[EOS]", "[SEP]")],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        mask_token="[MASK]",
        unk_token="[UNK]",
        sep_token="[SEP]",
        model_input_names=["input_ids", "attention_mask"],  # the model has no segment embeddings
    )


def vocab_config(**overrides):
    return tiny_config(vocab_size=len(SPECIALS) + len(WORDS), **overrides)


def random_rows(batch: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(len(SPECIALS), len(SPECIALS) + len(WORDS), (batch, length), generator=generator)


@pytest.fixture
def loading_log():
    """What transformers logs while loading (its loggers do not propagate to pytest's caplog)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    root = transformers_logging.get_logger("transformers")
    root.addHandler(handler)
    yield records
    root.removeHandler(handler)


# ---- masked LM ----------------------------------------------------------------------------------------------------


def test_masked_lm_loss_is_cross_entropy_over_the_masked_positions():
    torch.manual_seed(0)
    model = AutoModelForMaskedLM.from_config(vocab_config(tie_word_embeddings=True)).eval()
    assert type(model) is VanillaTransformerForMaskedLM and model.lm_head.weight is model.model.embed_tokens.weight
    assert isinstance(model.model, VanillaTransformerEncoder) and not model.config.is_decoder
    input_ids = random_rows(3, 8, seed=1)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 5:] = 0
    labels = torch.full_like(input_ids, -100)
    labels[0, 2], labels[1, 7], labels[2, 0] = 7, 9, 11
    out = model(input_ids, attention_mask=attention_mask, labels=labels)
    expected = torch.nn.functional.cross_entropy(out.logits[labels != -100], labels[labels != -100])
    torch.testing.assert_close(out.loss, expected)

    # Bidirectional: the first position's prediction reads the tokens after it.
    changed = input_ids.clone()
    changed[0, -1] = (changed[0, -1] - len(SPECIALS) + 1) % len(WORDS) + len(SPECIALS)  # another word
    assert not torch.allclose(model(changed[:1]).logits[0, 0], model(input_ids[:1]).logits[0, 0])


def test_masked_lm_trains_from_the_language_modeling_collator():
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    # Xavier: at d_model 32 the default N(0, 0.02) starts ~9x smaller, too slow for 15 steps at this learning rate.
    model = VanillaTransformerForMaskedLM(vocab_config(initialization="xavier"))
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=0)
    texts = ["the cat sat on the mat", "a big dog ran to the red house", "who sat on the blue mat"] * 4
    batch = collator([tokenizer(text) for text in texts])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ---- classifiers from pretrained checkpoints ----------------------------------------------------------------------


def pretrained_checkpoint(tmp_path, route: str):
    """A saved masked LM (BERT route) or causal LM (GPT route) with non-initial weights."""
    torch.manual_seed(0)
    head = VanillaTransformerForMaskedLM if route == "bert" else VanillaTransformerForCausalLM
    model = head(vocab_config(norm_position="pre", ffn_type="swiglu", position_embedding_type="rope"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))  # so no weight equals its initial value by chance
    model.save_pretrained(tmp_path / route)
    return model, tmp_path / route


@pytest.mark.parametrize("route", ["bert", "gpt"])
@pytest.mark.parametrize("head_class, auto_class", TASK_HEADS[:2], ids=["sequence", "token"])
def test_classifier_from_a_pretrained_lm_reuses_every_transformer_weight(
    tmp_path, loading_log, route, head_class, auto_class
):
    pretrained, path = pretrained_checkpoint(tmp_path, route)
    classifier, info = auto_class.from_pretrained(path, num_labels=3, output_loading_info=True)

    assert type(classifier) is head_class
    stack = VanillaTransformerDecoder if route == "gpt" else VanillaTransformerEncoder
    assert type(classifier.model) is stack and classifier.config.is_decoder == (route == "gpt")
    assert sorted(info["missing_keys"]) == ["classifier.bias", "classifier.weight"]
    assert info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    reported = "\n".join(loading_log)
    assert "MISSING" in reported and "classifier" in reported and "UNEXPECTED" not in reported
    for name in ("model.layers", "model.embed_tokens", "model.layer_norm", "lm_head"):
        assert name not in reported  # the loading table names only what it initialised anew

    reused = classifier.state_dict()
    pretrained_weights = {k: v for k, v in pretrained.state_dict().items() if not k.startswith("lm_head")}
    assert set(pretrained_weights) == {k for k in reused if not k.startswith("classifier")}
    for name, weight in pretrained_weights.items():
        assert torch.equal(reused[name], weight), name


def test_causal_classifier_pools_the_last_real_token_and_reads_nothing_after_it(tmp_path):
    _, path = pretrained_checkpoint(tmp_path, "gpt")
    classifier = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3).eval()
    rows = random_rows(3, 7, seed=2)
    lengths = [7, 4, 2]
    alone = torch.cat([classifier(rows[i : i + 1, :n]).logits for i, n in enumerate(lengths)])

    # Appending tokens after a row changes its prediction only through the pooled position, which moves: the
    # prefix's own last state is unchanged (causal), as the per-token head shows.
    tagger = AutoModelForTokenClassification.from_pretrained(path, num_labels=2).eval()
    for i, n in enumerate(lengths):
        torch.testing.assert_close(tagger(rows[i : i + 1]).logits[0, :n], tagger(rows[i : i + 1, :n]).logits[0])

    right = torch.zeros_like(rows)
    left = torch.zeros_like(rows)
    for i, n in enumerate(lengths):
        right[i, :n] = rows[i, :n]
        left[i, 7 - n :] = rows[i, :n]
    for padded in (right, left):
        mask = (padded != 0).long()
        torch.testing.assert_close(classifier(padded, attention_mask=mask).logits, alone, rtol=1e-5, atol=1e-5)
        # Tokens appended behind the real ones in the padding do not change the logits: masked out and after.
        noisy = torch.where(mask.bool(), padded, random_rows(3, 7, seed=3))
        torch.testing.assert_close(classifier(noisy, attention_mask=mask).logits, alone, rtol=1e-5, atol=1e-5)
    # Without an attention mask, the pad id marks the padding (Llama's convention).
    torch.testing.assert_close(classifier(right).logits, alone, rtol=1e-5, atol=1e-5)


ENCODER_HEADS = [VanillaTransformerForMaskedLM] + [head for head, _ in TASK_HEADS]
CAUSAL_HEADS = [VanillaTransformerForSequenceClassification, VanillaTransformerForTokenClassification]


@pytest.mark.parametrize(
    "head_class, is_decoder",
    [(head, False) for head in ENCODER_HEADS] + [(head, True) for head in CAUSAL_HEADS],
    ids=lambda value: value.__name__[len("VanillaTransformerFor") :] if isinstance(value, type) else str(value),
)
def test_experts_add_their_router_losses_to_every_task_loss(head_class, is_decoder):
    torch.manual_seed(0)
    config = vocab_config(num_experts=4, num_labels=3, is_encoder_decoder=False, is_decoder=is_decoder)
    model = head_class(config).eval()
    input_ids = random_rows(2, 6, seed=8)
    targets = {
        "VanillaTransformerForMaskedLM": {"labels": input_ids},
        "VanillaTransformerForSequenceClassification": {"labels": torch.tensor([0, 2])},
        "VanillaTransformerForTokenClassification": {"labels": input_ids % 3},
        "VanillaTransformerForQuestionAnswering": {
            "start_positions": torch.tensor([1, 2]),
            "end_positions": torch.tensor([3, 4]),
        },
    }[head_class.__name__]
    with_router = model(input_ids, **targets).loss
    model.config.router_aux_loss_coef = model.config.router_z_loss_coef = 0.0
    without_router = model(input_ids, **targets).loss
    assert with_router > without_router  # balancing (>= 1 at its optimum) and z-losses are positive
    with_router.backward()
    routers = [module.weight for module in model.modules() if type(module).__name__ == "VanillaTransformerRouter"]
    assert routers and all(weight.grad is not None and weight.grad.abs().sum() > 0 for weight in routers)


def router_gradients(model, input_ids: torch.Tensor, targets: dict, coefficient: float) -> torch.Tensor:
    """The gradient of the head's loss on its router weights, with both router-loss coefficients set to
    `coefficient`."""
    model.zero_grad()
    model.config.router_aux_loss_coef = model.config.router_z_loss_coef = coefficient
    model(input_ids, **targets).loss.backward()
    routers = [module.weight for module in model.modules() if type(module).__name__ == "VanillaTransformerRouter"]
    return torch.cat([weight.grad.flatten() for weight in routers])


@pytest.mark.parametrize(
    "head_class, is_decoder",
    [(head, False) for head in ENCODER_HEADS] + [(head, True) for head in CAUSAL_HEADS],
    ids=lambda value: value.__name__[len("VanillaTransformerFor") :] if isinstance(value, type) else str(value),
)
def test_router_losses_reach_the_gradient_of_every_task_loss(head_class, is_decoder):
    """The loss's gradient is that of the task loss plus coefficient * that of the router losses: the router term's
    share of the router weights' gradient is not 0 and grows linearly with its coefficient."""
    torch.manual_seed(0)
    config = vocab_config(num_experts=4, num_labels=3, is_encoder_decoder=False, is_decoder=is_decoder)
    model = head_class(config).eval()  # no dropout: every forward computes the same task loss
    input_ids = random_rows(2, 6, seed=8)
    targets = {"start_positions": torch.tensor([1, 2]), "end_positions": torch.tensor([3, 4])}
    if head_class is not VanillaTransformerForQuestionAnswering:
        labels = torch.tensor([0, 2]) if head_class is VanillaTransformerForSequenceClassification else input_ids % 3
        targets = {"labels": input_ids if head_class is VanillaTransformerForMaskedLM else labels}
    task_only = router_gradients(model, input_ids, targets, 0.0)
    router_share = router_gradients(model, input_ids, targets, 0.1) - task_only
    assert router_share.abs().max() > 1e-6
    torch.testing.assert_close(router_gradients(model, input_ids, targets, 0.2) - task_only, 2 * router_share)


# ---- save/load, remote code, LoRA ---------------------------------------------------------------------------------


REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_vanilla_transformer"] = None  # the editable install must not serve the classes
    import torch, transformers
    try:
        import hf_vanilla_transformer
        sys.exit("hf_vanilla_transformer is importable")
    except ImportError:
        pass
    folder, input_ids = sys.argv[1], torch.tensor(json.loads(sys.argv[2]))
    result = {}
    for auto_class in ["AutoModelForMaskedLM", "AutoModelForSequenceClassification",
                       "AutoModelForTokenClassification", "AutoModelForQuestionAnswering"]:
        model, info = getattr(transformers, auto_class).from_pretrained(
            folder, trust_remote_code=True, output_loading_info=True)
        output = model.eval()(input_ids)
        first = output.logits if hasattr(output, "logits") else output.start_logits
        result[auto_class] = [type(model).__module__, sorted(info["missing_keys"]), first.tolist()]
    print(json.dumps(result))
    """
)


def test_encoder_checkpoint_loads_every_encoder_head_through_remote_code(tmp_path):
    torch.manual_seed(0)
    model = VanillaTransformerForSequenceClassification(vocab_config(num_labels=2)).eval()
    model.save_pretrained(tmp_path / "classifier")
    input_ids = random_rows(2, 6, seed=4)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.pop("PYTHONPATH", None)
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path / "classifier"), json.dumps(input_ids.tolist())],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(module.startswith("transformers_modules.") for module, _, _ in loaded.values())
    module, missing, logits = loaded["AutoModelForSequenceClassification"]
    assert missing == []
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(logits), model(input_ids).logits, rtol=0, atol=1e-6)
    assert loaded["AutoModelForMaskedLM"][1] == []  # the projection is tied to the saved embedding
    assert sorted(loaded["AutoModelForQuestionAnswering"][1]) == ["qa_outputs.bias", "qa_outputs.weight"]


@pytest.mark.parametrize(
    "head_class, overrides",
    [
        (VanillaTransformerForMaskedLM, {}),
        (VanillaTransformerForTokenClassification, {"num_labels": 5}),
        (VanillaTransformerForQuestionAnswering, {}),
        (VanillaTransformerForSequenceClassification, {"is_encoder_decoder": False, "is_decoder": True}),
    ],
    ids=["masked-lm", "token", "qa", "causal-sequence"],
)
def test_save_load_is_exact(tmp_path, head_class, overrides):
    torch.manual_seed(0)
    model = head_class(vocab_config(**overrides)).eval()
    model.save_pretrained(tmp_path)
    reloaded = head_class.from_pretrained(tmp_path).eval()
    input_ids = random_rows(2, 6, seed=5)
    for name, weight in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], weight), name
    with torch.no_grad():
        for got, want in zip(reloaded(input_ids).to_tuple(), model(input_ids).to_tuple()):
            assert torch.equal(got, want)


@pytest.mark.parametrize("head_class", [VanillaTransformerForMaskedLM] + [head for head, _ in TASK_HEADS])
def test_lora_trains_only_adapters_and_the_task_layer(head_class):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    model = head_class(vocab_config(num_labels=3))
    task_layers = {"VanillaTransformerForMaskedLM": [], "VanillaTransformerForQuestionAnswering": ["qa_outputs"]}
    modules_to_save = task_layers.get(head_class.__name__, ["classifier"])
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, target_modules=["q_proj", "k_proj", "v_proj", "out_proj"], modules_to_save=modules_to_save
        ),
    )
    trainable = {name for name, parameter in lora.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name or "modules_to_save" in name for name in trainable)
    assert sum("lora_A" in name for name in trainable) == 4 * model.config.encoder_layers
    output = lora(input_ids=random_rows(2, 6, seed=6))
    first = output.logits if hasattr(output, "logits") else output.start_logits
    first.sum().backward()
    assert all(parameter.grad is not None for name, parameter in lora.named_parameters() if name in trainable)


# ---- pipelines ----------------------------------------------------------------------------------------------------


def test_fill_mask_pipeline_ranks_the_masked_word():
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    model = VanillaTransformerForMaskedLM(vocab_config()).eval()
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer)
    text = "the cat sat on the [MASK]"
    predictions = fill(text, top_k=len(tokenizer))
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0, inputs.input_ids[0].tolist().index(tokenizer.mask_token_id)]
    ranked = logits.softmax(-1).sort(descending=True)
    assert [p["token"] for p in predictions] == ranked.indices.tolist()
    torch.testing.assert_close(torch.tensor([p["score"] for p in predictions]), ranked.values, rtol=1e-5, atol=1e-6)
    for prediction in predictions:
        if prediction["token_str"] in WORDS:  # special tokens are dropped from the decoded sequence
            assert prediction["sequence"] == text.replace("[MASK]", prediction["token_str"])


def test_question_answering_loss_follows_transformers_convention():
    """transformers 5.23 removed the question-answering pipeline; the head keeps BERT's outputs and loss: the mean of
    the start and end cross-entropies, with positions outside the sequence ignored."""
    torch.manual_seed(0)
    model = VanillaTransformerForQuestionAnswering(vocab_config()).eval()
    input_ids = random_rows(3, 6, seed=7)
    start, end = torch.tensor([1, 2, 40]), torch.tensor([3, 2, 41])  # the third answer is outside: ignored
    out = model(input_ids, start_positions=start, end_positions=end)
    cross_entropy = torch.nn.functional.cross_entropy
    expected = (cross_entropy(out.start_logits[:2], start[:2]) + cross_entropy(out.end_logits[:2], end[:2])) / 2
    torch.testing.assert_close(out.loss, expected)
    assert out.start_logits.shape == out.end_logits.shape == input_ids.shape


@pytest.mark.parametrize("route", ["bert", "gpt"])
def test_text_and_token_classification_pipelines(route):
    torch.manual_seed(0)
    tokenizer = word_tokenizer()
    overrides = {"is_encoder_decoder": False, "is_decoder": route == "gpt"}
    labels = {"id2label": {0: "NEG", 1: "POS"}, "label2id": {"NEG": 0, "POS": 1}}
    classify = pipeline(
        "text-classification",
        model=VanillaTransformerForSequenceClassification(vocab_config(**overrides, **labels)).eval(),
        tokenizer=tokenizer,
    )
    tagger_model = VanillaTransformerForTokenClassification(vocab_config(**overrides, **labels)).eval()
    tag = pipeline("token-classification", model=tagger_model, tokenizer=tokenizer)
    texts = ["the cat sat on the mat", "a dog ran"]
    (first, second) = classify(texts)
    assert {first["label"], second["label"]} <= {"NEG", "POS"} and 0.5 <= first["score"] <= 1
    tags = tag(texts[1])
    assert [t["word"] for t in tags] == texts[1].split()
    with torch.no_grad():
        logits = tagger_model(**tokenizer(texts[1], return_tensors="pt")).logits[0, 1:-1]
    assert [t["entity"] for t in tags] == [labels["id2label"][int(i)] for i in logits.argmax(-1)]
