"""hf_vanilla_transformer: the "Attention Is All You Need" Transformer and its variants as a transformers model.

Importing the package registers the config and models with transformers' Auto classes.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
)

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .convert_llama_vanilla_transformer import convert_llama_to_vanilla_transformer
from .convert_marian_vanilla_transformer import convert_marian_to_vanilla_transformer
from .convert_mixtral_vanilla_transformer import convert_mixtral_to_vanilla_transformer
from .heads_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForSequenceClassification,
)
from .hub_vanilla_transformer import push_repository
from .model_card_vanilla_transformer import build_model_card, write_model_card
from .modeling_vanilla_transformer import VanillaTransformerModel, VanillaTransformerPreTrainedModel

AutoConfig.register(VanillaTransformerConfig.model_type, VanillaTransformerConfig, exist_ok=True)
VanillaTransformerConfig.register_for_auto_class()
for _auto_class, _model_class in [
    (AutoModel, VanillaTransformerModel),
    (AutoModelForSeq2SeqLM, VanillaTransformerForConditionalGeneration),
    (AutoModelForCausalLM, VanillaTransformerForCausalLM),
    (AutoModelForSequenceClassification, VanillaTransformerForSequenceClassification),
]:
    _auto_class.register(VanillaTransformerConfig, _model_class, exist_ok=True)
    _model_class.register_for_auto_class(_auto_class.__name__)  # save_pretrained copies the code files

__version__ = "0.1.0"
__all__ = [
    "VanillaTransformerConfig",
    "VanillaTransformerPreTrainedModel",
    "VanillaTransformerModel",
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerForCausalLM",
    "VanillaTransformerForSequenceClassification",
    "convert_llama_to_vanilla_transformer",
    "build_model_card",
    "write_model_card",
    "push_repository",
    "convert_marian_to_vanilla_transformer",
    "convert_mixtral_to_vanilla_transformer",
]
