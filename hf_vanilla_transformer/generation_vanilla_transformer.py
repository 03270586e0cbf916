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
from typing import Any, Literal

import torch
from transformers import GenerationConfig
from transformers.cache_utils import Cache
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


def _not_remote_code() -> bool:
    return False


class VanillaTransformerGenerationMixin(GenerationMixin):
    """`GenerationMixin` whose beam search can rank finished hypotheses with the GNMT length penalty, and whose
    decoding steps take the path transformers takes for its own models.

    transformers 5.23's `_beam_search` normalises scores in exactly two places, `_update_finished_beams` (the score a
    finished hypothesis is kept with) and `_check_early_stop_heuristic` (the best score a running beam could still
    reach). With `length_penalty_type="gnmt"` both get scores already divided by `lp(Y)` and `length_penalty=0`
    (so transformers' own division is by |Y|^0 = 1); everything else in beam search stays transformers' code.
    """

    _gnmt_alpha: float | None = None  # set for the duration of one GNMT beam search
    # Whether this class's `forward` takes `cache_position` (see `prepare_inputs_for_generation`); set per class.
    _forward_takes_cache_position: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._forward_takes_cache_position = "cache_position" in inspect.signature(cls.forward).parameters

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        next_sequence_length: int | None = None,
        past_key_values: Cache | None = None,
        attention_mask: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        is_first_iteration: bool | None = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """transformers' own, without the question it asks only of remote code. (Its parameters are named as
        transformers' are: `generate` reads them, e.g. `inputs_embeds` to let a decoder-only model start from them.)

        Every decoding step, transformers 5.23 asks `self.is_remote_code()` (true for a class registered with
        `register_for_auto_class`, as this package's are, so that `save_pretrained` ships the code) and, for remote
        code, reads `inspect.signature(self.forward)` to see whether the forward still takes `cache_position`,
        which it then builds. About 140 Python calls a token, to learn what `_forward_takes_cache_position` already
        says: the heads' forwards take no `cache_position`. For the length of this call `is_remote_code` answers
        no on this instance (an instance attribute shadows the classmethod; saving and loading never run here), so
        the step takes the path of transformers' own models, Marian's. A subclass whose forward takes
        `cache_position` gets transformers' check unchanged."""
        inputs = (input_ids, next_sequence_length, past_key_values, attention_mask, inputs_embeds, is_first_iteration)
        if self._forward_takes_cache_position:
            return super().prepare_inputs_for_generation(*inputs, **kwargs)
        instance = vars(self)
        instance["is_remote_code"] = _not_remote_code
        try:
            return super().prepare_inputs_for_generation(*inputs, **kwargs)
        finally:
            instance.pop("is_remote_code", None)

    def _prepare_generation_config(
        self, generation_config: GenerationConfig | None, **kwargs: Any
    ) -> tuple[GenerationConfig, dict[str, Any]]:
        # `length_penalty_type` is not a GenerationConfig field: take it out of the call's kwargs (or they would reach
        # `forward` as model inputs) and store it on this call's config copy.
        penalty_type = kwargs.pop("length_penalty_type", None)
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        if penalty_type is not None:
            generation_config.length_penalty_type = penalty_type
        _length_penalty_type(generation_config)
        return generation_config, model_kwargs

    def create_masks_for_generate(self, attention_mask: torch.Tensor | None, inputs_embeds: torch.Tensor, **kwargs):
        """The mask `generate` passes to a forward with a compileable cache (static): transformers' 4D one for the
        decoding steps, whose shape must stay the same from step to step under torch.compile, but the 2D padding mask
        itself for a prompt. A 4D mask says nothing about padding, and the stacks return 0 at the padding positions
        only when they know where it is: with the 4D mask a right-padded prompt would continue from its pad
        embeddings, with a dynamic cache from 0. (A step of one token is never padding.)"""
        if attention_mask is not None and attention_mask.dim() == 2 and inputs_embeds.shape[1] > 1:
            return attention_mask
        return create_masks_for_generate(attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)

    def _prepare_text_encoder_decoder_kwargs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        # The source's padding mask reaches every decoding step, for cross-attention; it does not change while
        # decoding. Where the sources have no padding it is dropped once the encoder has run, so that no step builds
        # a 4D mask nor runs masked attention for it (Marian skips it too, by reading the mask at every step: a
        # host-device sync per step on an accelerator). One read of the mask per `generate` call, before the loop.
        model_kwargs = super()._prepare_text_encoder_decoder_kwargs_for_generation(*args, **kwargs)
        mask = model_kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2 and bool(mask.all()):
            del model_kwargs["attention_mask"]
        return model_kwargs

    def _prepare_model_inputs(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, str, dict[str, Any]]:
        # Checked before transformers' generation loop indexes into them (an empty prompt fails there otherwise).
        inputs, input_name, model_kwargs = super()._prepare_model_inputs(*args, **kwargs)
        if input_name == "input_ids":
            check_token_ids(inputs)
        return inputs, input_name, model_kwargs

    def _beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **kw):
        gnmt = _length_penalty_type(generation_config) == "gnmt"
        self._gnmt_alpha = generation_config.length_penalty if gnmt else None
        try:
            return super()._beam_search(
                input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **kw
            )
        finally:
            self._gnmt_alpha = None

    def _update_finished_beams(self, *, topk_log_probs, cur_len, decoder_prompt_len, **kw):
        if self._gnmt_alpha is not None:
            # The candidates finishing now have cur_len + 1 - decoder_prompt_len tokens, EOS included.
            topk_log_probs = topk_log_probs / gnmt_length_penalty(cur_len + 1 - decoder_prompt_len, self._gnmt_alpha)
            kw["length_penalty"] = 0.0
        return super()._update_finished_beams(
            topk_log_probs=topk_log_probs, cur_len=cur_len, decoder_prompt_len=decoder_prompt_len, **kw
        )

    def _check_early_stop_heuristic(self, *, running_beam_scores, cur_len, max_length, decoder_prompt_len, **kw):
        if self._gnmt_alpha is not None:
            # Same bound as transformers' heuristic: with early_stopping="never" and alpha > 0 the best a running beam
            # can reach is its score at the longest allowed length (log-probs only fall, lp only grows).
            never_and_positive = kw["early_stopping"] == "never" and self._gnmt_alpha > 0.0
            length = (max_length if never_and_positive else cur_len) - decoder_prompt_len
            running_beam_scores = running_beam_scores / gnmt_length_penalty(length, self._gnmt_alpha)
            kw["length_penalty"] = 0.0
        return super()._check_early_stop_heuristic(
            running_beam_scores=running_beam_scores,
            cur_len=cur_len,
            max_length=max_length,
            decoder_prompt_len=decoder_prompt_len,
            **kw,
        )


__all__ = ["VanillaTransformerGenerationMixin", "gnmt_length_penalty", "LENGTH_PENALTY_TYPES", "LengthPenaltyType"]
