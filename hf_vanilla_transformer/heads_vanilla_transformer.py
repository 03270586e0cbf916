"""The translation model (encoder-decoder LM), and the pipeline every language-model head shares.

The language-model heads (this one, and the causal and masked LMs of `task_heads_vanilla_transformer.py`) share one
pipeline (`TokenPredictionHead`): plan which
positions the stack and the vocabulary projection must compute, run the stack, then `predict`: project, add the MoE
router losses, take the loss, and return the head's output class with the model's other outputs.
"""

from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_outputs import (
    BaseModelOutput,
    Seq2SeqLMOutput,
    Seq2SeqMoEOutput,
)
from transformers.modeling_utils import slice_logits_to_keep
from transformers.models.bart.modeling_bart import shift_tokens_right
from transformers.processing_utils import Unpack
from transformers.utils import ModelOutput, TransformersKwargs, can_return_tuple

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .generation_vanilla_transformer import VanillaTransformerGenerationMixin
from .inputs_vanilla_transformer import (
    IGNORE_INDEX,
    check_can_shift_labels,
    check_token_labels,
)
from .modeling_vanilla_transformer import (
    Stack,
    VanillaTransformerModel,
    VanillaTransformerPreTrainedModel,
)
from .moe_vanilla_transformer import (
    RouterLosses,
    attach_router_loss,
    counted_router_rows,
    router_logits_per_position,
)
from .packing_vanilla_transformer import PackedTokens, positions_the_loss_needs, token_mask_of


def first_given(*tensors: torch.Tensor | None) -> torch.Tensor | None:
    return next((tensor for tensor in tensors if tensor is not None), None)


def current_tokens(attention_mask: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The tokens among the last `length` columns of a padding mask: the positions of this forward (the mask of a
    decoding step also covers the cache)."""
    padding_mask = token_mask_of(attention_mask)
    return None if padding_mask is None else padding_mask[:, -length:]


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
        asked = config.output_router_logits if output_router_logits is None else output_router_logits
        if config.num_experts == 0:
            return cls(compute=False, report=False, return_logits=False)
        # Mixtral's convention: the losses are returned with a loss or when asked for, so that outputs[0] is the
        # logits whenever no loss is returned, in training as in inference.
        report = asked or labels is not None
        return cls(compute=report or torch.is_grad_enabled(), report=report, return_logits=asked)

    def returned(self, router_logits: tuple[torch.Tensor, ...] | None, token_mask: torch.Tensor | None):
        """The router logits to return (None unless asked for), one row per position (see
        `router_logits_per_position`)."""
        return router_logits_per_position(router_logits, token_mask) if self.return_logits else None

    def losses(self, config: VanillaTransformerConfig, **stacks: tuple) -> RouterLosses | None:
        """`stacks`: name -> (router logits of its MoE layers, the positions it routed, its padding mask), the masks
        (batch, length) or None; None when not computed."""
        if not self.compute:
            return None
        counted = {name: (logits, counted_router_rows(logits, *masks)) for name, (logits, *masks) in stacks.items()}
        return RouterLosses.of_stacks(config, **counted)


def with_router_gradient(logits: torch.Tensor, router_losses: RouterLosses | None) -> torch.Tensor:
    """The logits, carrying the router losses into the gradient of any loss built from them (`attach_router_loss`)."""
    return logits if router_losses is None else attach_router_loss(logits, router_losses.total)


def with_router_value(loss: torch.Tensor | None, router_losses: RouterLosses | None) -> torch.Tensor | None:
    """The reported loss plus the router losses, as a value only: their gradient already flows through the logits."""
    return loss if loss is None or router_losses is None else loss + router_losses.total.detach()


def carried_over(output_class: type[ModelOutput], model_outputs: ModelOutput, **fields) -> ModelOutput:
    """A head's output: `fields`, and every field its class shares with the model's output (cache, hidden states,
    attentions, encoder outputs), passed on as the model returned it."""
    shared = {name: value for name, value in model_outputs.items() if name in output_class.__dataclass_fields__}
    return output_class(**{**shared, **fields})


@dataclass
class TokenPredictions:
    """A language-model head's plan for one forward, made before its stack runs.

    targets         (batch, length) labels aligned with the outputs (shifted already for next-token prediction), -100
                    where ignored
    token_mask      the positions the stack must compute: those the loss reads and the real tokens before them; None
                    without labels (every token of the attention mask)
    scored          in training with `config.padding_free`, where the loss ignores some positions, the layout of those
                    it reads: the only logits a training step needs, the rest are returned as 0
    attention_mask  the padding mask of the predicting stack, as given (a decoding step's also covers the cache)
    """

    targets: torch.Tensor | None
    token_mask: torch.Tensor | None
    scored: PackedTokens | None
    router: RouterRequest
    attention_mask: torch.Tensor | None

    def routed_positions(self, length: int) -> torch.Tensor | None:
        """The positions the stack computed (and its MoE layers routed): `token_mask`, else the tokens of this
        forward's `length` positions."""
        return self.token_mask if self.token_mask is not None else current_tokens(self.attention_mask, length)


class TokenPredictionHead(VanillaTransformerPreTrainedModel):
    """The shared pipeline of the language-model heads: a stack, then `lm_head` tied to the embedding (§3.4).

    A head's `forward` checks its inputs, makes its `plan`, runs `self.model`, and hands the model's output to
    `predict`, which returns the head's output: `output_class`, or `moe_output_class` with experts.
    """

    output_class: type[ModelOutput]
    moe_output_class: type[ModelOutput] | None = None  # None: the head reports no router logits or losses
    predicting_stack: Stack = "decoder"  # the stack whose outputs `lm_head` projects

    def plan(
        self,
        targets: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        logits_to_keep: int | torch.Tensor,
        output_router_logits: bool | None,
    ) -> TokenPredictions:
        router = RouterRequest.of(self.config, targets, output_router_logits)
        if targets is None:
            return TokenPredictions(None, None, None, router, attention_mask)
        targets = targets.contiguous()  # transformers' loss flattens them with view()
        counted = targets != IGNORE_INDEX
        only_counted = (
            self.training and self.config.padding_free and isinstance(logits_to_keep, int) and not logits_to_keep
        )
        return TokenPredictions(
            targets=targets,
            token_mask=positions_the_loss_needs(counted, token_mask_of(attention_mask)),
            scored=PackedTokens.of(counted) if only_counted else None,
            router=router,
            attention_mask=attention_mask,
        )

    def predict(
        self,
        plan: TokenPredictions,
        outputs: ModelOutput,
        logits_to_keep: int | torch.Tensor,
        source_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ModelOutput:
        """The head's output from its model's `outputs`: logits, loss, router losses and logits, and the model's other
        fields. `source_mask`: the encoder's padding mask, in an encoder-decoder."""
        routed = self.routed_positions(plan, outputs.last_hidden_state.shape[1], source_mask)
        router_logits = {stack: getattr(outputs, self.field_name(stack, "router_logits"), None) for stack in routed}
        router_losses = plan.router.losses(
            self.config, **{stack: (router_logits[stack], *masks) for stack, masks in routed.items()}
        )
        loss, logits = self.loss_and_logits(plan, outputs.last_hidden_state, logits_to_keep, router_losses, **kwargs)
        if self.config.num_experts == 0 or self.moe_output_class is None:
            return carried_over(self.output_class, outputs, loss=loss, logits=logits)
        router_fields = self.router_fields(plan, routed, router_logits, router_losses)
        return carried_over(self.moe_output_class, outputs, loss=loss, logits=logits, **router_fields)

    def router_fields(
        self,
        plan: TokenPredictions,
        routed: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]],
        router_logits: dict[str, tuple[torch.Tensor, ...] | None],
        router_losses: RouterLosses | None,
    ) -> dict[str, torch.Tensor | tuple[torch.Tensor, ...] | None]:
        """The MoE output fields: each stack's router logits (None unless asked for) and, when reported, losses."""
        fields = {
            self.field_name(stack, "router_logits"): plan.router.returned(router_logits[stack], routed[stack][0])
            for stack in routed
        }
        if plan.router.report:
            fields.update(router_losses.output_fields(self.field_name("{stack}", "{kind}_loss")))
        return fields

    def field_name(self, stack: str, field: str) -> str:
        """Where an output field of one stack goes: prefixed by the stack in an encoder-decoder (`decoder_aux_loss`,
        as transformers' Seq2Seq outputs), bare on a single stack (`aux_loss`)."""
        return f"{stack}_{field}" if self.config.is_encoder_decoder else field

    def routed_positions(
        self, plan: TokenPredictions, length: int, source_mask: torch.Tensor | None
    ) -> dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]:
        """Stack -> (the positions its MoE layers routed, its real tokens), (batch, length) masks or None. The encoder
        of an encoder-decoder routes every source token."""
        routed = {self.predicting_stack: (plan.routed_positions(length), current_tokens(plan.attention_mask, length))}
        return {"encoder": (source_mask, source_mask), **routed} if self.config.is_encoder_decoder else routed

    def loss_and_logits(
        self,
        plan: TokenPredictions,
        hidden_states: torch.Tensor,
        logits_to_keep: int | torch.Tensor,
        router_losses: RouterLosses | None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(loss, logits): the vocabulary projection of the positions the plan keeps, the router losses carried into
        its gradient, and the loss over the targets (plus the router losses, as a value)."""
        if plan.scored is None:
            logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
        else:
            logits = self.lm_head(plan.scored.pack(hidden_states))
        logits = with_router_gradient(logits, router_losses)
        loss = None
        if plan.targets is not None:
            targets = plan.targets if plan.scored is None else plan.scored.pack(plan.targets)
            # Summed over tokens and divided by num_items_in_batch when the Trainer passes it: exact under gradient
            # accumulation, unlike a per-batch mean. Otherwise divided by the counted tokens, at least 1, so that a
            # batch whose labels are all ignored has loss 0 rather than the NaN of an empty mean.
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = (targets != IGNORE_INDEX).sum().clamp(min=1)
            loss = self.loss_function(logits, targets, vocab_size=self.config.vocab_size, **kwargs)
        if plan.scored is not None:  # the returned logits keep the (batch, length, vocab) layout, 0 where unscored
            logits = plan.scored.unpack(logits)
        return with_router_value(loss, router_losses), logits


class VanillaTransformerForConditionalGeneration(TokenPredictionHead, VanillaTransformerGenerationMixin):
    """Encoder-decoder with the pre-softmax projection tied to the shared embedding (§3.4): the translation model.

    Beam search can rank hypotheses with the paper's GNMT length penalty: `generate(..., length_penalty_type="gnmt")`.
    """

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}  # vocabulary-parallel, logits gathered on every rank
    output_class = Seq2SeqLMOutput
    moe_output_class = Seq2SeqMoEOutput
    _auto_map = {"AutoModelForSeq2SeqLM": "heads_vanilla_transformer.VanillaTransformerForConditionalGeneration"}

    def __init__(self, config: VanillaTransformerConfig):
        require_encoder_decoder(config)
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
        check_can_shift_labels(self.config.pad_token_id, self.config.decoder_start_token_id)
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
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput | Seq2SeqMoEOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            Target token ids, -100 where ignored. Without `decoder_input_ids` the decoder input is `labels` shifted
            right behind `decoder_start_token_id` (teacher forcing).

        With experts (`num_experts > 0`) the output is a `Seq2SeqMoEOutput` with per-stack balancing and z-losses;
        their weighted sum is already in the gradient of any loss built from `logits` (see `attach_router_loss`).
        """
        decoder_inputs = first_given(decoder_input_ids, decoder_inputs_embeds)
        check_token_labels(labels, self.config.vocab_size, decoder_inputs, "decoder_input_ids")
        if labels is not None and decoder_inputs is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        plan = self.plan(labels, decoder_attention_mask, logits_to_keep, output_router_logits)
        outputs = self.model(
            input_ids,
            return_dict=True,  # the head reads fields; its own return_dict applies to its output
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            decoder_token_mask=plan.token_mask,
            output_router_logits=plan.router.compute,
            **kwargs,
        )
        return self.predict(plan, outputs, logits_to_keep, source_mask=token_mask_of(attention_mask), **kwargs)


__all__ = ["VanillaTransformerForConditionalGeneration"]
