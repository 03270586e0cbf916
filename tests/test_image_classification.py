"""The image classifier (ViT on the encoder stack) and the ViT converter.

Checks: the patch embedding is the per-patch linear map of ViT eq. 1; mean pooling averages the encoder's outputs and
the [class] token is an extra first position; without positions the mean-pooled classifier is invariant to the order
of the patches (and with them it is not); every encoder variant (norm placement and type, FFN family, positions,
grouped K/V heads, experts) learns a fixed batch; experts add their router losses; a random ViT converts with equal
logits and loss; bad images and configs raise errors naming the field; exact save/load; the remote-code path and the
`image-classification` pipeline with transformers' ViT image processor, in a fresh process without the package.

Run: python -m pytest -q tests/test_image_classification.py
"""

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageClassification, ViTConfig, ViTForImageClassification, ViTImageProcessorPil

from hf_vanilla_transformer import (
    VanillaTransformerForImageClassification,
    convert_vit_to_vanilla_transformer,
    image_classification_config,
)
from hf_vanilla_transformer.image_classification_vanilla_transformer import VanillaTransformerImageEncoder

IMAGE = dict(image_size=8, patch_size=2, num_channels=3)  # 16 patches


def tiny_image_config(**overrides):
    fields = dict(
        d_model=32,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        dropout=0.0,
        num_labels=3,
        **IMAGE,
    )
    return image_classification_config(**{**fields, **overrides})


def images(batch: int, seed: int, size: tuple[int, int] = (8, 8)) -> torch.Tensor:
    return torch.randn(batch, 3, *size, generator=torch.Generator().manual_seed(seed))


def test_auto_class_and_defaults(tmp_path):
    model = AutoModelForImageClassification.from_config(tiny_image_config())
    assert type(model) is VanillaTransformerForImageClassification
    assert type(model.model) is VanillaTransformerImageEncoder and not hasattr(model.model, "embed_tokens")
    config = model.config
    assert (config.is_encoder_decoder, config.is_decoder, config.position_embedding_type) == (False, False, "learned")
    assert config.classifier_pooling == "mean" and config.max_position_embeddings == 16  # one row per patch
    assert config.vocab_size == 1 and config.pad_token_id is None  # no vocabulary: the tokens are patches
    assert config.initialization == "xavier"  # learned the digits better than the text default (README, Images)
    assert model.get_input_embeddings() is model.model.patch_embeddings
    model.save_pretrained(tmp_path)
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForImageClassification"].endswith(".VanillaTransformerForImageClassification")
    assert "AutoModel" not in auto_map  # its config dispatch would give the text encoder
    assert image_classification_config(classifier_pooling="first", **IMAGE).max_position_embeddings == 17


def test_patch_embedding_is_the_per_patch_linear_map():
    """ViT eq. 1: each flattened P x P x C patch times E plus a bias, patches in row-major order."""
    torch.manual_seed(0)
    model = VanillaTransformerForImageClassification(tiny_image_config(image_size=[8, 6], patch_size=[2, 3]))
    embed = model.model.patch_embeddings
    pixels = images(2, seed=1, size=(8, 6))
    patches = pixels.unfold(2, 2, 2).unfold(3, 3, 3)  # (batch, C, rows, columns, 2, 3)
    flattened = patches.permute(0, 2, 3, 1, 4, 5).reshape(2, 4 * 2, 3 * 2 * 3)  # (batch, patches, C * P_h * P_w)
    matrix = embed.projection.weight.reshape(32, -1)  # E^T
    torch.testing.assert_close(embed(pixels), flattened @ matrix.T + embed.projection.bias)


@pytest.mark.parametrize("initialization", ["xavier", "normal"])
def test_patch_embedding_is_initialised_as_a_linear_map(initialization):
    """The patch projection is the per-patch linear map, so it starts as every linear does: Xavier over the fans of
    that map (C P^2 in, d_model out; not torch's convolution fans), or N(0, initializer_range)."""
    torch.manual_seed(0)
    config = tiny_image_config(d_model=128, patch_size=4, initialization=initialization, initializer_range=0.05)
    weight = VanillaTransformerForImageClassification(config).model.patch_embeddings.projection.weight
    expected = math.sqrt(2 / (3 * 4 * 4 + 128)) if initialization == "xavier" else 0.05
    assert weight.std().item() == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("pooling", ["mean", "first"])
def test_pooling_reads_the_encoder_outputs(pooling):
    torch.manual_seed(0)
    model = VanillaTransformerForImageClassification(tiny_image_config(classifier_pooling=pooling)).eval()
    pixels = images(2, seed=2)
    with torch.no_grad():
        states = model.model(pixels).last_hidden_state
        logits = model(pixels).logits
    assert states.shape == (2, 16 + (pooling == "first"), 32)
    pooled = states[:, 0] if pooling == "first" else states.mean(dim=1)
    torch.testing.assert_close(logits, model.classifier(pooled))
    # No causal mask (ViT §3.1): the first token's output reads the last patch.
    changed = pixels.clone()
    changed[:, :, -2:, -2:] += 1.0
    with torch.no_grad():
        assert not torch.allclose(model.model(changed).last_hidden_state[:, 0], states[:, 0])


def test_without_positions_the_mean_pooled_classifier_ignores_the_order_of_the_patches():
    """Self-attention and the FFN are permutation-equivariant and the mean is invariant: swapping two patches changes
    nothing unless positions tell them apart."""
    pixels = images(2, seed=3)
    swapped = pixels.clone()
    swapped[:, :, 0:2, 0:2], swapped[:, :, 6:8, 4:6] = pixels[:, :, 6:8, 4:6], pixels[:, :, 0:2, 0:2]
    for positions, invariant in [("none", True), ("learned", False), ("sinusoidal", False)]:
        torch.manual_seed(0)
        model = VanillaTransformerForImageClassification(tiny_image_config(position_embedding_type=positions)).eval()
        with torch.no_grad():
            same = torch.allclose(model(pixels).logits, model(swapped).logits, atol=1e-5)
        assert same == invariant, positions


VARIANTS = [
    dict(norm_position="post"),
    dict(norm_position="pre", classifier_pooling="first"),
    dict(norm_position="sandwich", norm_type="rmsnorm"),
    dict(norm_position="deepnorm"),
    dict(ffn_type="gelu", norm_position="pre"),
    dict(ffn_type="swiglu", norm_type="rmsnorm", norm_position="pre", use_bias=False),
    dict(ffn_type="geglu"),
    dict(position_embedding_type="rope", num_key_value_heads=2),
    dict(position_embedding_type="sinusoidal"),
    dict(num_experts=4, num_experts_per_tok=2),
    dict(num_experts=4, num_experts_per_tok=1, ffn_type="swiglu", num_shared_experts=1, norm_position="pre"),
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda v: ",".join(f"{k}={x}" for k, x in v.items()))
def test_every_encoder_variant_learns_a_fixed_batch(overrides):
    torch.manual_seed(0)
    model = VanillaTransformerForImageClassification(tiny_image_config(**overrides)).train()
    pixels, labels = images(6, seed=4), torch.tensor([0, 1, 2, 0, 1, 2])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(pixels, labels=labels).loss
        losses.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        assert model.model.patch_embeddings.projection.weight.grad.abs().sum() > 0
        optimizer.step()
    assert all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0], losses


def test_experts_add_their_router_losses_to_the_loss():
    torch.manual_seed(0)
    model = VanillaTransformerForImageClassification(tiny_image_config(num_experts=4)).eval()
    pixels, labels = images(2, seed=5), torch.tensor([0, 2])
    with_router = model(pixels, labels=labels).loss
    model.config.router_aux_loss_coef = model.config.router_z_loss_coef = 0.0
    assert with_router > model(pixels, labels=labels).loss
    with_router.backward()
    routers = [module.weight for module in model.modules() if type(module).__name__ == "VanillaTransformerRouter"]
    assert len(routers) == 2 and all(weight.grad.abs().sum() > 0 for weight in routers)


def random_vit(**overrides) -> ViTForImageClassification:
    """A ViT with every weight random, LayerNorms and the [class] token included (its init sets some to 0 or 1)."""
    torch.manual_seed(0)
    fields = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_labels=5)
    model = ViTForImageClassification(ViTConfig(**{**fields, **IMAGE, **overrides})).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    return model


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(image_size=[8, 12], patch_size=[4, 3], hidden_act="relu", layer_norm_eps=1e-6)],
    ids=["vit", "rectangular-relu"],
)
def test_vit_converts_with_equal_logits_and_loss(overrides):
    vit = random_vit(**overrides)
    converted = convert_vit_to_vanilla_transformer(vit).eval()
    assert sum(p.numel() for p in converted.parameters()) == sum(p.numel() for p in vit.parameters())
    size = tuple(vit.config.image_size) if isinstance(vit.config.image_size, list) else (8, 8)
    pixels, labels = images(3, seed=6, size=size), torch.tensor([0, 4, 2])
    with torch.no_grad():
        expected = vit(pixels, labels=labels, output_hidden_states=True)
        got = converted(pixels, labels=labels, output_hidden_states=True)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, rtol=0, atol=1e-5)
    assert len(got.hidden_states) == len(expected.hidden_states) == 3
    assert converted.config.id2label == vit.config.id2label


@pytest.mark.parametrize(
    "overrides, message", [(dict(qkv_bias=False), "qkv_bias"), (dict(hidden_act="gelu_new"), "hidden_act")]
)
def test_vit_options_without_an_equivalent_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        convert_vit_to_vanilla_transformer(random_vit(**overrides))


@pytest.mark.parametrize(
    "pixels, error, message",
    [
        (torch.randn(2, 3, 16, 16), ValueError, "image_size"),
        (torch.randn(2, 1, 8, 8), ValueError, "num_channels"),
        (torch.randn(3, 8, 8), ValueError, "batch"),
        (torch.zeros(2, 3, 8, 8, dtype=torch.long), TypeError, "floating-point"),
    ],
    ids=["size", "channels", "no-batch", "integer"],
)
def test_bad_images_name_what_they_should_be(pixels, error, message):
    model = VanillaTransformerForImageClassification(tiny_image_config())
    with pytest.raises(error, match=message):
        model(pixels)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(patch_size=16), "larger than image_size"),
        (dict(image_size=[8, 8, 3]), "image_size"),
        (dict(patch_size=0), "patch_size"),
        (dict(num_channels=0), "num_channels"),
        (dict(max_position_embeddings=15), "max_position_embeddings"),
    ],
)
def test_bad_image_configs_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        VanillaTransformerForImageClassification(tiny_image_config(**overrides))


def test_save_load_is_exact(tmp_path):
    torch.manual_seed(0)
    model = VanillaTransformerForImageClassification(tiny_image_config(classifier_pooling="first")).eval()
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    state = reloaded.state_dict()
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[name], weight) for name, weight in model.state_dict().items())
    pixels = images(2, seed=7)
    with torch.no_grad():
        assert torch.equal(reloaded(pixels).logits, model(pixels).logits)


REMOTE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.modules["hf_vanilla_transformer"] = None  # the editable install must not serve the classes
    import torch, transformers
    from PIL import Image
    folder, image_path = sys.argv[1], sys.argv[2]
    model = transformers.AutoModelForImageClassification.from_pretrained(folder, trust_remote_code=True).eval()
    pixel_values = transformers.AutoImageProcessor.from_pretrained(folder)(
        Image.open(image_path), return_tensors="pt").pixel_values
    classify = transformers.pipeline("image-classification", model=folder, trust_remote_code=True)
    with torch.no_grad():
        logits = model(pixel_values).logits[0].tolist()
    predictions = classify(image_path, top_k=3)
    print(json.dumps([type(model).__module__, logits, pixel_values.tolist(), predictions]))
    """
)


def test_remote_code_and_the_image_classification_pipeline(tmp_path):
    torch.manual_seed(0)
    labels = {"id2label": {0: "cat", 1: "dog", 2: "bird"}, "label2id": {"cat": 0, "dog": 1, "bird": 2}}
    model = VanillaTransformerForImageClassification(tiny_image_config(**labels)).eval()
    model.save_pretrained(tmp_path / "model")
    processor = ViTImageProcessorPil(size={"height": 8, "width": 8})
    processor.save_pretrained(tmp_path / "model")
    pixels = np.random.default_rng(0).integers(0, 256, (20, 16, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "image.png")  # 20 x 16: the processor resizes it to 8 x 8
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.pop("PYTHONPATH", None)
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_SCRIPT, str(tmp_path / "model"), str(tmp_path / "image.png")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    module, logits, pixel_values, predictions = json.loads(result.stdout.strip().splitlines()[-1])
    assert module.startswith("transformers_modules.")
    expected_pixels = processor(Image.open(tmp_path / "image.png"), return_tensors="pt").pixel_values
    torch.testing.assert_close(torch.tensor(pixel_values), expected_pixels)
    with torch.no_grad():
        expected = model(expected_pixels).logits[0]
    torch.testing.assert_close(torch.tensor(logits), expected, rtol=0, atol=1e-6)
    scores = expected.softmax(-1).sort(descending=True)
    assert [p["label"] for p in predictions] == [labels["id2label"][int(i)] for i in scores.indices]
    torch.testing.assert_close(torch.tensor([p["score"] for p in predictions]), scores.values, rtol=1e-5, atol=1e-6)
