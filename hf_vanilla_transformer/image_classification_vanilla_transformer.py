"""The Transformer's encoder on images, as ViT uses it (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words").

ViT §3.1: cut the image into P x P patches, map each flattened patch linearly to d_model (a convolution with kernel
and stride P computes exactly that map on every patch), add position embeddings, run the encoder without a causal
mask, pool, classify with one linear layer. Pooling is the global average of the encoder's outputs by default
(`classifier_pooling="mean"`, ViT Appendix D.3) or, as ViT does, the output of a learned [class] token prepended to
the patches (`classifier_pooling="first"`). Everything else is the config's encoder: norm type and placement, FFN
family, Mixture of Experts, position type (`"learned"` in ViT; `image_classification_config` sets it).

Configs use ViT's field names for the image: `image_size`, `patch_size`, `num_channels`. Preprocessing is
transformers' `ViTImageProcessor`, saved beside the model for `AutoImageProcessor` and the `image-classification`
pipeline.
"""

import math
from functools import partial

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import ImageClassifierOutput
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .inputs_vanilla_transformer import check_sequence_classification_labels, labels_outside
from .modeling_vanilla_transformer import (
    MoeEncoderOutput,
    VanillaTransformerEncoder,
    VanillaTransformerPreTrainedModel,
)
from .router_losses_vanilla_transformer import RouterRequest

# transformers lets `set_experts_implementation` and `from_pretrained(experts_implementation=...)` switch the experts
# kernel of a model whose class is defined in a module that uses `@use_experts_implementation`. The heads here run the
# experts of modeling_vanilla_transformer, which that decorator declares; this comment declares them in this module too.


def height_and_width(value: int | list[int] | tuple[int, int], name: str) -> tuple[int, int]:
    """A size as ViT's configs give it, one number for both sides or (height, width), checked positive."""
    sides = (value, value) if isinstance(value, int) else tuple(value)
    if len(sides) != 2 or not all(isinstance(side, int) and side > 0 for side in sides):
        raise ValueError(f"{name}={value!r} must be a positive int or a (height, width) pair of them.")
    return sides


def patch_grid(config: VanillaTransformerConfig) -> tuple[int, int]:
    """Patches per column and per row. As in ViT, pixels past the last whole patch are not read."""
    (height, width), (patch_height, patch_width) = (
        height_and_width(config.image_size, "image_size"),
        height_and_width(config.patch_size, "patch_size"),
    )
    if patch_height > height or patch_width > width:
        raise ValueError(f"patch_size={config.patch_size!r} is larger than image_size={config.image_size!r}.")
    return height // patch_height, width // patch_width


def num_image_tokens(config: VanillaTransformerConfig) -> int:
    """The encoder's input length: one token per patch, plus the [class] token with `classifier_pooling="first"`."""
    rows, columns = patch_grid(config)
    return rows * columns + (config.classifier_pooling == "first")


def check_image_config(config: VanillaTransformerConfig) -> None:
    """The image fields, and room for every token in a learned position table."""
    if config.num_channels < 1:
        raise ValueError(f"num_channels must be >= 1, got {config.num_channels}.")
    tokens = num_image_tokens(config)
    if config.position_embedding_type == "learned" and config.max_position_embeddings < tokens:
        raise ValueError(
            f"max_position_embeddings={config.max_position_embeddings} is smaller than the {tokens} tokens of an "
            f"image (image_size={config.image_size!r}, patch_size={config.patch_size!r}, classifier_pooling="
            f"{config.classifier_pooling!r}); position_embedding_type='learned' needs one row per token."
        )


# What an image classifier's config holds where the caller says nothing: the encoder alone, learned positions (ViT
# §3.1), no vocabulary or special tokens (its tokens are patches, embedded by the patch embedding: the encoder builds
# no token embedding; vocab_size is 1, the least the config takes, as it was in every image checkpoint saved), and
# Xavier init, which learned the digits better than N(0, 0.02) with the same recipe (docs/images.md).
IMAGE_DEFAULTS = dict(
    is_encoder_decoder=False,
    is_decoder=False,
    position_embedding_type="learned",
    initialization="xavier",
    vocab_size=1,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
    decoder_start_token_id=None,
)


def image_classification_config(**fields) -> VanillaTransformerConfig:
    """A config for `VanillaTransformerForImageClassification` with `IMAGE_DEFAULTS` where `fields` says nothing and
    learned positions sized to exactly one row per token (ViT §3.1); the rest are the config's defaults (mean
    pooling, the paper's post-norm ReLU FFN)."""
    config = VanillaTransformerConfig(**{**IMAGE_DEFAULTS, **fields})
    if "max_position_embeddings" not in fields:
        config.max_position_embeddings = num_image_tokens(config)
    return config


class VanillaTransformerPatchEmbeddings(nn.Module):
    """x_p E (ViT eq. 1): each P x P x C patch, flattened, times E (C P^2 x d_model), plus a bias. A convolution with
    kernel = stride = P applies that one linear map to every patch; (batch, C, H, W) -> (batch, patches, d_model) in
    row-major patch order. With `classifier_pooling="first"`, the learned [class] embedding goes in front."""

    def __init__(self, config: VanillaTransformerConfig):
        super().__init__()
        self.image_size = height_and_width(config.image_size, "image_size")
        self.num_channels = config.num_channels
        patch_size = height_and_width(config.patch_size, "patch_size")
        self.projection = nn.Conv2d(config.num_channels, config.d_model, kernel_size=patch_size, stride=patch_size)
        self.cls_token = (
            nn.Parameter(torch.zeros(1, 1, config.d_model)) if config.classifier_pooling == "first" else None
        )

    def check_pixel_values(self, pixel_values: torch.Tensor) -> None:
        if not isinstance(pixel_values, torch.Tensor) or not pixel_values.is_floating_point():
            raise TypeError(
                "pixel_values must be a floating-point torch.Tensor (an image processor's output), got "
                f"{getattr(pixel_values, 'dtype', type(pixel_values).__name__)}."
            )
        expected = (self.num_channels, *self.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected or pixel_values.shape[0] == 0:
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, expected (batch, num_channels, height, width) = "
                f"(batch, {', '.join(map(str, expected))}) from the config's num_channels and image_size: resize "
                "the images to image_size (the model's image processor does)."
            )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        self.check_pixel_values(pixel_values)
        pixel_values = pixel_values.to(self.projection.weight.dtype)  # processors return float32
        patches = self.projection(pixel_values).flatten(2).transpose(1, 2)
        if self.cls_token is None:
            return patches
        return torch.cat((self.cls_token.expand(patches.shape[0], -1, -1).to(patches.dtype), patches), dim=1)


class VanillaTransformerImagePreTrainedModel(VanillaTransformerPreTrainedModel):
    """What the image encoder and its classifier share: pixel inputs, and the init of the patch embedding."""

    main_input_name = "pixel_values"
    input_modalities = ("image",)
    _input_embed_layer = "patch_embeddings"

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # The patch projection is initialised on the convolution itself: transformers skips, for remote code, a
        # module without parameters of its own (the patch embedding under mean pooling has none besides the
        # convolution's), so an init written on the patch embedding would never run.
        if isinstance(module, nn.Conv2d):
            # The per-patch linear map starts as every nn.Linear here; for Xavier its fans are C P^2 and d_model
            # (torch's conv fans would count the fan-out P^2 times).
            if self.config.initialization == "normal":
                init.normal_(module.weight, std=self.config.initializer_range)
            else:
                bound = math.sqrt(6.0 / (module.weight[0].numel() + module.weight.shape[0]))
                init.uniform_(module.weight, -bound, bound)
            init.zeros_(module.bias)
        elif isinstance(module, VanillaTransformerPatchEmbeddings) and module.cls_token is not None:
            init.trunc_normal_(module.cls_token, std=self.config.initializer_range)  # as ViT


class VanillaTransformerImageEncoder(VanillaTransformerImagePreTrainedModel, VanillaTransformerEncoder):
    """The encoder stack over an image's patches: the patch embedding in place of the token embedding (an image has
    no vocabulary), then positions, dropout, the N layers and the final norm of `VanillaTransformerEncoder`."""

    def __init__(self, config: VanillaTransformerConfig):
        check_image_config(config)
        super().__init__(config, patch_embeddings=VanillaTransformerPatchEmbeddings(config))

    def forward(self, pixel_values: torch.Tensor, **kwargs: Unpack[TransformersKwargs]) -> MoeEncoderOutput:
        return super().forward(inputs_embeds=self.patch_embeddings(pixel_values), **kwargs)


class VanillaTransformerForImageClassification(VanillaTransformerImagePreTrainedModel):
    """ViT-style image classifier: the image encoder, pooled (mean over patches, or the [class] token with
    `classifier_pooling="first"`), dropout, one linear layer. Always the bidirectional encoder: a config of another
    stack is read as its encoder-only counterpart, as the masked LM does."""

    def __init__(self, config: VanillaTransformerConfig):
        config = config.for_single_stack("encoder")
        super().__init__(config)
        self.model = VanillaTransformerImageEncoder(config)
        self.dropout = nn.Dropout(config.classifier_dropout)
        self.num_experts = config.num_experts  # read at every step: an attribute, as Mixtral's heads keep it
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    def pooled(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, d_model) -> (batch, d_model): the [class] token's output, or the mean over patches."""
        return hidden_states[:, 0] if self.config.classifier_pooling == "first" else hidden_states.mean(dim=1)

    def classification_loss(self, logits: torch.Tensor, labels: torch.Tensor | None, **kwargs) -> torch.Tensor | None:
        if labels is None:
            return None
        with labels_outside(self.config.num_labels):
            return self.loss_function(labels, logits, self.config, **kwargs)

    @can_return_tuple
    def forward(
        self,
        pixel_values: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ImageClassifierOutput:
        r"""
        pixel_values (`torch.FloatTensor` of shape `(batch_size, num_channels, height, width)`):
            Images as the model's image processor (`ViTImageProcessor`) returns them, of the config's `image_size`.
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Class indices (float targets: regression with `num_labels == 1`, else multi-label; `config.problem_type`
            decides, as in transformers' classifiers). With experts the loss includes the router losses.
        """
        if pixel_values is None:
            raise ValueError("pixel_values is required: (batch, num_channels, height, width) images.")
        check_sequence_classification_labels(
            labels, pixel_values.shape[0], self.config.num_labels, self.config.problem_type
        )
        router = RouterRequest.of(self.config, labels, output_router_logits)
        outputs = self.model(pixel_values, output_router_logits=router.compute, return_dict=True, **kwargs)
        logits = self.classifier(self.dropout(self.pooled(outputs.last_hidden_state)))
        loss_of = partial(self.classification_loss, labels=labels, **kwargs)
        if not self.num_experts:
            loss = loss_of(logits)
        else:  # every patch is a token: no padding to leave out of the router losses
            logits, loss, _ = router.add_losses(logits, loss_of, encoder=(outputs.router_logits, None))
        return ImageClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = [
    "VanillaTransformerForImageClassification",
    "VanillaTransformerImageEncoder",
    "VanillaTransformerPatchEmbeddings",
    "IMAGE_DEFAULTS",
    "image_classification_config",
]
