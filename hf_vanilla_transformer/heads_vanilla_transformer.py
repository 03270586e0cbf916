"""Task heads: the translation model (encoder-decoder LM), a decoder-only LM and an encoder-only classifier."""

import copy

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.generation import GenerationMixin
from transformers.modeling_outputs import (
    BaseModelOutput,
    CausalLMOutputWithPast,
    Seq2SeqLMOutput,
    Seq2SeqMoEOutput,
    SequenceClassifierOutput,
)
from transformers.models.bart.modeling_bart import shift_tokens_right
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .generation_vanilla_transformer import VanillaTransformerGenerationMixin
from .modeling_vanilla_transformer import (
    SEQ2SEQ_AUTO_MAP,
    VanillaTransformerDecoder,
    VanillaTransformerEncoder,
    VanillaTransformerModel,
    VanillaTransformerPreTrainedModel,
)
from .moe_vanilla_transformer import (
    MoeCausalLMOutput,
    add_reported_router_loss,
    request_router_logits,
    route_router_loss_through_logits,
)
from .packing_vanilla_transformer import PackedTokens, positions_the_loss_needs, routed_tokens


def lm_logits(
    lm_head: nn.Linear,
    hidden_states: torch.Tensor,
    logits_to_keep: int | torch.Tensor,
    scored: PackedTokens | None = None,
) -> torch.Tensor:
    """The pre-softmax projection, spared where it is not needed: on the `scored` positions only (packed, see
    `scored_positions`), else on the last `logits_to_keep` positions (0 = all)."""
    if scored is not None:
        return lm_head(scored.pack(hidden_states))
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return lm_head(hidden_states[:, keep, :])


def scored_positions(
    model: VanillaTransformerPreTrainedModel, counted: torch.Tensor | None, logits_to_keep: int | torch.Tensor
) -> PackedTokens | None:
    """In training with `config.padding_free`, the positions whose logits the loss reads (`counted`): the only logits
    a training step needs. The head returns theirs in place and 0 elsewhere (packing_vanilla_transformer)."""
    if (
        counted is None
        or not model.training
        or not model.config.padding_free
        or not (isinstance(logits_to_keep, int) and logits_to_keep == 0)
    ):
        return None
    return PackedTokens.of(counted)


class VanillaTransformerForConditionalGeneration(VanillaTransformerPreTrainedModel, VanillaTransformerGenerationMixin):
    """Encoder-decoder with the pre-softmax projection tied to the shared embedding (§3.4): the translation model.

    Beam search can rank hypotheses with the paper's GNMT length penalty: `generate(..., length_penalty_type="gnmt")`.
    """

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    _auto_map = SEQ2SEQ_AUTO_MAP

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.model = VanillaTransformerModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        # Labels are aligned with the decoder outputs already; the class-name default (ForCausalLM) would shift them.
        self.loss_type = "ForMaskedLM"
        self._set_auto_map()
        self.post_init()

    def resize_token_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True) -> nn.Embedding:
        embeddings = super().resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        bias = self.lm_head.bias
        if bias is not None and bias.shape[0] != embeddings.num_embeddings:  # a tied head keeps its old bias
            new_bias = bias.new_zeros(embeddings.num_embeddings)
            kept = min(bias.shape[0], new_bias.shape[0])
            new_bias[:kept] = bias.data[:kept]
            self.lm_head.bias = nn.Parameter(new_bias)
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput | Seq2SeqMoEOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            Target token ids, -100 where ignored. Without `decoder_input_ids` the decoder input is `labels` shifted
            right behind `decoder_start_token_id` (teacher forcing).

        With experts (`num_experts > 0`) the output is a `Seq2SeqMoEOutput` with per-stack balancing and z-losses;
        their weighted sum is already in the gradient of any loss built from `logits` (see `attach_router_loss`).
        """
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        counted = None if labels is None else labels != -100
        scored = scored_positions(self, counted, logits_to_keep)
        decoder_packing_mask = None if labels is None else positions_the_loss_needs(counted, decoder_attention_mask)
        with_router_losses, return_router_logits = request_router_logits(self.config, labels, kwargs)
        outputs = self.model(
            input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            decoder_packing_mask=decoder_packing_mask,
            **kwargs,
        )
        logits = lm_logits(self.lm_head, outputs.last_hidden_state, logits_to_keep, scored)
        if scored is not None:  # the loss over the counted labels, as packed as their logits
            labels = scored.pack(labels)
        router_stacks = None
        if with_router_losses:
            router_stacks = dict(
                encoder=(outputs.encoder_router_logits, attention_mask),
                # With labels, only the target positions the loss needs: label padding is not balanced either.
                decoder=(outputs.decoder_router_logits, routed_tokens(decoder_packing_mask, decoder_attention_mask)),
            )
        logits, router = route_router_loss_through_logits(self.config, logits, router_stacks)
        loss = None
        if labels is not None:
            # Summed over tokens and divided by num_items_in_batch when the Trainer passes it: exact under
            # gradient accumulation, unlike a per-batch mean.
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        loss = add_reported_router_loss(loss, router)
        fields = dict(
            loss=loss,
            logits=logits if scored is None else scored.unpack(logits),
            past_key_values=outputs.past_key_values,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )
        if self.config.num_experts == 0:
            return Seq2SeqLMOutput(**fields)
        return Seq2SeqMoEOutput(
            **fields,
            **(router.output_fields("{stack}_{kind}_loss") if router is not None else {}),
            encoder_router_logits=outputs.encoder_router_logits if return_router_logits else None,
            decoder_router_logits=outputs.decoder_router_logits if return_router_logits else None,
        )


def single_stack_config(config: VanillaTransformerConfig) -> VanillaTransformerConfig:
    """A copy of `config` for a decoder-only or encoder-only model: no cross-attention, and generate's causal path.
    A deep copy keeps the load-time settings (`attn_implementation`, dtype) that `to_dict` would drop."""
    config = copy.deepcopy(config)
    config.is_encoder_decoder = False
    return config


class VanillaTransformerForCausalLM(VanillaTransformerPreTrainedModel, GenerationMixin):
    """Decoder-only language model (GPT-style): the decoder stack without cross-attention, and a tied LM head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _auto_map = {"AutoModelForCausalLM": "heads_vanilla_transformer.VanillaTransformerForCausalLM"}

    def __init__(self, config: VanillaTransformerConfig):
        config = single_stack_config(config)
        super().__init__(config)
        self.model = VanillaTransformerDecoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self._set_auto_map()
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast | MoeCausalLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, length)`, *optional*):
            Usually `input_ids`; they are shifted inside the loss, -100 where ignored.

        With experts the output is a `MoeCausalLMOutput` (Mixtral's, plus `z_loss`); the weighted router losses are
        already in the gradient of any loss built from `logits` (see `attach_router_loss`).
        """
        with_router_losses, return_router_logits = request_router_logits(self.config, labels, kwargs)
        counted = scored = packing_mask = None
        if labels is not None:
            shift_labels = kwargs.get("shift_labels")
            if shift_labels is None:  # position t predicts token t + 1
                shift_labels = nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
            counted = shift_labels != -100
            scored = scored_positions(self, counted, logits_to_keep)
            packing_mask = positions_the_loss_needs(counted, attention_mask)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            packing_mask=packing_mask,
            **kwargs,
        )
        logits = lm_logits(self.lm_head, outputs.last_hidden_state, logits_to_keep, scored)
        if scored is not None:  # the loss over the counted labels, as packed as their logits
            kwargs["shift_labels"] = labels = scored.pack(shift_labels)
        router_mask = routed_tokens(packing_mask, attention_mask)
        router_stacks = dict(decoder=(outputs.router_logits, router_mask)) if with_router_losses else None
        logits, router = route_router_loss_through_logits(self.config, logits, router_stacks)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        loss = add_reported_router_loss(loss, router)
        fields = dict(
            loss=loss,
            logits=logits if scored is None else scored.unpack(logits),
            past_key_values=outputs.past_key_values,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        if self.config.num_experts == 0:
            return CausalLMOutputWithPast(**fields)
        return MoeCausalLMOutput(
            **fields,
            **(router.output_fields("{kind}_loss") if router is not None else {}),
            router_logits=outputs.router_logits if return_router_logits else None,
        )


class VanillaTransformerForSequenceClassification(VanillaTransformerPreTrainedModel):
    """Encoder-only classifier (BERT-style): the encoder stack, a pooled vector, and a linear classifier."""

    _auto_map = {
        "AutoModelForSequenceClassification": "heads_vanilla_transformer.VanillaTransformerForSequenceClassification"
    }

    def __init__(self, config: VanillaTransformerConfig):
        config = single_stack_config(config)
        super().__init__(config)
        self.model = VanillaTransformerEncoder(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self._set_auto_map()
        self.post_init()

    def pool(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """Mean over non-padding tokens (`classifier_pooling="mean"`) or the first token's vector (`"first"`)."""
        if self.config.classifier_pooling == "first":
            return hidden_states[:, 0]
        if attention_mask is None or attention_mask.dim() != 2:
            return hidden_states.mean(dim=1)
        weights = attention_mask.to(hidden_states.dtype).unsqueeze(-1)
        return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput:
        with_router_losses, _ = request_router_logits(self.config, labels, kwargs)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs)
        logits = self.classifier(self.dropout(self.pool(outputs.last_hidden_state, attention_mask)))
        router_stacks = dict(encoder=(outputs.router_logits, attention_mask)) if with_router_losses else None
        logits, router = route_router_loss_through_logits(self.config, logits, router_stacks)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config, **kwargs)
        loss = add_reported_router_loss(loss, router)
        return SequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerForCausalLM",
    "VanillaTransformerForSequenceClassification",
]
