"""Convert a Hugging Face `MixtralForCausalLM` into an equivalent decoder-only MoE `VanillaTransformerForCausalLM`.

Mixtral (Jiang et al. 2024) is Llama with every FFN replaced by a Mixture of Experts: top-2 of 8 SwiGLU experts,
the two weights renormalised. Attention, norms and positions convert as for Llama (convert_llama_vanilla_transformer);
the MoE weights already use our layout (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
"""

import torch
from transformers import LlamaConfig, MixtralForCausalLM

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .conversion_vanilla_transformer import renamed_state_dict
from .convert_llama_vanilla_transformer import PARAMETER_RENAMES, causal_lm_like, llama_config_to_vanilla_transformer
from .language_modeling_vanilla_transformer import VanillaTransformerForCausalLM


def mixtral_config_to_vanilla_transformer(config) -> VanillaTransformerConfig:
    """The `VanillaTransformerConfig` of a decoder-only MoE model computing the same function as a Mixtral `config`.

    Raises:
        ValueError: for a sliding attention window (not implemented here), and for the Llama options the Llama
            converter rejects.
    """
    if config.sliding_window is not None:
        raise ValueError(
            f"sliding_window={config.sliding_window} is not supported: the vanilla transformer attends to the whole "
            "prefix. Set sliding_window=None (the same function for sequences no longer than the window)."
        )
    dense = LlamaConfig(  # the same model with one dense FFN of an expert's size per layer
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim or config.hidden_size // config.num_attention_heads,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters=config.rope_parameters,
        attention_dropout=config.attention_dropout,
        attention_bias=False,  # Mixtral has no biases
        mlp_bias=False,
        tie_word_embeddings=config.tie_word_embeddings,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
    )
    moe = dict(
        num_experts=config.num_local_experts,
        num_experts_per_tok=config.num_experts_per_tok,
        moe_stacks="decoder",
        moe_layer_frequency=1,
        norm_topk_prob=True,  # Mixtral always renormalises the top-k weights
        router_jitter_noise=config.router_jitter_noise,
        router_aux_loss_coef=config.router_aux_loss_coef,
        router_z_loss_coef=0.0,  # Mixtral trains without a z-loss
        expert_capacity_factor=None,  # dropless
    )
    return VanillaTransformerConfig.from_dict({**llama_config_to_vanilla_transformer(dense).to_dict(), **moe})


@torch.no_grad()
def convert_mixtral_to_vanilla_transformer(model: MixtralForCausalLM) -> VanillaTransformerForCausalLM:
    """A `VanillaTransformerForCausalLM` with `model`'s weights, in its dtype and on its device, that computes the same
    logits: the Llama-style decoder of `convert_llama_to_vanilla_transformer` with a top-k SwiGLU Mixture of Experts
    in every layer. Two training-only differences: router jitter perturbs the router input only (Switch) where
    Mixtral's also perturbs the experts' input, and the balancing loss is averaged over layers (Switch) where Mixtral
    pools its statistics over all layers.
    """
    converted = causal_lm_like(model, mixtral_config_to_vanilla_transformer(model.config))
    converted.load_state_dict(renamed_state_dict(model.state_dict(), PARAMETER_RENAMES), strict=True)
    return converted.train(model.training)


__all__ = ["convert_mixtral_to_vanilla_transformer", "mixtral_config_to_vanilla_transformer"]
