"""Mixture of Experts: the FFN of §3.3 replaced by E expert FFNs, each token sent to its top-k (Shazeer et al. 2017).

    router      p = softmax(x W_r)  in fp32; the top-k experts of each token, weights optionally renormalised
    block       y = sum_{e in top-k} p_e FFN_e(x)  (+ shared experts applied to every token, DeepSeekMoE)
    experts     the E FFNs as 3D tensors in Mixtral's layout, run by the function `config._experts_implementation`
                names (`@use_experts_implementation`): transformers' "eager", "batched_mm", "grouped_mm", ..., or
                ours, "sorted_grouped_mm" (the default: the same grouped matmuls, fewer passes over the rows)
    capacity    with factor c, expert e serves at most ceil(c * tokens * k / E) tokens (GShard, Switch Transformer);
                the rest skip it, so a token with no expert left keeps only its residual

The router losses that train the gate are in router_losses_vanilla_transformer.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.integrations.moe import use_experts_implementation
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    MoeCausalLMOutputWithPast,
)

from .configuration_vanilla_transformer import GATED_FFN_TYPES, VanillaTransformerConfig
from .dropout_vanilla_transformer import Dropout
from .feed_forward_vanilla_transformer import ffn_activation
from .moe_kernels_vanilla_transformer import (  # the kernels' names stay importable from here
    EXPERTS_FUNCTIONS,
    SORTED_GROUPED_MM,
    gated_activation,
    grouped_mm_takes,
    local_expert_ids,
    sorted_grouped_mm_experts_forward,
)


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


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Tokens one expert may serve: ceil(c * tokens * k / E) (Switch Transformer eq. 3, times k for top-k)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def within_capacity(top_k_index: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Which (token, choice) assignments an expert still has room for: (T, k) bool.

    Assignments are served first choices first, then second choices, each in token order (GShard §2.2), so a token
    loses its k-th expert before any other token loses its first.
    """
    top_k = top_k_index.shape[1]
    by_rank = top_k_index.t().reshape(-1)  # (k*T,): every first choice, then every second choice, ...
    one_hot = F.one_hot(by_rank, num_experts)
    position_in_expert = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1)  # 1-based
    return (position_in_expert <= capacity).view(top_k, -1).t()


# ---------------------------------------------------------------------------------------------------- experts


@use_experts_implementation(experts_interface=EXPERTS_FUNCTIONS)
class VanillaTransformerExperts(nn.Module):
    """`num_experts` FFNs of `config.ffn_type` (§3.3 or a GLU variant) stored as 3D tensors in Mixtral's layout, so
    that transformers' experts functions run them: gated types fuse [gate; up] in `gate_up_proj` (E, 2I, H), ungated
    ones have `up_proj` (E, I, H); `down_proj` is (E, H, I); `*_bias` when `config.use_bias`. `forward` is the eager
    implementation; the decorator dispatches on `config._experts_implementation`."""

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
        self.activation_dropout = Dropout(config.activation_dropout)

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


class VanillaTransformerSparseMoeBlock(nn.Module):
    """The FFN sub-layer as a Mixture of Experts: `gate` (router), `experts`, and optional `shared_experts`.

    Parameter names follow Mixtral (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
    With `expert_capacity_factor` set,
    `dropped_tokens` holds the number of (token, expert) assignments the last forward dropped for lack of room.
    """

    def __init__(self, config: VanillaTransformerConfig, ffn_dim: int):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.capacity_factor = config.expert_capacity_factor
        self.gate = VanillaTransformerRouter(config)
        self.experts = VanillaTransformerExperts(config, config.num_experts, ffn_dim)
        # Shared experts (Dai et al. 2024, DeepSeekMoE): experts every token is sent to with weight 1.
        self.shared_experts = (
            VanillaTransformerExperts(config, config.num_shared_experts, ffn_dim) if config.num_shared_experts else None
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
        """Run only the kept assignments, one row each, and sum them back per token; dropped ones contribute 0, so
        a token that lost every expert keeps only its residual."""
        capacity = expert_capacity(tokens.shape[0], self.top_k, self.num_experts, self.capacity_factor)
        keep = within_capacity(top_k_index, self.num_experts, capacity)
        self.dropped_tokens = keep.numel() - int(keep.sum())
        token, choice = keep.nonzero(as_tuple=True)
        kept = self.experts(tokens[token], top_k_index[token, choice, None], top_k_weights[token, choice, None])
        return torch.zeros_like(tokens).index_add_(0, token, kept)


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
    """Module name -> assignments dropped for lack of capacity in the last forward, for every MoE block."""
    return {
        name: module.dropped_tokens
        for name, module in model.named_modules()
        if isinstance(module, VanillaTransformerSparseMoeBlock) and module.dropped_tokens is not None
    }


# ---------------------------------------------------------------------------------------------------- outputs


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


__all__ = [
    "SORTED_GROUPED_MM",
    "VanillaTransformerExperts",
    "VanillaTransformerRouter",
    "VanillaTransformerSparseMoeBlock",
    "MoeEncoderOutput",
    "MoeDecoderOutput",
    "MoeCausalLMOutput",
    "dropped_token_counts",
    "expert_capacity",
    "gated_activation",
    "grouped_mm_takes",
    "sorted_grouped_mm_experts_forward",
    "within_capacity",
]
