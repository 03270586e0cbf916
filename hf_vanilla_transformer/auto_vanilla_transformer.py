"""One declaration per model class: the Auto class that loads it, the checkpoints it can load, and what its model card
says. Registration (`__init__.py`), every saved checkpoint's `auto_map` and the model card derive from `HEADS`, so a
new head is its class and one entry here.
"""

from dataclasses import dataclass
from typing import Literal

Layout = Literal["encoder-decoder", "decoder-only", "encoder-only"]


@dataclass(frozen=True)
class HeadDeclaration:
    """module        the sibling module that defines the class
    auto_class    the transformers Auto class that loads it
    layouts       the checkpoints whose weights it can load: a head on one stack takes the stack of a decoder-only or
                  encoder-only checkpoint (a GPT-style classifier starts from a causal LM), never an encoder-decoder's
    pipeline_tag  the Hub task of its model card: one transformers 5 has a pipeline for, or None
    summary       what it is, in the model card
    usage         the lines after loading that show what it is for, in the model card"""

    module: str
    auto_class: str
    layouts: tuple[Layout, ...]
    pipeline_tag: str | None
    summary: str
    usage: str


SINGLE_STACK: tuple[Layout, ...] = ("decoder-only", "encoder-only")

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
}


def layout_of(config) -> Layout:
    """The stacks a config runs, as a checkpoint layout (see `VanillaTransformerConfig.stacks`)."""
    if config.is_encoder_decoder:
        return "encoder-decoder"
    return "decoder-only" if config.is_decoder else "encoder-only"


def auto_map(config) -> dict[str, str]:
    """`config.auto_map` of a checkpoint: every Auto class that can load it, not only the saved class's (which is all
    transformers writes), as "module.Class" for `trust_remote_code`."""
    layout = layout_of(config)
    loaders = {head.auto_class: f"{head.module}.{name}" for name, head in HEADS.items() if layout in head.layouts}
    return {"AutoConfig": "configuration_vanilla_transformer.VanillaTransformerConfig", **loaders}


__all__ = ["HEADS", "HeadDeclaration", "auto_map", "layout_of"]
