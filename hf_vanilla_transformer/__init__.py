"""hf_vanilla_transformer: the "Attention Is All You Need" Transformer and its variants as a transformers model.

Importing the package registers the config and models with transformers' Auto classes. Converters and exporters load
on first use (PEP 562): they pull in other models' code and optional dependencies (sentencepiece for Marian's
tokenizer) that using the model itself does not need.
"""

import importlib
from typing import Any

import transformers

from .auto_vanilla_transformer import HEADS
from .classification_vanilla_transformer import (
    VanillaTransformerForQuestionAnswering,
    VanillaTransformerForSequenceClassification,
    VanillaTransformerForTokenClassification,
)
from .collators_vanilla_transformer import (
    DataCollatorForSeq2SeqWithFlattening,
    preferred_layout,
    seq2seq_training_collator,
)
from .configuration_vanilla_transformer import VanillaTransformerConfig
from .hub_vanilla_transformer import push_repository
from .image_classification_vanilla_transformer import (
    VanillaTransformerForImageClassification,
    image_classification_config,
)
from .language_modeling_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForMaskedLM,
)
from .model_card_vanilla_transformer import build_model_card, write_model_card
from .modeling_vanilla_transformer import VanillaTransformerModel, VanillaTransformerPreTrainedModel

# Public names imported on first access, and the sibling module defining each.
LAZY_NAMES: dict[str, str] = {
    "convert_llama_to_vanilla_transformer": "convert_llama_vanilla_transformer",
    "convert_marian_to_vanilla_transformer": "convert_marian_vanilla_transformer",
    "convert_mixtral_to_vanilla_transformer": "convert_mixtral_vanilla_transformer",
    "convert_vit_to_vanilla_transformer": "convert_vit_vanilla_transformer",
    "export_to_ctranslate2": "ctranslate2_vanilla_transformer",
    "optimize_for_cpu_inference": "cpu_inference_vanilla_transformer",
    "optimize_for_cpu_training": "cpu_training_vanilla_transformer",
}

transformers.AutoConfig.register(VanillaTransformerConfig.model_type, VanillaTransformerConfig, exist_ok=True)
VanillaTransformerConfig.register_for_auto_class()
for _name, _head in HEADS.items():  # every declared class, with the Auto class that loads it
    _model_class = getattr(importlib.import_module(f".{_head.module}", __name__), _name)
    getattr(transformers, _head.auto_class).register(VanillaTransformerConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_head.auto_class)  # save_pretrained copies the code files


def __getattr__(name: str) -> Any:
    if name not in LAZY_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{LAZY_NAMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(LAZY_NAMES))


__version__ = "0.1.0"
__all__ = [
    "VanillaTransformerConfig",
    "VanillaTransformerPreTrainedModel",
    "VanillaTransformerModel",
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerForCausalLM",
    "VanillaTransformerForSequenceClassification",
    "VanillaTransformerForMaskedLM",
    "VanillaTransformerForTokenClassification",
    "VanillaTransformerForQuestionAnswering",
    "VanillaTransformerForImageClassification",
    "image_classification_config",
    "DataCollatorForSeq2SeqWithFlattening",
    "preferred_layout",
    "seq2seq_training_collator",
    "build_model_card",
    "write_model_card",
    "push_repository",
    *LAZY_NAMES,  # loaded on first access by __getattr__
]
