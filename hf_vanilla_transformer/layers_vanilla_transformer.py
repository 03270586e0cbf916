"""The layers of the Transformer (§3.1-3.3): multi-head attention, the FFN or Mixture-of-Experts sub-layer, and the
encoder and decoder layers that wrap each sub-layer in dropout, residual and norm.

Attention goes through transformers' attention interface (eager, sdpa, flash, flex), or over the sequences of a
flattened batch (packing_vanilla_transformer); the Mixture of Experts block is in moe_vanilla_transformer.
"""

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, eager_attention_forward
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs

from .configuration_vanilla_transformer import Stack, VanillaTransformerConfig
from .feed_forward_vanilla_transformer import build_feed_forward
from .moe_vanilla_transformer import VanillaTransformerSparseMoeBlock
from .norms_vanilla_transformer import SublayerConnection, deepnorm_constants, set_deepnorm_init_gains
from .packing_vanilla_transformer import VARLEN_IMPLEMENTATIONS, AttentionLayout, packed_attention

# The longest sequence at which PyTorch's math SDPA kernel is the faster one for bfloat16/float16 training on a CPU.
SHORT_SEQUENCE_ON_CPU = 128


def attention_backend(attn_implementation: str, query: torch.Tensor, longest: int):
    """The SDPA kernel for this call: PyTorch's math kernel when training in bfloat16 or float16 on a CPU at short
    sequences, where its flash kernel (SDPA's choice there) is the slower one, up to 2.9x at 16 tokens (measured in
    docs/benchmarks.md, "CPU attention kernels"); SDPA's own choice everywhere else."""
    if (
        attn_implementation == "sdpa"
        and query.device.type == "cpu"
        and query.dtype in (torch.bfloat16, torch.float16)
        and torch.is_grad_enabled()
        and longest <= SHORT_SEQUENCE_ON_CPU
    ):
        return sdpa_kernel(SDPBackend.MATH)
    return nullcontext()


class VanillaTransformerAttention(nn.Module):
    """Multi-head scaled dot-product attention (§3.2), with grouped K/V heads when `num_key_value_heads` is set.

    Self-attention reads keys and values from its own input; cross-attention (`is_cross_attention`) from
    `key_value_states`, the encoder output (§3.2.3). A flattened batch attends within each of its sequences, as its
    `layout` says (packing_vanilla_transformer).
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

    def split_heads(self, projected: torch.Tensor) -> torch.Tensor:
        """(batch, length, heads * head_dim) -> (batch, heads, length, head_dim)."""
        return projected.view(*projected.shape[:-1], -1, self.head_dim).transpose(1, 2)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        key_value_states: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Cache | None = None,
        layout: AttentionLayout | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query = self.split_heads(self.q_proj(hidden_states))

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
            key, value = self.split_heads(self.k_proj(source)), self.split_heads(self.v_proj(source))
            if position_embeddings is not None:  # RoPE: rotate before caching, so cached keys keep their positions
                query, key = apply_rotary_pos_emb(query, key, *position_embeddings)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)
                if self.is_cross_attention:
                    past_key_values.is_updated[self.layer_idx] = True

        implementation = self.config._attn_implementation
        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        longest = max(query.shape[-2], key.shape[-2])
        if layout is not None:
            # transformers' flash integrations read the offsets themselves; packed rows without a kernel are a padded
            # batch with a mask that keeps each sequence to itself; every other call runs ours
            if layout.kernel in VARLEN_IMPLEMENTATIONS:
                kwargs.update(layout.flash_kwargs())
            elif layout.kernel is None and layout.queries.row_sequences is not None:
                attention_mask = layout.mask
            else:
                attention_interface, kwargs["layout"] = packed_attention, layout
            longest = max(layout.queries.max_length, layout.keys.max_length)
        with attention_backend(implementation, query, longest):
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


def build_mlp(config: VanillaTransformerConfig, stack: Stack, layer_idx: int) -> nn.Module:
    """The position-wise FFN of one layer (§3.3), or a Mixture of Experts in the layers `config.is_moe_layer` picks."""
    ffn_dim = config.encoder_ffn_dim if stack == "encoder" else config.decoder_ffn_dim
    if config.is_moe_layer(stack, layer_idx):
        return VanillaTransformerSparseMoeBlock(config, ffn_dim)
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
        attention_layout: AttentionLayout | None = None,
        cross_attention_layout: AttentionLayout | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        """`kwargs` reach both attentions: the decoder's cache (`past_key_values`) and transformers' attention
        options. A flattened batch's sequences come as the layouts of self- and cross-attention."""
        # Self-attention (§3.2.3): over the whole source in the encoder; in the decoder `attention_mask` is causal,
        # position i sees positions <= i only.
        attention_input = self.self_attn_connection.sublayer_input(hidden_states)
        attention_output, _ = self.self_attn(
            attention_input, attention_mask, position_embeddings=position_embeddings, layout=attention_layout, **kwargs
        )
        hidden_states = self.self_attn_connection.add_residual(hidden_states, attention_output)

        # Encoder-decoder attention: queries from the decoder, keys and values from the encoder output (§3.2.3).
        if encoder_hidden_states is not None:
            attention_input = self.encoder_attn_connection.sublayer_input(hidden_states)
            attention_output, _ = self.encoder_attn(
                attention_input,
                encoder_attention_mask,
                key_value_states=encoder_hidden_states,
                layout=cross_attention_layout,
                **kwargs,
            )
            hidden_states = self.encoder_attn_connection.add_residual(hidden_states, attention_output)

        # Position-wise feed-forward network, or Mixture of Experts (§3.3).
        mlp_output = self.mlp(self.mlp_connection.sublayer_input(hidden_states))
        return self.mlp_connection.add_residual(hidden_states, mlp_output)


class VanillaTransformerEncoderLayer(VanillaTransformerLayer):
    """An encoder layer: self-attention over the whole source, then FFN."""

    stack = "encoder"


class VanillaTransformerDecoderLayer(VanillaTransformerLayer):
    """A decoder layer: masked self-attention, attention over the encoder output (absent when decoder-only), then
    FFN."""

    stack = "decoder"


__all__ = [
    "VanillaTransformerAttention",
    "VanillaTransformerDecoderLayer",
    "VanillaTransformerEncoderLayer",
    "VanillaTransformerLayer",
    "build_mlp",
]
