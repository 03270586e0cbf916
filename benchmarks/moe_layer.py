"""Our sparse MoE layer against HF `MixtralSparseMoeBlock` (same weights) and against a dense FFN of equal active size.

All three are SwiGLU FFNs without biases (Mixtral's expert): top-k of E experts of hidden size I each, versus one
dense SwiGLU FFN of hidden size k * I, which has the same parameters active per token. Timed: forward + backward
(a training step's share of the layer), in tokens/s.
"""

import torch
from measure import time_alternating
from transformers import MixtralConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

from hf_vanilla_transformer import VanillaTransformerConfig, VanillaTransformerModel
from hf_vanilla_transformer.modeling_vanilla_transformer import build_feed_forward
from hf_vanilla_transformer.moe_kernels_vanilla_transformer import SORTED_GROUPED_MM


def moe_config(d_model: int, ffn_dim: int, num_experts: int, top_k: int, gated_dim: int) -> VanillaTransformerConfig:
    """One encoder layer, no decoder: the MoE block is taken out of it."""
    return VanillaTransformerConfig(
        vocab_size=16,
        d_model=d_model,
        encoder_layers=1,
        decoder_layers=0,
        is_encoder_decoder=False,  # encoder-only: no decoder to run
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        ffn_type="swiglu",
        gated_ffn_dim=gated_dim,
        use_bias=False,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        dropout=0.0,
    )


def build_layers(d_model: int, expert_dim: int, num_experts: int, top_k: int, dtype, device):
    """(our MoE block, Mixtral's block with the same weights, dense SwiGLU FFN of hidden size top_k * expert_dim)."""
    config = moe_config(d_model, expert_dim, num_experts, top_k, expert_dim)
    ours = VanillaTransformerModel(config).encoder.layers[0].mlp
    mixtral = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=d_model,
            intermediate_size=expert_dim,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            hidden_act="silu",
        )
    )
    mixtral.load_state_dict({name: ours.state_dict()[name] for name in mixtral.state_dict()})
    dense_config = moe_config(d_model, expert_dim, 0, top_k, top_k * expert_dim)
    dense = build_feed_forward(dense_config, top_k * expert_dim)
    return tuple(layer.to(device=device, dtype=dtype).train() for layer in (ours, mixtral, dense))


def set_experts_implementation(block: torch.nn.Module, implementation: str) -> None:
    # Both experts classes are wrapped by transformers' `use_experts_implementation`, which dispatches on the
    # `_experts_implementation` of the config the experts module holds.
    block.experts.config._experts_implementation = implementation


def forward_backward(layer: torch.nn.Module, hidden_states: torch.Tensor):
    def run():
        layer.zero_grad(set_to_none=True)
        layer(hidden_states).sum().backward()

    return run


def moe_section(
    settings, tokens: int, d_model: int = 512, expert_dim: int = 1024, num_experts: int = 8, top_k: int = 2
) -> list[dict]:
    """Our MoE block vs Mixtral's (eager, then grouped_mm experts) and vs the dense FFN, forward + backward."""
    ours, mixtral, dense = build_layers(d_model, expert_dim, num_experts, top_k, settings.dtype, settings.device)
    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(1, tokens, d_model, generator=generator).to(settings.device, settings.dtype)
    for block in (ours, mixtral):
        set_experts_implementation(block, "eager")
    with torch.no_grad():
        difference = (ours(hidden_states) - mixtral(hidden_states)).abs().max().item()
    rows = []

    def compare(name: str, reference_name: str, reference: torch.nn.Module, implementation: str, ours_as=None):
        set_experts_implementation(ours, ours_as or implementation)
        if reference is mixtral:
            set_experts_implementation(mixtral, implementation)
        timing = time_alternating(
            forward_backward(ours, hidden_states),
            forward_backward(reference, hidden_states),
            settings.repeats,
            settings.device,
            settings.clock,
        )
        rows.append(
            {
                "name": name,
                "reference": reference_name,
                "experts_implementation": implementation,
                "ours_experts_implementation": ours_as or implementation,
                "tokens": tokens,
                "ours_tokens_per_s": tokens / timing.median_a,
                "reference_tokens_per_s": tokens / timing.median_b,
                "speed_ratio": timing.ratio,
                "max_abs_diff_vs_mixtral": difference,
                "seconds_ours": timing.seconds_a,
                "seconds_reference": timing.seconds_b,
            }
        )

    compare("MoE fwd+bwd vs Mixtral (eager)", "MixtralSparseMoeBlock", mixtral, "eager")
    # Our default experts implementation against transformers' grouped_mm.
    compare("MoE fwd+bwd vs Mixtral (grouped_mm)", "MixtralSparseMoeBlock", mixtral, "grouped_mm", SORTED_GROUPED_MM)
    compare(f"MoE fwd+bwd vs dense FFN ({top_k * expert_dim})", "dense SwiGLU FFN", dense, SORTED_GROUPED_MM)
    return rows
