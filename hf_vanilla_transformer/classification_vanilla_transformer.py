"""Classifier heads on one stack, as GPT and BERT fine-tune the Transformer: sequence classification, token
classification and extractive question answering.

Each runs the stack its config names (`config.is_decoder`): the bidirectional encoder of a masked-LM checkpoint
(BERT-style), or the causal decoder of a causal-LM checkpoint (GPT-style), whose config says `is_decoder=True`. The
stack is `self.model` either way, as in the language-model heads, so every transformer weight of a pretrained
checkpoint loads under the same name and only the task's output layer is new.
"""

from functools import partial

import torch
from torch import nn
from transformers.modeling_outputs import (
    QuestionAnsweringModelOutput,
    SequenceClassifierOutput,
    TokenClassifierOutput,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .inputs_vanilla_transformer import (
    check_sequence_classification_labels,
    check_token_ids,
    labels_outside,
)
from .modeling_vanilla_transformer import (
    MoeEncoderOutput,
    VanillaTransformerDecoder,
    VanillaTransformerEncoder,
    VanillaTransformerPreTrainedModel,
    current_tokens,
    with_item_count,
)
from .router_losses_vanilla_transformer import RouterRequest

# transformers lets `set_experts_implementation` and `from_pretrained(experts_implementation=...)` switch the experts
# kernel of a model whose class is defined in a module that uses `@use_experts_implementation`. The heads here run the
# experts of modeling_vanilla_transformer, which that decorator declares; this comment declares them in this module too.


def runs_causal_decoder(config: VanillaTransformerConfig) -> bool:
    """Whether a single-stack head on `config` runs the causal decoder: the config of a decoder-only checkpoint."""
    return not config.is_encoder_decoder and config.is_decoder


def positions_after_left_padding(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Position ids that start at 0 on each row's first real token, as `generate` gives left-padded prompts: a row's
    outputs then do not depend on the padding in front of it. Padding positions get 0 (they are masked anyway)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def last_token_indices(token_mask: torch.Tensor | None, batch_size: int, length: int, device) -> torch.Tensor:
    """Each row's last real token (GPT-2/Llama's classifier convention): the rightmost position of `token_mask`, so
    left and right padding both work; the last position without a mask."""
    if token_mask is None:
        return torch.full((batch_size,), length - 1, device=device)
    positions = torch.arange(length, device=device)
    return (positions * token_mask.to(device=device, dtype=torch.long)).argmax(-1)


class SingleStackTaskHead(VanillaTransformerPreTrainedModel):
    """What the task heads share: `self.model`, the encoder or the causal decoder that the config names, and one run
    of it that also returns the MoE router losses the head's loss must carry."""

    # A head with one output per sequence cannot take a flattened batch (packing_vanilla_transformer): it would pool
    # across texts.
    outputs_per_sequence = False

    def __init__(self, config: VanillaTransformerConfig):
        config = config.for_single_stack("decoder" if runs_causal_decoder(config) else "encoder")
        super().__init__(config)
        stack_class = VanillaTransformerDecoder if config.is_decoder else VanillaTransformerEncoder
        self.model = stack_class(config)
        self.num_experts = config.num_experts  # read at every step: an attribute, as Mixtral's heads keep it

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def run_stack(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None,
        router: RouterRequest,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeEncoderOutput:
        """The stack's outputs, with the router logits of its MoE layers where `router` (the head's request) computes
        their losses."""
        if self.outputs_per_sequence and kwargs.get("cu_seq_lens_q") is not None:
            raise ValueError(
                f"{type(self).__name__} has one output per sequence and cannot take a flattened batch "
                "(cu_seq_lens_q/k): pass the sequences padded, with an attention_mask."
            )
        if self.config.is_decoder:
            # One pass over the whole input, no cache to fill; unless given, positions restart at each row's first
            # token.
            kwargs["use_cache"] = False
            if kwargs.get("position_ids") is None:
                kwargs["position_ids"] = positions_after_left_padding(attention_mask)
        return self.model(
            return_dict=True,  # the head reads fields; its own return_dict applies to its output
            input_ids=input_ids,
            attention_mask=attention_mask,
            inputs_embeds=inputs_embeds,
            output_router_logits=router.compute,
            **kwargs,
        )

    def with_router_losses(self, router, logits, loss_of, outputs, attention_mask) -> tuple:
        """(logits, loss): the head's loss (`loss_of(logits)`), and with experts the router losses of the stack's MoE
        layers, over its tokens, joined to its gradient (`RouterRequest.add_losses`)."""
        if not self.num_experts:
            return logits, loss_of(logits)
        stack = "decoder" if self.config.is_decoder else "encoder"
        logits, loss, _ = router.add_losses(logits, loss_of, **{stack: (outputs.router_logits, attention_mask)})
        return logits, loss


class ClassifierHead(SingleStackTaskHead):
    """A linear classifier on the stack's states, after dropout: `classified_states` says which states (each token's,
    or one vector per sequence), `classification_loss` which loss; the subclass returns `output_class`."""

    output_class: type[SequenceClassifierOutput | TokenClassifierOutput]

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(self.config.classifier_dropout)
        self.classifier = nn.Linear(self.config.d_model, self.config.num_labels)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> SequenceClassifierOutput | TokenClassifierOutput:
        r"""
        labels (`torch.LongTensor`, *optional*):
            Sequence classification: class indices of shape `(batch_size,)` (a float target with `num_labels == 1`:
            regression; `config.problem_type` decides, as in transformers' own classifiers). Token classification:
            a class index per token, `(batch_size, length)`, -100 where ignored (padding, continuation word pieces).
        """
        router = RouterRequest.of(self.config, labels, output_router_logits)
        outputs = self.run_stack(input_ids, attention_mask, inputs_embeds, router, **kwargs)
        states = self.classified_states(outputs.last_hidden_state, attention_mask, input_ids)
        logits = self.classifier(self.dropout(states))
        loss_of = partial(self.classification_loss, labels=labels, **kwargs)
        logits, loss = self.with_router_losses(router, logits, loss_of, outputs, attention_mask)
        return self.output_class(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


class VanillaTransformerForSequenceClassification(ClassifierHead):
    """A linear classifier on a pooled vector. On the encoder (BERT-style) the pooled vector is the mean over real
    tokens or the first token (`config.classifier_pooling`); on the causal decoder of a causal-LM checkpoint
    (GPT-style) it is the last real token's state, the only one that has read the whole input."""

    output_class = SequenceClassifierOutput
    outputs_per_sequence = True

    def classified_states(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """The pooled vector of each sequence, (batch, d_model)."""
        token_mask = current_tokens(attention_mask, hidden_states.shape[1])
        if self.config.is_decoder:
            if token_mask is None and input_ids is not None and self.config.pad_token_id is not None:
                token_mask = input_ids != self.config.pad_token_id  # Llama's fallback without an attention mask
            batch_size, length = hidden_states.shape[:2]
            last = last_token_indices(token_mask, batch_size, length, hidden_states.device)
            return hidden_states[torch.arange(batch_size, device=hidden_states.device), last]
        if self.config.classifier_pooling == "first":
            return hidden_states[:, 0]
        if token_mask is None:
            return hidden_states.mean(dim=1)
        weights = token_mask.to(hidden_states.dtype).unsqueeze(-1)
        return (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)

    def classification_loss(self, logits: torch.Tensor, labels: torch.Tensor | None, **kwargs) -> torch.Tensor | None:
        if labels is None:
            return None
        check_sequence_classification_labels(labels, logits.shape[0], self.config.num_labels, self.config.problem_type)
        kwargs = with_item_count(kwargs, labels)
        with labels_outside(self.config.num_labels):
            return self.loss_function(labels=labels, pooled_logits=logits, config=self.config, **kwargs)


class VanillaTransformerForTokenClassification(ClassifierHead):
    """A linear classifier on every token's state (named-entity tagging, BERT §4.3); on the causal decoder a token's
    label is predicted from it and the tokens before it only."""

    output_class = TokenClassifierOutput

    def classified_states(
        self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, input_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """Every token's state, (batch, length, d_model)."""
        return hidden_states

    def classification_loss(self, logits: torch.Tensor, labels: torch.Tensor | None, **kwargs) -> torch.Tensor | None:
        if labels is None:
            return None
        check_token_ids(labels, "labels", logits.shape[:2], "class ids (-100 where ignored)")
        with labels_outside(self.config.num_labels):
            return self.loss_function(logits, labels, self.config, **with_item_count(kwargs, labels))


def split_span_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, length, 2) -> the start and the end scores, each (batch, length)."""
    start_logits, end_logits = (scores.contiguous() for scores in logits.unbind(dim=-1))
    return start_logits, end_logits


class VanillaTransformerForQuestionAnswering(SingleStackTaskHead):
    """Extractive question answering (BERT §4.2): a start and an end score per token of "question [SEP] context";
    the answer is the best-scoring span."""

    outputs_per_sequence = True

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.qa_outputs = nn.Linear(self.config.d_model, 2)
        self.post_init()

    def span_loss(self, logits, start_positions, end_positions, **kwargs) -> torch.Tensor | None:
        """transformers' QA loss over the answer spans, None without them."""
        if start_positions is None or end_positions is None:
            return None
        return self.loss_function(*split_span_logits(logits), start_positions, end_positions, **kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        start_positions: torch.LongTensor | None = None,
        end_positions: torch.LongTensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> QuestionAnsweringModelOutput:
        r"""
        start_positions, end_positions (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            The answer span's first and last token; positions outside the sequence are clamped and ignored, as in
            transformers' QA heads.
        """
        labels = None if start_positions is None or end_positions is None else start_positions
        router = RouterRequest.of(self.config, labels, output_router_logits)
        outputs = self.run_stack(input_ids, attention_mask, inputs_embeds, router, **kwargs)
        logits = self.qa_outputs(outputs.last_hidden_state)
        loss_of = partial(self.span_loss, start_positions=start_positions, end_positions=end_positions, **kwargs)
        # The router losses join before the split, so that a loss built from either half carries them once.
        logits, loss = self.with_router_losses(router, logits, loss_of, outputs, attention_mask)
        start_logits, end_logits = split_span_logits(logits)
        return QuestionAnsweringModelOutput(
            loss=loss,
            start_logits=start_logits,
            end_logits=end_logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "VanillaTransformerForSequenceClassification",
    "VanillaTransformerForTokenClassification",
    "VanillaTransformerForQuestionAnswering",
]
