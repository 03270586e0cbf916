"""The router losses of a Mixture of Experts (the block is in the modeling file), and how a head adds them to its loss.

    balancing   E * sum_e f_e P_e per layer  (Switch Transformer eq. 4-6, mask-aware, Mixtral's function)
    z-loss      mean_tokens (logsumexp x)^2   (ST-MoE eq. 5)
    total       router_aux_loss_coef * balancing + router_z_loss_coef * z-loss, summed over the stacks

The heads are the only readers. A head states what it asks of the routers in one forward (`RouterRequest.of`: one
line, for a dense model too) and adds their losses (`RouterRequest.add_losses`): the total joins the gradient of any
loss built from the head's logits, and the reported loss as a value whose gradient scales it as that loss is scaled
(fp16's loss scale, gradient accumulation).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .configuration_vanilla_transformer import VanillaTransformerConfig


def counted_rows(attention_mask: torch.Tensor | None, layer_logits: torch.Tensor) -> torch.Tensor:
    """The weight of each row of a layer's router logits (one per position of this forward) in its losses: 1 for a
    token, 0 for padding. A 2D padding mask gives them from its last columns (a decoding step's mask also covers the
    cache); without one, or with a 4D mask, which says nothing about padding, every row counts."""
    if attention_mask is None or attention_mask.dim() == 4:
        return layer_logits.new_ones(layer_logits.shape[0])
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be (batch, length) or 4D, got shape {tuple(attention_mask.shape)}.")
    length = layer_logits.shape[0] // attention_mask.shape[0]
    return attention_mask[:, -length:].reshape(-1).to(layer_logits.dtype)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | None,
    config: VanillaTransformerConfig,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Switch Transformer's auxiliary loss E * sum_e f_e P_e (eq. 4-6), per layer and averaged over one stack's MoE
    layers, padding excluded.

    f_e is the fraction of the counted tokens that chose expert e among their top k and P_e its mean router
    probability (transformers' Mixtral `load_balancing_loss_func`, one layer at a time: given all layers at once it
    pools f and P over them, which a stack with each layer collapsed onto different experts would satisfy). Perfectly
    balanced routing gives k, its minimum; sending everything to k experts gives E. No token counted: 0.
    """
    if not router_logits:
        return torch.zeros(())
    num_experts, top_k = config.num_experts, config.num_experts_per_tok
    per_layer = []
    for layer_logits in router_logits:
        weights = counted_rows(attention_mask, layer_logits)
        probabilities = layer_logits.float().softmax(dim=-1)
        chosen = probabilities.topk(top_k, dim=-1).indices.reshape(-1)
        per_choice = weights[:, None].expand(-1, top_k).reshape(-1)
        count = weights.sum().clamp(min=1.0)
        fraction = probabilities.new_zeros(num_experts).index_add_(0, chosen, per_choice) / count
        mean_probability = (probabilities * weights[:, None]).sum(dim=0) / count
        per_layer.append(num_experts * (fraction * mean_probability).sum())
    return torch.stack(per_layer).mean()


def router_z_loss(router_logits: tuple[torch.Tensor, ...] | None, attention_mask=None) -> torch.Tensor:
    """ST-MoE's z-loss (Zoph et al. 2022, eq. 5): mean over tokens and layers of logsumexp(logits)^2, padding
    excluded. It keeps router logits small, where the fp32 softmax stays accurate."""
    if not router_logits:
        return torch.zeros(())
    squared = torch.cat([layer.logsumexp(dim=-1) ** 2 for layer in router_logits])
    weights = torch.cat([counted_rows(attention_mask, layer) for layer in router_logits])
    return (squared * weights).sum() / weights.sum().clamp(min=1.0)


class _RouterLossGradient(torch.autograd.Function):
    """Identity on the logits whose backward also starts the router loss's backward (the trick of Megatron-LM's
    MoEAuxLossAutoScaler), and a copy of the router loss's value for the reported loss.

    The router loss's gradient is the one that copy receives: the reported loss's, so that the router loss is scaled
    as the loss it joins is (fp16's loss scale under GradScaler, a division over accumulation steps). A loss built
    from the logits alone leaves the copy without a gradient: the router loss then gets 1, as if added to it.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, router_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused copy's gradient stays None instead of zeros
        ctx.save_for_backward(router_loss)
        return logits.view_as(logits), router_loss.clone()

    @staticmethod
    def backward(ctx, grad_logits: torch.Tensor | None, grad_copy: torch.Tensor | None) -> tuple:
        (router_loss,) = ctx.saved_tensors
        return grad_logits, torch.ones_like(router_loss) if grad_copy is None else grad_copy


def router_loss_carriers(logits: torch.Tensor, router_loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the logits carrying `router_loss` into any gradient taken through them, the router loss's value to add to
    the reported loss): see `_RouterLossGradient`. Without a gradient to take, the logits and a detached value."""
    if not (torch.is_grad_enabled() and router_loss.requires_grad):
        return logits, router_loss.detach()
    return _RouterLossGradient.apply(logits, router_loss.to(logits.device))


@dataclass
class RouterLosses:
    """Balancing (`aux`) and z-losses per stack, and `total` = aux_coef * sum(aux) + z_coef * sum(z), the term that
    joins the head's loss."""

    aux: dict[str, torch.Tensor]
    z: dict[str, torch.Tensor]
    total: torch.Tensor

    @classmethod
    def of_stacks(cls, config: VanillaTransformerConfig, **stacks: tuple) -> "RouterLosses":
        """`stacks`: name -> (router logits of its MoE layers, its attention mask or None)."""
        aux = {name: load_balancing_loss(logits, config, mask) for name, (logits, mask) in stacks.items()}
        z = {name: router_z_loss(logits, mask) for name, (logits, mask) in stacks.items()}
        total = config.router_aux_loss_coef * sum(aux.values()) + config.router_z_loss_coef * sum(z.values())
        return cls(aux, z, total)


@dataclass
class RouterRequest:
    """What a head asks of the MoE routers in one forward: their losses (`compute`, which the model's
    `output_router_logits` follows: the losses are computed from the router logits), which join the gradient through
    the logits whenever one may be taken, so that a loss built from the logits alone still trains the routers;
    whether the losses are returned (`report`); and whether the router logits are (`return_logits`)."""

    config: VanillaTransformerConfig
    compute: bool
    report: bool
    return_logits: bool

    @classmethod
    def of(cls, config: VanillaTransformerConfig, labels, output_router_logits: bool | None) -> "RouterRequest":
        """The request of a head on `config` given `labels` (or None) and its `output_router_logits` argument. A
        dense model's asks nothing."""
        if not config.num_experts:
            return cls(config, compute=False, report=False, return_logits=False)
        asked = config.output_router_logits if output_router_logits is None else output_router_logits
        # Mixtral's convention: the losses are returned with a loss or when asked for, so that outputs[0] is the
        # logits whenever no loss is returned, in training as in inference.
        report = asked or labels is not None
        return cls(config, compute=report or torch.is_grad_enabled(), report=report, return_logits=asked)

    def returned(self, router_logits: tuple[torch.Tensor, ...] | None):
        """The router logits to return: each layer's (batch * length, num_experts), None unless asked for."""
        return router_logits if self.return_logits else None

    def add_losses(
        self, logits: torch.Tensor, loss_of: Callable[[torch.Tensor], torch.Tensor | None], **stacks: tuple
    ) -> tuple[torch.Tensor, torch.Tensor | None, RouterLosses | None]:
        """(logits, loss, router losses) of a head with experts whose loss is `loss_of(logits)`. The router losses of
        `stacks` (name -> (router logits of its MoE layers, its attention mask or None), padding not counted) join the
        gradient through the logits, so that a loss built from the logits alone (the Trainer's label smoothing, a
        `compute_loss_func`) trains the routers too, and the head's loss as a value whose gradient scales them (see
        `_RouterLossGradient`): a user must not add `outputs.*_aux_loss` again. Not computed: no router losses."""
        if not self.compute:
            return logits, loss_of(logits), None
        router_losses = RouterLosses.of_stacks(self.config, **stacks)
        logits, reported = router_loss_carriers(logits, router_losses.total)
        loss = loss_of(logits)
        return logits, None if loss is None else loss + reported, router_losses


__all__ = [
    "RouterLosses",
    "RouterRequest",
    "load_balancing_loss",
    "router_z_loss",
]
