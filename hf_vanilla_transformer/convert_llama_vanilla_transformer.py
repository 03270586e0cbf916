"""Convert a Hugging Face `LlamaForCausalLM` into an equivalent decoder-only `VanillaTransformerForCausalLM`.

Llama is the paper's decoder with four variants switched on, each one config field here: pre-norm
(`norm_position="pre"`, Xiong et al. 2020), RMSNorm (Zhang & Sennrich 2019), a gated FFN (SwiGLU, Shazeer 2020) and
rotary positions (Su et al. 2021), plus grouped K/V heads (Ainslie et al. 2023). The weights map one to one; only
names change. `rope_parameters` carry over as they are: every RoPE type of transformers' table runs here.
"""

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .conversion_vanilla_transformer import renamed_state_dict
from .language_modeling_vanilla_transformer import VanillaTransformerForCausalLM

# Llama's `hidden_act` (applied to gate_proj) -> our gated ffn_type with the same gate activation.
GATED_FFN_FOR_ACTIVATION = {"silu": "swiglu", "gelu": "geglu", "relu": "reglu"}

# Llama parameter name -> ours (regex, replacement); names not listed are the same in both models.
PARAMETER_RENAMES = [
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
    (r"\.input_layernorm\.", ".self_attn_connection.norm."),  # the norm before self-attention (pre-norm)
    (r"\.post_attention_layernorm\.", ".mlp_connection.norm."),  # the norm before the FFN
    (r"^model\.norm\.", "model.layer_norm."),  # the final norm after the stack
]


def _check_convertible(config) -> None:
    """Llama options our model has no equivalent for raise instead of converting to a different function."""
    if config.hidden_act not in GATED_FFN_FOR_ACTIVATION:
        raise ValueError(f"hidden_act={config.hidden_act!r} is not one of {sorted(GATED_FFN_FOR_ACTIVATION)}.")
    if config.head_dim * config.num_attention_heads != config.hidden_size:
        raise ValueError(
            f"head_dim={config.head_dim} * num_attention_heads={config.num_attention_heads} != hidden_size="
            f"{config.hidden_size}: the vanilla transformer splits d_model evenly across heads."
        )
    if config.attention_bias != config.mlp_bias:
        raise ValueError(
            f"attention_bias={config.attention_bias} and mlp_bias={config.mlp_bias} differ; the vanilla transformer "
            "has one `use_bias` switch for all linears."
        )


def llama_config_to_vanilla_transformer(config) -> VanillaTransformerConfig:
    """The `VanillaTransformerConfig` of a decoder-only model computing the same function as a Llama `config`."""
    _check_convertible(config)
    return VanillaTransformerConfig(
        vocab_size=config.vocab_size,
        d_model=config.hidden_size,
        encoder_layers=config.num_hidden_layers,  # `num_hidden_layers` maps to encoder_layers (BART's attribute_map)
        decoder_layers=config.num_hidden_layers,
        encoder_attention_heads=config.num_attention_heads,
        decoder_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        encoder_ffn_dim=config.intermediate_size,
        decoder_ffn_dim=config.intermediate_size,
        gated_ffn_dim=config.intermediate_size,  # Llama's size is the gated one already: no 2/3 rescaling
        max_position_embeddings=config.max_position_embeddings,
        dropout=0.0,
        attention_dropout=config.attention_dropout,
        norm_type="rmsnorm",
        norm_position="pre",
        norm_eps=config.rms_norm_eps,
        ffn_type=GATED_FFN_FOR_ACTIVATION[config.hidden_act],
        use_bias=config.attention_bias,
        position_embedding_type="rope",
        rope_parameters=config.rope_parameters,
        scale_embedding=False,  # Llama does not multiply embeddings by sqrt(d_model)
        tie_word_embeddings=config.tie_word_embeddings,
        is_encoder_decoder=False,
        is_decoder=True,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        decoder_start_token_id=config.bos_token_id,
    )


@torch.no_grad()
def convert_llama_to_vanilla_transformer(model: LlamaForCausalLM) -> VanillaTransformerForCausalLM:
    """A `VanillaTransformerForCausalLM` with `model`'s weights, in its dtype and on its device, that computes the same
    logits: pre-norm RMSNorm decoder, SwiGLU FFN of Llama's `intermediate_size`, RoPE with Llama's `rope_parameters`
    (any type of transformers', Llama 3's included), grouped K/V heads, unscaled embeddings, and an LM head tied only
    if Llama ties it.

    Raises:
        ValueError: for Llama options without an equivalent here (a head size other than hidden_size /
            num_attention_heads, a `partial_rotary_factor` that leaves part of each head unrotated, differing
            attention and MLP bias switches, other activations).
    """
    converted = causal_lm_like(model, llama_config_to_vanilla_transformer(model.config))
    converted.load_state_dict(renamed_state_dict(model.state_dict(), PARAMETER_RENAMES), strict=True)
    return converted.train(model.training)


def causal_lm_like(model: nn.Module, config: VanillaTransformerConfig) -> VanillaTransformerForCausalLM:
    """A causal LM of `config` in `model`'s dtype and on its device, built as `from_pretrained` builds it: parameters
    in that dtype, RoPE's frequencies in float32 as transformers' models keep them (casting the built model to
    bfloat16 would round them, and the angles at long positions with them)."""
    return AutoModelForCausalLM.from_config(config, dtype=model.dtype).to(model.device)


__all__ = ["convert_llama_to_vanilla_transformer", "llama_config_to_vanilla_transformer"]
