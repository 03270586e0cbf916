"""Configuration of the "Attention Is All You Need" Transformer (Vaswani et al., 2017) and its variants.

Defaults reproduce the paper's base model (Table 3); every variant is one field away. Sizes use BART's names; the
generic names that transformers' caches and generation read (`num_hidden_layers`, `num_attention_heads`,
`num_key_value_heads`, `hidden_size`) describe the stack a model actually runs (see `VanillaTransformerConfig.stacks`).
"""

import copy
import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Any, Literal, get_args, get_origin

import torch
from huggingface_hub.dataclasses import type_validator
from transformers import PreTrainedConfig

Stack = Literal["encoder", "decoder"]
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

# Smallest value of each integer field (its type is checked separately).
INT_MINIMUMS: dict[str, int] = {
    "vocab_size": 1,
    "d_model": 1,
    "encoder_layers": 0,  # an encoder may be empty (it then only embeds); a decoder that runs may not (_check_stacks)
    "decoder_layers": 0,
    "encoder_attention_heads": 1,
    "decoder_attention_heads": 1,
    "num_key_value_heads": 1,
    "encoder_ffn_dim": 1,
    "decoder_ffn_dim": 1,
    "gated_ffn_dim": 1,
    "ffn_multiple_of": 1,
    "max_position_embeddings": 1,
    "num_experts": 0,
    "num_experts_per_tok": 1,
    "moe_layer_frequency": 1,
    "num_shared_experts": 0,
    "chunk_size_feed_forward": 0,
}

# What each float field must satisfy beyond being finite (NaN and infinity are refused everywhere), and how to say it.
FLOAT_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "dropout": (lambda value: 0 <= value < 1, "in [0, 1)"),
    "attention_dropout": (lambda value: 0 <= value < 1, "in [0, 1)"),
    "activation_dropout": (lambda value: 0 <= value < 1, "in [0, 1)"),
    "classifier_dropout": (lambda value: 0 <= value < 1, "in [0, 1)"),
    "norm_eps": (lambda value: value > 0, "positive"),
    "rope_theta": (
        lambda value: value >= 1,
        (
            ">= 1 (the base of the rotary wavelengths 2pi theta^(2i/d): below 1 they shrink with i, and a tiny "
            "theta overflows the float32 frequencies to NaN)"
        ),
    ),
    "router_jitter_noise": (
        lambda value: 0 <= value < 1,
        "in [0, 1) (the router input is scaled by U(1 - noise, 1 + noise), which must stay positive)",
    ),
    "router_aux_loss_coef": (lambda value: value >= 0, ">= 0"),
    "router_z_loss_coef": (lambda value: value >= 0, ">= 0"),
    "expert_capacity_factor": (lambda value: value > 0, "positive (or None for dropless routing)"),
    "initializer_range": (lambda value: value >= 0, ">= 0 (the standard deviation of the initial weights)"),
}

TOKEN_ID_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id")


class _KeyValueHeadsField:
    """`num_key_value_heads` keeps what was given (None = one K/V head per query head), which is what
    `save_pretrained` writes, and reads filled in as transformers' own configs do: the K/V heads of the stack that
    the generic size names describe."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, config: "VanillaTransformerConfig | None", owner: type | None = None) -> int | None:
        if config is None:
            return None  # the dataclass default
        return config.key_value_heads(config.num_attention_heads)

    def __set__(self, config: "VanillaTransformerConfig", value: int | None) -> None:
        config.__dict__[self.name] = value


class VanillaTransformerConfig(PreTrainedConfig):
    r"""
    Configuration for [`VanillaTransformerModel`] and its heads.

    Variant axes (each a `Literal`, validated): `norm_type`, `norm_position`, `ffn_type`, `position_embedding_type`.
    Mixture of Experts is switched on with `num_experts > 0`. Invalid values and combinations raise `ValueError`
    naming the field, at construction and when `from_pretrained` reads a `config.json`.

    Which stacks a model runs (`stacks`) follows BERT's convention in transformers: `is_encoder_decoder=True` runs
    both; otherwise `is_decoder=True` is a causal decoder-only model (GPT-style) and `is_decoder=False` an
    encoder-only one. `num_hidden_layers`, `num_attention_heads` and `num_key_value_heads` give that stack's sizes
    (the encoder's for an encoder-decoder, as in BART; `get_text_config(decoder=True)` gives the decoder's, which is
    what transformers' caches read).

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
    attribute_map = {"hidden_size": "d_model"}  # the per-stack names are properties below: they depend on `stacks`

    # Sizes (paper Table 3, base).
    vocab_size: int = 37000
    d_model: int = 512
    encoder_layers: int = 6
    decoder_layers: int = 6
    encoder_attention_heads: int = 8
    decoder_attention_heads: int = 8
    # GQA/MQA for every attention; None = one K/V head per query head. Reads filled in (see `_KeyValueHeadsField`).
    num_key_value_heads: int | None = _KeyValueHeadsField()
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
    is_decoder: bool = False  # without the encoder-decoder: True = causal decoder-only, False = encoder-only
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1
    forced_eos_token_id: int | list[int] | None = None

    # Images (ViT, Dosovitskiy et al. 2021, §3.1; ViT's names and types): the image classifier cuts each image of
    # `num_channels` x `image_size` pixels into `patch_size` squares, the encoder's tokens. A size is (height, width)
    # or one number for both.
    image_size: int | list[int] | tuple[int, int] = 224
    patch_size: int | list[int] | tuple[int, int] = 16
    num_channels: int = 3

    def __post_init__(self, **kwargs):
        # The base class converts these first and would fail on bad ones with errors that do not name them.
        check_dtype("dtype", self.dtype)
        check_dtype("torch_dtype", kwargs.get("torch_dtype"))
        check_label_arguments(self.id2label, self.label2id, kwargs)
        super().__post_init__(**kwargs)
        self.validate()
        # Attention weights need the eager implementation: asking for them picks it unless another was chosen, as
        # transformers' own `output_attentions` setter does (the base class bypasses that setter here).
        if self.output_attentions and self._attn_implementation is None:
            self._attn_implementation = "eager"

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> Any:
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded  # `(config, unused_kwargs)` when asked for
        config.validate()  # `from_pretrained(..., field=value)` sets its overrides after construction
        return loaded

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

    # ------------------------------------------------------------------ the stacks a model runs

    @property
    def stacks(self) -> tuple[Stack, ...]:
        """The stacks a model built from this config runs: both for an encoder-decoder, else the decoder
        (`is_decoder=True`, GPT-style) or the encoder (BERT-style)."""
        if self.is_encoder_decoder:
            return ("encoder", "decoder")
        return ("decoder",) if self.is_decoder else ("encoder",)

    @property
    def _named_stack(self) -> Stack:
        """The stack the generic size names describe: the decoder of a decoder-only model, else the encoder (BART's
        convention for an encoder-decoder, whose `get_text_config(decoder=True)` renames the decoder's sizes)."""
        return "decoder" if self.stacks == ("decoder",) else "encoder"

    @property
    def num_hidden_layers(self) -> int:
        return getattr(self, f"{self._named_stack}_layers")

    @num_hidden_layers.setter
    def num_hidden_layers(self, value: int) -> None:
        setattr(self, f"{self._named_stack}_layers", value)

    @property
    def num_attention_heads(self) -> int:
        return getattr(self, f"{self._named_stack}_attention_heads")

    @num_attention_heads.setter
    def num_attention_heads(self, value: int) -> None:
        setattr(self, f"{self._named_stack}_attention_heads", value)

    def key_value_heads(self, num_attention_heads: int) -> int:
        """K/V heads of an attention with `num_attention_heads` query heads: `num_key_value_heads` when it was given
        (grouped-query attention in every attention), else one per query head. Encoder and decoder may have
        different head counts, so a single filled-in value could not serve both."""
        given = self.__dict__.get("num_key_value_heads")
        return num_attention_heads if given is None else given

    def for_single_stack(self, stack: Stack) -> "VanillaTransformerConfig":
        """A validated copy for a model that runs one stack: `"decoder"` (causal, no cross-attention) or `"encoder"`.
        A deep copy keeps the load-time settings (`attn_implementation`, dtype) that `to_dict` would drop."""
        if stack not in get_args(Stack):
            raise ValueError(f"stack={stack!r} is not one of {get_args(Stack)}.")
        config = copy.deepcopy(self)
        config.is_encoder_decoder = False
        config.is_decoder = stack == "decoder"
        config.validate()
        return config

    # ------------------------------------------------------------------ sizes the layers derive

    def gated_hidden_size(self, ffn_dim: int) -> int:
        """Hidden size of a gated FFN: 2/3 of `ffn_dim` (three matrices instead of two keep the parameter count,
        Shazeer 2020 §2), rounded up to `ffn_multiple_of`; an explicit `gated_ffn_dim` wins."""
        if self.gated_ffn_dim is not None:
            return self.gated_ffn_dim
        return self.ffn_multiple_of * math.ceil(2 * ffn_dim / 3 / self.ffn_multiple_of)

    def is_moe_layer(self, stack: Stack, layer_idx: int) -> bool:
        """Whether layer `layer_idx` of `stack` carries a Mixture-of-Experts FFN."""
        in_stack = self.moe_stacks in (stack, "both")
        return self.num_experts > 0 and in_stack and (layer_idx + 1) % self.moe_layer_frequency == 0

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Check every field and every combination; a problem raises `ValueError` naming the field.

        Runs at construction, after `from_pretrained` has applied its keyword overrides, and in `save_pretrained`;
        call it after changing fields by hand. Ends with transformers' own checks."""
        self._check_types()
        self._check_ranges()
        self._check_stacks()
        self._check_token_ids()
        self._check_labels()
        self._check_outputs()
        super().validate()

    def _check_types(self) -> None:
        """Each field against its declared type, the inherited ones included. An int is accepted (and stored as a
        float) wherever a float is, as in transformers' own configs."""
        types = field_types()
        for field in dataclasses.fields(self):
            expected, value = types[field.name], self.__dict__[field.name]
            if accepts_float(expected) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
                setattr(self, field.name, value)
            try:
                type_validator(field.name, value, expected)
            except TypeError as err:
                raise ValueError(f"{field.name}={value!r} {describe_expected_type(expected)}.") from err
        check_dtype("dtype", self.dtype)

    def _check_ranges(self) -> None:
        """Numbers inside the range where they mean something (sizes, probabilities, scales), and finite."""
        for name, minimum in INT_MINIMUMS.items():
            value = self.__dict__[name]
            if value is not None and value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}.")
        for name, (in_range, expected) in FLOAT_RANGES.items():
            value = self.__dict__[name]
            if value is not None and not (math.isfinite(value) and in_range(value)):
                raise ValueError(f"{name} must be finite and {expected}, got {value}.")
        if self.num_experts > 0 and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}."
            )

    def _check_stacks(self) -> None:
        """Head sizes of the stacks the model runs (the other stack's sizes are unused), and a decoder with layers."""
        given_key_value_heads = self.__dict__["num_key_value_heads"]
        for stack in self.stacks:
            name = f"{stack}_attention_heads"
            heads = getattr(self, name)
            if self.d_model % heads:
                raise ValueError(f"d_model={self.d_model} is not divisible by {name}={heads}.")
            if self.position_embedding_type == "rope" and (self.d_model // heads) % 2:
                raise ValueError(
                    f"position_embedding_type='rope' needs an even head size; d_model={self.d_model} / {name}={heads} "
                    "is odd."
                )
            if given_key_value_heads is not None and heads % given_key_value_heads:
                raise ValueError(f"{name}={heads} is not divisible by num_key_value_heads={given_key_value_heads}.")
        if "decoder" in self.stacks and self.decoder_layers == 0:
            raise ValueError(
                "decoder_layers must be >= 1 when the decoder runs (encoder-decoder or decoder-only): transformers' "
                "KV cache counts the decoded length in its layers, so a decoder without layers would decode every "
                "step at position 0 (and DeepNet's constants divide by its depth). An encoder-only model is "
                "is_encoder_decoder=False, is_decoder=False."
            )

    def _check_token_ids(self) -> None:
        """Every special token id is None or inside the vocabulary; a list of end tokens is not empty."""
        for name in TOKEN_ID_FIELDS:
            value = getattr(self, name)
            if value == []:
                raise ValueError(f"{name}=[] names no token; give at least one id, or None.")
            token_ids = value if isinstance(value, list) else [value]
            if any(token_id is not None and not 0 <= token_id < self.vocab_size for token_id in token_ids):
                raise ValueError(f"{name}={value!r} is outside the vocabulary [0, vocab_size={self.vocab_size}).")

    def _check_labels(self) -> None:
        """The classifier's labels: ids 0..num_labels-1, a consistent `label2id`, a `problem_type` that fits."""
        id2label = self.id2label or {}
        if not id2label:
            raise ValueError("num_labels (the size of id2label) must be >= 1, got 0.")
        if sorted(id2label) != list(range(len(id2label))):
            raise ValueError(f"id2label keys must be the label ids 0..{len(id2label) - 1}, got {sorted(id2label)}.")
        inverse = {label: label_id for label_id, label in id2label.items()}
        if self.label2id is not None and self.label2id != inverse:
            raise ValueError(f"label2id={self.label2id!r} is not the inverse of id2label={id2label!r}.")
        if self.problem_type == "single_label_classification" and len(id2label) == 1:
            raise ValueError(
                "problem_type='single_label_classification' needs num_labels >= 2; use num_labels=2 for a binary "
                "task, or problem_type='regression' for one output."
            )

    def _check_outputs(self) -> None:
        if not isinstance(self.output_attentions, bool | None):
            raise ValueError(f"output_attentions={self.output_attentions!r} must be a bool.")
        if self.output_attentions and self._attn_implementation not in (None, "eager"):
            raise ValueError(
                "output_attentions=True needs attn_implementation='eager' (the others do not return attention "
                f"weights), got {self._attn_implementation!r}."
            )


@functools.cache
def field_types() -> dict[str, Any]:
    """The declared type of every config field. transformers declares its own fields with postponed (string)
    annotations, which huggingface_hub's validator skips; resolving them checks the inherited fields
    (`output_hidden_states`, `id2label`, `problem_type`, ...) against transformers' own declarations."""
    hints = typing.get_type_hints(VanillaTransformerConfig, localns={"torch": torch})
    return {field.name: hints[field.name] for field in dataclasses.fields(VanillaTransformerConfig)}


def accepts_float(expected: Any) -> bool:
    return expected is float or float in get_args(expected)


def describe_expected_type(expected: Any) -> str:
    """'is not one of (...)' for a (possibly optional) `Literal`, else the type's name."""
    members = get_args(expected) if get_origin(expected) is not Literal else (expected,)
    choices = tuple(choice for member in members if get_origin(member) is Literal for choice in get_args(member))
    if choices:
        return f"is not one of {choices + ((None,) if type(None) in members else ())}"
    return f"does not have the type {getattr(expected, '__name__', None) or expected}"


def check_dtype(name: str, value: Any) -> None:
    """Refuse a dtype that is neither None nor a floating-point torch dtype (given as such or by name)."""
    resolved = getattr(torch, value, None) if isinstance(value, str) else value
    if value is not None and not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"{name}={value!r} is not a floating-point torch dtype such as 'float32' or 'bfloat16'.")


def check_label_arguments(id2label: Any, label2id: Any, kwargs: dict[str, Any]) -> None:
    """The label fields as the base class will read them: `id2label` a dict keyed by label ids (ints, or their
    strings as JSON stores them), `label2id` only beside it (alone, the base class would replace it with default
    names), and a positive `num_labels` keyword that agrees with `id2label`."""
    if id2label is not None and (not isinstance(id2label, dict) or not all(is_label_id(key) for key in id2label)):
        raise ValueError(f"id2label={id2label!r} must be a dict keyed by the label ids 0..num_labels-1.")
    if label2id is not None and id2label is None:
        raise ValueError(f"label2id={label2id!r} needs id2label beside it (the label of each id).")
    if "num_labels" not in kwargs:
        return
    num_labels = kwargs["num_labels"]
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ValueError(f"num_labels={num_labels!r} must be an int >= 1.")
    if id2label is not None and len(id2label) != num_labels:
        raise ValueError(
            f"num_labels={num_labels} contradicts id2label, which has {len(id2label)} labels; give one of them."
        )


def is_label_id(key: Any) -> bool:
    if isinstance(key, str):
        return key.isdecimal()
    return isinstance(key, int) and not isinstance(key, bool)


__all__ = ["GATED_FFN_TYPES", "PRESETS", "Stack", "VanillaTransformerConfig"]
