"""Convert a Hugging Face `MarianMTModel` (the OPUS-MT checkpoints) into a `VanillaTransformerForConditionalGeneration`.

Marian is the paper's post-LN encoder-decoder with three differences, each of which is a config field here:
sinusoids laid out as [sin | cos] instead of interleaved (`sinusoidal_layout="concatenated"`), a bias on the output
logits (`final_logits_bias` -> `lm_head.bias`, `lm_head_bias=True`), and a configurable FFN activation
(`swish`/`gelu`/`relu` -> `ffn_type`). Positions start at 0 in both, Marian has no embedding layer norm, and its
attention projections already use our names (`q_proj`, `k_proj`, `v_proj`, `out_proj`).

Command line (keeps the Marian tokenizer files, so `AutoTokenizer.from_pretrained(DST_DIR)` still works):

    convert-marian-to-vanilla-transformer SRC_DIR DST_DIR
    python -m hf_vanilla_transformer.convert_marian_vanilla_transformer SRC_DIR DST_DIR  # same; runpy warns
                                                                       # harmlessly that the package imported it
"""

import argparse
import copy
import re
import shutil
from pathlib import Path

import torch
from transformers import MarianMTModel, MarianTokenizer
from transformers.utils import logging

from .configuration_vanilla_transformer import VanillaTransformerConfig
from .language_modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration

logger = logging.get_logger(__name__)

# Marian `activation_function` -> our `ffn_type` (ACT2FN's "swish" and "silu" are the same function).
MARIAN_FFN_TYPES = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}

# Marian parameter name -> ours: the layer norms belong to the residual connection they close (post-LN, §3.1),
# the FFN linears live in `mlp`. Marian's sinusoid tables are recomputed, not stored.
RENAMES = [
    (r"\.self_attn_layer_norm\.", ".self_attn_connection.norm."),
    (r"\.encoder_attn_layer_norm\.", ".encoder_attn_connection.norm."),
    (r"\.final_layer_norm\.", ".mlp_connection.norm."),
    (r"\.(fc1|fc2)\.", r".mlp.\1."),
]
SKIPPED = re.compile(r"\.embed_positions\.")

TOKENIZER_FILES = (*MarianTokenizer.vocab_files_names.values(), "special_tokens_map.json", "tokenizer.json")


def vanilla_config_from_marian(marian: MarianMTModel) -> VanillaTransformerConfig:
    """The config of the same network; raises `ValueError` for Marian options that have no equivalent here."""
    marian_config = marian.config
    if marian_config.decoder_vocab_size != marian_config.vocab_size:
        raise ValueError(
            f"decoder_vocab_size={marian_config.decoder_vocab_size} differs from vocab_size={marian_config.vocab_size}"
            ": separate source and target vocabularies of different sizes are not supported."
        )
    if marian_config.activation_function not in MARIAN_FFN_TYPES:
        raise ValueError(
            f"activation_function={marian_config.activation_function!r} has no ffn_type equivalent; "
            f"supported: {sorted(MARIAN_FFN_TYPES)}."
        )
    if marian_config.encoder_layerdrop or marian_config.decoder_layerdrop:
        logger.warning("LayerDrop only acts in training and is not carried over.")
    source_embedding = marian.get_encoder().embed_tokens.weight
    target_embedding = marian.get_decoder().embed_tokens.weight
    return VanillaTransformerConfig(
        vocab_size=marian_config.vocab_size,
        d_model=marian_config.d_model,
        encoder_layers=marian_config.encoder_layers,
        decoder_layers=marian_config.decoder_layers,
        encoder_attention_heads=marian_config.encoder_attention_heads,
        decoder_attention_heads=marian_config.decoder_attention_heads,
        encoder_ffn_dim=marian_config.encoder_ffn_dim,
        decoder_ffn_dim=marian_config.decoder_ffn_dim,
        max_position_embeddings=marian_config.max_position_embeddings,
        dropout=float(marian_config.dropout),
        attention_dropout=float(marian_config.attention_dropout),
        activation_dropout=float(marian_config.activation_dropout),
        # MarianMTModel always runs post-LN with nn.LayerNorm's default eps, whatever `normalize_before` says.
        norm_type="layernorm",
        norm_position="post",
        norm_eps=1e-5,
        ffn_type=MARIAN_FFN_TYPES[marian_config.activation_function],
        position_embedding_type="sinusoidal",
        sinusoidal_layout="concatenated",
        scale_embedding=marian_config.scale_embedding,
        # transformers 5 ties Marian's embeddings only when tie_word_embeddings is set, so with it off even "shared"
        # source and target embeddings are separate matrices: read what is shared from the weights themselves.
        share_encoder_decoder_embeddings=torch.equal(source_embedding, target_embedding),
        tie_word_embeddings=torch.equal(marian.lm_head.weight, target_embedding),
        lm_head_bias=True,
        pad_token_id=marian_config.pad_token_id,
        bos_token_id=marian_config.bos_token_id,
        eos_token_id=marian_config.eos_token_id,
        decoder_start_token_id=marian_config.decoder_start_token_id,
        forced_eos_token_id=marian_config.forced_eos_token_id,
    )


def rename_marian_weights(marian_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Marian's state dict under our parameter names."""
    state = {}
    for name, tensor in marian_state.items():
        if SKIPPED.search(name):
            continue
        if name == "final_logits_bias":
            state["lm_head.bias"] = tensor.reshape(-1)  # Marian keeps it as a (1, vocab) buffer
            continue
        for pattern, replacement in RENAMES:
            name = re.sub(pattern, replacement, name)
        state[name] = tensor
    # Our `shared` is the target embedding. Marian's `shared` is absent without source/target sharing, and unused
    # (its decoder reads `decoder.embed_tokens`) when tie_word_embeddings=False unties it.
    state["model.shared.weight"] = state["model.decoder.embed_tokens.weight"]
    return state


def convert_marian_to_vanilla_transformer(marian: MarianMTModel) -> VanillaTransformerForConditionalGeneration:
    """A `VanillaTransformerForConditionalGeneration` computing the same function as `marian`, with its
    generation settings (e.g. OPUS-MT's `bad_words_ids=[[pad]]`, `num_beams`, `max_length`)."""
    config = vanilla_config_from_marian(marian)
    model = VanillaTransformerForConditionalGeneration(config).to(marian.dtype)
    state = rename_marian_weights(marian.state_dict())
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"Marian weights do not map: missing {sorted(missing)}, unexpected {sorted(unexpected)}.")
    model.generation_config = copy.deepcopy(marian.generation_config)
    return model.train(marian.training)


def convert_marian_directory(src_dir: str | Path, dst_dir: str | Path) -> VanillaTransformerForConditionalGeneration:
    """Convert the Marian checkpoint in `src_dir` and save it, with the tokenizer files, to a new `dst_dir`."""
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if dst_dir.exists() and any(dst_dir.iterdir()):
        raise ValueError(f"{dst_dir} is not empty; choose a new or empty output directory.")
    model = convert_marian_to_vanilla_transformer(MarianMTModel.from_pretrained(src_dir))
    model.save_pretrained(dst_dir)
    for name in TOKENIZER_FILES:  # copied, not re-saved: the conversion needs neither sentencepiece nor tokenizers
        if (src_dir / name).is_file():
            shutil.copy(src_dir / name, dst_dir / name)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Convert a MarianMTModel checkpoint to hf_vanilla_transformer.")
    parser.add_argument("src_dir", help="folder with the Marian config.json, weights and tokenizer files")
    parser.add_argument("dst_dir", help="new (or empty) folder for the converted model and the tokenizer files")
    args = parser.parse_args(argv)
    convert_marian_directory(args.src_dir, args.dst_dir)


__all__ = ["convert_marian_to_vanilla_transformer", "convert_marian_directory"]

if __name__ == "__main__":
    main()
