"""Beam search with the GNMT length penalty, the one the paper decodes with (§6.1: beam 4, alpha = 0.6).

transformers ranks finished beam hypotheses by `sum log p / |Y|^length_penalty`. The paper uses the penalty of Wu et
al. 2016 (GNMT, eq. 14), `lp(Y) = ((5 + |Y|) / 6)^alpha`, which grows more slowly with length and so ranks hypotheses
of different lengths differently. Select it per call or in the generation config:

```python
model.generate(input_ids, num_beams=4, length_penalty=0.6, length_penalty_type="gnmt",
               max_new_tokens=input_ids.shape[1] + 50)   # §6.1: max output length = input length + 50
model.generation_config.length_penalty_type = "gnmt"  # or make it the model's default (saved with the model)
```

`length_penalty_type="power"` (the default) keeps transformers' behaviour. |Y| counts the generated tokens including
the end-of-sequence token and excluding the decoder start token, exactly the length transformers uses.
"""

import inspect
import warnings
from typing import Any, Literal

import torch
import transformers
from transformers import GenerationConfig
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_masks_for_generate

from .inputs_vanilla_transformer import check_token_ids

LengthPenaltyType = Literal["power", "gnmt"]
LENGTH_PENALTY_TYPES: tuple[str, ...] = ("power", "gnmt")


def gnmt_length_penalty(length: int | torch.Tensor, alpha: float) -> float | torch.Tensor:
    """Wu et al. 2016, eq. 14: `((5 + |Y|) / 6) ** alpha`; a finished hypothesis scores `log P(Y|X) / lp(Y)`."""
    return ((5 + length) / 6) ** alpha


def _length_penalty_type(generation_config: GenerationConfig) -> str:
    penalty_type = getattr(generation_config, "length_penalty_type", "power")
    if penalty_type not in LENGTH_PENALTY_TYPES:
        raise ValueError(f"length_penalty_type={penalty_type!r} is not one of {LENGTH_PENALTY_TYPES}.")
    return penalty_type


def _takes_keywords(method_name: str, keywords: tuple[str, ...]) -> bool:
    method = getattr(GenerationMixin, method_name, None)
    return method is not None and set(keywords) <= set(inspect.signature(method).parameters)


# The GNMT penalty has no public hook in transformers: it takes the two private methods of `_beam_search` that
# normalise scores by length (transformers 5.20 to 5.24 have both, with these keywords). Checked once, here: under a
# release that changed them, beam search keeps transformers' own length penalty and says so (`generate`).
GNMT_HOOKS_FIT = _takes_keywords(
    "_update_finished_beams", ("topk_log_probs", "cur_len", "decoder_prompt_len", "length_penalty")
) and _takes_keywords(
    "_check_early_stop_heuristic",
    ("running_beam_scores", "cur_len", "max_length", "decoder_prompt_len", "early_stopping", "length_penalty"),
)


class VanillaTransformerGenerationMixin(GenerationMixin):
    """`GenerationMixin` whose beam search can rank finished hypotheses with the GNMT length penalty, and whose
    decoding steps take the path transformers takes for its own models.

    transformers' `_beam_search` normalises scores in exactly two places, `_update_finished_beams` (the score a
    finished hypothesis is kept with) and `_check_early_stop_heuristic` (the best score a running beam could still
    reach). With `length_penalty_type="gnmt"` both get scores already divided by `lp(Y)` and `length_penalty=0`
    (so transformers' own division is by |Y|^0 = 1); everything else in beam search stays transformers' code.
    """

    _gnmt: bool = False  # True for the duration of one `generate` call with length_penalty_type="gnmt"
    # Whether this class's `forward` takes `cache_position` (see `prepare_inputs_for_generation`); set per class.
    _forward_takes_cache_position: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._forward_takes_cache_position = "cache_position" in inspect.signature(cls.forward).parameters

    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 *args: Any, **kwargs: Any):  # fmt: skip
        """transformers' `generate`, which also takes `length_penalty_type` ("power" or "gnmt"), per call or from the
        generation config. Before transformers runs:
        - the prompt's token ids are checked (an empty prompt fails deep in the decoding loop otherwise);
        - an encoder-decoder's source mask without padding is dropped. It would reach every decoding step, for
          cross-attention, and make each build a 4D mask and run masked attention for nothing (Marian skips it by
          reading the mask at every step: a host-device sync per step on an accelerator). transformers builds no
          mask for an encoder-decoder's source, so no step sees one; here, one read of the mask per call."""
        penalty_type = kwargs.pop("length_penalty_type", None)
        if penalty_type is None:
            penalty_type = _length_penalty_type(generation_config or self.generation_config)
        elif penalty_type not in LENGTH_PENALTY_TYPES:
            raise ValueError(f"length_penalty_type={penalty_type!r} is not one of {LENGTH_PENALTY_TYPES}.")
        prompt = inputs if inputs is not None else kwargs.get("input_ids")
        if prompt is not None:
            check_token_ids(prompt)
        mask = kwargs.get("attention_mask")
        if self.config.is_encoder_decoder and mask is not None and mask.dim() == 2 and bool(mask.all()):
            del kwargs["attention_mask"]
        if penalty_type == "gnmt" and not GNMT_HOOKS_FIT:
            warnings.warn(
                f"transformers {transformers.__version__} changed the beam search methods the GNMT length penalty "
                "hooks into (_update_finished_beams, _check_early_stop_heuristic): length_penalty_type='gnmt' is "
                "ignored and beam search ranks hypotheses with transformers' own length penalty.",
                stacklevel=2,
            )
        self._gnmt = penalty_type == "gnmt" and GNMT_HOOKS_FIT
        try:
            return super().generate(inputs, generation_config, *args, **kwargs)
        finally:
            self._gnmt = False

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """transformers' own, without the question it asks only of remote code. Its parameters are named as
        transformers' are (`generate` reads them: `inputs_embeds` lets a decoder-only model start from embeddings),
        but for the cache: it comes in `kwargs` under the installed release's name (`past_key_values`; `cache` from
        transformers 5.24) and is passed on under it, every argument by keyword.

        Every decoding step, transformers asks `self.is_remote_code()` (true for a class registered with
        `register_for_auto_class`, as this package's are, so that `save_pretrained` ships the code) and, for remote
        code, reads `inspect.signature(self.forward)` to see whether the forward still takes `cache_position`,
        which it then builds. About 140 Python calls a token, to learn what `_forward_takes_cache_position` already
        says: the heads' forwards take no `cache_position`. For the length of this call `is_remote_code` answers
        no on this instance (an instance attribute shadows the classmethod; saving and loading never run here), so
        the step takes the path of transformers' own models, Marian's. A subclass whose forward takes
        `cache_position` gets transformers' check unchanged."""
        kwargs.update(
            next_sequence_length=next_sequence_length,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            is_first_iteration=is_first_iteration,
        )
        if self._forward_takes_cache_position:
            return super().prepare_inputs_for_generation(input_ids, **kwargs)
        instance = vars(self)
        instance["is_remote_code"] = bool  # `bool()` is False, answered in C: no Python call at the step
        try:
            return super().prepare_inputs_for_generation(input_ids, **kwargs)
        finally:
            instance.pop("is_remote_code", None)

    def create_masks_for_generate(self, attention_mask: torch.Tensor | None, inputs_embeds: torch.Tensor, **kwargs):
        """The mask `generate` passes to a forward with a compileable cache (static): transformers' 4D one for the
        decoding steps, whose shape must stay the same from step to step under torch.compile, but the 2D padding mask
        itself for a prompt. A 4D mask says nothing about padding, and the stacks return 0 at the padding positions
        only when they know where it is: with the 4D mask a right-padded prompt would continue from its pad
        embeddings, with a dynamic cache from 0. (A step of one token is never padding.)"""
        if attention_mask is not None and attention_mask.dim() == 2 and inputs_embeds.shape[1] > 1:
            return attention_mask
        return create_masks_for_generate(attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)

    def _update_finished_beams(self, *args: Any, **kw: Any):
        if self._gnmt:
            # The candidates finishing now have cur_len + 1 - decoder_prompt_len tokens, EOS included.
            length = kw["cur_len"] + 1 - kw["decoder_prompt_len"]
            kw["topk_log_probs"] = kw["topk_log_probs"] / gnmt_length_penalty(length, kw["length_penalty"])
            kw["length_penalty"] = 0.0
        return super()._update_finished_beams(*args, **kw)

    def _check_early_stop_heuristic(self, *args: Any, **kw: Any):
        if self._gnmt:
            # Same bound as transformers' heuristic: with early_stopping="never" and alpha > 0 the best a running beam
            # can reach is its score at the longest allowed length (log-probs only fall, lp only grows).
            alpha = kw["length_penalty"]
            never_and_positive = kw["early_stopping"] == "never" and alpha > 0.0
            length = (kw["max_length"] if never_and_positive else kw["cur_len"]) - kw["decoder_prompt_len"]
            kw["running_beam_scores"] = kw["running_beam_scores"] / gnmt_length_penalty(length, alpha)
            kw["length_penalty"] = 0.0
        return super()._check_early_stop_heuristic(*args, **kw)


__all__ = ["VanillaTransformerGenerationMixin", "gnmt_length_penalty", "LENGTH_PENALTY_TYPES", "LengthPenaltyType"]
