"""One declaration per model class: the Auto class that loads it, the checkpoints it can load, and what its model card
says. Registration (`__init__.py`), every saved checkpoint's `auto_map` and the model card derive from `HEADS`, so a
new head is its class and one entry here.
"""

from dataclasses import dataclass
from typing import Literal

# The kinds of checkpoint a head can load: the stacks its config runs, and an image encoder (its encoder embeds
# patches, where the text encoder has a token embedding: no text head can load it, nor it a text checkpoint).
CheckpointKind = Literal["encoder-decoder", "decoder-only", "encoder-only", "image-encoder"]


@dataclass(frozen=True)
class HeadDeclaration:
    """module            the sibling module that defines the class
    auto_class        the transformers Auto class that loads it
    checkpoint_kinds  the kinds of checkpoint whose weights it can load: a head on one stack takes the stack of a
                      decoder-only or encoder-only checkpoint (a GPT-style classifier starts from a causal LM), never
                      an encoder-decoder's
    pipeline_tag      the Hub task of its model card: one transformers 5 has a pipeline for, or None
    summary           what it is, in the model card
    usage             the lines after loading that show what it is for, in the model card
    preprocessor      the Auto class of its preprocessor, saved beside it, and its variable in the usage lines"""

    module: str
    auto_class: str
    checkpoint_kinds: tuple[CheckpointKind, ...]
    pipeline_tag: str | None
    summary: str
    usage: str
    preprocessor: tuple[str, str] = ("AutoTokenizer", "tokenizer")


SINGLE_STACK: tuple[CheckpointKind, ...] = ("decoder-only", "encoder-only")

HEADS: dict[str, HeadDeclaration] = {
    "VanillaTransformerModel": HeadDeclaration(
        "modeling_vanilla_transformer",
        "AutoModel",
        ("encoder-decoder", *SINGLE_STACK),  # gives the stack a single-stack checkpoint was trained with
        "feature-extraction",
        "the Transformer without a head",
        'inputs = tokenizer(["Some text."], return_tensors="pt")\n'
        "hidden_states = model(**inputs, decoder_input_ids=inputs.input_ids).last_hidden_state",
    ),
    "VanillaTransformerForConditionalGeneration": HeadDeclaration(
        "language_modeling_vanilla_transformer",
        "AutoModelForSeq2SeqLM",
        ("encoder-decoder",),
        None,  # transformers 5 has no pipeline for encoder-decoder generation (translation, text2text were removed)
        "an encoder-decoder with a language-model head (the paper's translation model)",
        'inputs = tokenizer(["Your source sentence."], return_tensors="pt")\n'
        "outputs = model.generate(**inputs, num_beams=4, max_new_tokens=64)\n"
        "print(tokenizer.batch_decode(outputs, skip_special_tokens=True))",
    ),
    "VanillaTransformerForCausalLM": HeadDeclaration(
        "language_modeling_vanilla_transformer",
        "AutoModelForCausalLM",
        ("decoder-only",),
        "text-generation",
        "a decoder-only language model (the decoder stack without cross-attention)",
        'inputs = tokenizer(["Once upon a time"], return_tensors="pt")\n'
        "outputs = model.generate(**inputs, do_sample=True, max_new_tokens=64)\n"
        "print(tokenizer.batch_decode(outputs, skip_special_tokens=True))",
    ),
    "VanillaTransformerForMaskedLM": HeadDeclaration(
        "language_modeling_vanilla_transformer",
        "AutoModelForMaskedLM",
        ("encoder-only",),
        "fill-mask",
        "an encoder-only masked language model (BERT-style), its output projection tied to the embedding",
        'inputs = tokenizer([f"Some {tokenizer.mask_token} text."], return_tensors="pt")\n'
        "masked = inputs.input_ids == tokenizer.mask_token_id\n"
        "print(tokenizer.decode(model(**inputs).logits[masked].argmax(-1)))",
    ),
    "VanillaTransformerForSequenceClassification": HeadDeclaration(
        "classification_vanilla_transformer",
        "AutoModelForSequenceClassification",
        SINGLE_STACK,
        "text-classification",
        "a classifier: the encoder pooled (BERT-style), or a causal decoder's last token (GPT-style), then a linear "
        "layer",
        'logits = model(**tokenizer(["Some text."], return_tensors="pt")).logits\n'
        "print(model.config.id2label[int(logits.argmax(-1))])",
    ),
    "VanillaTransformerForTokenClassification": HeadDeclaration(
        "classification_vanilla_transformer",
        "AutoModelForTokenClassification",
        SINGLE_STACK,
        "token-classification",
        "a per-token classifier on the encoder (or a causal decoder)",
        'logits = model(**tokenizer(["Some text."], return_tensors="pt")).logits\n'
        "print([model.config.id2label[int(i)] for i in logits[0].argmax(-1)])",
    ),
    "VanillaTransformerForQuestionAnswering": HeadDeclaration(
        "classification_vanilla_transformer",
        "AutoModelForQuestionAnswering",
        ("encoder-only",),
        None,  # transformers 5 removed the question-answering pipeline
        "extractive question answering: start and end scores per token of the encoder",
        'inputs = tokenizer(["A question?"], ["The context."], return_tensors="pt")\n'
        "outputs = model(**inputs)\n"
        "start, end = int(outputs.start_logits.argmax()), int(outputs.end_logits.argmax())\n"
        "print(tokenizer.decode(inputs.input_ids[0, start : end + 1]))",
    ),
    "VanillaTransformerForImageClassification": HeadDeclaration(
        "image_classification_vanilla_transformer",
        "AutoModelForImageClassification",
        ("image-encoder",),
        "image-classification",
        "a ViT-style image classifier: image patches embedded linearly, the encoder, pooled, then a linear layer",
        "from PIL import Image\n\n"
        'inputs = image_processor(Image.open("image.png").convert("RGB"), return_tensors="pt")\n'
        "print(model.config.id2label[int(model(**inputs).logits.argmax(-1))])",
        preprocessor=("AutoImageProcessor", "image_processor"),
    ),
}


def checkpoint_kind(config, model_class: str | None = None) -> CheckpointKind:
    """The kind of checkpoint a model of class `model_class` (by name) on `config` saves: an image model's own, else
    the stacks the config runs (see `VanillaTransformerConfig.stacks`)."""
    declared = HEADS.get(model_class)
    if declared is not None and declared.checkpoint_kinds == ("image-encoder",):
        return "image-encoder"
    if config.is_encoder_decoder:
        return "encoder-decoder"
    return "decoder-only" if config.is_decoder else "encoder-only"


def loaders(config, model_class: str | None = None) -> dict[str, HeadDeclaration]:
    """The declared classes that can load a checkpoint saved by a model of class `model_class` on `config`."""
    kind = checkpoint_kind(config, model_class)
    return {name: head for name, head in HEADS.items() if kind in head.checkpoint_kinds}


def auto_map(config, model_class: str | None = None) -> dict[str, str]:
    """`config.auto_map` of a checkpoint saved by a model of class `model_class`: every Auto class that can load it,
    not only the saved class's (which is all transformers writes), as "module.Class" for `trust_remote_code`."""
    heads = loaders(config, model_class)
    return {
        "AutoConfig": "configuration_vanilla_transformer.VanillaTransformerConfig",
        **{head.auto_class: f"{head.module}.{name}" for name, head in heads.items()},
    }


__all__ = ["HEADS", "CheckpointKind", "HeadDeclaration", "auto_map", "checkpoint_kind", "loaders"]
