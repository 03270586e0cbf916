"""The router losses of a Mixture of Experts (in the modeling file), and how they reach the gradient.

    balancing   E * sum_e f_e P_e per layer  (Switch Transformer eq. 4-6, mask-aware, Mixtral's function)
    z-loss      mean_tokens (logsumexp x)^2   (ST-MoE eq. 5)
    total       router_aux_loss_coef * balancing + router_z_loss_coef * z-loss, summed over the stacks

A head asks the routers for their logits and losses (`RouterRequest`); the total joins the gradient of any loss built
from the head's logits (`with_router_gradient`), and the reported loss as a value (`with_router_value`) whose gradient
scales it as that loss is scaled (fp16's loss scale, gradient accumulation).
"""

from dataclasses import dataclass

import torch

from .configuration_vanilla_transformer import VanillaTransformerConfig


def counted_rows(token_mask: torch.Tensor | None, layer_logits: torch.Tensor) -> torch.Tensor:
    """The weight of each row of a layer's router logits in its losses: 1 for a token, 0 for padding (`token_mask`,
    one entry per row, or None for a batch without padding, such as a flattened one)."""
    if token_mask is None:
        return layer_logits.new_ones(layer_logits.shape[0])
    return token_mask.reshape(-1).to(layer_logits.dtype)


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...] | None,
    config: VanillaTransformerConfig,
    token_mask: torch.Tensor | None = None,
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
        weights = counted_rows(token_mask, layer_logits)
        probabilities = layer_logits.float().softmax(dim=-1)
        chosen = probabilities.topk(top_k, dim=-1).indices.reshape(-1)
        per_choice = weights[:, None].expand(-1, top_k).reshape(-1)
        count = weights.sum().clamp(min=1.0)
        fraction = probabilities.new_zeros(num_experts).index_add_(0, chosen, per_choice) / count
        mean_probability = (probabilities * weights[:, None]).sum(dim=0) / count
        per_layer.append(num_experts * (fraction * mean_probability).sum())
    return torch.stack(per_layer).mean()


def router_z_loss(router_logits: tuple[torch.Tensor, ...] | None, token_mask=None) -> torch.Tensor:
    """ST-MoE's z-loss (Zoph et al. 2022, eq. 5): mean over tokens and layers of logsumexp(logits)^2, padding
    excluded. It keeps router logits small, where the fp32 softmax stays accurate."""
    if not router_logits:
        return torch.zeros(())
    squared = torch.cat([layer.logsumexp(dim=-1) ** 2 for layer in router_logits])
    weights = torch.cat([counted_rows(token_mask, layer) for layer in router_logits])
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


def attach_router_loss(logits: torch.Tensor, router_loss: torch.Tensor) -> torch.Tensor:
    """The logits, carrying `router_loss` into any gradient taken through them.

    Why not just `loss = cross_entropy + router_loss`: the Trainer with label smoothing (or a `compute_loss_func`)
    pops `labels`, calls the model without them and builds its own loss from `outputs.logits`; a router loss added to
    the model's loss would silently vanish (NLLB-MoE, Mixtral). Attached here, it reaches the router whatever loss
    is built from the logits. The heads add it to their reported `loss` as a value whose gradient is the router
    loss's scale (`router_loss_carriers`): under fp16 loss scaling (GradScaler, the Trainer's fp16) the router loss is
    scaled with the loss, so its gradient survives unscaling. A user must NOT add `outputs.*_aux_loss` to their loss
    again (it would count twice). On its own, as here, the router loss's gradient is 1: unscaled.
    """
    return router_loss_carriers(logits, router_loss)[0]


@dataclass
class RouterLosses:
    """Balancing (`aux`) and z-losses per stack, and `total` = aux_coef * sum(aux) + z_coef * sum(z), the term that
    joins the language-model loss."""

    aux: dict[str, torch.Tensor]
    z: dict[str, torch.Tensor]
    total: torch.Tensor
    reported: torch.Tensor | None = None  # `total`'s value for the reported loss, set by `with_router_gradient`

    @classmethod
    def of_stacks(cls, config: VanillaTransformerConfig, **stacks: tuple) -> "RouterLosses":
        """`stacks`: name -> (router logits of its MoE layers, the (batch, length) mask of its tokens or None)."""
        aux = {name: load_balancing_loss(logits, config, mask) for name, (logits, mask) in stacks.items()}
        z = {name: router_z_loss(logits, mask) for name, (logits, mask) in stacks.items()}
        total = config.router_aux_loss_coef * sum(aux.values()) + config.router_z_loss_coef * sum(z.values())
        return cls(aux, z, total)


@dataclass
class RouterRequest:
    """What a head asks of the MoE routers in one forward: their losses (`compute`), which join the gradient through
    the logits whenever one may be taken, so that a loss built from the logits alone still trains the routers;
    whether the losses are returned (`report`); and whether the router logits are (`return_logits`)."""

    compute: bool
    report: bool
    return_logits: bool

    @classmethod
    def of(cls, config: VanillaTransformerConfig, labels, output_router_logits: bool | None) -> "RouterRequest":
        """The request of a head on `config`, a model with experts (a dense model's heads make none)."""
        asked = config.output_router_logits if output_router_logits is None else output_router_logits
        # Mixtral's convention: the losses are returned with a loss or when asked for, so that outputs[0] is the
        # logits whenever no loss is returned, in training as in inference.
        report = asked or labels is not None
        return cls(compute=report or torch.is_grad_enabled(), report=report, return_logits=asked)

    def returned(self, router_logits: tuple[torch.Tensor, ...] | None):
        """The router logits to return: each layer's (batch * length, num_experts), None unless asked for."""
        return router_logits if self.return_logits else None

    def losses(self, config: VanillaTransformerConfig, **stacks: tuple) -> RouterLosses | None:
        """`stacks`: name -> (router logits of its MoE layers, the (batch, length) mask of its tokens or None); None
        when not computed."""
        return RouterLosses.of_stacks(config, **stacks) if self.compute else None


def with_router_gradient(logits: torch.Tensor, router_losses: RouterLosses | None) -> torch.Tensor:
    """The logits, carrying the router losses into the gradient of any loss built from them (`attach_router_loss`),
    scaled as the reported loss is (`with_router_value`)."""
    if router_losses is None:
        return logits
    logits, router_losses.reported = router_loss_carriers(logits, router_losses.total)
    return logits


def with_router_value(loss: torch.Tensor | None, router_losses: RouterLosses | None) -> torch.Tensor | None:
    """The reported loss plus the router losses, as a value: their gradient flows through the logits, and the
    gradient this loss receives sets its scale (`_RouterLossGradient`)."""
    if loss is None or router_losses is None:
        return loss
    reported = router_losses.total.detach() if router_losses.reported is None else router_losses.reported
    return loss + reported


__all__ = [
    "RouterLosses",
    "RouterRequest",
    "attach_router_loss",
    "load_balancing_loss",
    "router_z_loss",
    "with_router_gradient",
    "with_router_value",
]
