"""Configuration of the "Attention Is All You Need" Transformer (Vaswani et al., 2017) and its variants.

Defaults reproduce the paper's base model (Table 3); every variant is one field away. Sizes use BART's names so that
transformers' generic code (caches, `get_text_config`, generation) finds them.
"""

import dataclasses
import math
from typing import Any, Literal, get_args, get_origin

from huggingface_hub.dataclasses import type_validator
from transformers import PreTrainedConfig

NormType = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["post", "pre", "sandwich", "deepnorm"]
FfnType = Literal["relu", "gelu", "swish", "glu", "bilinear", "reglu", "geglu", "swiglu"]
PositionEmbeddingType = Literal["sinusoidal", "learned", "rope", "none"]
SinusoidalLayout = Literal["interleaved", "concatenated"]
MoeStacks = Literal["encoder", "decoder", "both"]
ClassifierPooling = Literal["mean", "first"]

GATED_FFN_TYPES = ("glu", "bilinear", "reglu", "geglu", "swiglu")

# Paper Table 3: N, d_model, d_ff, h, P_drop (d_k = d_v = d_model / h follows from the head count).
PRESETS: dict[str, dict[str, Any]] = {
    "transformer-base": dict(layers=6, d_model=512, ffn_dim=2048, heads=8, dropout=0.1),
    "transformer-big": dict(layers=6, d_model=1024, ffn_dim=4096, heads=16, dropout=0.3),
}


class VanillaTransformerConfig(PreTrainedConfig):
    r"""
    Configuration for [`VanillaTransformerModel`] and its heads.

    Variant axes (each a `Literal`, validated): `norm_type`, `norm_position`, `ffn_type`, `position_embedding_type`.
    Mixture of Experts is switched on with `num_experts > 0`. Invalid values and combinations raise `ValueError`
    naming the field.

    Example:

    ```python
    >>> from hf_vanilla_transformer import VanillaTransformerConfig
    >>> config = VanillaTransformerConfig.from_preset("transformer-base", vocab_size=37000)
    >>> modern = VanillaTransformerConfig.from_preset(
    ...     "transformer-base", norm_position="pre", norm_type="rmsnorm", ffn_type="swiglu",
    ...     position_embedding_type="rope",
    ... )
    ```
    """

    model_type = "vanilla_transformer"
    # Outputs the Trainer's evaluation loop must not collect as predictions (MoE losses are scalars, router logits
    # are per-layer tuples whose shapes differ between batches).
    keys_to_ignore_at_inference = [
        "past_key_values",
        "router_logits",
        "encoder_router_logits",
        "decoder_router_logits",
        "aux_loss",
        "z_loss",
        "encoder_aux_loss",
        "decoder_aux_loss",
        "encoder_z_loss",
        "decoder_z_loss",
    ]
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "encoder_layers",
        "num_attention_heads": "encoder_attention_heads",
    }

    # Sizes (paper Table 3, base).
    vocab_size: int = 37000
    d_model: int = 512
    encoder_layers: int = 6
    decoder_layers: int = 6
    encoder_attention_heads: int = 8
    decoder_attention_heads: int = 8
    num_key_value_heads: int | None = None  # GQA/MQA for every attention; None = one K/V head per query head
    encoder_ffn_dim: int = 2048
    decoder_ffn_dim: int = 2048
    max_position_embeddings: int = 1024  # learned positions only; the other position types have no limit

    # Regularisation (§5.4: residual dropout on every sub-layer output and on the embedding sums).
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    classifier_dropout: float = 0.0

    # Variants.
    norm_type: NormType = "layernorm"
    norm_position: NormPosition = "post"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm only; RMSNorm has no bias
    ffn_type: FfnType = "relu"
    gated_ffn_dim: int | None = None  # gated FFNs: explicit hidden size; None = 2/3 of the FFN size (Shazeer 2020)
    ffn_multiple_of: int = 8
    use_bias: bool = True  # biases in attention and FFN linears (paper: yes; T5/Llama: no)
    lm_head_bias: bool = False  # a bias on the pre-softmax projection (Marian's `final_logits_bias`)
    position_embedding_type: PositionEmbeddingType = "sinusoidal"
    sinusoidal_layout: SinusoidalLayout = "interleaved"  # paper §3.5 interleaves sin/cos; Marian concatenates
    rope_theta: float = 10000.0
    scale_embedding: bool = True  # multiply token embeddings by sqrt(d_model) (§3.4)
    padding_free: bool = True  # layers skip padding tokens (packing_vanilla_transformer); same outputs, less work
    share_encoder_decoder_embeddings: bool = True  # one source/target embedding (§3.4)
    tie_word_embeddings: bool = True  # pre-softmax projection = target embedding (§3.4)

    # Mixture of Experts (num_experts = 0: dense FFN).
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_stacks: MoeStacks = "both"
    moe_layer_frequency: int = 1  # every k-th layer of a MoE stack is sparse
    num_shared_experts: int = 0
    norm_topk_prob: bool = True
    router_jitter_noise: float = 0.0
    router_aux_loss_coef: float = 1e-2  # Switch Transformer
    router_z_loss_coef: float = 1e-3  # ST-MoE
    expert_capacity_factor: float | None = None  # None = dropless
    output_router_logits: bool = False

    # Heads and generation.
    classifier_pooling: ClassifierPooling = "mean"
    initializer_range: float = 0.02
    use_cache: bool = True
    is_encoder_decoder: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1
    forced_eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._check_field_types()
        self._check_values()

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VanillaTransformerConfig":
        """A paper Table 3 configuration (`"transformer-base"` or `"transformer-big"`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
        p = PRESETS[name]
        fields = dict(
            d_model=p["d_model"],
            encoder_layers=p["layers"],
            decoder_layers=p["layers"],
            encoder_attention_heads=p["heads"],
            decoder_attention_heads=p["heads"],
            encoder_ffn_dim=p["ffn_dim"],
            decoder_ffn_dim=p["ffn_dim"],
            dropout=p["dropout"],
        )
        return cls(**{**fields, **overrides})

    def gated_hidden_size(self, ffn_dim: int) -> int:
        """Hidden size of a gated FFN: 2/3 of `ffn_dim` (three matrices instead of two keep the parameter count,
        Shazeer 2020 §2), rounded up to `ffn_multiple_of`; an explicit `gated_ffn_dim` wins."""
        if self.gated_ffn_dim is not None:
            return self.gated_ffn_dim
        return self.ffn_multiple_of * math.ceil(2 * ffn_dim / 3 / self.ffn_multiple_of)

    def is_moe_layer(self, stack: Literal["encoder", "decoder"], layer_idx: int) -> bool:
        """Whether layer `layer_idx` of `stack` carries a Mixture-of-Experts FFN."""
        in_stack = self.moe_stacks in (stack, "both")
        return self.num_experts > 0 and in_stack and (layer_idx + 1) % self.moe_layer_frequency == 0

    def _check_field_types(self) -> None:
        """Type-check this class's own fields; a wrong type or an unknown variant value names the field."""
        for field in dataclasses.fields(self):
            if field.name not in VanillaTransformerConfig.__annotations__:
                continue
            value = getattr(self, field.name)
            if field.type is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, field.name, value)
            try:
                type_validator(field.name, value, field.type)
            except TypeError as err:
                if get_origin(field.type) is Literal:
                    raise ValueError(f"{field.name}={value!r} is not one of {get_args(field.type)}.") from err
                raise ValueError(f"{field.name}={value!r} has the wrong type: {err}") from err

    def _check_values(self) -> None:
        """Cross-field checks. Each error names the field to change."""
        positive = [
            "vocab_size",
            "d_model",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "max_position_embeddings",
            "ffn_multiple_of",
            "moe_layer_frequency",
        ]
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        for name in ["encoder_layers", "decoder_layers", "num_experts", "num_shared_experts"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ["dropout", "attention_dropout", "activation_dropout", "classifier_dropout"]:
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}.")
        for name in ["norm_eps", "rope_theta"]:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        for name in ["encoder_attention_heads", "decoder_attention_heads"]:
            heads = getattr(self, name)
            if self.d_model % heads:
                raise ValueError(f"d_model={self.d_model} is not divisible by {name}={heads}.")
            if self.position_embedding_type == "rope" and (self.d_model // heads) % 2:
                raise ValueError(f"position_embedding_type='rope' needs an even head size; d_model / {name} is odd.")
            if self.num_key_value_heads is not None and (
                self.num_key_value_heads <= 0 or heads % self.num_key_value_heads
            ):
                raise ValueError(f"{name}={heads} is not divisible by num_key_value_heads={self.num_key_value_heads}.")
        if self.gated_ffn_dim is not None and self.gated_ffn_dim <= 0:
            raise ValueError(f"gated_ffn_dim must be positive, got {self.gated_ffn_dim}.")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}."
            )
        if self.expert_capacity_factor is not None and self.expert_capacity_factor <= 0:
            raise ValueError(f"expert_capacity_factor must be positive or None, got {self.expert_capacity_factor}.")
        for name in ["router_jitter_noise", "router_aux_loss_coef", "router_z_loss_coef"]:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}.")
        for name in ["pad_token_id", "bos_token_id", "decoder_start_token_id"]:
            token_id = getattr(self, name)
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{name}={token_id} is outside the vocabulary (vocab_size={self.vocab_size}).")


__all__ = ["VanillaTransformerConfig", "GATED_FFN_TYPES", "PRESETS"]
