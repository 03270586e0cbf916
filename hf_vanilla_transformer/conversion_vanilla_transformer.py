"""What the converters (convert_*_vanilla_transformer) share: another model's parameter names mapped onto this
package's by (regex, replacement) rules, each converter listing its own as `PARAMETER_RENAMES`."""

import re

import torch

Renames = list[tuple[str, str]]


def rename_parameter(name: str, renames: Renames) -> str:
    """`name` with every rule of `renames` applied in order; a name no rule matches is the same in both models."""
    for pattern, replacement in renames:
        name = re.sub(pattern, replacement, name)
    return name


def renamed_state_dict(state_dict: dict[str, torch.Tensor], renames: Renames) -> dict[str, torch.Tensor]:
    """`state_dict` under this package's parameter names."""
    return {rename_parameter(name, renames): tensor for name, tensor in state_dict.items()}


__all__ = ["rename_parameter", "renamed_state_dict"]
