"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a transformers 5.x model, with its variants.

Section numbers in comments refer to the paper. Here: the stacks (embeddings, positions, N layers, final norm), the
encoder-decoder base model and the weight init; the layers themselves are in layers_vanilla_transformer. Masks come
from `transformers.masking_utils`; the decoder cache is an `EncoderDecoderCache`. A batch comes padded, (batch,
length) with an attention mask, or flattened with the offsets of its sequences (packing_vanilla_transformer), in
which case no mask is built and attention runs per sequence. Nothing here reads a tensor's values on the host: a
step runs without waiting for the device.
"""

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer
from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqModelOutput,
    Seq2SeqMoEModelOutput,
)
from transformers.modeling_utils import PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .dropout_vanilla_transformer import Dropout
from .inputs_vanilla_transformer import (
    check_inputs_embeds,
    check_position_ids,
    check_same_batch,
    check_stack_inputs,
    checked_attention_mask,
    raises_value_error,
)
from .layers_vanilla_transformer import (
    VanillaTransformerAttention,
    VanillaTransformerDecoderLayer,
    VanillaTransformerEncoderLayer,
)
from .moe_vanilla_transformer import (
    MoeDecoderOutput,
    MoeEncoderOutput,
    VanillaTransformerExperts,
    VanillaTransformerRouter,
    init_moe_weights,
)
from .norms_vanilla_transformer import build_norm, has_final_norm
from .packing_vanilla_transformer import AttentionLayout, Sequences, layout_kernel
from .positions_vanilla_transformer import POSITION_EMBEDDINGS, SinusoidalPositionalEmbedding
from .pretrained_vanilla_transformer import LoadSaveShardMixin


class ScaledWordEmbedding(nn.Embedding):
    """Token embedding multiplied by sqrt(d_model) (§3.4)."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config.vocab_size, config.d_model, padding_idx=config.pad_token_id)
        self.embed_scale = config.d_model**0.5 if config.scale_embedding else 1.0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.embed_scale


class VanillaTransformerPreTrainedModel(LoadSaveShardMixin, PreTrainedModel):
    config: VanillaTransformerConfig
    config_class = VanillaTransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["VanillaTransformerEncoderLayer", "VanillaTransformerDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # Each `forward` is annotated with its dense output class: transformers reads the annotation to tell whether a
    # class returns router logits, and one class serves dense and MoE configs. With experts the forward returns the
    # MoE output class named beside the annotation.

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        normal = self.config.initialization == "normal"
        if isinstance(module, nn.Linear):
            deepnorm_gain = getattr(module, "deepnorm_gain", None)  # set by set_deepnorm_init_gains
            if deepnorm_gain is not None:
                init.xavier_normal_(module.weight, gain=deepnorm_gain)  # DeepNet (Wang et al. 2022), Figure 2
            elif normal:
                init.normal_(module.weight, std=self.config.initializer_range)
            else:
                init.xavier_uniform_(module.weight)  # as torch.nn.Transformer and the Annotated Transformer
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, VanillaTransformerExperts | VanillaTransformerRouter):
            init_moe_weights(module, self.config)
        elif isinstance(module, nn.Embedding):
            # "xavier": N(0, 1/d_model), so that after the sqrt(d_model) scaling of §3.4 token vectors have unit
            # variance (fairseq).
            init.normal_(module.weight, std=self.config.initializer_range if normal else self.config.d_model**-0.5)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, SinusoidalPositionalEmbedding):  # a buffer, not saved
            init.copy_(module.table, module.encoding(torch.arange(len(module.table))))
        elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                init.zeros_(module.bias)


class VanillaTransformerStack(VanillaTransformerPreTrainedModel):
    """What the encoder and decoder share (§3.1): scaled token embeddings, positions, dropout on their sum (§5.4), N
    identical layers and, for the pre-norm placements, a final norm."""

    def __init__(self, config: VanillaTransformerConfig, layer_class: type[nn.Module], num_layers: int, num_heads: int):
        super().__init__(config)
        self.embed_tokens = ScaledWordEmbedding(config)
        self.embed_positions = POSITION_EMBEDDINGS[config.position_embedding_type](config, config.d_model // num_heads)
        self.dropout = Dropout(config.dropout)
        self.layers = nn.ModuleList([layer_class(config, i) for i in range(num_layers)])
        self.layer_norm = build_norm(config) if has_final_norm(config) else None
        self.gradient_checkpointing = False

    def embed(
        self,
        input_ids: torch.LongTensor | None,
        inputs_embeds: torch.Tensor | None,
        position_ids: torch.LongTensor | None,
        sequences: Sequences | None,
        past_length: int | torch.Tensor = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(token embeddings, the layers' input, the RoPE table or None). Positions continue after the cache, or
        restart at each sequence of a flattened batch."""
        check_stack_inputs(input_ids, inputs_embeds, self.config.d_model, self.argument_prefix)
        if inputs_embeds is None:
            # The lookup checks the ids itself, at no cost: on an accelerator its kernel asserts on the device, on a
            # CPU it raises an IndexError that names nothing, replaced here.
            name = "decoder_input_ids (or the labels shifted into them)" if self.argument_prefix else "input_ids"
            vocab_size = self.config.vocab_size
            with raises_value_error(
                IndexError, f"{name} holds an id outside the vocabulary [0, vocab_size={vocab_size})"
            ):
                inputs_embeds = self.embed_tokens(input_ids)
        check_position_ids(position_ids, *inputs_embeds.shape[:2])
        if position_ids is None and sequences is not None:
            position_ids = sequences.positions(inputs_embeds.shape[:2])
        positions_below = sequences.max_length if sequences is not None else None
        hidden_states, rotary = self.embed_positions(inputs_embeds, position_ids, past_length, positions_below)
        if self.first_layer_run > 0:  # a later pipeline rank: `inputs_embeds` is the previous rank's output
            return inputs_embeds, inputs_embeds, rotary
        return inputs_embeds, self.dropout(hidden_states), rotary

    @property
    def first_layer_run(self) -> int:
        """The index of the first layer this rank runs: 0, but on the later ranks of a pipeline, where transformers'
        engine has replaced the layers of the ranks before by identities and passes their output as `inputs_embeds`."""
        run = (index for index, layer in enumerate(self.layers) if not isinstance(layer, PipelineIdentityLayer))
        return next(run, 0)

    @property
    def runs_last_layer(self) -> bool:
        """False on the ranks of a pipeline before the last, whose output goes on to the next rank's layers."""
        return len(self.layers) == 0 or not isinstance(self.layers[-1], PipelineIdentityLayer)

    @property
    def argument_prefix(self) -> str:
        """How callers name this stack's inputs: "decoder_" (decoder_input_ids, ...) for the decoder of an
        encoder-decoder."""
        return "decoder_" if self.config.is_encoder_decoder and isinstance(self, VanillaTransformerDecoder) else ""

    def final_norm(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.layer_norm(hidden_states) if self.layer_norm is not None and self.runs_last_layer else hidden_states

    def flattened_sequences(self, kwargs: dict, input_ids, inputs_embeds, source_shape=None):
        """A flattened batch's sequences, (this stack's own: "q" for a decoder or a single stack, "k" for the
        encoder; the source's for cross-attention), taken out of the keyword arguments: the layers get them as
        `AttentionLayout`s. Also what runs their attention (`layout_kernel`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError(f"Pass exactly one of input_ids or inputs_embeds to the {type(self).__name__}.")
        offsets = {name: kwargs.pop(name) for name in FLATTENED_KEYWORDS if name in kwargs}
        if not offsets:
            return None, None, None
        kernel = layout_kernel(self.config, self.embed_tokens.weight, self.training)
        shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        own = Sequences.of(offsets, "k" if isinstance(self, VanillaTransformerEncoder) else "q", shape, kernel)
        sources = Sequences.of(offsets, "k", source_shape, kernel) if source_shape is not None else None
        return own, sources, kernel


# The keywords of a flattened batch (cu_seq_lens_q is the target's or a single stack's, _k the source's).
FLATTENED_KEYWORDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class VanillaTransformerEncoder(VanillaTransformerStack):
    """The encoder stack: N identical layers over the embedded source (§3.1)."""

    _can_record_outputs = {
        "hidden_states": VanillaTransformerEncoderLayer,
        "attentions": VanillaTransformerAttention,
        "router_logits": OutputRecorder(VanillaTransformerRouter, index=0),
    }

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config, VanillaTransformerEncoderLayer, config.encoder_layers, config.encoder_attention_heads)
        self.output_class = MoeEncoderOutput if config.num_experts else BaseModelOutput
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutput:  # MoeEncoderOutput with experts, which adds the router logits of its MoE layers
        sources, _, kernel = self.flattened_sequences(kwargs, input_ids, inputs_embeds)
        inputs_embeds, hidden_states, rotary = self.embed(input_ids, inputs_embeds, position_ids, sources)
        batch_size, length = inputs_embeds.shape[:2]
        attention_mask = checked_attention_mask(attention_mask, batch_size, length, length, "attention_mask")
        if sources is None:
            attention_mask = create_bidirectional_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                allow_is_bidirectional_skip=attention_mask is None,  # deciding it from the mask's values would sync
            )
        layout = (
            None if sources is None else AttentionLayout.of(sources, sources, False, kernel, self.embed_tokens.weight)
        )
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, attention_mask, position_embeddings=rotary, attention_layout=layout, **kwargs
            )
        return self.output_class(last_hidden_state=self.final_norm(hidden_states))


class VanillaTransformerDecoder(VanillaTransformerStack):
    """The decoder stack (§3.1); without cross-attention when `config.is_encoder_decoder` is False (decoder-only)."""

    _can_record_outputs = {
        "hidden_states": VanillaTransformerDecoderLayer,
        "attentions": OutputRecorder(VanillaTransformerAttention, index=1, layer_name="self_attn"),
        "cross_attentions": OutputRecorder(VanillaTransformerAttention, index=1, layer_name="encoder_attn"),
        "router_logits": OutputRecorder(VanillaTransformerRouter, index=0),
    }

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config, VanillaTransformerDecoderLayer, config.decoder_layers, config.decoder_attention_heads)
        self.output_class = MoeDecoderOutput if config.num_experts else BaseModelOutputWithPastAndCrossAttentions
        self.post_init()

    def new_cache(self) -> Cache:
        if not self.config.is_encoder_decoder:
            return DynamicCache(config=self.config)
        return EncoderDecoderCache(DynamicCache(config=self.config), DynamicCache(config=self.config))

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPastAndCrossAttentions:  # MoeDecoderOutput with experts, which adds the router logits
        source_shape = encoder_hidden_states.shape[:2] if encoder_hidden_states is not None else None
        targets, sources, kernel = self.flattened_sequences(kwargs, input_ids, inputs_embeds, source_shape)
        if use_cache and past_key_values is None and targets is None:  # a flattened batch is a training batch
            past_key_values = self.new_cache()
        first_layer = self.first_layer_run  # whose cache holds the decoded length
        past_length = past_key_values.get_seq_length(first_layer) if past_key_values is not None else 0
        inputs_embeds, hidden_states, rotary = self.embed(input_ids, inputs_embeds, position_ids, targets, past_length)
        batch_size, length = inputs_embeds.shape[:2]
        self_attention_cache = (
            past_key_values.self_attention_cache
            if isinstance(past_key_values, EncoderDecoderCache)
            else past_key_values
        )
        # A static (compileable) cache's masks span the whole cache, whatever has been decoded.
        static_cache = self_attention_cache is not None and self_attention_cache.is_compileable
        key_length = None if static_cache else past_length + length
        mask_name = f"{self.argument_prefix}attention_mask"
        attention_mask = checked_attention_mask(attention_mask, batch_size, length, key_length, mask_name)
        if targets is None:
            # Position ids restarting at 0 without a mask mark sequences packed in one row; transformers finds them
            # only without a cache, and a dynamic cache this forward starts empty changes nothing else in the mask.
            starts_dynamic_cache = type(self_attention_cache) is DynamicCache and past_length == 0
            attention_mask = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                past_key_values=None if starts_dynamic_cache else self_attention_cache,
                position_ids=position_ids,
                layer_idx=first_layer,
                allow_is_causal_skip=attention_mask is None,  # deciding it from the mask's values would sync
            )
        if encoder_hidden_states is not None:
            check_inputs_embeds(encoder_hidden_states, self.config.d_model, "encoder_outputs.last_hidden_state")
            source_batch_size, source_length = encoder_hidden_states.shape[:2]
            check_same_batch(f"{self.argument_prefix}input_ids", batch_size, "the encoder output", source_batch_size)
            # The encoder checked the values of its mask, unless it did not run (given encoder outputs): see
            # VanillaTransformerModel.forward.
            encoder_attention_mask = checked_attention_mask(
                encoder_attention_mask, batch_size, length, source_length, "attention_mask", check_values=False
            )
            if sources is None:
                encoder_attention_mask = create_bidirectional_mask(
                    config=self.config,
                    inputs_embeds=inputs_embeds,
                    attention_mask=encoder_attention_mask,
                    encoder_hidden_states=encoder_hidden_states,
                    allow_is_bidirectional_skip=encoder_attention_mask is None,
                )
        weight = self.embed_tokens.weight
        self_attention_layout = AttentionLayout.of(targets, targets, True, kernel, weight)
        cross_attention_layout = (
            AttentionLayout.of(targets, sources, False, kernel, weight) if source_shape is not None else None
        )
        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask,
                encoder_hidden_states,  # positional: activation checkpointing only passes grads through positionals
                encoder_attention_mask=encoder_attention_mask,
                position_embeddings=rotary,
                past_key_values=past_key_values,
                attention_layout=self_attention_layout,
                cross_attention_layout=cross_attention_layout,
                **kwargs,
            )
        return self.output_class(last_hidden_state=self.final_norm(hidden_states), past_key_values=past_key_values)


def base_model_class(config: VanillaTransformerConfig) -> type[VanillaTransformerPreTrainedModel]:
    """The base model of a checkpoint: the encoder-decoder, or the one stack a decoder-only (`is_decoder`) or
    encoder-only model runs, which its heads keep as `model`."""
    if config.is_encoder_decoder:
        return VanillaTransformerModel
    return VanillaTransformerDecoder if config.is_decoder else VanillaTransformerEncoder


class VanillaTransformerModel(VanillaTransformerPreTrainedModel):
    """Encoder-decoder without a head. `shared` is the target embedding, and also the source one by default (§3.4)."""

    _tied_weights_keys = {
        "decoder.embed_tokens.weight": "shared.weight",
        "encoder.embed_tokens.weight": "shared.weight",
    }
    # The stacks shard their own embeddings on the vocabulary (transformers adds that rule to a model with
    # `embed_tokens`); the shared one, held here, must be sharded like the `lm_head` tied to it.
    _tp_plan = {"shared": "embedding_rowwise"}

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__(config)
        self.shared = ScaledWordEmbedding(config)
        self.encoder = VanillaTransformerEncoder(config)
        self.decoder = VanillaTransformerDecoder(config)
        # The stacks hold the shared embedding module itself, not a module tied to its weight: FSDP2 shards by
        # module, and a tied weight reachable from a second module would sit in two FSDP groups (torch rejects it).
        self.set_input_embeddings(self.shared)
        self.post_init()

    # `AutoModel` maps the config class to this one class; for a decoder-only or encoder-only checkpoint it must give
    # the stack that checkpoint was trained with (as AutoModel gives LlamaModel for a Llama checkpoint), whose weights
    # the head saved under `model.`, the base model prefix.
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, config=None, **kwargs):
        if cls is VanillaTransformerModel:
            base_class = base_model_class(cls.checkpoint_config(pretrained_model_name_or_path, config, kwargs))
            if base_class is not cls:
                return base_class.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)

    @classmethod
    def _from_config(cls, config: VanillaTransformerConfig, **kwargs):
        base_class = base_model_class(config) if cls is VanillaTransformerModel else cls
        if base_class is not cls:
            return base_class._from_config(config, **kwargs)
        return super()._from_config(config, **kwargs)

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Source/target sharing is its own switch (share_encoder_decoder_embeddings); transformers' generic mapping
        # would gate it on tie_word_embeddings, which only concerns the pre-softmax projection.
        if all_submodels:
            return super().get_expanded_tied_weights_keys(all_submodels=True)
        tied = dict(self._tied_weights_keys)
        if not self.config.share_encoder_decoder_embeddings:
            del tied["encoder.embed_tokens.weight"]
        return tied

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = self.decoder.embed_tokens = value
        if self.config.share_encoder_decoder_embeddings:
            self.encoder.embed_tokens = value

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
        position_ids: torch.LongTensor | None = None,
        decoder_position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqModelOutput:  # Seq2SeqMoEModelOutput with experts
        r"""
        decoder_position_ids (`torch.LongTensor` of shape `(batch_size, target_length)`, *optional*):
            The target positions (default: 0, 1, ... after the cache; in a flattened batch, restarting at each
            sequence).

        A flattened batch (`DataCollatorForSeq2SeqWithFlattening`) gives the offsets of its target sequences as
        `cu_seq_lens_q`/`max_length_q` and of its source sequences as `cu_seq_lens_k`/`max_length_k`.
        """
        # Router logits describe the layers that run in this call: those of given encoder outputs (generate passes
        # them at every step, not expanded to the beams) are not returned.
        encoder_runs = encoder_outputs is None
        if encoder_runs:
            encoder_outputs = self.encoder(
                return_dict=True,  # fields are read below; return_dict applies to this model's output
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                position_ids=position_ids,
                **kwargs,
            )
        else:
            if not isinstance(encoder_outputs, BaseModelOutput):
                encoder_outputs = BaseModelOutput(*encoder_outputs)
            if attention_mask is not None and attention_mask.dim() == 2:  # the encoder did not check its values
                batch_size, source_length = encoder_outputs.last_hidden_state.shape[:2]
                checked_attention_mask(attention_mask, batch_size, source_length, source_length, "attention_mask")
        decoder_outputs = self.decoder(
            return_dict=True,
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=decoder_inputs_embeds,
            position_ids=decoder_position_ids,
            use_cache=use_cache,
            **kwargs,
        )
        outputs = dict(
            last_hidden_state=decoder_outputs.last_hidden_state,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        if self.config.num_experts == 0:
            return Seq2SeqModelOutput(**outputs)
        return Seq2SeqMoEModelOutput(
            **outputs,
            encoder_router_logits=getattr(encoder_outputs, "router_logits", None) if encoder_runs else None,
            decoder_router_logits=decoder_outputs.router_logits,
        )


__all__ = [
    "VanillaTransformerPreTrainedModel",
    "VanillaTransformerEncoder",
    "VanillaTransformerDecoder",
    "VanillaTransformerModel",
    "VanillaTransformerExperts",
]
