"""Padding-free layers: the position-wise work of a padded batch done on its real tokens only.

In a padded batch every linear map, norm, FFN and dropout of every layer also runs on the padding, and so does the
vocabulary projection in training; HF's encoder-decoders (Marian, Bart, T5) pay for it. Everything but the attention
scores is position-wise (§3.3), so a stack packs the hidden states of its tokens once, on entry, as (tokens, d_model),
and each attention scatters only its projected queries, keys and values back into (batch, length) for the score
matrix. The result at every real position is unchanged: padded keys are masked anyway, and a padded query's row is
never read. Padded positions of the returned hidden states and logits are 0 instead of values computed from pad
embeddings.

The layout travels to the sub-layers through the keyword arguments that already reach transformers' attention
interface (as its `cu_seq_lens_*` do): `packed_tokens` for the stack's own tokens, `encoder_packed_tokens` for the
source tokens that cross-attention reads. A tensor of shape (tokens, d_model) is packed; (batch, length, d_model) is
not.
"""

import torch


def token_mask_of(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The (batch, length) bool mask of the tokens in a 2D padding mask (1 = token); None for no mask or a 4D one
    (built by the caller: it says nothing about padding). Every use of a padding mask goes through here."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask.bool()


class PackedTokens:
    """Where the tokens of a (batch, length) mask are, to pack and unpack per-token tensors."""

    def __init__(self, mask: torch.Tensor):
        self.batch_size, self.length = mask.shape
        self.indices = mask.flatten().nonzero().squeeze(1)

    @classmethod
    def of(cls, attention_mask: torch.Tensor | None) -> "PackedTokens | None":
        """The packing of the tokens of a padding mask (see `token_mask_of`), or None when there is nothing to skip.
        One position per row (a decoding step) is never worth it, and is left alone without a host sync."""
        mask = token_mask_of(attention_mask)
        if mask is None or mask.shape[1] == 1 or bool(mask.all()):
            return None
        return cls(mask)

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[0]

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """(batch, length, ...) -> (tokens, ...)."""
        return padded.flatten(0, 1).index_select(0, self.indices)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """(tokens, ...) -> (batch, length, ...), zeros at the padding."""
        padded = packed.new_zeros(self.batch_size * self.length, *packed.shape[1:])
        padded.index_copy_(0, self.indices, packed)  # in place: the out-of-place op would copy the zeros once more
        return padded.view(self.batch_size, self.length, *packed.shape[1:])


def positions_the_loss_needs(counted: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """(batch, length) mask of the positions a causal decoder must compute for a loss that reads its outputs at
    `counted`: the counted positions, and the real tokens before them (keys and values of the counted ones). The tail
    after each row's last counted position (the collator's label padding) is read by nothing."""
    positions = torch.arange(counted.shape[1], device=counted.device)
    last = torch.where(counted, positions, -1).amax(dim=1, keepdim=True)
    needed = positions <= last
    if token_mask is not None:
        needed &= token_mask.bool() | counted
    return needed


__all__ = ["PackedTokens", "positions_the_loss_needs", "token_mask_of"]
