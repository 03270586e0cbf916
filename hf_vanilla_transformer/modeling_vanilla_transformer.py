"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a transformers 5.x model, with its variants.

What every forward runs, read top to bottom as in transformers' own modeling files: the embeddings and positions
(§3.4, §3.5), the norms and their placement around each sub-layer (§3.1), the position-wise FFN and its GLU
variants (§3.3), the Mixture-of-Experts block that can replace it, multi-head attention (§3.2), the layer, the
weight init, the two stacks and the encoder-decoder base model; then what the heads share (their losses' item count,
the tokens of a padding mask). Section numbers in comments refer to the paper.

Beside this file: the checks of the inputs (inputs_vanilla_transformer, run where each stack receives them), a
flattened batch's kernels and masks (packing_vanilla_transformer: its offsets travel in the forward's keyword
arguments, as transformers passes them), the experts' kernels (moe_kernels_vanilla_transformer), the opt-in CPU
training speed-ups (cpu_training_vanilla_transformer) and the heads. Masks come from `transformers.masking_utils`; the
decoder cache is an `EncoderDecoderCache`. Nothing here reads a tensor's values on the host: a step runs without
waiting for the device.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.integrations.moe import use_experts_implementation
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    MoeCausalLMOutputWithPast,
    Seq2SeqModelOutput,
    Seq2SeqMoEModelOutput,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults

from .compat_vanilla_transformer import OutputRecorder, PipelineIdentityLayer, capture_outputs, overrides
from .configuration_vanilla_transformer import GATED_FFN_TYPES, StackName, VanillaTransformerConfig
from .eager_attention_vanilla_transformer import apply_rotary_pos_emb, eager_attention_forward
from .inputs_vanilla_transformer import FLATTENED_KEYWORDS, IGNORE_INDEX, check_stack_inputs, require
from .moe_kernels_vanilla_transformer import EXPERTS_FUNCTIONS, gated_activation, local_expert_ids
from .packing_vanilla_transformer import (
    VARLEN_IMPLEMENTATIONS,
    block_attention_masks,
    positions_in_sequences,
    varlen_attention,
    varlen_kernel,
)
from .pretrained_vanilla_transformer import LoadSaveShardMixin

# transformers 5.24 renamed the decoder cache from `past_key_values` to `cache`: `generate` passes it under the new name
# and the output classes hold it as `cache` (their constructors take the old name with a warning). The models take it
# under either name and return it under the name of the installed release's output classes.
CACHE_FIELD = (
    "cache" if "cache" in BaseModelOutputWithPastAndCrossAttentions.__dataclass_fields__ else "past_key_values"
)


def given_cache(cache: Cache | None, past_key_values: Cache | None) -> Cache | None:
    """The decoder cache a forward was given, as `cache` (transformers >= 5.24) or as `past_key_values`."""
    if past_key_values is None:
        return cache
    if cache is not None:
        raise ValueError("Pass the decoder cache as `cache` or as `past_key_values`, not both.")
    return past_key_values


def is_flattened(kwargs: dict) -> bool:
    """Whether a forward's `kwargs` carry a flattened batch's offsets (an encoder-decoder's may give either side)."""
    return kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None


# ------------------------------------------------------------------------------------ embeddings and positions
#
# Every position module maps `(inputs_embeds, position_ids, past_length, positions_below)` to `(hidden_states,
# rotary)` (`positions_below`: a bound on `position_ids` the caller knows, which only a table lookup needs): additive
# encodings return the embeddings with positions added and no rotary table; RoPE returns the embeddings unchanged and
# the `(cos, sin)` table that self-attention applies to queries and keys. Without `position_ids` the positions are
# `past_length`, `past_length + 1`, ... (after a cache).

PositionOutput = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]


class ScaledWordEmbedding(nn.Embedding):
    """Token embedding multiplied by sqrt(d_model) (§3.4)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.embed_scale = config.d_model**0.5 if config.scale_embedding else 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


def sinusoidal_position_encoding(position_ids: torch.Tensor, dim: int, layout: str = "interleaved") -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))  (§3.5), in fp32.

    `layout="concatenated"` puts all sines first and all cosines after them (Marian, tensor2tensor).
    """
    inv_freq = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim)
    angles = position_ids.to(torch.float32)[..., None] * inv_freq
    if layout == "interleaved":
        encoding = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    else:
        encoding = torch.cat((angles.sin(), angles.cos()), dim=-1)
    return encoding[..., :dim]


def default_positions(inputs_embeds: torch.Tensor, past_length: int | torch.Tensor) -> torch.Tensor:
    return torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_length


class SinusoidalPositionalEmbedding(nn.Module):
    """Fixed sinusoids added to the embeddings; they extrapolate to any length (§3.5).

    The first `max_position_embeddings` rows are kept as a table (not saved: `_init_weights` recomputes it), so the
    usual positions 0, 1, ... cost one slice instead of a dozen small kernels; other positions are computed."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.dim = config.d_model
        self.layout = config.sinusoidal_layout
        self.register_buffer("table", self.encoding(torch.arange(config.max_position_embeddings)), persistent=False)

    def encoding(self, position_ids: torch.Tensor) -> torch.Tensor:
        return sinusoidal_position_encoding(position_ids, self.dim, self.layout)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        """`positions_below`: a bound the caller knows `position_ids` keep to (a flattened batch's longest sequence),
        so that they can be looked up in the table."""
        length, table = inputs_embeds.shape[1], self.table
        if position_ids is None and isinstance(past_length, int) and past_length + length <= table.shape[0]:
            encoding = table[past_length : past_length + length]
        elif position_ids is not None and positions_below is not None and positions_below <= table.shape[0]:
            try:  # the lookup checks the positions itself, at no cost (a device assert on an accelerator)
                encoding = F.embedding(position_ids, table)
            except IndexError as error:
                raise ValueError(f"position_ids hold a position past max_length ({positions_below}): {error}") from None
        else:
            positions = default_positions(inputs_embeds, past_length) if position_ids is None else position_ids
            encoding = self.encoding(positions)
        return inputs_embeds + encoding.to(inputs_embeds.dtype), None


class LearnedPositionalEmbedding(nn.Embedding):
    """A learned table of `max_position_embeddings` rows (the paper's §3.5 alternative, BERT/GPT-2 style)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config.max_position_embeddings, config.d_model)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        position_ids = default_positions(inputs_embeds, past_length) if position_ids is None else position_ids
        require(
            (position_ids < self.num_embeddings).all(),
            f"A position is past max_position_embeddings={self.num_embeddings} (position_embedding_type='learned'): "
            "shorten the input or raise max_position_embeddings.",
        )
        return inputs_embeds + super().forward(position_ids), None


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al. 2021) in the rotate-half layout of GPT-NeoX/Llama: a `(cos, sin)` table per position.

    The frequencies follow `config.rope_parameters` as in transformers' Llama: plain RoPE, or a scaled type from
    transformers' table (`ROPE_INIT_FUNCTIONS`), computed once into `inv_freq` (not saved: `_init_weights` recomputes
    it) with the `attention_scaling` that multiplies cos and sin (YaRN, LongRoPE). transformers' `dynamic_rope_update`
    recomputes them for the two types that depend on the longest position: "dynamic" past `max_position_embeddings`
    (it reads that position on the host, as Llama does) and "longrope" past its original context.
    """

    def __init__(self, config: VanillaTransformerConfig, head_dim: int):
        super().__init__()
        self.config = config.rotary_config(head_dim)  # read by the RoPE functions and `dynamic_rope_update`
        self.rope_type = config.rope_parameters["rope_type"]
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings  # the trained context
        inv_freq, self.attention_scaling = self.compute_inv_freq()
        if inv_freq.shape[-1] != head_dim // 2:
            raise ValueError(
                f"rope_parameters={config.rope_parameters!r} rotate {2 * inv_freq.shape[-1]} of the {head_dim} "
                "dimensions of a head (partial_rotary_factor); the attention here rotates whole heads."
            )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: VanillaTransformerConfig, device=None, **kwargs):
        """Plain RoPE's inverse frequencies theta^(-2i/d), and cos and sin unscaled. Written as this package always
        computed them, so that its RoPE checkpoints keep their logits to the bit (Llama's 1 / theta^(2i/d) differs
        from it in the last bit of some frequencies)."""
        dim, theta = config.head_dim, config.rope_parameters["rope_theta"]
        return theta ** -(torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim), 1.0

    def compute_inv_freq(self) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention_scaling) of the configured type at the trained context."""
        if self.rope_type == "default":
            return self.compute_default_rope_parameters(self.config)
        return ROPE_INIT_FUNCTIONS[self.rope_type](self.config)

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        position_ids = default_positions(inputs_embeds, past_length) if position_ids is None else position_ids
        if position_ids.dim() == 1:  # shared positions -> broadcast over the batch
            position_ids = position_ids[None]
        return inputs_embeds, self.cos_sin(inputs_embeds, position_ids)

    @dynamic_rope_update  # a no-op for the types whose frequencies do not depend on the positions
    def cos_sin(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.attention_scaling != 1.0:  # YaRN, LongRoPE; a Python float, so plain RoPE skips two kernels for free
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)


class NoPositionalEmbedding(nn.Module):
    """No position information (the decoder's causal mask still leaks order; Haviv et al. 2022)."""

    def forward(
        self,
        inputs_embeds: torch.Tensor,
        position_ids: torch.Tensor | None,
        past_length: int | torch.Tensor = 0,
        positions_below: int | None = None,
    ) -> PositionOutput:
        return inputs_embeds, None


def build_position_embedding(config: VanillaTransformerConfig, num_heads: int) -> nn.Module:
    """The position module of `config.position_embedding_type` for a stack of `num_heads` heads (RoPE rotates each
    head's dimensions)."""
    if config.position_embedding_type == "rope":
        return RotaryEmbedding(config, config.d_model // num_heads)
    if config.position_embedding_type == "none":
        return NoPositionalEmbedding()
    tables = {"sinusoidal": SinusoidalPositionalEmbedding, "learned": LearnedPositionalEmbedding}
    return tables[config.position_embedding_type](config)


# ----------------------------------------------------------------------------------- norms and their placement


def build_norm(config: VanillaTransformerConfig) -> nn.Module:
    """LayerNorm (paper, Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019), with the configured epsilon."""
    if config.norm_type == "rmsnorm":
        return nn.RMSNorm(config.d_model, eps=config.norm_eps)  # eps given: torch's default is finfo(dtype).eps
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.norm_bias)


def deepnorm_constants(config: VanillaTransformerConfig, stack: StackName) -> tuple[float, float]:
    """DeepNet (Wang et al. 2022, Figure 2 / Table 1) residual weight alpha and init gain beta.

    Encoder-decoder with N encoder and M decoder layers:
        encoder  alpha = 0.81 (N^4 M)^(1/16),  beta = 0.87 (N^4 M)^(-1/16)
        decoder  alpha = (3M)^(1/4),           beta = (12M)^(-1/4)
    Encoder-only (N layers) or decoder-only (M layers): alpha = (2L)^(1/4), beta = (8L)^(-1/4).
    """
    n, m = config.encoder_layers, config.decoder_layers
    if not config.is_encoder_decoder:
        depth = n if stack == "encoder" else m
        return (2 * depth) ** 0.25, (8 * depth) ** -0.25
    if stack == "encoder":
        return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
    return (3 * m) ** 0.25, (12 * m) ** -0.25


# DeepNet Figure 2 (pseudocode): these get Xavier-normal with gain beta; queries and keys keep gain 1. Mixture-of-
# Experts FFNs (`experts`, `shared_experts`) are FFN weights too.
DEEPNORM_SCALED_MODULES = ("v_proj", "out_proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj", "experts")


def set_deepnorm_init_gains(layer: nn.Module, config: VanillaTransformerConfig, stack: StackName) -> None:
    """Store the DeepNet init gain on each linear map and expert bank of `layer` as `deepnorm_gain`, for
    `_init_weights` to apply.

    The gain lives on the module itself because transformers initialises module by module and, for custom-code
    models, skips every module without parameters of its own, so a layer could not re-initialise its children.
    """
    if config.norm_position != "deepnorm":
        return
    beta = deepnorm_constants(config, stack)[1]
    for name, module in layer.named_modules():
        kind = name.rsplit(".", 1)[-1].removeprefix("shared_")
        if isinstance(module, nn.Linear) or kind == "experts":
            module.deepnorm_gain = beta if kind in DEEPNORM_SCALED_MODULES else 1.0


def norm_first(config: VanillaTransformerConfig) -> bool:
    """Whether a sub-layer reads the normalised stream (pre, sandwich): then the stream itself is never normalised,
    and each stack ends with one more norm."""
    return config.norm_position in ("pre", "sandwich")


class SublayerConnection(nn.Module):
    """One sub-layer f (attention or FFN) with its norms, dropout and residual add, placed per `norm_position`:

    post      LayerNorm(x + Dropout(f(x)))                 the paper, §3.1 and §5.4
    pre       x + Dropout(f(LayerNorm(x)))                 Xiong et al. 2020; the stack ends with a final norm
    sandwich  x + Dropout(LayerNorm(f(LayerNorm(x))))      Ding et al. 2021 (CogView)
    deepnorm  LayerNorm(alpha * x + Dropout(f(x)))         Wang et al. 2022 (DeepNet)

    As x-transformers' optional norms per branch: `norm` is the placement's norm, on the branch's input where the norm
    comes first (pre, sandwich: the stream itself is never normalised), else on the stream after the residual add;
    `sandwich_norm` normalises the branch's output. (The names are those of the saved checkpoints.)
    """

    def __init__(self, config: VanillaTransformerConfig, residual_scale: float = 1.0):
        super().__init__()
        self.norm_first = norm_first(config)
        self.norm = build_norm(config)
        self.sandwich_norm = build_norm(config) if config.norm_position == "sandwich" else None
        self.dropout = nn.Dropout(config.dropout)
        self.residual_scale = residual_scale

    def forward(self, hidden_states: torch.Tensor, sublayer: nn.Module, **kwargs) -> torch.Tensor:
        """The stream after `sublayer`, called on the stream (normalised where the norm comes first) and `kwargs`
        (by keyword: forward hooks read positional inputs as number tensors); of an attention's (output, weights) the
        output (the weights are recorded on the attention)."""
        output = sublayer(self.norm(hidden_states) if self.norm_first else hidden_states, **kwargs)
        output = output[0] if isinstance(output, tuple) else output
        if self.sandwich_norm is not None:
            output = self.sandwich_norm(output)
        output = self.dropout(output)
        if self.norm_first:
            return hidden_states + output
        # alpha = 1 (post-LN) would cost a full-size multiply forward and backward for nothing.
        scaled = hidden_states if self.residual_scale == 1.0 else self.residual_scale * hidden_states
        return self.norm(scaled + output)


# ----------------------------------------------------------------------------------------- feed-forward networks
#
# Position-wise FFNs (§3.3) and the GLU family (Shazeer 2020, "GLU Variants Improve Transformer"):
#   ungated  FFN(x) = act(x W1 + b1) W2 + b2                 (fc1, fc2; the paper uses ReLU)
#   gated    FFN(x) = (act(x W_gate) * (x W_up)) W_down      (gate_proj, up_proj, down_proj)

# ffn_type -> activation (ACT2FN key). For gated types it is applied to the gate; "bilinear" has none.
FFN_ACTIVATIONS = {
    "relu": "relu",
    "gelu": "gelu",
    "swish": "silu",
    "glu": "sigmoid",
    "bilinear": "linear",
    "reglu": "relu",
    "geglu": "gelu",
    "swiglu": "silu",
}


def ffn_activation(config: VanillaTransformerConfig) -> nn.Module:
    """The activation of `config.ffn_type` (on the gate for gated types), from transformers' ACT2FN."""
    return ACT2FN[FFN_ACTIVATIONS[config.ffn_type]]


class FeedForward(nn.Module):
    """The paper's FFN: two linear maps with an activation between them, each position on its own."""

    def __init__(self, config: VanillaTransformerConfig, ffn_dim: int):
        super().__init__()
        self.fc1 = nn.Linear(config.d_model, ffn_dim, bias=config.use_bias)
        self.fc2 = nn.Linear(ffn_dim, config.d_model, bias=config.use_bias)
        self.act_fn = ffn_activation(config)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.act_fn(self.fc1(hidden_states))
        return self.fc2(self.activation_dropout(hidden_states))


class GatedFeedForward(nn.Module):
    """A GLU-variant FFN: the activated gate multiplies a second linear projection."""

    def __init__(self, config: VanillaTransformerConfig, ffn_dim: int):
        super().__init__()
        hidden = config.gated_hidden_size(ffn_dim)
        self.gate_proj = nn.Linear(config.d_model, hidden, bias=config.use_bias)
        self.up_proj = nn.Linear(config.d_model, hidden, bias=config.use_bias)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=config.use_bias)
        self.act_fn = ffn_activation(config)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gated = self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states)
        return self.down_proj(self.activation_dropout(gated))


def build_feed_forward(config: VanillaTransformerConfig, ffn_dim: int) -> nn.Module:
    """The FFN of `config.ffn_type`; gated types get 2/3 of `ffn_dim` (see `config.gated_hidden_size`)."""
    return GatedFeedForward(config, ffn_dim) if config.ffn_type in GATED_FFN_TYPES else FeedForward(config, ffn_dim)


# ------------------------------------------------------------------------------------------ Mixture of Experts
#
# The FFN of §3.3 replaced by E expert FFNs, each token sent to its top-k (Shazeer et al. 2017):
#   router    p = softmax(x W_r)  in fp32; the top-k experts of each token, weights optionally renormalised
#   experts   the E FFNs as 3D tensors in Mixtral's layout, run by the function `config._experts_implementation`
#             names (transformers' `@use_experts_implementation` dispatch): transformers' "eager", "batched_mm",
#             "grouped_mm", ..., or ours, "sorted_grouped_mm" (the default: the same grouped matmuls, fewer passes
#             over the rows), whose kernels are in moe_kernels_vanilla_transformer
#   capacity  with factor c, expert e serves at most ceil(c * tokens * k / E) tokens (GShard, Switch Transformer);
#             the rest skip it, so a token with no expert left keeps only its residual
#   block     y = sum_{e in top-k} p_e FFN_e(x)  (+ shared experts applied to every token, DeepSeekMoE)
# The router losses that train the gate, which the heads add to their loss, are in router_losses_vanilla_transformer.


class VanillaTransformerRouter(nn.Module):
    """The gate: a linear map to one logit per expert, softmax, top-k. Always computed in fp32, because a bf16
    softmax over near-equal logits flips top-k choices and the router is tiny (Switch Transformer §2.4): in a bf16
    model as under autocast, which would otherwise run the linear map in bf16 whatever its inputs' dtype."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.jitter_noise = config.router_jitter_noise
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model))

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden_states (T, H) -> router logits (T, E) fp32, top-k weights (T, k) fp32, top-k expert ids (T, k)."""
        with torch.autocast(device_type=hidden_states.device.type, enabled=False):
            hidden_states = hidden_states.float()
            if self.training and self.jitter_noise > 0:
                # Multiplicative jitter on the router input only (Switch Transformer §2.4): explores routings in
                # training while the experts still see the clean hidden states.
                noise = torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
                hidden_states = hidden_states * noise
            router_logits = F.linear(hidden_states, self.weight.float())
            top_k_weights, top_k_index = torch.topk(router_logits.softmax(dim=-1), self.top_k, dim=-1)
            if self.norm_topk_prob:  # Mixtral: the k chosen weights sum to one
                top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
            return router_logits, top_k_weights, top_k_index


def expert_activation(config: VanillaTransformerConfig) -> tuple[nn.Module, nn.Module]:
    """An expert's activation and the dropout after it: the dense FFN's (§3.3, or its GLU variant)."""
    return ffn_activation(config), nn.Dropout(config.activation_dropout)


@use_experts_implementation(experts_interface=EXPERTS_FUNCTIONS)
class VanillaTransformerExperts(nn.Module):
    """`num_experts` FFNs of `config.ffn_type` (§3.3 or a GLU variant) stored as 3D tensors in Mixtral's layout, so
    that transformers' experts functions run them: gated types fuse [gate; up] in `gate_up_proj` (E, 2I, H), ungated
    ones have `up_proj` (E, I, H); `down_proj` is (E, H, I); `*_bias` when `config.use_bias`. `forward` is the eager
    implementation; the decorator dispatches on `config._experts_implementation`. `activation` and
    `activation_dropout`: the dense FFN's (`expert_activation`)."""

    def __init__(
        self,
        config: VanillaTransformerConfig,
        num_experts: int,
        ffn_dim: int,
        activation: nn.Module,
        activation_dropout: nn.Module,
    ):
        super().__init__()
        gated = config.ffn_type in GATED_FFN_TYPES
        hidden = config.gated_hidden_size(ffn_dim) if gated else ffn_dim
        self.num_experts = num_experts
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, config.d_model))
        else:
            self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, config.d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, config.d_model, hidden))
        if config.use_bias:
            if gated:
                self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden))
            else:
                self.up_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
            self.down_proj_bias = nn.Parameter(torch.empty(num_experts, config.d_model))
        self.activation = activation  # on the gate for gated types
        self.activation_dropout = activation_dropout

    # What the experts functions read. The decorator assigns one `has_gate` and `has_bias` to every instance of the
    # class after `__init__`; here they follow the config, so they are read off the parameters and that is ignored.
    has_gate = property(lambda self: "gate_up_proj" in self._parameters, lambda self, value: None)
    has_bias = property(lambda self: "down_proj_bias" in self._parameters, lambda self, value: None)

    @property
    def up_projection_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    def act_fn(self, up: torch.Tensor) -> torch.Tensor:
        """Hidden activation of an ungated expert (the experts functions call it by this name)."""
        return self.activation_dropout(self.activation(up))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Hidden activation of a gated expert: act(gate) * up (Shazeer 2020)."""
        return self.activation_dropout(gated_activation(gate_up, self.activation))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The eager path, one expert at a time: hidden_states (T, H), top_k_index and top_k_weights (T, k) -> (T, H),
        each token's sum over its choices of weight * FFN_expert(x).

        It rounds where transformers' batched and grouped functions do, so that in bf16 or fp16 switching the
        implementation does not change the outputs: the bias is added to the rounded product, and the sum is taken
        in the dtype of their weighted products (expert weights' times routing weights': the router's fp32) and cast
        once."""
        up_name = self.up_projection_name
        top_k_index = local_expert_ids(self, top_k_index)
        summed_dtype = torch.promote_types(self.down_proj.dtype, top_k_weights.dtype)
        output = hidden_states.new_zeros(hidden_states.shape, dtype=summed_dtype)
        for expert in top_k_index.unique().tolist():
            token, choice = torch.where(top_k_index == expert)
            hidden = self._linear(hidden_states[token], up_name, expert)
            hidden = self._apply_gate(hidden) if self.has_gate else self.act_fn(hidden)
            weighted = self._linear(hidden, "down_proj", expert) * top_k_weights[token, choice, None]
            # Under autocast the matmuls here come out in bf16 whatever the weights' dtype (the grouped kernels,
            # which autocast does not cover, in the weights' dtype), and a bias may promote them.
            output.index_add_(0, token, weighted.to(output.dtype))
        return output.to(hidden_states.dtype)

    def _linear(self, inputs: torch.Tensor, projection: str, expert: int) -> torch.Tensor:
        output = F.linear(inputs, getattr(self, projection)[expert])
        return output + getattr(self, f"{projection}_bias")[expert] if self.has_bias else output


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may serve: ceil(c * tokens * k / E) (Switch Transformer eq. 3, times k for top-k)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def positions_in_experts(top_k_index: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Where each (token, choice) assignment queues at its expert, from 0: (T, k).

    Assignments are served first choices first, then second choices, each in token order (GShard §2.2), so a token
    loses its k-th expert before any other token loses its first.
    """
    top_k = top_k_index.shape[1]
    by_rank = top_k_index.t().reshape(-1)  # (k*T,): every first choice, then every second choice, ...
    # A comparison, not F.one_hot, which reads the ids' range on the host to check it.
    one_hot = (by_rank[:, None] == torch.arange(num_experts, device=by_rank.device)).long()
    position_in_expert = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1
    return position_in_expert.view(top_k, -1).t()


def capacity_slots(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, capacity: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard's dispatch: each expert has `capacity` slots, filled by its kept assignments in serving order. Returns
    each slot's token and routing weight ((E * capacity,): an empty slot holds token 0 with weight 0) and which
    assignments were kept ((T, k) bool). Every shape is fixed by T, so nothing waits for the device."""
    num_tokens, top_k = top_k_index.shape
    position = positions_in_experts(top_k_index, num_experts)
    keep = position < capacity
    # A dropped assignment goes to a spare slot of its own past the experts' (unique indices: a deterministic
    # scatter), which is cut off afterwards.
    spare = num_experts * capacity + torch.arange(num_tokens * top_k, device=top_k_index.device).view_as(position)
    slot = torch.where(keep, top_k_index * capacity + position, spare).reshape(-1)
    token = torch.arange(num_tokens, device=top_k_index.device)[:, None].expand(-1, top_k).reshape(-1)
    slots = num_experts * capacity + num_tokens * top_k
    slot_token = token.new_zeros(slots).scatter(0, slot, token)[: num_experts * capacity]
    weights = (top_k_weights * keep).reshape(-1)
    slot_weight = weights.new_zeros(slots).scatter(0, slot, weights)[: num_experts * capacity]
    return slot_token, slot_weight, keep


class VanillaTransformerSparseMoeBlock(nn.Module):
    """The FFN sub-layer as a Mixture of Experts: `gate` (router), `experts`, and optional `shared_experts`.

    Parameter names follow Mixtral (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
    With `expert_capacity_factor` set, `dropped_tokens` holds the number of (token, expert) assignments the last
    forward dropped for lack of room, as a tensor on the device (`dropped_token_counts` reads it on the host).
    """

    def __init__(self, config: VanillaTransformerConfig, ffn_dim: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.expert_capacity_factor
        self.gate = VanillaTransformerRouter(config)
        self.experts = VanillaTransformerExperts(config, config.num_experts, ffn_dim, *expert_activation(config))
        # Shared experts (Dai et al. 2024, DeepSeekMoE): experts every token is sent to with weight 1.
        self.shared_experts = (
            VanillaTransformerExperts(config, config.num_shared_experts, ffn_dim, *expert_activation(config))
            if config.num_shared_experts
            else None
        )
        self.dropped_tokens = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, length, H) -> the same shape; every position is routed (padding too, as in Mixtral: skipping it
        would need to find it on the host), and the losses count tokens only."""
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, top_k_weights, top_k_index = self.gate(tokens)
        if self.capacity_factor is None:
            output = self.experts(tokens, top_k_index, top_k_weights)
        else:
            output = self._experts_within_capacity(tokens, top_k_index, top_k_weights)
        if self.shared_experts is not None:
            everyone = torch.arange(self.shared_experts.num_experts, device=tokens.device).expand(tokens.shape[0], -1)
            output = output + self.shared_experts(tokens, everyone, torch.ones(everyone.shape, device=tokens.device))
        return output.view_as(hidden_states)

    def _experts_within_capacity(
        self, tokens: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Run each expert on its `capacity` slots (`capacity_slots`) and sum the slots back per token; dropped
        assignments and empty slots contribute 0, so a token that lost every expert keeps only its residual."""
        capacity = expert_capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        slot_token, slot_weight, keep = capacity_slots(top_k_index, top_k_weights, capacity, self.num_experts)
        self.dropped_tokens = keep.numel() - keep.sum()  # stays on the device: no training step waits for it
        slot_expert = torch.arange(self.num_experts * capacity, device=tokens.device)[:, None] // capacity
        kept = self.experts(tokens[slot_token], slot_expert, slot_weight[:, None])
        return torch.zeros_like(tokens).index_add_(0, slot_token, kept)


@torch.no_grad()
def init_moe_weights(module: nn.Module, config: VanillaTransformerConfig) -> None:
    """Router: N(0, initializer_range) as Mixtral (small logits, near-uniform routing at the start). Experts: each
    (fan_out, fan_in) matrix as the dense FFN's linears (`config.initialization`; Xavier-normal with gain beta under
    DeepNorm); biases zero."""
    if isinstance(module, VanillaTransformerRouter):
        init.normal_(module.weight, std=config.initializer_range)
        return
    fan_sum = module.down_proj.shape[1] + module.down_proj.shape[2]  # d_model + expert hidden size
    gain = getattr(module, "deepnorm_gain", None)
    for name, parameter in module.named_parameters(recurse=False):
        if name.endswith("_bias"):
            init.zeros_(parameter)
        elif gain is None and config.initialization == "normal":
            init.normal_(parameter, std=config.initializer_range)
        elif gain is None:
            bound = math.sqrt(6.0 / fan_sum)
            init.uniform_(parameter, -bound, bound)
        else:
            init.normal_(parameter, std=gain * math.sqrt(2.0 / fan_sum))


def dropped_token_counts(model: nn.Module) -> dict[str, int]:
    """Module name -> assignments dropped for lack of capacity in the last forward, for every MoE block: read on the
    host here, when asked, not in the forward."""
    return {
        name: int(module.dropped_tokens)
        for name, module in model.named_modules()
        if isinstance(module, VanillaTransformerSparseMoeBlock) and module.dropped_tokens is not None
    }


@dataclass
class MoeEncoderOutput(BaseModelOutput):
    """`BaseModelOutput` plus the router logits of the stack's MoE layers, each (batch * length, num_experts)."""

    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class MoeDecoderOutput(BaseModelOutputWithPastAndCrossAttentions):
    """`BaseModelOutputWithPastAndCrossAttentions` plus the router logits of the stack's MoE layers."""

    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class MoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """Mixtral's `MoeCausalLMOutputWithPast` plus the router z-loss (ST-MoE) next to the balancing `aux_loss`."""

    z_loss: torch.Tensor | None = None


# ------------------------------------------------------------------------------------- attention and the layers


class VanillaTransformerAttention(nn.Module):
    """Multi-head scaled dot-product attention (§3.2), with grouped K/V heads when `num_key_value_heads` is set.

    Self-attention reads keys and values from its own input; cross-attention (`is_cross_attention`) from
    `key_value_states`, the encoder output (§3.2.3). The config's attention function runs it, from transformers'
    attention interface as in Bart and Llama. Over a flattened batch a variable-length kernel runs it where one runs
    (the stack leaves the batch's offsets in `kwargs`, as transformers passes them), else the config's function under
    the block mask the stack built (packing_vanilla_transformer).
    """

    def __init__(
        self,
        config: VanillaTransformerConfig,
        num_heads: int,
        *,
        is_causal: bool,
        is_cross_attention: bool = False,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal  # read by the sdpa/flash integrations; False for encoder and cross-attention
        self.is_cross_attention = is_cross_attention
        self.head_dim = config.d_model // num_heads
        num_key_value_heads = config.key_value_heads(num_heads)
        self.num_key_value_groups = num_heads // num_key_value_heads
        self.scaling = self.head_dim**-0.5  # 1 / sqrt(d_k), §3.2.1
        self.attention_dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.d_model, num_heads * self.head_dim, bias=config.use_bias)
        self.k_proj = nn.Linear(config.d_model, num_key_value_heads * self.head_dim, bias=config.use_bias)
        self.v_proj = nn.Linear(config.d_model, num_key_value_heads * self.head_dim, bias=config.use_bias)
        self.out_proj = nn.Linear(num_heads * self.head_dim, config.d_model, bias=config.use_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None,
        key_value_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # (batch, length, heads * head_dim) -> (batch, heads, length, head_dim)
        heads_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(heads_shape).transpose(1, 2)

        cache, cross_cached = past_key_values, False
        if isinstance(past_key_values, EncoderDecoderCache):
            cross_cached = self.is_cross_attention and past_key_values.is_updated.get(self.layer_idx, False)
            cache = (
                past_key_values.cross_attention_cache
                if self.is_cross_attention
                else past_key_values.self_attention_cache
            )

        if cross_cached:  # the encoder output does not change while decoding: its K/V are projected once
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            source = key_value_states if self.is_cross_attention else hidden_states
            heads_shape = (*source.shape[:-1], -1, self.head_dim)
            key = self.k_proj(source).view(heads_shape).transpose(1, 2)
            value = self.v_proj(source).view(heads_shape).transpose(1, 2)
            if position_embeddings is not None:  # RoPE: rotate before caching, so cached keys keep their positions
                query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
                if self.is_cross_attention:
                    past_key_values.is_updated[self.layer_idx] = True

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        if kwargs.get("cu_seq_lens_q") is not None:  # a flattened batch that a variable-length kernel runs
            if not self.is_cross_attention:  # self-attention: the keys are the queries' own sequences
                kwargs = {**kwargs, "cu_seq_lens_k": kwargs["cu_seq_lens_q"], "max_length_k": kwargs["max_length_q"]}
            if self.config._attn_implementation not in VARLEN_IMPLEMENTATIONS:  # these read the offsets themselves
                attention_interface = varlen_attention
        attn_output, attn_weights = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*attn_output.shape[:2], -1).contiguous()
        return self.out_proj(attn_output), attn_weights


def build_mlp(config: VanillaTransformerConfig, stack: StackName, layer_idx: int) -> nn.Module:
    """The position-wise FFN of one layer (§3.3), or a Mixture of Experts in the layers `config.is_moe_layer` picks."""
    ffn_dim = config.encoder_ffn_dim if stack == "encoder" else config.decoder_ffn_dim
    if config.is_moe_layer(stack, layer_idx):
        return VanillaTransformerSparseMoeBlock(config, ffn_dim)
    return build_feed_forward(config, ffn_dim)


class VanillaTransformerLayer(nn.Module):
    """One layer of either stack (§3.1): self-attention, attention over the encoder output (a decoder of an
    encoder-decoder only), then the FFN; each sub-layer wrapped in dropout, residual and norm (`SublayerConnection`).
    The subclasses name the stack (`stack`): encoder self-attention sees the whole source, decoder self-attention is
    masked. They, not this base, are the `GradientCheckpointingLayer`s: transformers >= 5.23 wraps the `forward` of
    every subclass of it, so a layer below a second subclass would run two wrappers at every call."""

    stack: StackName

    def __init__(self, config: VanillaTransformerConfig, layer_idx: int):
        super().__init__()
        # DeepNet's alpha for the residual branch of every sub-layer (1 for the other placements).
        alpha = deepnorm_constants(config, self.stack)[0] if config.norm_position == "deepnorm" else 1.0
        decoder = self.stack == "decoder"
        heads = config.decoder_attention_heads if decoder else config.encoder_attention_heads
        self.self_attn = VanillaTransformerAttention(config, heads, is_causal=decoder, layer_idx=layer_idx)
        self.self_attn_connection = SublayerConnection(config, alpha)
        if decoder and config.is_encoder_decoder:
            self.encoder_attn = VanillaTransformerAttention(
                config, heads, is_causal=False, is_cross_attention=True, layer_idx=layer_idx
            )
            self.encoder_attn_connection = SublayerConnection(config, alpha)
        self.mlp = build_mlp(config, self.stack, layer_idx)
        self.mlp_connection = SublayerConnection(config, alpha)
        set_deepnorm_init_gains(self, config, self.stack)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`kwargs` reach both attentions: the decoder's cache (`past_key_values`), a flattened batch's offsets and
        transformers' attention options. Each connection places the norms around its sub-layer
        (`SublayerConnection`). Positional: the tensors gradients flow through (activation checkpointing passes
        gradients through positional arguments only); the masks by keyword, as transformers' forward hooks (`--debug
        underflow_overflow`) read every positional input as a number tensor."""
        # Self-attention (§3.2.3): over the whole source in the encoder; in the decoder `attention_mask` is causal,
        # position i sees positions <= i only.
        hidden_states = self.self_attn_connection(
            hidden_states,
            self.self_attn,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        # Encoder-decoder attention: queries from the decoder, keys and values from the encoder output (§3.2.3).
        if encoder_hidden_states is not None:
            hidden_states = self.encoder_attn_connection(
                hidden_states,
                self.encoder_attn,
                attention_mask=encoder_attention_mask,
                key_value_states=encoder_hidden_states,
                **kwargs,
            )
        # Position-wise feed-forward network, or Mixture of Experts (§3.3).
        return self.mlp_connection(hidden_states, self.mlp)


class VanillaTransformerEncoderLayer(VanillaTransformerLayer, GradientCheckpointingLayer):
    """An encoder layer: self-attention over the whole source, then FFN."""

    stack = "encoder"


class VanillaTransformerDecoderLayer(VanillaTransformerLayer, GradientCheckpointingLayer):
    """A decoder layer: masked self-attention, attention over the encoder output (absent when decoder-only), then
    FFN."""

    stack = "decoder"


# ------------------------------------------------------------------------------------ the stacks and the model


class VanillaTransformerPreTrainedModel(LoadSaveShardMixin, PreTrainedModel):
    config: VanillaTransformerConfig
    config_class = VanillaTransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VanillaTransformerEncoderLayer", "VanillaTransformerDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # Each `forward` is annotated with its dense output class: transformers' tests read the annotation to tell whether
    # a class returns router logits, and one class serves dense and MoE configs. With experts the forward returns the
    # MoE output class named beside the annotation.

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        normal = self.config.initialization == "normal"
        if isinstance(module, nn.Linear):
            deepnorm_gain = getattr(module, "deepnorm_gain", None)  # set by set_deepnorm_init_gains
            if deepnorm_gain is not None:
                init.xavier_normal_(module.weight, gain=deepnorm_gain)  # DeepNet (Wang et al. 2022), Figure 2
            elif normal:
                init.normal_(module.weight, std=self.config.initializer_range)
            else:
                init.xavier_uniform_(module.weight)  # as torch.nn.Transformer and the Annotated Transformer
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, VanillaTransformerExperts | VanillaTransformerRouter):
            init_moe_weights(module, self.config)
        elif isinstance(module, nn.Embedding):
            # "xavier": N(0, 1/d_model), so that after the sqrt(d_model) scaling of §3.4 token vectors have unit
            # variance (fairseq).
            init.normal_(module.weight, std=self.config.initializer_range if normal else self.config.d_model**-0.5)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, SinusoidalPositionalEmbedding):  # a buffer, not saved
            init.copy_(module.table, module.encoding(torch.arange(len(module.table))))
        elif isinstance(module, RotaryEmbedding):  # buffers, not saved
            inv_freq = module.compute_inv_freq()[0]
            init.copy_(module.inv_freq, inv_freq)
            init.copy_(module.original_inv_freq, inv_freq)
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


class VanillaTransformerStack(VanillaTransformerPreTrainedModel):
    """What the encoder and decoder share (§3.1): scaled token embeddings, positions, dropout on their sum (§5.4), N
    identical layers and, for the pre-norm placements, a final norm."""

    def __init__(
        self,
        config: VanillaTransformerConfig,
        layer_class: type[nn.Module],
        num_layers: int,
        num_heads: int,
        **input_embeddings: nn.Module,
    ):
        """`input_embeddings`: what embeds inputs that are not token ids (the image encoder's `patch_embeddings`),
        in place of the token embedding."""
        super().__init__(config)
        if not input_embeddings:
            self.embed_tokens = ScaledWordEmbedding(config)
        self.embed_positions = build_position_embedding(config, num_heads)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(num_layers)])
        self.layer_norm = build_norm(config) if norm_first(config) else None
        self.gradient_checkpointing = False
        # After the layers: the parameter order of the image checkpoints (and their optimizer states) saved before.
        for name, module in input_embeddings.items():
            self.add_module(name, module)

    def embed(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        offsets: dict | None,
        past_length: int | torch.Tensor = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(token embeddings, the layers' input, the RoPE table or None). Positions continue after the cache, or,
        in a flattened batch (its `offsets`), restart at each sequence (the collator's position ids, below its
        longest sequence)."""
        if inputs_embeds is None:
            try:  # the lookup checks the ids itself, at no cost (on an accelerator its kernel asserts on the device)
                inputs_embeds = self.embed_tokens(input_ids)
            except IndexError as error:
                seq2seq_decoder = self.config.is_encoder_decoder and isinstance(self, VanillaTransformerDecoder)
                name = "decoder_input_ids (or the labels shifted into them)" if seq2seq_decoder else "input_ids"
                vocab_size = self.config.vocab_size
                raise ValueError(f"{name} holds an id outside the vocabulary [0, {vocab_size=}): {error}") from None
        positions_below = None
        if offsets is not None:
            positions_below = offsets["max_length_q"]
            if position_ids is None:
                position_ids = positions_in_sequences(offsets["cu_seq_lens_q"], inputs_embeds.shape[:2])
        hidden_states, rotary = self.embed_positions(inputs_embeds, position_ids, past_length, positions_below)
        if self.first_layer_run > 0:  # a later pipeline rank: `inputs_embeds` is the previous rank's output
            return inputs_embeds, inputs_embeds, rotary
        return inputs_embeds, self.dropout(hidden_states), rotary

    def flattened_attention(
        self, kwargs: dict, shape: tuple[int, int], source_shape: tuple[int, int] | None = None
    ) -> tuple[dict, dict, torch.Tensor | None, torch.Tensor | None]:
        """How attention runs over the flattened batch of `kwargs` (packing_vanilla_transformer), decided once per
        forward: (its offsets, the layers' keyword arguments, the self-attention mask, the cross-attention mask).
        Where a variable-length kernel runs, the offsets stay in the keyword arguments for it and there is no mask;
        elsewhere each kind of attention gets a block mask. The stack's own sequences are the "q" side; a decoder's
        cross-attention reads the source's, the "k" side, laid out in `source_shape`."""
        offsets = {name: kwargs[name] for name in FLATTENED_KEYWORDS if kwargs.get(name) is not None}
        for name in ("max_length_q", "max_length_k"):  # a collator's 0-dim CPU tensor: read here (no sync)
            if isinstance(offsets.get(name), torch.Tensor):
                offsets[name] = int(offsets[name])
        layer_kwargs = {name: value for name, value in kwargs.items() if name not in FLATTENED_KEYWORDS}
        # Attention runs on the weights' device, in autocast's dtype where it is on (the Trainer's bf16 keeps float32
        # weights), else in the weights'. The image encoder has no token embedding: any weight will do.
        weight = next(self.parameters())
        device_type = weight.device.type
        dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
        dropout = self.config.attention_dropout if self.training else 0.0
        if varlen_kernel(self.config._attn_implementation, weight.device, dtype, dropout) is not None:
            return offsets, {**layer_kwargs, **offsets}, None, None
        causal = isinstance(self, VanillaTransformerDecoder)
        return offsets, layer_kwargs, *block_attention_masks(offsets, shape, source_shape, causal, dtype)

    def run_layers(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The N identical layers (§3.1), then the final norm of the pre-norm placements (on the last rank of a
        pipeline)."""
        for layer in self.layers:
            hidden_states = layer(hidden_states, *args, **kwargs)
        if self.layer_norm is not None and self.runs_last_layer:
            hidden_states = self.layer_norm(hidden_states)
        return hidden_states

    @property
    def first_layer_run(self) -> int:
        """The index of the first layer this rank runs: 0, but on the later ranks of a pipeline, where transformers'
        engine has replaced the layers of the ranks before by identities and passes their output as `inputs_embeds`."""
        for index, layer in enumerate(self.layers):
            if not isinstance(layer, PipelineIdentityLayer):
                return index
        return 0

    @property
    def runs_last_layer(self) -> bool:
        """False on the ranks of a pipeline before the last, whose output goes on to the next rank's layers."""
        return len(self.layers) == 0 or not isinstance(self.layers[-1], PipelineIdentityLayer)


class VanillaTransformerEncoder(VanillaTransformerStack):
    """The encoder stack: N identical layers over the embedded source (§3.1)."""

    _can_record_outputs = {
        "hidden_states": VanillaTransformerEncoderLayer,
        "attentions": VanillaTransformerAttention,
        "router_logits": OutputRecorder(VanillaTransformerRouter, index=0),
    }

    def __init__(self, config: VanillaTransformerConfig, **input_embeddings: nn.Module):
        layers, heads = config.encoder_layers, config.encoder_attention_heads
        super().__init__(config, VanillaTransformerEncoderLayer, layers, heads, **input_embeddings)
        self.output_class = MoeEncoderOutput if config.num_experts else BaseModelOutput
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutput:  # MoeEncoderOutput with experts: the router logits of its MoE layers
        r"""
        A flattened batch gives the offsets of its sequences as `cu_seq_lens_q`/`max_length_q` (transformers'
        `DataCollatorWithFlattening`; the encoder-decoder passes the source's so).
        """
        check_stack_inputs(
            self.config,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            offsets=kwargs,
            first_layer=self.first_layer_run,
            offsets_side="k" if self.config.is_encoder_decoder else "q",  # an encoder-decoder's source: `source_side`
        )
        offsets = None
        if is_flattened(kwargs):
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            offsets, kwargs, attention_mask, _ = self.flattened_attention(kwargs, shape)
        inputs_embeds, hidden_states, rotary = self.embed(input_ids, inputs_embeds, position_ids, offsets)
        if offsets is None:
            attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                allow_is_bidirectional_skip=attention_mask is None,  # deciding it from the mask's values would sync
            )
        hidden_states = self.run_layers(
            hidden_states, attention_mask=attention_mask, position_embeddings=rotary, **kwargs
        )
        return self.output_class(last_hidden_state=hidden_states)


class VanillaTransformerDecoder(VanillaTransformerStack):
    """The decoder stack (§3.1); without cross-attention when `config.is_encoder_decoder` is False (decoder-only)."""

    _can_record_outputs = {
        "hidden_states": VanillaTransformerDecoderLayer,
        "attentions": OutputRecorder(VanillaTransformerAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(VanillaTransformerAttention, index=1, layer_name="encoder_attn"),
        "router_logits": OutputRecorder(VanillaTransformerRouter, index=0),
    }

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config, VanillaTransformerDecoderLayer, config.decoder_layers, config.decoder_attention_heads)
        self.output_class = MoeDecoderOutput if config.num_experts else BaseModelOutputWithPastAndCrossAttentions
        self.post_init()

    def new_cache(self) -> Cache:
        if not self.config.is_encoder_decoder:
            return DynamicCache(config=self.config)
        return EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:  # MoeDecoderOutput with experts
        r"""
        past_key_values (`Cache`, *optional*):
            The name of `cache` before transformers 5.24.

        A flattened batch gives the offsets of its sequences as `cu_seq_lens_q`/`max_length_q` and, under an
        encoder, those of the source's as `cu_seq_lens_k`/`max_length_k`.
        """
        cache = given_cache(cache, past_key_values)
        first_layer = self.first_layer_run  # whose cache holds the decoded length
        check_stack_inputs(
            self.config,
            input_ids=input_ids,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            offsets=kwargs,
            prefix="decoder_" if self.config.is_encoder_decoder else "",
            first_layer=first_layer,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
        )
        offsets = None
        if is_flattened(kwargs):  # a training batch: no cache
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            source_shape = None if encoder_hidden_states is None else encoder_hidden_states.shape[:2]
            offsets, kwargs, attention_mask, encoder_attention_mask = self.flattened_attention(
                kwargs, shape, source_shape
            )
        elif use_cache and cache is None:
            cache = self.new_cache()
        past_length = cache.get_seq_length(first_layer) if cache is not None else 0
        inputs_embeds, hidden_states, rotary = self.embed(input_ids, inputs_embeds, position_ids, offsets, past_length)
        if offsets is None:  # a padded batch: transformers' masks, built where Bart builds them
            self_attention_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
            # Position ids restarting at 0 without a mask mark sequences packed in one row; transformers finds them
            # only without a cache, and a dynamic cache this forward starts empty changes nothing else in the mask.
            starts_dynamic_cache = type(self_attention_cache) is DynamicCache and past_length == 0
            attention_mask = create_causal_mask(
                self.config,
                inputs_embeds,
                attention_mask,
                None if starts_dynamic_cache else self_attention_cache,  # positional: `cache` from transformers 5.24
                position_ids=position_ids,
                layer_idx=first_layer,
                allow_is_causal_skip=attention_mask is None,  # deciding it from the mask's values would sync
            )
            if encoder_hidden_states is not None:
                encoder_attention_mask = create_bidirectional_mask(
                    config=self.config,
                    inputs_embeds=inputs_embeds,
                    attention_mask=encoder_attention_mask,
                    encoder_hidden_states=encoder_hidden_states,
                    allow_is_bidirectional_skip=encoder_attention_mask is None,
                )
        hidden_states = self.run_layers(
            hidden_states,
            encoder_hidden_states,  # positional: activation checkpointing only passes grads through positionals
            attention_mask=attention_mask,
            encoder_attention_mask=encoder_attention_mask,
            position_embeddings=rotary,
            past_key_values=cache,
            **kwargs,
        )
        return self.output_class(last_hidden_state=hidden_states, **{CACHE_FIELD: cache})


def base_model_class(config: VanillaTransformerConfig) -> type[VanillaTransformerPreTrainedModel]:
    """The base model of a checkpoint: the encoder-decoder, or the one stack a decoder-only (`is_decoder`) or
    encoder-only model runs, which its heads keep as `model`."""
    if config.is_encoder_decoder:
        return VanillaTransformerModel
    return VanillaTransformerDecoder if config.is_decoder else VanillaTransformerEncoder


class VanillaTransformerModel(VanillaTransformerPreTrainedModel):
    """Encoder-decoder without a head. `shared` is the target embedding, and also the source one by default (§3.4)."""

    _tied_weights_keys = {
        "decoder.embed_tokens.weight": "shared.weight",
        "encoder.embed_tokens.weight": "shared.weight",
    }
    # The stacks shard their own embeddings on the vocabulary (transformers adds that rule to a model with
    # `embed_tokens`); the shared one, held here, must be sharded like the `lm_head` tied to it.
    _tp_plan = {"shared": "embedding_rowwise"}

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.shared = ScaledWordEmbedding(config)
        self.encoder = VanillaTransformerEncoder(config)
        self.decoder = VanillaTransformerDecoder(config)
        # The stacks hold the shared embedding module itself, not a module tied to its weight: FSDP2 shards by
        # module, and a tied weight reachable from a second module would sit in two FSDP groups (torch rejects it).
        self.set_input_embeddings(self.shared)
        self.post_init()

    # `AutoModel` maps the config class to this one class; for a decoder-only or encoder-only checkpoint it must give
    # the stack that checkpoint was trained with (as AutoModel gives LlamaModel for a Llama checkpoint), whose weights
    # the head saved under `model.`, the base model prefix.
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        if cls is VanillaTransformerModel:
            base_class = base_model_class(cls.checkpoint_config(pretrained_model_name_or_path, config, kwargs))
            if base_class is not cls:
                return base_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    @overrides("PreTrainedModel._from_config")
    @classmethod
    def _from_config(cls, config: VanillaTransformerConfig, **kwargs):
        base_class = base_model_class(config) if cls is VanillaTransformerModel else cls
        if base_class is not cls:
            return base_class._from_config(config, **kwargs)
        return super()._from_config(config, **kwargs)

    @overrides("PreTrainedModel.get_expanded_tied_weights_keys")
    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Source/target sharing is its own switch (share_encoder_decoder_embeddings); transformers' generic mapping
        # would gate it on tie_word_embeddings, which only concerns the pre-softmax projection.
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        tied = dict(self._tied_weights_keys)
        if not self.config.share_encoder_decoder_embeddings:
            del tied["encoder.embed_tokens.weight"]
        return tied

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = self.decoder.embed_tokens = value
        if self.config.share_encoder_decoder_embeddings:
            self.encoder.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqModelOutput:  # Seq2SeqMoEModelOutput with experts
        r"""
        decoder_position_ids (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            The target positions (default: 0, 1, ... after the cache; in a flattened batch, restarting at each
            sequence).
        past_key_values (`Cache`, *optional*):
            The name of `cache` before transformers 5.24.

        A flattened batch (`DataCollatorForSeq2SeqWithFlattening`) gives the offsets of its target sequences as
        `cu_seq_lens_q`/`max_length_q` and of its source sequences as `cu_seq_lens_k`/`max_length_k`. Each stack
        checks its own inputs; the decoder those it reads from the encoder too.
        """
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "VanillaTransformerModel needs the target: pass decoder_input_ids (or decoder_inputs_embeds); a head "
                "with labels shifts them into it (VanillaTransformerForConditionalGeneration)."
            )
        # Router logits describe the layers that run in this call: those of given encoder outputs (generate passes
        # them at every step, not expanded to the beams) are not returned.
        encoder_runs = encoder_outputs is None
        if encoder_runs:
            encoder_outputs = self.encoder(
                return_dict=True,  # fields are read below; return_dict applies to this model's output
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                position_ids=position_ids,
                **source_side(kwargs),
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            return_dict=True,
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            cache=given_cache(cache, past_key_values),
            inputs_embeds=decoder_inputs_embeds,
            position_ids=decoder_position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        outputs = dict(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{CACHE_FIELD: getattr(decoder_outputs, CACHE_FIELD)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        if not self.config.num_experts:
            return Seq2SeqModelOutput(**outputs)
        return Seq2SeqMoEModelOutput(
            **outputs,
            encoder_router_logits=getattr(encoder_outputs, "router_logits", None) if encoder_runs else None,
            decoder_router_logits=decoder_outputs.router_logits,
        )


def source_side(kwargs: dict) -> dict:
    """The encoder's keyword arguments: in a flattened batch its sequences, the "q" side of a stack, are the source's,
    which an encoder-decoder batch gives as its "k" side (cross-attention's keys)."""
    if not is_flattened(kwargs):
        return kwargs
    return {**kwargs, "cu_seq_lens_q": kwargs.get("cu_seq_lens_k"), "max_length_q": kwargs.get("max_length_k")}


# ---------------------------------------------------------------------------------------- what the heads share


def current_tokens(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The tokens among the last `length` columns of a 2D padding mask, (batch, length) bool: the positions of this
    forward (the mask of a decoding step also covers the cache). None for no mask or a 4D one, which says nothing
    about padding."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask[:, -length:].bool()


def with_item_count(kwargs: dict, labels: torch.Tensor) -> dict:
    """The loss arguments with `num_items_in_batch` (the labels not ignored, at least 1: a tensor, no sync) unless the
    Trainer passed it: the loss is then a sum over that count, exact under gradient accumulation unlike a per-batch
    mean, and 0 when every label is ignored, where a mean would be NaN. Float labels (regression) count no items."""
    if kwargs.get("num_items_in_batch") is not None or labels.is_floating_point():
        return kwargs
    return {**kwargs, "num_items_in_batch": (labels != IGNORE_INDEX).sum().clamp(min=1)}


__all__ = [
    "FeedForward",
    "GatedFeedForward",
    "LearnedPositionalEmbedding",
    "MoeCausalLMOutput",
    "MoeDecoderOutput",
    "MoeEncoderOutput",
    "NoPositionalEmbedding",
    "RotaryEmbedding",
    "SinusoidalPositionalEmbedding",
    "SublayerConnection",
    "VanillaTransformerAttention",
    "VanillaTransformerDecoder",
    "VanillaTransformerDecoderLayer",
    "VanillaTransformerEncoder",
    "VanillaTransformerEncoderLayer",
    "VanillaTransformerExperts",
    "VanillaTransformerLayer",
    "VanillaTransformerModel",
    "VanillaTransformerPreTrainedModel",
    "VanillaTransformerRouter",
    "VanillaTransformerSparseMoeBlock",
    "build_feed_forward",
    "build_norm",
    "current_tokens",
    "deepnorm_constants",
    "dropped_token_counts",
    "expert_capacity",
    "ffn_activation",
    "sinusoidal_position_encoding",
    "with_item_count",
]
