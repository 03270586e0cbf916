"""Our model and an HF `MarianMTModel` of the same architecture, holding the same weights.

The paper's Transformer and Marian share the layout (post-LN, ReLU FFN, sqrt(d_model)-scaled embeddings shared by
encoder, decoder and pre-softmax projection, fixed sinusoids); with `sinusoidal_layout="concatenated"` (Marian's
order of sines and cosines) the two compute the same function, so their logits and generated tokens must agree. The
benchmark checks that before timing anything: a speed ratio between two different computations would mean nothing.
"""

import re

import torch
from transformers import MarianConfig, MarianMTModel

from hf_vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForConditionalGeneration

# name: (d_model, layers, heads, ffn_dim, vocab_size). "transformer-base" is the paper's base model (Table 3) with
# its 37000-token shared BPE vocabulary (§5.1); "small" is a quick CPU-sized model of the same shape.
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "small": (256, 3, 4, 1024, 8000),
    "transformer-base": (512, 6, 8, 2048, 37000),
}
# Sizes of cpu_decoding.py and gpu_benchmark.py: transformer-base with a 32000-token vocabulary.
DECODING_SIZES: dict[str, tuple[int, int, int, int, int]] = {"transformer-base-32k": (512, 6, 8, 2048, 32000)}
# A size for smoke runs only (gpu_benchmark.py --quick on a CPU): every code path, in seconds.
SMOKE_SIZES: dict[str, tuple[int, int, int, int, int]] = {"tiny": (64, 1, 4, 128, 512)}

# Our parameter names -> Marian's (a name not matched is the same in both).
RENAMES = [
    (r"\.self_attn_connection\.norm\.", ".self_attn_layer_norm."),
    (r"\.encoder_attn_connection\.norm\.", ".encoder_attn_layer_norm."),
    (r"\.mlp_connection\.norm\.", ".final_layer_norm."),
    (r"\.mlp\.(fc[12])\.", r".\1."),
]


def our_config(size: str, dropout: float) -> VanillaTransformerConfig:
    d_model, layers, heads, ffn_dim, vocab_size = {**SIZES, **DECODING_SIZES, **SMOKE_SIZES}[size]
    return VanillaTransformerConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn_dim,
        decoder_ffn_dim=ffn_dim,
        dropout=dropout,
        sinusoidal_layout="concatenated",
    )


def marian_config(config: VanillaTransformerConfig) -> MarianConfig:
    return MarianConfig(
        vocab_size=config.vocab_size,
        decoder_vocab_size=config.vocab_size,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.encoder_attention_heads,
        decoder_attention_heads=config.decoder_attention_heads,
        encoder_ffn_dim=config.encoder_ffn_dim,
        decoder_ffn_dim=config.decoder_ffn_dim,
        activation_function="relu",
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        tie_word_embeddings=True,
        dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        activation_dropout=config.activation_dropout,
        max_position_embeddings=1024,
        pad_token_id=config.pad_token_id,
        eos_token_id=config.eos_token_id,
        bos_token_id=config.bos_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
        forced_eos_token_id=None,
    )


def build_pair(
    size: str, dropout: float, dtype: torch.dtype, device: torch.device, attn_implementation: str
) -> tuple[VanillaTransformerForConditionalGeneration, MarianMTModel]:
    """Our model and its Marian twin with our weights copied in, both in `dtype` on `device`."""
    config = our_config(size, dropout)
    ours = VanillaTransformerForConditionalGeneration._from_config(config, attn_implementation=attn_implementation)
    marian = MarianMTModel._from_config(marian_config(config), attn_implementation=attn_implementation)
    state = {rename(name): tensor for name, tensor in ours.state_dict().items()}
    missing, unexpected = marian.load_state_dict(state, strict=False)
    # Marian's extra entries are its fixed sinusoid tables and its zero `final_logits_bias`.
    if unexpected or any("embed_positions" not in m and m != "final_logits_bias" for m in missing):
        raise RuntimeError(f"Weight mapping to Marian is incomplete: missing={missing}, unexpected={unexpected}")
    return ours.to(device=device, dtype=dtype), marian.to(device=device, dtype=dtype)


def rename(name: str) -> str:
    for pattern, replacement in RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def training_flops(config: VanillaTransformerConfig, batch: int, source_len: int, target_len: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3x forward), counting matmuls only (as PaLM's MFU).

    Causal self-attention counts the half of the score matrix it needs; embeddings lookups, norms, softmax and the
    optimizer are not model FLOPs.
    """
    d, f, v = config.d_model, config.encoder_ffn_dim, config.vocab_size
    source_tokens, target_tokens = batch * source_len, batch * target_len
    encoder_layer = 2 * source_tokens * (4 * d * d + 2 * d * f) + 4 * source_tokens * source_len * d
    decoder_layer = (
        2 * target_tokens * (6 * d * d + 2 * d * f)  # self q/k/v/o, cross q/o, FFN
        + 2 * source_tokens * 2 * d * d  # cross-attention keys and values of the encoder output
        + 2 * target_tokens * target_len * d  # causal self-attention (half of QK^T and AV)
        + 4 * target_tokens * source_len * d  # cross-attention scores and weighted values
    )
    forward = config.encoder_layers * encoder_layer + config.decoder_layers * decoder_layer + 2 * target_tokens * d * v
    return 3.0 * forward
