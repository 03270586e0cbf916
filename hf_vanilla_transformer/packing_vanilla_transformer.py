"""Padding-free layers: the position-wise work of a padded batch done on its real tokens only.

In a padded batch every linear map, norm, FFN and dropout of every layer also runs on the padding, and so does the
vocabulary projection in training; HF's encoder-decoders (Marian, Bart, T5) pay for it. Everything but the attention
scores is position-wise (§3.3), so the layers keep the hidden states of the real tokens packed as (tokens, d_model)
and scatter only the projected queries, keys and values back into (batch, length) for the score matrix. The result
at every real position is unchanged: padded keys are masked anyway, and a padded query's row is never read. Padded
positions of the returned hidden states and logits are 0 instead of values computed from pad embeddings.
"""

import torch


class PackedTokens:
    """Where the real tokens of a (batch, length) padding mask are, to pack and unpack per-token tensors."""

    def __init__(self, mask: torch.Tensor):
        self.batch_size, self.length = mask.shape
        self.indices = mask.flatten().nonzero().squeeze(1)

    @classmethod
    def of(cls, mask: torch.Tensor | None) -> "PackedTokens | None":
        """The packing of a 2D padding mask (1 = token), or None when there is nothing to skip. One position per
        row (a decoding step) is never worth it, and is left alone without a host sync."""
        if mask is None or mask.dim() != 2 or mask.shape[1] == 1 or bool(mask.all()):
            return None
        return cls(mask.bool())

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(batch, length, ...) -> (tokens, ...)."""
        return padded.flatten(0, 1).index_select(0, self.indices)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) -> (batch, length, ...), zeros at the padding."""
        padded = packed.new_zeros(self.batch_size * self.length, *packed.shape[1:])
        padded.index_copy_(0, self.indices, packed)  # in place: the out-of-place op would copy the zeros once more
        return padded.view(self.batch_size, self.length, *packed.shape[1:])


def positions_the_loss_needs(counted: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, length) mask of the positions a causal decoder must compute for a loss that reads its outputs at
    `counted`: the counted positions, and the real tokens before them (keys and values of the counted ones). The tail
    after each row's last counted position (the collator's label padding) is read by nothing."""
    positions = torch.arange(counted.shape[1], device=counted.device)
    last = torch.where(counted, positions, -1).amax(dim=1, keepdim=True)
    needed = positions <= last
    if attention_mask is not None and attention_mask.dim() == 2:
        needed &= attention_mask.bool() | counted
    return needed


def routed_tokens(packing_mask: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The rows MoE balancing statistics count: the computed positions (`packing_mask`, when a loss narrowed them)
    that the attention mask keeps. Packed or not, the same rows: a packed layer routes only `packing_mask`'s."""
    if packing_mask is None:
        return attention_mask
    if attention_mask is None or attention_mask.dim() != 2:
        return packing_mask
    return packing_mask & attention_mask.bool()
