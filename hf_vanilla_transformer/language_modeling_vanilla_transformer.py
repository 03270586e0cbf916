"""The language-model heads: the translation model (encoder-decoder), the causal LM (GPT-style pretraining of a
decoder) and the masked LM (BERT-style pretraining of an encoder), each with the pre-softmax projection tied to its
embedding (§3.4).

Each `forward` reads as Mixtral's: the model, `lm_head`, `loss_function`, and with experts the router losses. A
batch may come padded or flattened (packing_vanilla_transformer); the heads read neither layout's values on the host.
"""

from functools import partial

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutput,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    Seq2SeqLMOutput,
    Seq2SeqMoEOutput,
)
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.bart.modeling_bart import shift_tokens_right
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .generation_vanilla_transformer import VanillaTransformerGenerationMixin
from .inputs_vanilla_transformer import (
    IGNORE_INDEX,
    SKIP_LOGITS_WITHOUT_LABELS,
    check_can_shift_labels,
    check_token_labels,
)
from .modeling_vanilla_transformer import (
    CACHE_FIELD,
    MoeCausalLMOutput,
    VanillaTransformerDecoder,
    VanillaTransformerEncoder,
    VanillaTransformerModel,
    VanillaTransformerPreTrainedModel,
    given_cache,
    with_item_count,
)
from .packing_vanilla_transformer import shift_packed_labels
from .router_losses_vanilla_transformer import RouterRequest

# transformers lets `set_experts_implementation` and `from_pretrained(experts_implementation=...)` switch the experts
# kernel of a model whose class is defined in a module that uses `@use_experts_implementation`. The heads here run the
# experts of modeling_vanilla_transformer, which that decorator declares; this comment declares them in this module too.


def require_encoder_decoder(config: VanillaTransformerConfig) -> None:
    """The encoder-decoder head needs an encoder-decoder config: a decoder-only or encoder-only checkpoint would load
    into a model without cross-attention (or without its weights) and fail later, or silently be random."""
    if not config.is_encoder_decoder:
        auto_class, head = (
            ("AutoModelForCausalLM", "VanillaTransformerForCausalLM")
            if config.is_decoder
            else ("AutoModelForSequenceClassification", "VanillaTransformerForSequenceClassification")
        )
        raise ValueError(
            f"This config is {'decoder' if config.is_decoder else 'encoder'}-only (is_encoder_decoder=False, "
            f"is_decoder={config.is_decoder}): an encoder-decoder head cannot run it. Load it with {auto_class} "
            f"({head}), or set is_encoder_decoder=True for a new encoder-decoder model."
        )


class LanguageModelingHead(VanillaTransformerPreTrainedModel):
    """What the language-model heads share: the token loss."""

    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor | None, **kwargs) -> torch.Tensor | None:
        """transformers' loss over the targets, summed over tokens and divided by their count (`with_item_count`)."""
        if targets is None:
            return None
        kwargs = with_item_count(kwargs, targets)
        try:  # the loss checks the labels itself (on an accelerator its kernel asserts on the device)
            return self.loss_function(logits, targets.contiguous(), vocab_size=self.config.vocab_size, **kwargs)
        except IndexError as error:
            vocab = self.config.vocab_size
            raise ValueError(f"labels must hold ids in [0, {vocab}) or {IGNORE_INDEX} (ignored): {error}") from None


class VanillaTransformerForConditionalGeneration(LanguageModelingHead, VanillaTransformerGenerationMixin):
    """Encoder-decoder with the pre-softmax projection tied to the shared embedding (§3.4): the translation model.

    Beam search can rank hypotheses with the paper's GNMT length penalty: `generate(..., length_penalty_type="gnmt")`.
    """

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # vocabulary-parallel, logits gathered on every rank

    def __init__(self, config: VanillaTransformerConfig):
        require_encoder_decoder(config)
        super().__init__(config)
        self.num_experts = config.num_experts  # read at every step: an attribute, as Mixtral's heads keep it
        self.model = VanillaTransformerModel(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        # Labels are aligned with the decoder outputs already; the class-name default (ForCausalLM) would shift them.
        self.loss_type = "ForMaskedLM"
        self.post_init()

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        # Whatever it takes, transformers' method returns the resized input embedding, whose size the bias follows.
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        bias = self.lm_head.bias
        if bias is not None and bias.shape[0] != embeddings.num_embeddings:  # a tied head keeps its old bias
            new_bias = bias.new_zeros(embeddings.num_embeddings)
            kept = min(bias.shape[0], new_bias.shape[0])
            new_bias[:kept] = bias.data[:kept]
            self.lm_head.bias = nn.Parameter(new_bias)
        return embeddings

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor, cu_seq_lens: torch.Tensor | None = None):
        """Teacher forcing: the labels shifted right behind `decoder_start_token_id`, -100 replaced by
        `pad_token_id`; per sequence in a flattened batch (`cu_seq_lens`, the target's offsets)."""
        check_can_shift_labels(self.config.pad_token_id, self.config.decoder_start_token_id)
        if cu_seq_lens is not None:
            return shift_packed_labels(
                labels, cu_seq_lens, self.config.pad_token_id, self.config.decoder_start_token_id
            )
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_logits: bool | None = None,
        skip_logits: bool = False,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput:  # Seq2SeqMoEOutput with experts
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            Target token ids, -100 where ignored. Without `decoder_input_ids` the decoder input is `labels` shifted
            right behind `decoder_start_token_id` (teacher forcing).
        skip_logits (`bool`, *optional*, defaults to `False`):
            Return the loss without logits (`logits=None`): a training step that reads only the loss. Needs labels.
        past_key_values (`Cache`, *optional*):
            The name of `cache` before transformers 5.24.

        With experts (`num_experts > 0`) the output is a `Seq2SeqMoEOutput` with per-stack balancing and z-losses;
        their weighted sum is already in the gradient of any loss built from `logits` (`RouterRequest.add_losses`).
        """
        target = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
        check_token_labels(labels, target, "decoder_input_ids", skip_logits)
        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels, kwargs.get("cu_seq_lens_q"))
        router = RouterRequest.of(self.config, labels, output_router_logits)
        outputs = self.model(
            input_ids,
            return_dict=True,  # the head reads fields; its own return_dict applies to its output
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            cache=given_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=False if labels is not None or self.training and use_cache is None else use_cache,  # as BART
            output_router_logits=router.compute,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        model_outputs = {
            CACHE_FIELD: getattr(outputs, CACHE_FIELD),
            "decoder_hidden_states": outputs.decoder_hidden_states,
            "decoder_attentions": outputs.decoder_attentions,
            "cross_attentions": outputs.cross_attentions,
            "encoder_last_hidden_state": outputs.encoder_last_hidden_state,
            "encoder_hidden_states": outputs.encoder_hidden_states,
            "encoder_attentions": outputs.encoder_attentions,
        }
        if not self.num_experts:
            loss = None if labels is None else self.token_loss(logits, labels, **kwargs)
            return Seq2SeqLMOutput(loss=loss, logits=None if skip_logits else logits, **model_outputs)
        # With experts: the router losses of both stacks, counted over their tokens, join the gradient through the
        # logits, so that a loss built from them alone (the Trainer's label smoothing) trains the routers too.
        logits, loss, router_losses = router.add_losses(
            logits,
            partial(self.token_loss, targets=labels, **kwargs),
            encoder=(outputs.encoder_router_logits, attention_mask),
            decoder=(outputs.decoder_router_logits, decoder_attention_mask),
        )
        aux, z = (router_losses.aux, router_losses.z) if router.report else ({}, {})
        return Seq2SeqMoEOutput(
            loss=loss,
            logits=None if skip_logits else logits,
            encoder_router_logits=router.returned(outputs.encoder_router_logits),
            decoder_router_logits=router.returned(outputs.decoder_router_logits),
            encoder_aux_loss=aux.get("encoder"),
            decoder_aux_loss=aux.get("decoder"),
            encoder_z_loss=z.get("encoder"),
            decoder_z_loss=z.get("decoder"),
            **model_outputs,
        )


class VanillaTransformerForCausalLM(LanguageModelingHead, VanillaTransformerGenerationMixin):
    """Decoder-only language model (GPT-style): the decoder stack without cross-attention, and a tied LM head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # vocabulary-parallel, logits gathered on every rank
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: VanillaTransformerConfig):
        config = config.for_single_stack("decoder")
        super().__init__(config)
        self.num_experts = config.num_experts  # read at every step: an attribute, as Mixtral's heads keep it
        self.model = VanillaTransformerDecoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        # The head shifts the labels itself (`next_token_targets`), so the loss must not shift them again.
        self.loss_type = "ForMaskedLM"
        self.post_init()

    @staticmethod
    def next_token_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None) -> torch.Tensor | None:
        """The label each position predicts: position t predicts token t + 1 (or the caller's `shift_labels`). In a
        flattened batch each sequence's first label is -100 (`DataCollatorWithFlattening`), so no position predicts
        the next sequence."""
        if labels is None or shift_labels is not None:
            return shift_labels
        return nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_logits: bool | None = None,
        skip_logits: bool = False,
        past_key_values: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:  # MoeCausalLMOutput with experts
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, length)`, *optional*):
            Usually `input_ids`; they are shifted inside the head, -100 where ignored. Labels already aligned with
            the outputs may come as `shift_labels` instead (transformers' keyword; not a named argument, so that the
            Trainer does not take it for a label column it requires).
        past_key_values (`Cache`, *optional*):
            The name of `cache` before transformers 5.24.

        With experts the output is a `MoeCausalLMOutput` (Mixtral's, plus `z_loss`); the weighted router losses are
        already in the gradient of any loss built from `logits` (`RouterRequest.add_losses`).
        """
        check_token_labels(labels, input_ids if input_ids is not None else inputs_embeds, "input_ids")
        targets = self.next_token_targets(labels, kwargs.get("shift_labels"))
        if skip_logits and targets is None:
            raise ValueError(SKIP_LOGITS_WITHOUT_LABELS)
        router = RouterRequest.of(self.config, targets, output_router_logits)
        outputs = self.model(
            return_dict=True,  # the head reads fields; its own return_dict applies to its output
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=given_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=False if targets is not None or self.training and use_cache is None else use_cache,
            output_router_logits=router.compute,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        model_outputs = {
            CACHE_FIELD: getattr(outputs, CACHE_FIELD),
            "hidden_states": outputs.hidden_states,
            "attentions": outputs.attentions,
        }
        if not self.num_experts:
            loss = self.token_loss(logits, targets, **kwargs)
            return CausalLMOutputWithPast(loss=loss, logits=None if skip_logits else logits, **model_outputs)
        # With experts: the router losses join the gradient (see VanillaTransformerForConditionalGeneration).
        logits, loss, router_losses = router.add_losses(
            logits, partial(self.token_loss, targets=targets, **kwargs), decoder=(outputs.router_logits, attention_mask)
        )
        return MoeCausalLMOutput(
            loss=loss,
            logits=None if skip_logits else logits,
            router_logits=router.returned(outputs.router_logits),
            aux_loss=router_losses.aux["decoder"] if router.report else None,
            z_loss=router_losses.z["decoder"] if router.report else None,
            **model_outputs,
        )


class VanillaTransformerForMaskedLM(LanguageModelingHead):
    """Encoder-only masked language model (BERT-style pretraining): the bidirectional encoder and a vocabulary
    projection tied to its embedding (§3.4). Labels are -100 except at the masked positions
    (`DataCollatorForLanguageModeling`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # vocabulary-parallel, logits gathered on every rank

    def __init__(self, config: VanillaTransformerConfig):
        config = config.for_single_stack("encoder")
        super().__init__(config)
        self.num_experts = config.num_experts  # read at every step: an attribute, as Mixtral's heads keep it
        self.model = VanillaTransformerEncoder(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_logits: bool | None = None,
        skip_logits: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MaskedLMOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, length)`, *optional*):
            The original token at each masked position, -100 elsewhere.
        skip_logits (`bool`, *optional*, defaults to `False`):
            Return the loss without logits (`logits=None`): a training step that reads only the loss. Needs labels.
        """
        check_token_labels(labels, input_ids if input_ids is not None else inputs_embeds, "input_ids", skip_logits)
        router = RouterRequest.of(self.config, labels, output_router_logits)
        outputs = self.model(
            return_dict=True,  # the head reads fields; its own return_dict applies to its output
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_router_logits=router.compute,
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        if not self.num_experts:
            loss = self.token_loss(logits, labels, **kwargs)
        else:  # the router losses join the gradient (see the seq2seq head); not reported apart
            loss_of = partial(self.token_loss, targets=labels, **kwargs)
            logits, loss, _ = router.add_losses(logits, loss_of, encoder=(outputs.router_logits, attention_mask))
        return MaskedLMOutput(
            loss=loss,
            logits=None if skip_logits else logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "VanillaTransformerForConditionalGeneration",
    "VanillaTransformerForCausalLM",
    "VanillaTransformerForMaskedLM",
]
