"""Export a trained model to CTranslate2, the C++ inference engine, for fast CPU/GPU decoding.

The encoder-decoder (`VanillaTransformerForConditionalGeneration`) becomes a `ctranslate2.Translator` model and the
decoder-only `VanillaTransformerForCausalLM` a `ctranslate2.Generator` model. The spec is filled the way CTranslate2's
own Transformers converters fill it for Marian and Llama, and every variant is written so that CTranslate2 computes
the same function:

- post-, pre- and sandwich norm, LayerNorm (with or without bias) or RMSNorm, the global `norm_eps`;
- relu/gelu/swish FFNs and the gated glu/reglu/geglu/swiglu ones (gate -> `linear_0`, up -> `linear_0_noact`);
- positions: CTranslate2's built-in sinusoid is tensor2tensor's (timescales 10000^(i / (d/2 - 1))), neither of our
  layouts, so additive positions (sinusoidal of either layout, learned, none = zeros) are stored as a table of
  `max_position_embeddings` rows computed by our own code (CTranslate2 refuses longer inputs and outputs with a clear
  error); RoPE is CTranslate2's non-interleaved rotary over the whole head with base `rope_parameters['rope_theta']`
  (plain RoPE only);

Variants CTranslate2 cannot compute exactly raise a `ValueError` naming the config field (`unsupported_fields`).

    python -m hf_vanilla_transformer.ctranslate2_vanilla_transformer out/demo out/demo-ct2 --quantization int8
    export-vanilla-transformer-to-ctranslate2 out/demo out/demo-ct2    # the same, installed as a script

CTranslate2 reads tokens as strings, so the export writes the tokenizer's vocabulary (ids beyond the tokenizer get
placeholder tokens). Sources must be passed as the model sees them: with the `</s>` the tokenizer appends.

Decoding settings that give the tokens of `generate`: CTranslate2's beam search stops once `beam_size` hypotheses have
finished (patience 1), as `generate(..., early_stopping=True)`; its length penalty is the power form
(`length_penalty=`, as transformers'), so the GNMT penalty (`length_penalty_type="gnmt"`) has no CTranslate2
equivalent; `translate_batch` forbids the end token as the first token unless `min_decoding_length=0`.
"""

import argparse
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .configuration_vanilla_transformer import GATED_FFN_TYPES, VanillaTransformerConfig
from .language_modeling_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
)
from .modeling_vanilla_transformer import sinusoidal_position_encoding

INSTALL_HINT = "pip install hf_vanilla_transformer[ctranslate2]"

# ffn_type -> the name of CTranslate2's `common_spec.Activation` member (applied to the gate for gated FFNs).
# "bilinear" (no activation on the gate) is missing: CTranslate2 has no identity activation.
CT2_ACTIVATIONS = {
    "relu": "RELU",
    "gelu": "GELU",  # transformers' "gelu" is the exact erf form, CTranslate2's GELU too (GELUTanh is the other)
    "swish": "SWISH",
    "glu": "Sigmoid",
    "reglu": "RELU",
    "geglu": "GELU",
    "swiglu": "SWISH",
}

ExportableModel = VanillaTransformerForConditionalGeneration | VanillaTransformerForCausalLM
# Class name -> class. Models are recognised by name: after a trust_remote_code load their classes are copies of ours.
EXPORTABLE_CLASSES = {
    cls.__name__: cls for cls in (VanillaTransformerForConditionalGeneration, VanillaTransformerForCausalLM)
}


# norm_position -> CTranslate2's flags: the norm before the sub-layer (else after the residual add), and the sandwich's
# second norm, after the sub-layer.
NORM_PLACEMENTS = {
    "post": dict(pre_norm=False, pre_post_layer_norm=False),
    "pre": dict(pre_norm=True, pre_post_layer_norm=False),
    "sandwich": dict(pre_norm=True, pre_post_layer_norm=True),
}
# norm_type -> CTranslate2's `rms_norm`.
RMS_NORM = {"layernorm": False, "rmsnorm": True}


# The additive position vectors of positions 0 .. max_position_embeddings - 1, as our model adds them.
def learned_positions(config: VanillaTransformerConfig, stack: nn.Module) -> torch.Tensor:
    return stack.embed_positions.weight


def sinusoidal_positions(config: VanillaTransformerConfig, stack: nn.Module) -> torch.Tensor:
    positions = torch.arange(config.max_position_embeddings)
    return sinusoidal_position_encoding(positions, config.d_model, config.sinusoidal_layout)


def no_positions(config: VanillaTransformerConfig, stack: nn.Module) -> torch.Tensor:
    return torch.zeros(config.max_position_embeddings, config.d_model)  # adding zeros changes nothing


# position_embedding_type -> its table of additive positions; None for RoPE, which CTranslate2 applies in attention.
POSITION_TABLES = {"learned": learned_positions, "sinusoidal": sinusoidal_positions, "none": no_positions, "rope": None}
# Each config field the export switches on -> the table of the values it exports. Any other value, one the config
# gains later included, is refused by name rather than exported as some other variant.
SWITCHES = {
    "norm_position": NORM_PLACEMENTS,
    "norm_type": RMS_NORM,
    "ffn_type": CT2_ACTIVATIONS,
    "position_embedding_type": POSITION_TABLES,
}
# Why a value the config has is not among them.
UNREPRESENTABLE = {
    ("norm_position", "deepnorm"): (
        "'deepnorm' scales the residual by alpha before the norm, and CTranslate2 has no residual scale "
        "(folding it into the norm input is not exact because of norm_eps)"
    ),
    ("ffn_type", "bilinear"): "'bilinear' needs an identity activation on the gate, which CTranslate2 lacks",
}


def unsupported_fields(config: VanillaTransformerConfig) -> dict[str, str]:
    """Config field -> why CTranslate2 cannot compute that variant exactly; empty when the model exports."""
    reasons = {}
    if config.num_experts > 0:
        reasons["num_experts"] = "CTranslate2's Transformer specs have no Mixture-of-Experts layers"
    for field, table in SWITCHES.items():
        value = getattr(config, field)
        if value not in table:
            reasons[field] = UNREPRESENTABLE.get((field, value), f"the export handles {list(table)} only")
    if config.position_embedding_type == "rope" and config.rope_parameters["rope_type"] != "default":
        reasons["rope_parameters"] = "the export writes plain RoPE (rope_type 'default') only"
    return reasons


def exported(config: VanillaTransformerConfig, field: str) -> Any:
    """The export's entry for `config.<field>` in its table (`SWITCHES`); a value without one is refused by name."""
    table = SWITCHES[field]
    value = getattr(config, field)
    if value not in table:
        check_exportable(config)
    return table[value]


def check_exportable(config: VanillaTransformerConfig) -> None:
    """Raise `ValueError` naming every field whose value CTranslate2 cannot represent exactly."""
    reasons = unsupported_fields(config)
    if reasons:
        details = "; ".join(f"{field}={getattr(config, field)!r}: {why}" for field, why in reasons.items())
        raise ValueError(f"This model cannot be exported to CTranslate2 exactly: {details}.")


def require_ctranslate2() -> None:
    """Raise an ImportError that says how to install the optional dependency when ctranslate2 is missing."""
    try:
        import ctranslate2  # noqa: F401  (imported here only: the package itself does not need it)
    except ImportError as err:
        raise ImportError(f"Exporting to CTranslate2 needs the ctranslate2 package: `{INSTALL_HINT}`.") from err


# ---------------------------------------------------------------------------------------------------------------------
# Weights -> CTranslate2 spec


def set_linear(spec: Any, linear: nn.Linear) -> None:
    spec.weight = linear.weight
    if linear.bias is not None:
        spec.bias = linear.bias


def fused_linear(spec: Any, linears: list[nn.Linear]) -> None:
    """One CTranslate2 linear for several of ours stacked on the output axis (q|k|v, k|v)."""
    from ctranslate2.converters.utils import fuse_linear
    from ctranslate2.specs import common_spec

    parts = [common_spec.LinearSpec() for _ in linears]
    for part, linear in zip(parts, linears):
        set_linear(part, linear)
    fuse_linear(spec, parts)


def set_norm(spec: Any, norm: nn.Module) -> None:
    """gamma = the norm's weight; a LayerNorm spec (the spec was built with `rms_norm` from `config.norm_type`) also
    takes beta, zero when the norm has no bias (`norm_bias=False`)."""
    spec.gamma = norm.weight
    if hasattr(spec, "beta"):
        bias = getattr(norm, "bias", None)
        spec.beta = bias if bias is not None else torch.zeros_like(norm.weight)


def set_attention(spec: Any, attention: nn.Module, self_attention: bool) -> None:
    """CTranslate2 fuses q|k|v for self-attention, and k|v (on the encoder output) for cross-attention."""
    if self_attention:
        fused_linear(spec.linear[0], [attention.q_proj, attention.k_proj, attention.v_proj])
    else:
        set_linear(spec.linear[0], attention.q_proj)
        fused_linear(spec.linear[1], [attention.k_proj, attention.v_proj])
    set_linear(spec.linear[-1], attention.out_proj)


def set_feed_forward(spec: Any, mlp: nn.Module) -> None:
    """CTranslate2 applies the activation to `linear_0` and multiplies by `linear_0_noact` when gated."""
    if hasattr(mlp, "gate_proj"):
        set_linear(spec.linear_0, mlp.gate_proj)
        set_linear(spec.linear_0_noact, mlp.up_proj)
        set_linear(spec.linear_1, mlp.down_proj)
    else:
        set_linear(spec.linear_0, mlp.fc1)
        set_linear(spec.linear_1, mlp.fc2)


# Where each norm of our residual connections goes in a CTranslate2 layer spec. With one norm per sub-layer (post/pre),
# CTranslate2 places it before the sub-layer (pre_norm) or after the residual add (post-norm), as our
# `norm_position` does. The sandwich's two norms are its `pre_post_layer_norm` slots (Gemma's and T5Gemma's layout:
# x + post_norm(f(pre_norm(x)))), the cross-attention's being the "external" pair.
NORM_SLOTS = {
    "single": {
        "self_attn_connection": {"norm": "self_attention.layer_norm"},
        "encoder_attn_connection": {"norm": "attention.layer_norm"},
        "mlp_connection": {"norm": "ffn.layer_norm"},
    },
    "sandwich": {
        "self_attn_connection": {"norm": "input_layer_norm", "sandwich_norm": "post_attention_layer_norm"},
        "encoder_attn_connection": {
            "norm": "external_pre_encoder_attention_layer_norm",
            "sandwich_norm": "external_post_encoder_attention_layer_norm",
        },
        "mlp_connection": {"norm": "pre_feedforward_layer_norm", "sandwich_norm": "post_feedforward_layer_norm"},
    },
}


def set_layer(spec: Any, layer: nn.Module, sandwich: bool) -> None:
    """One encoder or decoder layer: attention(s), FFN, and the norms of their residual connections (two each in the
    sandwich)."""
    set_attention(spec.self_attention, layer.self_attn, self_attention=True)
    if hasattr(layer, "encoder_attn"):
        set_attention(spec.attention, layer.encoder_attn, self_attention=False)
    set_feed_forward(spec.ffn, layer.mlp)
    slots = NORM_SLOTS["sandwich" if sandwich else "single"]
    for connection_name, norms in slots.items():
        connection = getattr(layer, connection_name, None)  # no encoder_attn_connection in encoder/decoder-only
        for norm_name, spec_path in norms.items() if connection is not None else ():
            set_norm(attrgetter(spec_path)(spec), getattr(connection, norm_name))


def set_stack(spec: Any, stack: nn.Module, config: VanillaTransformerConfig) -> None:
    """Embeddings (with their sqrt(d_model) scale or none), positions, layers and the final norm of one stack."""
    embeddings = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    embeddings.weight = stack.embed_tokens.weight
    spec.scale_embeddings = stack.embed_tokens.embed_scale
    position_table = exported(config, "position_embedding_type")
    if position_table is not None:
        spec.position_encodings.encodings = position_table(config, stack).to(stack.embed_tokens.weight.dtype)
    for layer_spec, layer in zip(spec.layer, stack.layers):
        set_layer(layer_spec, layer, sandwich=exported(config, "norm_position")["pre_post_layer_norm"])
    if stack.layer_norm is not None:
        set_norm(spec.layer_norm, stack.layer_norm)


def stack_options(config: VanillaTransformerConfig, num_heads: int) -> dict[str, Any]:
    """The `Transformer{Encoder,Decoder}Spec` arguments shared by both stacks."""
    from ctranslate2.specs import common_spec

    kv_heads = config.key_value_heads(num_heads)
    options = dict(
        **exported(config, "norm_position"),
        activation=getattr(common_spec.Activation, exported(config, "ffn_type")),
        ffn_glu=config.ffn_type in GATED_FFN_TYPES,
        rms_norm=exported(config, "norm_type"),
        num_heads_kv=kv_heads if kv_heads != num_heads else None,
    )
    if exported(config, "position_embedding_type") is None:  # RoPE: rotate-half (GPT-NeoX/Llama), the whole head
        options.update(rotary_dim=0, rotary_interleave=False, rotary_base=config.rope_parameters["rope_theta"])
    return options


def seq2seq_spec(model: VanillaTransformerForConditionalGeneration) -> Any:
    """A `TransformerSpec` (for `ctranslate2.Translator`) holding the model's weights."""
    from ctranslate2.specs import transformer_spec

    config = model.config
    encoder = transformer_spec.TransformerEncoderSpec(
        config.encoder_layers, config.encoder_attention_heads, **stack_options(config, config.encoder_attention_heads)
    )
    decoder = transformer_spec.TransformerDecoderSpec(
        config.decoder_layers,
        config.decoder_attention_heads,
        # the sandwich's cross-attention norms sit outside CTranslate2's attention layer (T5Gemma's layout)
        external_pre_post_encoder_layers=exported(config, "norm_position")["pre_post_layer_norm"],
        **stack_options(config, config.decoder_attention_heads),
    )
    spec = transformer_spec.TransformerSpec(encoder, decoder)
    set_stack(spec.encoder, model.model.encoder, config)
    set_stack(spec.decoder, model.model.decoder, config)
    set_linear(spec.decoder.projection, model.lm_head)
    return spec


def causal_lm_spec(model: VanillaTransformerForCausalLM) -> Any:
    """A `TransformerDecoderModelSpec` (for `ctranslate2.Generator`) holding the model's weights."""
    from ctranslate2.specs import transformer_spec

    config = model.config
    decoder = transformer_spec.TransformerDecoderSpec(
        config.decoder_layers,
        config.decoder_attention_heads,
        with_encoder_attention=False,
        **stack_options(config, config.decoder_attention_heads),
    )
    spec = transformer_spec.TransformerDecoderModelSpec(decoder)
    set_stack(spec.decoder, model.model, config)
    set_linear(spec.decoder.projection, model.lm_head)
    return spec


# ---------------------------------------------------------------------------------------------------------------------
# Vocabulary and special tokens


def vocabulary(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[str]:
    """Token strings by id; ids the tokenizer does not have (a vocabulary padded to a multiple) get placeholders."""
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"The tokenizer has {len(tokenizer)} tokens but the model only vocab_size={vocab_size}; "
            "pass the tokenizer the model was trained with."
        )
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    tokens += [f"<extra_id_{i}>" for i in range(vocab_size - len(tokens))]
    if len(set(tokens)) != len(tokens):
        raise ValueError("The tokenizer maps two ids to the same token string; CTranslate2 needs unique tokens.")
    return tokens


def special_tokens(model: nn.Module, tokens: list[str], unk_token: str | None) -> dict[str, str]:
    """The CTranslate2 config's special tokens: those `generate` uses, from the model's generation config. With several
    end tokens the first is the default; CTranslate2 takes the others per call (`end_token=`)."""
    generation = model.generation_config
    eos_ids = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    named_ids = {"eos_token_id": eos_ids[0], "bos_token_id": generation.bos_token_id}
    if model.config.is_encoder_decoder:
        named_ids["decoder_start_token_id"] = generation.decoder_start_token_id
    missing = [name for name, token_id in named_ids.items() if token_id is None]
    if missing:
        raise ValueError(f"CTranslate2 needs the special tokens {missing}; set them in the model's generation config.")
    special = {name.removesuffix("_id"): tokens[token_id] for name, token_id in named_ids.items()}
    special["unk_token"] = unk_token if unk_token is not None else ""  # as CTranslate2's Llama converter does
    return special


# ---------------------------------------------------------------------------------------------------------------------
# Entry points


def load_exportable_model(path: str | Path) -> ExportableModel:
    """The translation or causal LM model saved in `path`."""
    architectures = VanillaTransformerConfig.from_pretrained(path).architectures or []
    model_class = next((EXPORTABLE_CLASSES[name] for name in architectures if name in EXPORTABLE_CLASSES), None)
    if model_class is None:
        raise ValueError(f"{path} holds {architectures}; only {sorted(EXPORTABLE_CLASSES)} export to CTranslate2.")
    return model_class.from_pretrained(path)


def resolve_tokenizer(
    tokenizer: PreTrainedTokenizerBase | str | Path | None, model_path: str | Path | None
) -> PreTrainedTokenizerBase:
    """The tokenizer given, else the one saved next to the model."""
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        return tokenizer
    source = tokenizer if tokenizer is not None else model_path
    if source is None:
        raise ValueError("Pass tokenizer=...: CTranslate2 models carry their vocabulary as token strings.")
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"No tokenizer could be loaded from {source}; pass tokenizer=... (CTranslate2 needs the token strings)."
        ) from err


def check_output_dir(output_dir: Path, force: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise ValueError(f"output_dir={str(output_dir)!r} is a file; give a directory.")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not force:
        raise ValueError(f"output_dir={str(output_dir)!r} is not empty; choose a new directory or pass force=True.")


def check_quantization(quantization: str | None) -> None:
    from ctranslate2.specs.model_spec import ACCEPTED_MODEL_TYPES

    if quantization is not None and quantization not in ACCEPTED_MODEL_TYPES:
        raise ValueError(f"quantization={quantization!r} is not one of {ACCEPTED_MODEL_TYPES} (or None).")


def spec_converter(build_spec: Callable[[], Any]) -> Any:
    """A `ctranslate2.converters.Converter` whose model spec is `build_spec()`; `Converter.convert` then validates,
    quantizes and saves it like CTranslate2's own converters."""
    from ctranslate2.converters import Converter

    class VanillaTransformerConverter(Converter):
        def _load(self) -> Any:
            return build_spec()

    return VanillaTransformerConverter()


def export_to_ctranslate2(
    model_or_path: ExportableModel | str | Path,
    output_dir: str | Path,
    quantization: str | None = None,
    force: bool = False,
    tokenizer: PreTrainedTokenizerBase | str | Path | None = None,
) -> str:
    """Write a CTranslate2 model directory computing the same function as the model; return its path.

    model_or_path: a `VanillaTransformerForConditionalGeneration` (-> `ctranslate2.Translator`) or
        `VanillaTransformerForCausalLM` (-> `ctranslate2.Generator`), or a folder one of them was saved to.
    quantization: CTranslate2's weight type (`"int8"`, `"int8_float32"`, `"float16"`, `"bfloat16"`, ...); None keeps
        the model's dtype. The compute type can still be chosen when loading (`compute_type=`).
    force: replace a non-empty `output_dir` (its whole content is deleted); otherwise such a directory is refused.
    tokenizer: the model's tokenizer (or its folder); by default the one saved in `model_or_path`.
    """
    require_ctranslate2()
    check_quantization(quantization)
    output_dir = Path(output_dir)
    check_output_dir(output_dir, force)

    model_path = model_or_path if isinstance(model_or_path, str | Path) else None
    model = load_exportable_model(model_path) if model_path is not None else model_or_path
    if type(model).__name__ not in EXPORTABLE_CLASSES:
        raise TypeError(
            f"model_or_path must be one of {sorted(EXPORTABLE_CLASSES)} or a folder holding one, got {type(model)}."
        )
    check_exportable(model.config)
    tokenizer = resolve_tokenizer(tokenizer, model_path)
    tokens = vocabulary(tokenizer, model.config.vocab_size)

    def build_spec() -> Any:
        is_seq2seq = model.config.is_encoder_decoder
        spec = seq2seq_spec(model) if is_seq2seq else causal_lm_spec(model)
        for name, token in special_tokens(model, tokens, tokenizer.unk_token).items():
            setattr(spec.config, name, token)
        spec.config.layer_norm_epsilon = model.config.norm_eps
        if is_seq2seq:
            spec.register_source_vocabulary(tokens)
            spec.register_target_vocabulary(tokens)
        else:
            spec.register_vocabulary(tokens)
        return spec

    # Converter.convert refuses any existing directory without `force` and empties it with: an empty directory was
    # accepted above, a non-empty one only with force=True.
    with torch.no_grad():
        spec_converter(build_spec).convert(str(output_dir), quantization=quantization, force=output_dir.exists())
    return str(output_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Export a saved hf_vanilla_transformer translation or causal LM model to a CTranslate2 model "
        "directory (for ctranslate2.Translator / ctranslate2.Generator)."
    )
    parser.add_argument("src", help="folder the model was saved to (save_pretrained), with its tokenizer")
    parser.add_argument("dst", help="the CTranslate2 model directory to write; must be new or empty unless --force")
    parser.add_argument(
        "--quantization",
        default=None,
        help="CTranslate2 weight type, e.g. int8, int8_float32, float16, bfloat16 (default: keep the model's dtype)",
    )
    parser.add_argument("--force", action="store_true", help="replace dst even when it is not empty (deletes it)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder or Hub id when src has none")
    args = parser.parse_args(argv)
    try:
        print(export_to_ctranslate2(args.src, args.dst, args.quantization, args.force, args.tokenizer))
    except (ValueError, ImportError) as err:  # bad input or the missing extra: a one-line message, not a traceback
        parser.error(str(err))


__all__ = ["export_to_ctranslate2", "unsupported_fields"]

if __name__ == "__main__":
    main()
