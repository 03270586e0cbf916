"""The layers of the Transformer (§3.1-3.3): multi-head attention, the FFN or Mixture-of-Experts sub-layer, and the
encoder and decoder layers that wrap each sub-layer in dropout, residual and norm.

Attention goes through transformers' attention interface (eager, sdpa, flash, flex). The expert banks run
transformers' grouped/batched kernels (`@use_experts_implementation`). A layer's input may be packed, (tokens,
d_model), by its stack (packing_vanilla_transformer): only attention scatters back to (batch, length).
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.integrations.moe import use_experts_implementation
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_vanilla_transformer import GATED_FFN_TYPES, Stack, VanillaTransformerConfig
from .feed_forward_vanilla_transformer import build_feed_forward, ffn_activation
from .moe_vanilla_transformer import EXPERTS_FUNCTIONS, VanillaTransformerSparseMoeBlock, gated_activation
from .norms_vanilla_transformer import SublayerConnection, deepnorm_constants, set_deepnorm_init_gains
from .packing_vanilla_transformer import PackedTokens


class VanillaTransformerAttention(nn.Module):
    """Multi-head scaled dot-product attention (§3.2), with grouped K/V heads when `num_key_value_heads` is set.

    Self-attention reads keys and values from its own input; cross-attention (`is_cross_attention`) from
    `key_value_states`, the encoder output (§3.2.3). Packed inputs, (tokens, d_model), are scattered back to
    (batch, length) after their projections, for the score matrix only.
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

    def _split_heads(self, projected: torch.Tensor, packed_tokens: PackedTokens | None) -> torch.Tensor:
        """(batch, heads, length, head_dim); packed projections (tokens, ·) are scattered to (batch, length, ·)."""
        if projected.dim() == 2:
            projected = packed_tokens.unpack(projected)
        return projected.view(*projected.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        packed_tokens: PackedTokens | None = None,
        encoder_packed_tokens: PackedTokens | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`packed_tokens`: the layout of packed `hidden_states`; `encoder_packed_tokens`: that of packed
        `key_value_states` (cross-attention)."""
        query = self._split_heads(self.q_proj(hidden_states), packed_tokens)

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
            source, source_tokens = (
                (key_value_states, encoder_packed_tokens) if self.is_cross_attention else (hidden_states, packed_tokens)
            )
            key = self._split_heads(self.k_proj(source), source_tokens)
            value = self._split_heads(self.v_proj(source), source_tokens)
            if position_embeddings is not None:  # RoPE: rotate before caching, so cached keys keep their positions
                query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
                if self.is_cross_attention:
                    past_key_values.is_updated[self.layer_idx] = True

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
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
        attn_output = attn_output.reshape(*attn_output.shape[:2], -1)
        attn_output = packed_tokens.pack(attn_output) if hidden_states.dim() == 2 else attn_output.contiguous()
        return self.out_proj(attn_output), attn_weights


@use_experts_implementation(experts_interface=EXPERTS_FUNCTIONS)
class ExpertBank(nn.Module):
    """`num_experts` FFNs of `config.ffn_type` (§3.3 or a GLU variant) stored as 3D tensors in Mixtral's layout, so
    transformers' `grouped_mm`/`batched_mm` kernels run them: gated types fuse [gate; up] in `gate_up_proj`
    (E, 2I, H), ungated ones have `up_proj` (E, I, H); `down_proj` is (E, H, I); `*_bias` when `config.use_bias`."""

    def __init__(self, config: VanillaTransformerConfig, num_experts: int, ffn_dim: int):
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
        self.activation = ffn_activation(config)
        self.activation_dropout = nn.Dropout(config.activation_dropout)

    @property
    def up_projection_name(self) -> str:
        return "gate_up_proj" if self.has_gate else "up_proj"

    def act_fn(self, up: torch.Tensor) -> torch.Tensor:
        """Hidden activation of an ungated expert (the kernels call it by this name)."""
        return self.activation_dropout(self.activation(up))

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Hidden activation of a gated expert: act(gate) * up (Shazeer 2020)."""
        return self.activation_dropout(gated_activation(gate_up, self.activation))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """The eager path, one expert at a time: hidden_states (T, H), top_k_index and top_k_weights (T, k) -> (T, H),
        each token's sum over its choices of weight * FFN_expert(x)."""
        up_name = self.up_projection_name
        output = torch.zeros_like(hidden_states)
        for expert in top_k_index.unique().tolist():
            token, choice = torch.where(top_k_index == expert)
            up = nn.functional.linear(hidden_states[token], getattr(self, up_name)[expert], self._bias(up_name, expert))
            hidden = self._apply_gate(up) if self.has_gate else self.act_fn(up)
            expert_output = nn.functional.linear(hidden, self.down_proj[expert], self._bias("down_proj", expert))
            output.index_add_(0, token, (expert_output * top_k_weights[token, choice, None]).to(output.dtype))
        return output

    def _bias(self, projection: str, expert: int) -> torch.Tensor | None:
        return getattr(self, f"{projection}_bias")[expert] if self.has_bias else None


class VanillaTransformerExperts(ExpertBank):
    """The expert bank of one MoE layer. transformers' decorator fixes `has_gate`/`has_bias` per class, after
    `__init__`; here they follow the config, so they are set once the decorated `__init__` has run."""

    def __init__(self, config: VanillaTransformerConfig, num_experts: int, ffn_dim: int):
        super().__init__(config, num_experts, ffn_dim)
        self.has_gate = config.ffn_type in GATED_FFN_TYPES
        self.has_bias = config.use_bias

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self._is_expert_parallel:
            # Under expert parallelism `num_experts` counts this rank's experts, and a choice of another rank's expert
            # comes as id `num_experts` with weight 0 (transformers' all-reduce dispatch): a local expert runs it and
            # the weight drops its output, as in transformers' own experts kernels.
            top_k_index = top_k_index.clamp(max=self.num_experts - 1)
        return super().forward(hidden_states, top_k_index, top_k_weights)


def build_mlp(config: VanillaTransformerConfig, stack: Stack, layer_idx: int) -> nn.Module:
    """The position-wise FFN of one layer (§3.3), or a Mixture of Experts in the layers `config.is_moe_layer` picks."""
    ffn_dim = config.encoder_ffn_dim if stack == "encoder" else config.decoder_ffn_dim
    if config.is_moe_layer(stack, layer_idx):
        return VanillaTransformerSparseMoeBlock(config, ffn_dim, VanillaTransformerExperts)
    return build_feed_forward(config, ffn_dim)


def residual_scale(config: VanillaTransformerConfig, stack: Stack) -> float:
    """DeepNet's alpha for the residual branch of every sub-layer of `stack` (1 for the other placements)."""
    return deepnorm_constants(config, stack)[0] if config.norm_position == "deepnorm" else 1.0


class VanillaTransformerLayer(GradientCheckpointingLayer):
    """One layer of either stack (§3.1): self-attention, attention over the encoder output (a decoder of an
    encoder-decoder only), then the FFN; each sub-layer wrapped in dropout, residual and norm. The subclasses name
    the stack (`stack`): encoder self-attention sees the whole source, decoder self-attention is masked."""

    stack: Stack

    def __init__(self, config: VanillaTransformerConfig, layer_idx: int):
        super().__init__()
        alpha = residual_scale(config, self.stack)
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
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`kwargs` reach both attentions: the decoder's cache (`past_key_values`), the token layouts
        (`packed_tokens`, `encoder_packed_tokens`) and transformers' attention options."""
        # Self-attention (§3.2.3): over the whole source in the encoder; in the decoder `attention_mask` is causal,
        # position i sees positions <= i only.
        attention_input = self.self_attn_connection.sublayer_input(hidden_states)
        attention_output, _ = self.self_attn(
            attention_input, attention_mask, position_embeddings=position_embeddings, **kwargs
        )
        hidden_states = self.self_attn_connection.add_residual(hidden_states, attention_output)

        # Encoder-decoder attention: queries from the decoder, keys and values from the encoder output (§3.2.3).
        if encoder_hidden_states is not None:
            attention_input = self.encoder_attn_connection.sublayer_input(hidden_states)
            attention_output, _ = self.encoder_attn(
                attention_input, encoder_attention_mask, key_value_states=encoder_hidden_states, **kwargs
            )
            hidden_states = self.encoder_attn_connection.add_residual(hidden_states, attention_output)

        # Position-wise feed-forward network, or Mixture of Experts (§3.3).
        mlp_output = self.mlp(self.mlp_connection.sublayer_input(hidden_states), **kwargs)
        return self.mlp_connection.add_residual(hidden_states, mlp_output)


class VanillaTransformerEncoderLayer(VanillaTransformerLayer):
    """An encoder layer: self-attention over the whole source, then FFN."""

    stack = "encoder"


class VanillaTransformerDecoderLayer(VanillaTransformerLayer):
    """A decoder layer: masked self-attention, attention over the encoder output (absent when decoder-only), then
    FFN."""

    stack = "decoder"


__all__ = [
    "ExpertBank",
    "VanillaTransformerAttention",
    "VanillaTransformerDecoderLayer",
    "VanillaTransformerEncoderLayer",
    "VanillaTransformerExperts",
    "VanillaTransformerLayer",
    "build_mlp",
]
