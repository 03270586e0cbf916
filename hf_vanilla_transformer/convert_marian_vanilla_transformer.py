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
from .conversion_vanilla_transformer import rename_parameter
from .language_modeling_vanilla_transformer import VanillaTransformerForConditionalGeneration

logger = logging.get_logger(__name__)

# Marian's `activation_function` -> our `ffn_type` (ACT2FN's "swish" and "silu" are the same function).
FFN_FOR_ACTIVATION = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}

# Marian parameter name -> ours (regex, replacement): the layer norms belong to the residual connection they close
# (post-LN, §3.1), the FFN linears live in `mlp`. Marian's sinusoid tables are recomputed, not stored.
PARAMETER_RENAMES = [
    (r"\.self_attn_layer_norm\.", ".self_attn_connection.norm."),
    (r"\.encoder_attn_layer_norm\.", ".encoder_attn_connection.norm."),
    (r"\.final_layer_norm\.", ".mlp_connection.norm."),
    (r"\.(fc1|fc2)\.", r".mlp.\1."),
]
SKIPPED_PARAMETERS = re.compile(r"\.embed_positions\.")

# Marian's config fields that this config names and reads the same way (both use BART's names), copied as they are.
SAME_FIELDS = (
    "vocab_size",
    "d_model",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "max_position_embeddings",
    "scale_embedding",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "decoder_start_token_id",
    "forced_eos_token_id",
)

TOKENIZER_FILES = (*MarianTokenizer.vocab_files_names.values(), "special_tokens_map.json", "tokenizer.json")


def marian_config_to_vanilla_transformer(
    config, *, share_encoder_decoder_embeddings: bool, tie_word_embeddings: bool
) -> VanillaTransformerConfig:
    """The `VanillaTransformerConfig` of an encoder-decoder computing the same function as a Marian model of
    `config`; raises `ValueError` for Marian options that have no equivalent here.

    Which embeddings are one matrix is given, not read from `config`: transformers 5 ties Marian's embeddings
    only when its `tie_word_embeddings` is set, so with it off even "shared" source and target embeddings are
    separate matrices, which `convert_marian_to_vanilla_transformer` compares."""
    if config.decoder_vocab_size != config.vocab_size:
        raise ValueError(
            f"decoder_vocab_size={config.decoder_vocab_size} differs from vocab_size={config.vocab_size}"
            ": separate source and target vocabularies of different sizes are not supported."
        )
    if config.activation_function not in FFN_FOR_ACTIVATION:
        raise ValueError(
            f"activation_function={config.activation_function!r} has no ffn_type equivalent; "
            f"supported: {sorted(FFN_FOR_ACTIVATION)}."
        )
    if config.encoder_layerdrop or config.decoder_layerdrop:
        logger.warning("LayerDrop only acts in training and is not carried over.")
    return VanillaTransformerConfig(
        **{name: getattr(config, name) for name in SAME_FIELDS},
        dropout=float(config.dropout),
        attention_dropout=float(config.attention_dropout),
        activation_dropout=float(config.activation_dropout),
        # MarianMTModel always runs post-LN with nn.LayerNorm's default eps, whatever `normalize_before` says.
        norm_type="layernorm",
        norm_position="post",
        norm_eps=1e-5,
        ffn_type=FFN_FOR_ACTIVATION[config.activation_function],
        position_embedding_type="sinusoidal",
        sinusoidal_layout="concatenated",
        share_encoder_decoder_embeddings=share_encoder_decoder_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        lm_head_bias=True,
    )


def rename_marian_weights(marian_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Marian's state dict under our parameter names."""
    state = {}
    for name, tensor in marian_state.items():
        if SKIPPED_PARAMETERS.search(name):
            continue
        if name == "final_logits_bias":
            state["lm_head.bias"] = tensor.reshape(-1)  # Marian keeps it as a (1, vocab) buffer
            continue
        state[rename_parameter(name, PARAMETER_RENAMES)] = tensor
    # Our `shared` is the target embedding. Marian's `shared` is absent without source/target sharing, and unused
    # (its decoder reads `decoder.embed_tokens`) when tie_word_embeddings=False unties it.
    state["model.shared.weight"] = state["model.decoder.embed_tokens.weight"]
    return state


def convert_marian_to_vanilla_transformer(marian: MarianMTModel) -> VanillaTransformerForConditionalGeneration:
    """A `VanillaTransformerForConditionalGeneration` computing the same function as `marian`, with its
    generation settings (e.g. OPUS-MT's `bad_words_ids=[[pad]]`, `num_beams`, `max_length`)."""
    # Which embeddings are one matrix, read from the weights (see `marian_config_to_vanilla_transformer`).
    target_embedding = marian.get_decoder().embed_tokens.weight
    config = marian_config_to_vanilla_transformer(
        marian.config,
        share_encoder_decoder_embeddings=torch.equal(marian.get_encoder().embed_tokens.weight, target_embedding),
        tie_word_embeddings=torch.equal(marian.lm_head.weight, target_embedding),
    )
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


__all__ = ["convert_marian_to_vanilla_transformer", "convert_marian_directory", "marian_config_to_vanilla_transformer"]

if __name__ == "__main__":
    main()
