"""Re-heading a classifier checkpoint for a task with another label set, the everyday transformers workflow:
`from_pretrained(ckpt, num_labels=k, ignore_mismatched_sizes=True)` gives a k-label model whose stack is the
checkpoint's and whose classifier is new, with fresh label maps, as for BERT."""

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from hf_vanilla_transformer import (
    VanillaTransformerConfig,
    VanillaTransformerForSequenceClassification,
    VanillaTransformerForTokenClassification,
)

TINY = dict(
    vocab_size=40,
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
    is_encoder_decoder=False,
)


@pytest.mark.parametrize(
    "head, auto_class",
    [
        (VanillaTransformerForSequenceClassification, AutoModelForSequenceClassification),
        (VanillaTransformerForTokenClassification, AutoModelForTokenClassification),
    ],
    ids=["sequence", "token"],
)
@pytest.mark.parametrize("is_decoder", [False, True], ids=["bert-style", "gpt-style"])
def test_a_classifier_checkpoint_re_heads_to_another_label_count(tmp_path, head, auto_class, is_decoder):
    torch.manual_seed(0)
    labels = {0: "negative", 1: "neutral", 2: "positive"}
    checkpoint = head(VanillaTransformerConfig(**TINY, is_decoder=is_decoder, id2label=labels))
    checkpoint.save_pretrained(tmp_path)

    reheaded = auto_class.from_pretrained(tmp_path, num_labels=5, ignore_mismatched_sizes=True)

    assert type(reheaded) is head and reheaded.config.num_labels == 5
    assert reheaded.config.id2label == {i: f"LABEL_{i}" for i in range(5)}
    assert reheaded.config.label2id == {f"LABEL_{i}": i for i in range(5)}
    assert reheaded.classifier.weight.shape == (5, TINY["d_model"])
    kept = checkpoint.model.state_dict()
    assert all(torch.equal(value, kept[name]) for name, value in reheaded.model.state_dict().items())
    logits = reheaded(input_ids=torch.randint(3, 40, (2, 6))).logits
    assert logits.shape[-1] == 5
    # The same number of labels keeps the checkpoint's classifier and its names.
    same = auto_class.from_pretrained(tmp_path)
    assert same.config.id2label == labels and torch.equal(same.classifier.weight, checkpoint.classifier.weight)
