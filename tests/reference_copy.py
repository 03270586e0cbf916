"""Copy a VanillaTransformerForConditionalGeneration into an independent reference: `torch.nn.Transformer`.

`torch.nn.Transformer` holds only the layer stacks (§3.1), so the token embeddings, the §3.4 scaling, the position
encodings (§3.5) and the pre-softmax projection stay ours: `torch_transformer_logits` embeds with our modules, runs the
reference stacks, and projects with our `lm_head`. Everything in between is torch's code.

Used by the post-norm parity test (tests/test_core.py) and the pre-norm one (tests/test_variants.py).
"""

import warnings

import torch
from torch import nn

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration

# ffn_type -> the `activation` argument of torch.nn.Transformer (it has no gated FFN).
TORCH_ACTIVATIONS = {"relu": "relu", "gelu": "gelu"}


def _check_comparable(config) -> None:
    """torch.nn.Transformer has post- or pre-LayerNorm, ReLU/GELU FFNs and one K/V head per query head only."""
    if config.norm_type != "layernorm" or config.norm_position not in ("post", "pre"):
        raise ValueError(
            f"torch.nn.Transformer has post- or pre-LayerNorm only, not norm_type={config.norm_type!r} "
            f"with norm_position={config.norm_position!r}."
        )
    if config.ffn_type not in TORCH_ACTIVATIONS:
        raise ValueError(f"torch.nn.Transformer has no ffn_type={config.ffn_type!r}; use one of {TORCH_ACTIVATIONS}.")
    if config.num_key_value_heads not in (None, config.encoder_attention_heads, config.decoder_attention_heads):
        raise ValueError("torch.nn.Transformer has no grouped K/V heads (num_key_value_heads).")
    if config.encoder_attention_heads != config.decoder_attention_heads or config.num_experts:
        raise ValueError("torch.nn.Transformer needs equal encoder/decoder head counts and a dense FFN.")
    if config.encoder_ffn_dim != config.decoder_ffn_dim or not config.norm_bias:
        raise ValueError("torch.nn.Transformer needs equal encoder/decoder FFN sizes and LayerNorms with bias.")


def _copy_attention(target: nn.MultiheadAttention, source: nn.Module) -> None:
    # nn.MultiheadAttention packs the query, key and value projections into one (3 d_model, d_model) matrix.
    target.in_proj_weight.copy_(torch.cat([source.q_proj.weight, source.k_proj.weight, source.v_proj.weight]))
    target.out_proj.weight.copy_(source.out_proj.weight)
    if source.q_proj.bias is not None:
        target.in_proj_bias.copy_(torch.cat([source.q_proj.bias, source.k_proj.bias, source.v_proj.bias]))
        target.out_proj.bias.copy_(source.out_proj.bias)


def _copy_ffn(target: nn.Module, source: nn.Module) -> None:
    target.linear1.load_state_dict(source.fc1.state_dict())
    target.linear2.load_state_dict(source.fc2.state_dict())


@torch.no_grad()
def copy_into_torch_transformer(model: VanillaTransformerForConditionalGeneration) -> nn.Transformer:
    """A `torch.nn.Transformer` (batch_first, eval mode) computing the same encoder and decoder stacks as `model`.

    Post-norm (`norm_first=False`) or pre-norm (`norm_first=True`) follows `config.norm_position`. torch always ends
    each stack with a LayerNorm; the paper's post-norm stacks have none, so for post-norm those are removed.
    """
    config = model.config
    _check_comparable(config)
    with warnings.catch_warnings():  # "enable_nested_tensor is True, but ... norm_first": irrelevant, fast path is off
        warnings.filterwarnings("ignore", message="enable_nested_tensor")
        reference = nn.Transformer(
            d_model=config.d_model,
            nhead=config.encoder_attention_heads,
            num_encoder_layers=config.encoder_layers,
            num_decoder_layers=config.decoder_layers,
            dim_feedforward=config.encoder_ffn_dim,
            dropout=0.0,
            activation=TORCH_ACTIVATIONS[config.ffn_type],
            layer_norm_eps=config.norm_eps,
            batch_first=True,
            norm_first=config.norm_position == "pre",
            bias=config.use_bias,
        )
    for ours, theirs in zip(model.model.encoder.layers, reference.encoder.layers, strict=True):
        _copy_attention(theirs.self_attn, ours.self_attn)
        _copy_ffn(theirs, ours.mlp)
        theirs.norm1.load_state_dict(ours.self_attn_connection.norm.state_dict())
        theirs.norm2.load_state_dict(ours.mlp_connection.norm.state_dict())
    for ours, theirs in zip(model.model.decoder.layers, reference.decoder.layers, strict=True):
        _copy_attention(theirs.self_attn, ours.self_attn)
        _copy_attention(theirs.multihead_attn, ours.encoder_attn)
        _copy_ffn(theirs, ours.mlp)
        theirs.norm1.load_state_dict(ours.self_attn_connection.norm.state_dict())
        theirs.norm2.load_state_dict(ours.encoder_attn_connection.norm.state_dict())
        theirs.norm3.load_state_dict(ours.mlp_connection.norm.state_dict())
    if config.norm_position == "pre":
        reference.encoder.norm.load_state_dict(model.model.encoder.layer_norm.state_dict())
        reference.decoder.norm.load_state_dict(model.model.decoder.layer_norm.state_dict())
    else:
        reference.encoder.norm = reference.decoder.norm = None
    return reference.eval()


def embed(stack: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Our stack's input: scaled token embeddings (§3.4) plus position encodings (§3.5), positions 0..T-1."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return stack.embed_positions(stack.embed_tokens(input_ids), positions)[0]


@torch.no_grad()
def torch_transformer_logits(
    model: VanillaTransformerForConditionalGeneration,
    reference: nn.Transformer,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    decoder_input_ids: torch.Tensor,
) -> torch.Tensor:
    """Logits computed by `reference`'s stacks between our embeddings and our `lm_head`, with source padding masked
    in encoder self-attention and in cross-attention, and a causal mask on decoder self-attention."""
    source_padding = attention_mask == 0  # torch: True = ignore this key
    target_length = decoder_input_ids.shape[1]
    causal = torch.ones(target_length, target_length, dtype=torch.bool, device=input_ids.device).triu(1)
    # torch's inference fast path (nested tensors) returns zeros at padded positions; compare the plain math path.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        hidden_states = reference(
            embed(model.model.encoder, input_ids),
            embed(model.model.decoder, decoder_input_ids),
            tgt_mask=causal,
            src_key_padding_mask=source_padding,
            memory_key_padding_mask=source_padding,
            tgt_is_causal=True,
        )
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return model.lm_head(hidden_states)
