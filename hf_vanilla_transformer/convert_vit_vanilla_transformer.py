"""Convert a Hugging Face `ViTForImageClassification` into an equivalent `VanillaTransformerForImageClassification`.

ViT (Dosovitskiy et al. 2021) is the paper's encoder with three variants switched on, each one config field here:
pre-norm LayerNorm with a final norm after the stack (`norm_position="pre"`), a GELU FFN (`ffn_type="gelu"`) and
learned positions (`position_embedding_type="learned"`, one row per token); it classifies the output of a learned
[class] token (`classifier_pooling="first"`). The weights map one to one; only names change. A converted
`google/vit-*` checkpoint then fine-tunes with this package, and with its variants from there.
"""

import torch
from transformers import ViTForImageClassification

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .conversion_vanilla_transformer import renamed_state_dict
from .image_classification_vanilla_transformer import (
    VanillaTransformerForImageClassification,
    image_classification_config,
)

# ViT's `hidden_act` -> our ungated ffn_type with the same activation (both go through transformers' ACT2FN).
FFN_FOR_ACTIVATION = {"gelu": "gelu", "relu": "relu", "silu": "swish", "swish": "swish"}

# ViT parameter name -> ours (regex, replacement); names not listed are the same in both models.
PARAMETER_RENAMES = [
    (r"^vit\.embeddings\.patch_embeddings\.", "model.patch_embeddings."),
    (r"^vit\.embeddings\.cls_token$", "model.patch_embeddings.cls_token"),
    (r"^vit\.embeddings\.position_embeddings$", "model.embed_positions.weight"),
    (r"^vit\.layers\.", "model.layers."),
    (r"\.attention\.o_proj\.", ".self_attn.out_proj."),
    (r"\.attention\.", ".self_attn."),
    (r"\.layernorm_before\.", ".self_attn_connection.norm."),  # the norm before self-attention (pre-norm)
    (r"\.layernorm_after\.", ".mlp_connection.norm."),  # the norm before the FFN
    (r"^vit\.layernorm\.", "model.layer_norm."),  # the final norm after the stack
]


def _check_convertible(config) -> None:
    """ViT options our model has no equivalent for raise instead of converting to a different function."""
    if config.hidden_act not in FFN_FOR_ACTIVATION:
        raise ValueError(f"hidden_act={config.hidden_act!r} is not one of {sorted(FFN_FOR_ACTIVATION)}.")
    if not config.qkv_bias:
        raise ValueError(
            "qkv_bias=False is not supported: ViT keeps biases on its output and FFN projections, and the vanilla "
            "transformer has one `use_bias` switch for all linears."
        )
    if config.num_labels < 1:
        raise ValueError(f"num_labels={config.num_labels}: ViT without a classifier has no equivalent head here.")


# ViT's config fields that this config names and reads the same way, copied as they are.
SAME_FIELDS = ("initializer_range", "image_size", "patch_size", "num_channels", "problem_type")


def vit_config_to_vanilla_transformer(config) -> VanillaTransformerConfig:
    """The `VanillaTransformerConfig` of an image classifier computing the same function as a ViT `config`."""
    _check_convertible(config)
    return image_classification_config(  # encoder-only, learned positions: one per patch and one for [class]
        d_model=config.hidden_size,
        encoder_layers=config.num_hidden_layers,
        decoder_layers=config.num_hidden_layers,
        encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=config.num_attention_heads,
        encoder_ffn_dim=config.intermediate_size,
        decoder_ffn_dim=config.intermediate_size,
        dropout=config.hidden_dropout_prob,
        attention_dropout=config.attention_probs_dropout_prob,
        norm_type="layernorm",
        norm_position="pre",
        norm_eps=config.layer_norm_eps,
        ffn_type=FFN_FOR_ACTIVATION[config.hidden_act],
        use_bias=True,
        classifier_pooling="first",
        id2label=dict(config.id2label),
        label2id=dict(config.label2id),
        **{name: getattr(config, name) for name in SAME_FIELDS},
    )


@torch.no_grad()
def convert_vit_to_vanilla_transformer(model: ViTForImageClassification) -> VanillaTransformerForImageClassification:
    """A `VanillaTransformerForImageClassification` with `model`'s weights, in its dtype and on its device, that
    computes the same logits: pre-norm LayerNorm encoder with ViT's epsilon, GELU FFN, learned positions, [class]
    token pooling.

    Raises:
        ValueError: for ViT options without an equivalent here (`qkv_bias=False`, activations other than
            gelu/relu/silu, no classifier).
    """
    config = vit_config_to_vanilla_transformer(model.config)
    converted = VanillaTransformerForImageClassification(config).to(device=model.device, dtype=model.dtype)
    state_dict = renamed_state_dict(model.state_dict(), PARAMETER_RENAMES)
    state_dict["model.embed_positions.weight"] = state_dict["model.embed_positions.weight"][0]  # (1, N, d) -> (N, d)
    converted.load_state_dict(state_dict, strict=True)
    return converted.train(model.training)


__all__ = ["convert_vit_to_vanilla_transformer", "vit_config_to_vanilla_transformer"]
