"""Configuration of the "Attention Is All You Need" Transformer (Vaswani et al., 2017) and its variants.

Defaults reproduce the paper's base model (Table 3); every variant is one field away. Sizes use BART's names; the
generic names that transformers' caches and generation read (`num_hidden_layers`, `num_attention_heads`,
`num_key_value_heads`, `hidden_size`) describe the stack a model actually runs (see `VanillaTransformerConfig.stacks`).
"""

import copy
import math
from typing import Any, Literal, get_args

import torch
from huggingface_hub.dataclasses import strict
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters
from transformers.utils.type_validators import interval, positive_int_field

from .moe_kernels_vanilla_transformer import SORTED_GROUPED_MM

StackName = Literal["encoder", "decoder"]
NormType = Literal["layernorm", "rmsnorm"]
NormPosition = Literal["post", "pre", "sandwich", "deepnorm"]
FfnType = Literal["relu", "gelu", "swish", "glu", "bilinear", "reglu", "geglu", "swiglu"]
PositionEmbeddingType = Literal["sinusoidal", "learned", "rope", "none"]
SinusoidalLayout = Literal["interleaved", "concatenated"]
MoeStacks = Literal["encoder", "decoder", "both"]
ClassifierPooling = Literal["mean", "first"]
Initialization = Literal["xavier", "normal"]

GATED_FFN_TYPES = ("glu", "bilinear", "reglu", "geglu", "swiglu")

# Fields that config.json files written by earlier versions carry and that no longer describe the model: dropped when
# such a file loads (the base class would keep them as attributes and write them back on save).
# `padding_free`: whether batches are laid end to end is the training scripts' choice, from the device
# (collators_vanilla_transformer.preferred_layout).
RETIRED_FIELDS = ("padding_free",)

# Paper Table 3: N, d_model, d_ff, h, P_drop (d_k = d_v = d_model / h follows from the head count).
PRESETS: dict[str, dict[str, Any]] = {
    "transformer-base": dict(layers=6, d_model=512, ffn_dim=2048, heads=8, dropout=0.1),
    "transformer-big": dict(layers=6, d_model=1024, ffn_dim=4096, heads=16, dropout=0.3),
}

# Validators of the numeric fields (transformers' own): sizes and counts, probabilities in [0, 1), and finite
# positive scales (an open upper bound at infinity also refuses infinity; NaN fails every comparison).
size = interval(min=1)
count = interval(min=0)
rate = interval(min=0.0, max=1.0, exclude_max=True)
finite_non_negative = interval(min=0.0, max=math.inf, exclude_max=True)
finite_positive = interval(min=0.0, max=math.inf, exclude_min=True, exclude_max=True)


class _KeyValueHeadsField:
    """`num_key_value_heads` keeps what was given (None = one K/V head per query head), which is what
    `save_pretrained` writes, and reads filled in as transformers' own configs do: the K/V heads of the stack that
    the generic size names describe. Encoder and decoder may have different head counts, so a single value filled in
    at construction could not serve both."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, config: "VanillaTransformerConfig | None", owner: type | None = None) -> int | None:
        if config is None:
            return None  # the dataclass default
        return config.key_value_heads(config.num_attention_heads)

    def __set__(self, config: "VanillaTransformerConfig", value: int | None) -> None:
        config.__dict__[self.name] = value


@strict
class VanillaTransformerConfig(PreTrainedConfig):
    r"""
    Configuration for [`VanillaTransformerModel`] and its heads.

    A `@strict` dataclass, as transformers' own configs: each field is checked against its type and validator when
    set, and `validate_architecture` checks the rules between fields at construction, in `save_pretrained` and after
    `from_pretrained` has applied its keyword overrides (call `config.validate()` after changing fields by hand).
    Errors name the field.

    Which stacks a model runs (`stacks`) follows BERT's convention in transformers: `is_encoder_decoder=True` runs
    both; otherwise `is_decoder=True` is a causal decoder-only model (GPT-style) and `is_decoder=False` an
    encoder-only one. `num_hidden_layers`, `num_attention_heads` and `num_key_value_heads` give that stack's sizes
    (the encoder's for an encoder-decoder, as in BART; `get_text_config(decoder=True)` gives the decoder's, which is
    what transformers' caches read).

    Fields inherited from `PreTrainedConfig` (label maps, `problem_type`, `dtype`, `output_attentions`, ...) are
    documented there; they are checked here too. Every field below is checked when set (type and range) or by
    `validate_architecture` (the rules between fields) unless its entry says which model checks it.

    Args:
        vocab_size (`int`, *optional*, defaults to `37000`):
            Tokens in the vocabulary: the rows of the token embeddings and the outputs of the language-model heads
            (the paper's shared BPE vocabulary of about 37000 tokens). An int >= 1; every special token id must lie
            in [0, vocab_size). An image classifier has none (`image_classification_config` sets 1).
        d_model (`int`, *optional*, defaults to `512`):
            Width of the embeddings and of every sub-layer's input and output (paper Table 3: 512 base, 1024 big).
            An int >= 1, divisible by the attention heads of each stack the model runs; with RoPE the head size
            d_model / heads must be even.
        encoder_layers (`int`, *optional*, defaults to `6`):
            Layers of the encoder (N). An int >= 0: an encoder without layers only embeds its input. Unused where
            the encoder does not run (decoder-only).
        decoder_layers (`int`, *optional*, defaults to `6`):
            Layers of the decoder. An int >= 0, and >= 1 wherever the decoder runs (encoder-decoder, decoder-only):
            transformers' KV cache counts the decoded length in its layers.
        encoder_attention_heads (`int`, *optional*, defaults to `8`):
            Attention heads of each encoder layer (h). An int >= 1 that divides d_model where the encoder runs.
        decoder_attention_heads (`int`, *optional*, defaults to `8`):
            Attention heads of each decoder layer, self- and cross-attention. An int >= 1 that divides d_model where
            the decoder runs.
        num_key_value_heads (`int`, *optional*, defaults to `None`):
            Key/value heads of every attention, encoder and decoder (grouped-query attention, Ainslie et al. 2023;
            1 is multi-query attention). None: one per query head, the paper's multi-head attention. Else an int
            >= 1 that divides the query heads of each stack the model runs. Saved as given; read, it is filled in
            for the stack that the generic size names describe, as transformers' caches expect.
        encoder_ffn_dim (`int`, *optional*, defaults to `2048`):
            Inner size of the encoder's position-wise FFN (d_ff; paper: 2048 base, 4096 big) and of each of its
            experts. An int >= 1; the gated types derive their hidden size from it (`gated_ffn_dim`).
        decoder_ffn_dim (`int`, *optional*, defaults to `2048`):
            The same for the decoder. An int >= 1.
        max_position_embeddings (`int`, *optional*, defaults to `1024`):
            Rows of the learned position table (`position_embedding_type="learned"`): the longest input such a model
            reads; a position past it fails (a ValueError on the CPU, a device-side assert on an accelerator). An int
            >= 1. For RoPE, the context the model was trained on, as in Llama: where `"dynamic"` scaling starts, and
            the default `original_max_position_embeddings` of the other scaled types; RoPE itself has no limit. The
            other position types ignore it.
        dropout (`float`, *optional*, defaults to `0.1`):
            Residual dropout (P_drop, §5.4): on each sub-layer's output before the residual sum, and on the
            embeddings with their positions. A probability in [0, 1).
        attention_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the attention weights. A probability in [0, 1). On a GPU it keeps training on padded batches
            unless flash-attn is installed (`preferred_layout`).
        activation_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout after the FFN's activation, in every FFN and expert. A probability in [0, 1).
        classifier_dropout (`float`, *optional*, defaults to `0.0`):
            Dropout on the states the sequence, token and image classifiers read, before their output layer. A
            probability in [0, 1).
        norm_type (`str`, *optional*, defaults to `"layernorm"`):
            Every norm's kind: `"layernorm"` (the paper's, Ba et al. 2016) or `"rmsnorm"` (`torch.nn.RMSNorm`, Zhang
            & Sennrich 2019).
        norm_position (`str`, *optional*, defaults to `"post"`):
            Where each sub-layer F's norm sits: `"post"` LN(x + F(x)), the paper's; `"pre"` x + F(LN(x)), with a
            final norm after the stack (Xiong et al. 2020); `"sandwich"` x + LN(F(LN(x))), with the final norm too
            (Ding et al. 2021); `"deepnorm"` LN(alpha x + F(x)) with DeepNet's beta-scaled init, alpha and beta from
            the depths (Wang et al. 2022).
        norm_eps (`float`, *optional*, defaults to `1e-05`):
            The epsilon of every norm. Finite and > 0.
        norm_bias (`bool`, *optional*, defaults to `True`):
            Whether LayerNorm has a bias. RMSNorm has none either way.
        ffn_type (`str`, *optional*, defaults to `"relu"`):
            The FFN: two linear maps (`fc1`, `fc2`) with `"relu"` (the paper's), `"gelu"` or `"swish"` between them;
            or a gated linear unit of three (`gate_proj`, `up_proj`, `down_proj`; Shazeer 2020), act(gate) * up with
            act sigmoid (`"glu"`), none (`"bilinear"`), ReLU (`"reglu"`), GELU (`"geglu"`) or SiLU (`"swiglu"`).
        gated_ffn_dim (`int`, *optional*, defaults to `None`):
            Hidden size of a gated FFN. None: 2/3 of the stack's ffn_dim rounded up to `ffn_multiple_of`, which keeps
            the ungated FFN's parameter count. Else an int >= 1. The ungated types ignore it.
        ffn_multiple_of (`int`, *optional*, defaults to `8`):
            The multiple that a gated FFN's derived hidden size is rounded up to. An int >= 1.
        use_bias (`bool`, *optional*, defaults to `True`):
            Biases in the attention projections and the FFN linears (the paper's; T5 and Llama have none).
        lm_head_bias (`bool`, *optional*, defaults to `False`):
            A bias on the output projection of the language-model heads (Marian's `final_logits_bias`).
        position_embedding_type (`str`, *optional*, defaults to `"sinusoidal"`):
            `"sinusoidal"`: fixed sines and cosines added to the embeddings (§3.5); `"learned"`: a trained table of
            `max_position_embeddings` rows (BERT, GPT-2, ViT); `"rope"`: rotary positions applied to the queries and
            keys of every attention (Su et al. 2021); `"none"`: no positions.
        sinusoidal_layout (`str`, *optional*, defaults to `"interleaved"`):
            The order of a sinusoidal encoding's dimensions: `"interleaved"` sin, cos, sin, cos, ... (§3.5), or
            `"concatenated"` all sines then all cosines (Marian, tensor2tensor). Sinusoidal positions only.
        rope_parameters (`dict`, *optional*, defaults to `None`):
            RoPE's settings, as transformers' Llama reads them: `rope_type`, `"default"` (Su et al. 2021) or one of
            transformers' `ROPE_INIT_FUNCTIONS` (`"linear"`, `"dynamic"`, `"yarn"`, `"longrope"`, `"llama3"`, ...),
            with that type's keys (`factor`, `original_max_position_embeddings`, `low_freq_factor`, ...; a missing
            one is an error naming it), and `rope_theta`, the base of the rotary wavelengths 2pi theta^(2i/d),
            finite and >= 1 (below 1 the wavelengths would shrink with i). None: plain RoPE with theta 10000. A
            top-level `rope_theta` (configs saved by earlier versions, or a keyword) goes into the dict. RoPE only;
            the whole head rotates (a `partial_rotary_factor` that leaves part of it unrotated is refused when the
            model is built).
        scale_embedding (`bool`, *optional*, defaults to `True`):
            Multiply the token embeddings by sqrt(d_model) (§3.4).
        share_encoder_decoder_embeddings (`bool`, *optional*, defaults to `True`):
            One token embedding for source and target (§3.4; a shared vocabulary). Encoder-decoder only.
        tie_word_embeddings (`bool`, *optional*, defaults to `True`):
            The output projection is the target token embedding (§3.4).
        num_experts (`int`, *optional*, defaults to `0`):
            Experts of each Mixture-of-Experts FFN. An int >= 0; 0 keeps every FFN dense.
        num_experts_per_tok (`int`, *optional*, defaults to `2`):
            The experts each token is routed to (top-k). An int >= 1, at most num_experts where there are experts.
        moe_stacks (`str`, *optional*, defaults to `"both"`):
            The stacks with Mixture-of-Experts layers: `"encoder"`, `"decoder"` or `"both"`.
        moe_layer_frequency (`int`, *optional*, defaults to `1`):
            Every k-th layer of such a stack is sparse (layers k, 2k, ... counting from 1), the others dense. An int
            >= 1.
        num_shared_experts (`int`, *optional*, defaults to `0`):
            Experts that every token passes through with weight 1, beside the routed ones (DeepSeekMoE, Dai et al.
            2024). An int >= 0.
        norm_topk_prob (`bool`, *optional*, defaults to `True`):
            Renormalise a token's k routing weights to sum to 1 (Mixtral); else they are its softmax probabilities
            over all experts.
        router_jitter_noise (`float`, *optional*, defaults to `0.0`):
            In training, the router's input is multiplied by noise drawn from U(1 - noise, 1 + noise) (Switch
            Transformer §2.4); the experts read the clean states. In [0, 1), so that the factor stays positive.
        router_aux_loss_coef (`float`, *optional*, defaults to `0.01`):
            Weight of the load-balancing loss (Switch Transformer) in the training loss. Finite and >= 0.
        router_z_loss_coef (`float`, *optional*, defaults to `0.001`):
            Weight of the router z-loss (ST-MoE) in the training loss. Finite and >= 0.
        expert_capacity_factor (`float`, *optional*, defaults to `None`):
            None: dropless, every routed assignment is served. Else a finite c > 0: each expert serves at most
            ceil(c * tokens * k / num_experts) assignments per layer and batch, first choices first (GShard, Switch
            Transformer); a token left with no expert keeps only its residual.
        output_router_logits (`bool`, *optional*, defaults to `False`):
            Return the router logits and losses from every forward, not only when labels are given (a forward's own
            `output_router_logits` argument wins).
        classifier_pooling (`str`, *optional*, defaults to `"mean"`):
            How the sequence and image classifiers pool the encoder's outputs: `"mean"` over the real tokens, or
            `"first"`, the first token's (an image's learned [class] token, as ViT). A classifier on a causal decoder
            reads the last real token either way.
        initialization (`str`, *optional*, defaults to `"normal"`):
            Weight init (the paper fixes none): `"normal"`, N(0, initializer_range) for linears and embeddings
            (BERT, GPT-2, Marian, Llama); `"xavier"`, Xavier-uniform linears and N(0, 1/d_model) embeddings (torch's
            nn.Transformer, fairseq). DeepNorm keeps its scaled Xavier init and the router N(0, initializer_range)
            either way. Which to choose: docs/benchmarks.md, "Initialization".
        initializer_range (`float`, *optional*, defaults to `0.02`):
            The standard deviation of the normal init. In [0, 1].
        use_cache (`bool`, *optional*, defaults to `True`):
            Whether decoding keeps the past tokens' keys and values (a KV cache). A forward with labels builds none.
        is_encoder_decoder (`bool`, *optional*, defaults to `True`):
            Run both stacks, the paper's encoder-decoder. Without it, `is_decoder` chooses the one stack.
        is_decoder (`bool`, *optional*, defaults to `False`):
            Without `is_encoder_decoder`: True runs a causal decoder-only model (GPT-style, no cross-attention),
            False an encoder-only one (BERT-style).
        pad_token_id (`int`, *optional*, defaults to `0`):
            The padding token. None, or an id in [0, vocab_size).
        bos_token_id (`int`, *optional*, defaults to `1`):
            The beginning-of-sequence token. None, or an id in [0, vocab_size).
        eos_token_id (`int` or `list[int]`, *optional*, defaults to `2`):
            The end-of-sequence token(s) that stop generation. None, an id in [0, vocab_size), or a non-empty list
            of such ids.
        decoder_start_token_id (`int`, *optional*, defaults to `1`):
            The decoder's first input in an encoder-decoder: the labels are shifted right behind it. None, or an id
            in [0, vocab_size).
        forced_eos_token_id (`int` or `list[int]`, *optional*, defaults to `None`):
            The token(s) that generation forces as the last one when it reaches its maximum length. None, an id in
            [0, vocab_size), or a non-empty list of such ids.
        image_size (`int` or `tuple[int, int]`, *optional*, defaults to `224`):
            Pixels of an image classifier's input images: one int for square ones, or (height, width); each side an
            int > 0. Checked by the image classifier when it is built; text models ignore it.
        patch_size (`int` or `tuple[int, int]`, *optional*, defaults to `16`):
            The patches an image is cut into, the encoder's tokens: one int for square ones, or (height, width);
            each side an int > 0 and no larger than the image's. Checked by the image classifier.
        num_channels (`int`, *optional*, defaults to `3`):
            Channels of an image. An int >= 1, checked by the image classifier.

    Example:

    ```python
    >>> from hf_vanilla_transformer import VanillaTransformerConfig
    >>> config = VanillaTransformerConfig.from_preset("transformer-base", vocab_size=37000)
    >>> modern = VanillaTransformerConfig.from_preset(
    ...     "transformer-base", norm_position="pre", norm_type="rmsnorm", ffn_type="swiglu",
    ...     position_embedding_type="rope",
    ... )
    ```
    """

    model_type = "vanilla_transformer"
    # Outputs the Trainer's evaluation loop must not collect as predictions (MoE losses are scalars, router logits
    # are per-layer tuples whose shapes differ between batches).
    keys_to_ignore_at_inference = [
        "cache",  # the decoder cache (`past_key_values` before transformers 5.24)
        "past_key_values",
        "router_logits",
        "encoder_router_logits",
        "decoder_router_logits",
        "aux_loss",
        "z_loss",
        "encoder_aux_loss",
        "decoder_aux_loss",
        "encoder_z_loss",
        "decoder_z_loss",
    ]
    attribute_map = {"hidden_size": "d_model"}  # the per-stack names are properties below: they depend on `stacks`
    # The parallelism plans of transformers' distributed engine (`from_pretrained(..., distributed_config=
    # DistributedConfig(tp_size=..., ep_size=..., pp_size=...))`), for one stack: `layers.*` of a decoder-only or
    # encoder-only model, `encoder.layers.*` and `decoder.layers.*` of an encoder-decoder. They name the modules of
    # every variant; a model keeps the rules that name its own modules (`init_parallel_plans`).
    # Tensor parallelism (Megatron-LM, Shoeybi et al. 2019 §3): each rank holds a slice of the heads of every
    # attention (q/k/v by output column, out_proj by input row; K/V head groups stay whole) and of the hidden units of
    # every FFN, so one all-reduce per sub-layer sums its output. Norms, routers and expert banks are replicated.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.out_proj": "rowwise",
        "layers.*.encoder_attn.q_proj": "colwise",
        "layers.*.encoder_attn.k_proj": "colwise",
        "layers.*.encoder_attn.v_proj": "colwise",
        "layers.*.encoder_attn.out_proj": "rowwise",
        "layers.*.mlp.fc1": "colwise",
        "layers.*.mlp.fc2": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # Expert parallelism (GShard, Lepikhin et al. 2020): each rank holds num_experts / ep_size whole experts, biases
    # included, and the tokens routed to them; the router and shared experts stay on every rank.
    base_model_ep_plan = {
        "layers.*.mlp.experts": "ep_dispatch_experts",
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts.gate_up_proj_bias": "grouped_gemm",
        "layers.*.mlp.experts.up_proj_bias": "grouped_gemm",
        "layers.*.mlp.experts.down_proj_bias": "grouped_gemm",
    }
    # Pipeline parallelism: consecutive layers per rank (the causal LM only, see `check_parallelism`).
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "layer_norm": (["hidden_states"], ["hidden_states"]),
    }

    # Sizes (paper Table 3, base).
    vocab_size: int = size(default=37000)
    d_model: int = size(default=512)
    encoder_layers: int = count(default=6)  # an encoder may be empty (it then only embeds)
    decoder_layers: int = count(default=6)  # >= 1 when the decoder runs (validate_architecture)
    encoder_attention_heads: int = size(default=8)
    decoder_attention_heads: int = size(default=8)
    # GQA/MQA for every attention; None = one K/V head per query head. Reads filled in (see `_KeyValueHeadsField`).
    num_key_value_heads: int | None = _KeyValueHeadsField()
    encoder_ffn_dim: int = size(default=2048)
    decoder_ffn_dim: int = size(default=2048)
    max_position_embeddings: int = size(default=1024)  # learned positions only; the other types have no limit

    # Regularisation (§5.4: residual dropout on every sub-layer output and on the embedding sums).
    dropout: float | int = rate(default=0.1)
    attention_dropout: float | int = rate(default=0.0)
    activation_dropout: float | int = rate(default=0.0)
    classifier_dropout: float | int = rate(default=0.0)

    # Variants.
    norm_type: NormType = "layernorm"
    norm_position: NormPosition = "post"
    norm_eps: float | int = finite_positive(default=1e-5)
    norm_bias: bool = True  # LayerNorm only; RMSNorm has no bias
    ffn_type: FfnType = "relu"
    gated_ffn_dim: int | None = positive_int_field(default=None)  # None = 2/3 of the FFN size (Shazeer 2020)
    ffn_multiple_of: int = size(default=8)
    use_bias: bool = True  # biases in attention and FFN linears (paper: yes; T5/Llama: no)
    lm_head_bias: bool = False  # a bias on the pre-softmax projection (Marian's `final_logits_bias`)
    position_embedding_type: PositionEmbeddingType = "sinusoidal"
    sinusoidal_layout: SinusoidalLayout = "interleaved"  # paper §3.5 interleaves sin/cos; Marian concatenates
    # RoPE as transformers' Llama takes it: the base class folds a top-level `rope_theta` in and fills the defaults.
    rope_parameters: RopeParameters | dict | None = None
    scale_embedding: bool = True  # multiply token embeddings by sqrt(d_model) (§3.4)
    share_encoder_decoder_embeddings: bool = True  # one source/target embedding (§3.4)
    tie_word_embeddings: bool = True  # pre-softmax projection = target embedding (§3.4)

    # Mixture of Experts (num_experts = 0: dense FFN).
    num_experts: int = count(default=0)
    num_experts_per_tok: int = size(default=2)  # <= num_experts (validate_architecture)
    moe_stacks: MoeStacks = "both"
    moe_layer_frequency: int = size(default=1)  # every k-th layer of a MoE stack is sparse
    num_shared_experts: int = count(default=0)
    norm_topk_prob: bool = True
    # The router input is scaled by U(1 - noise, 1 + noise), which must stay positive.
    router_jitter_noise: float | int = rate(default=0.0)
    router_aux_loss_coef: float | int = finite_non_negative(default=1e-2)  # Switch Transformer
    router_z_loss_coef: float | int = finite_non_negative(default=1e-3)  # ST-MoE
    expert_capacity_factor: float | int | None = None  # None: dropless; else finite and > 0 (validate_architecture)
    output_router_logits: bool = False

    # Heads and generation.
    classifier_pooling: ClassifierPooling = "mean"
    # Weight init (the paper fixes none). "normal": N(0, initializer_range) for linears and embeddings (BERT, GPT-2,
    # Marian, Llama); "xavier": Xavier-uniform linears and N(0, 1/d_model) embeddings (torch's nn.Transformer,
    # fairseq). "normal" translated Multi30k better at d_model 256; "xavier" learned the encoder tasks better at
    # d_model 128 and 512, where N(0, 0.02) left a masked LM at its unigram loss (docs/benchmarks.md,
    # Initialization). DeepNorm keeps its own scaled Xavier init either way; the router is N(0, initializer_range)
    # always.
    initialization: Initialization = "normal"
    initializer_range: float | int = interval(min=0.0, max=1.0)(default=0.02)
    use_cache: bool = True
    is_encoder_decoder: bool = True
    is_decoder: bool = False  # without the encoder-decoder: True = causal decoder-only, False = encoder-only
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    decoder_start_token_id: int | None = 1
    forced_eos_token_id: int | list[int] | None = None

    # Images (ViT, Dosovitskiy et al. 2021, §3.1; ViT's names and types): the image classifier cuts each image of
    # `num_channels` x `image_size` pixels into `patch_size` squares, the encoder's tokens. A size is (height, width)
    # or one number for both.
    image_size: int | list[int] | tuple[int, int] = 224
    patch_size: int | list[int] | tuple[int, int] = 16
    num_channels: int = 3

    def __post_init__(self, **kwargs):
        # The base class turns a dtype name into a torch dtype with getattr(torch, name) and reads the label map's
        # keys as ints; on bad values both fail with errors that do not say which field they came from.
        check_dtype("dtype", self.dtype)
        check_dtype("torch_dtype", kwargs.get("torch_dtype"))
        check_label_arguments(self.id2label, kwargs.get("num_labels"))
        for name in RETIRED_FIELDS:
            kwargs.pop(name, None)
        # The experts run ours unless another is asked for (here, in `from_pretrained` or `set_experts_implementation`):
        # it makes the grouped matmuls of transformers' default, "grouped_mm", with fewer passes over the rows around
        # them, and takes the expert sizes torch's grouped_mm kernel refuses.
        kwargs.setdefault("experts_implementation", SORTED_GROUPED_MM)
        # The base class fills in `rope_parameters` in place: a copy leaves the caller's dict (another model's config,
        # in the converters) as it was.
        self.rope_parameters = copy.deepcopy(self.rope_parameters)
        super().__post_init__(**kwargs)
        # Attention weights need the eager implementation: asking for them picks it unless another was chosen, as
        # transformers' own `output_attentions` setter does (the base class bypasses that setter here).
        if self.output_attentions and self._attn_implementation is None:
            self._attn_implementation = "eager"

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs) -> Any:
        loaded = super().from_dict(with_rope_overrides(config_dict, kwargs), **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded  # `(config, unused_kwargs)` when asked for
        config.validate()  # `from_pretrained(..., field=value)` sets its overrides after construction
        return loaded

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "VanillaTransformerConfig":
        """A paper Table 3 configuration (`"transformer-base"` or `"transformer-big"`), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"Unknown preset {name!r}; choose one of {sorted(PRESETS)}.")
        p = PRESETS[name]
        fields = dict(
            d_model=p["d_model"],
            encoder_layers=p["layers"],
            decoder_layers=p["layers"],
            encoder_attention_heads=p["heads"],
            decoder_attention_heads=p["heads"],
            encoder_ffn_dim=p["ffn_dim"],
            decoder_ffn_dim=p["ffn_dim"],
            dropout=p["dropout"],
        )
        return cls(**{**fields, **overrides})

    # ------------------------------------------------------------------ rules between fields

    def validate_rope(self) -> None:
        """transformers' check of `rope_parameters` (the keys each type requires), its missing keys raised as a
        ValueError, and what it only warns about and the model could not run: a type outside transformers' table, a
        theta or factor that is not a finite number, a theta below 1, a factor <= 0."""
        rope_parameters = self.rope_parameters
        rope_type = rope_parameters.get("rope_type") if isinstance(rope_parameters, dict) else None
        if rope_type not in rope_types():
            raise ValueError(f"rope_parameters={rope_parameters!r} needs a 'rope_type' in {rope_types()}.")
        try:
            super().validate_rope()
        except KeyError as error:  # "Missing required keys in `rope_parameters` for 'rope_type'=...: {...}"
            raise ValueError(error.args[0]) from None
        theta, factor = rope_parameters.get("rope_theta"), rope_parameters.get("factor", 1.0)
        if not (is_real(theta) and 1 <= theta < math.inf):
            raise ValueError(f"rope_parameters['rope_theta']={theta!r} must be a finite number >= 1.")
        if not (is_real(factor) and 0 < factor < math.inf):
            raise ValueError(f"rope_parameters['factor']={factor!r} ({rope_type}) must be a finite number > 0.")

    def validate_architecture(self) -> None:
        """The rules between fields: the head sizes of the stacks the model runs (the other stack's sizes are unused),
        a decoder with layers, top-k within the experts, special tokens inside the vocabulary."""
        super().validate_architecture()
        given_key_value_heads = self.__dict__["num_key_value_heads"]
        if given_key_value_heads is not None and given_key_value_heads < 1:
            raise ValueError(f"num_key_value_heads must be None or >= 1, got {given_key_value_heads}.")
        for stack in self.stacks:
            name = f"{stack}_attention_heads"
            heads = getattr(self, name)
            if self.d_model % heads:
                raise ValueError(f"d_model={self.d_model} is not divisible by {name}={heads}.")
            if self.position_embedding_type == "rope" and (self.d_model // heads) % 2:
                raise ValueError(
                    f"position_embedding_type='rope' needs an even head size; d_model={self.d_model} / {name}={heads} "
                    "is odd."
                )
            dynamic_rope = self.position_embedding_type == "rope" and self.rope_parameters["rope_type"] == "dynamic"
            if dynamic_rope and self.d_model // heads <= 2:  # its base grows as a power dim / (dim - 2)
                raise ValueError(
                    "rope_parameters rope_type='dynamic' needs a head size above 2 (transformers' NTK scaling raises "
                    f"the base to dim / (dim - 2)); d_model={self.d_model} / {name}={heads} gives "
                    f"{self.d_model // heads}."
                )
            if given_key_value_heads is not None and heads % given_key_value_heads:
                raise ValueError(f"{name}={heads} is not divisible by num_key_value_heads={given_key_value_heads}.")
        if "decoder" in self.stacks and self.decoder_layers == 0:
            raise ValueError(
                "decoder_layers must be >= 1 when the decoder runs (encoder-decoder or decoder-only): transformers' "
                "KV cache counts the decoded length in its layers, so a decoder without layers would decode every "
                "step at position 0 (and DeepNet's constants divide by its depth). An encoder-only model is "
                "is_encoder_decoder=False, is_decoder=False."
            )
        capacity_factor = self.expert_capacity_factor
        if capacity_factor is not None and not (math.isfinite(capacity_factor) and capacity_factor > 0):
            raise ValueError(f"expert_capacity_factor must be None (dropless) or finite and > 0, got {capacity_factor}")
        if self.num_experts > 0 and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and num_experts={self.num_experts}."
            )
        # transformers only warns about these (Hub configs store pad_token_id=-1); here every one of them indexes the
        # embedding, where an id outside the vocabulary fails far from its cause.
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "forced_eos_token_id"):
            value = getattr(self, name)
            if value == []:
                raise ValueError(f"{name}=[] names no token; give at least one id, or None.")
            token_ids = value if isinstance(value, list) else [value]
            if any(token_id is not None and not 0 <= token_id < self.vocab_size for token_id in token_ids):
                raise ValueError(f"{name}={value!r} is outside the vocabulary [0, vocab_size={self.vocab_size}).")

    # ------------------------------------------------------------------ the stacks a model runs

    @property
    def stacks(self) -> tuple[StackName, ...]:
        """The stacks a model built from this config runs: both for an encoder-decoder, else the decoder
        (`is_decoder=True`, GPT-style) or the encoder (BERT-style)."""
        if self.is_encoder_decoder:
            return ("encoder", "decoder")
        return ("decoder",) if self.is_decoder else ("encoder",)

    @property
    def _named_stack(self) -> StackName:
        """The stack the generic size names describe: the decoder of a decoder-only model, else the encoder (BART's
        convention for an encoder-decoder, whose `get_text_config(decoder=True)` renames the decoder's sizes)."""
        return "decoder" if self.is_decoder and not self.is_encoder_decoder else "encoder"

    @property
    def num_hidden_layers(self) -> int:
        return getattr(self, f"{self._named_stack}_layers")

    @num_hidden_layers.setter
    def num_hidden_layers(self, value: int) -> None:
        setattr(self, f"{self._named_stack}_layers", value)

    @property
    def num_attention_heads(self) -> int:
        return getattr(self, f"{self._named_stack}_attention_heads")

    @num_attention_heads.setter
    def num_attention_heads(self, value: int) -> None:
        setattr(self, f"{self._named_stack}_attention_heads", value)

    def key_value_heads(self, num_attention_heads: int) -> int:
        """K/V heads of an attention with `num_attention_heads` query heads: `num_key_value_heads` when it was given
        (grouped-query attention in every attention), else one per query head."""
        given = self.__dict__.get("num_key_value_heads")
        return num_attention_heads if given is None else given

    def for_single_stack(self, stack: StackName) -> "VanillaTransformerConfig":
        """A validated copy for a model that runs one stack: `"decoder"` (causal, no cross-attention) or `"encoder"`.
        A deep copy keeps the load-time settings (`attn_implementation`, dtype) that `to_dict` would drop."""
        if stack not in get_args(StackName):
            raise ValueError(f"stack={stack!r} is not one of {get_args(StackName)}.")
        config = copy.deepcopy(self)
        config.is_encoder_decoder = False
        config.is_decoder = stack == "decoder"
        config.validate()
        return config

    def rotary_config(self, head_dim: int) -> "VanillaTransformerConfig":
        """A copy for transformers' RoPE functions (`ROPE_INIT_FUNCTIONS`, `dynamic_rope_update`), which read the
        head size from `head_dim`: the size of one stack's heads (encoder and decoder may have different counts)."""
        config = copy.deepcopy(self)
        config.head_dim = head_dim
        return config

    # ------------------------------------------------------------------ sizes the layers derive

    def gated_hidden_size(self, ffn_dim: int) -> int:
        """Hidden size of a gated FFN: 2/3 of `ffn_dim` (three matrices instead of two keep the parameter count,
        Shazeer 2020 §2), rounded up to `ffn_multiple_of`; an explicit `gated_ffn_dim` wins."""
        if self.gated_ffn_dim is not None:
            return self.gated_ffn_dim
        return self.ffn_multiple_of * math.ceil(2 * ffn_dim / 3 / self.ffn_multiple_of)

    def is_moe_layer(self, stack: StackName, layer_idx: int) -> bool:
        """Whether layer `layer_idx` of `stack` carries a Mixture-of-Experts FFN."""
        in_stack = self.moe_stacks in (stack, "both")
        return self.num_experts > 0 and in_stack and (layer_idx + 1) % self.moe_layer_frequency == 0


def rope_types() -> tuple[str, ...]:
    """The RoPE types a model can run: plain RoPE and every entry of transformers' table (which users may extend)."""
    return ("default", *ROPE_INIT_FUNCTIONS)


def with_rope_overrides(config_dict: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config_dict` with `from_pretrained`'s RoPE keywords moved out of `overrides` into its `rope_parameters`,
    where the base class fills in their defaults at construction (set after it, as other overrides are, a
    `rope_parameters` would miss them and a `rope_theta` would be dropped: no field has that name). A new
    `rope_parameters` keeps the saved theta unless it gives one; a `rope_theta` keyword wins over both."""
    if "rope_parameters" not in overrides and "rope_theta" not in overrides:
        return config_dict
    saved = config_dict.get("rope_parameters") or {}
    rope_parameters = copy.deepcopy(overrides.pop("rope_parameters", saved)) or {}
    if not isinstance(rope_parameters, dict):  # the field's type check names it
        return {**config_dict, "rope_parameters": rope_parameters}
    saved_theta = saved.get("rope_theta", config_dict.get("rope_theta"))
    if "rope_theta" in overrides:
        rope_parameters["rope_theta"] = overrides.pop("rope_theta")
    elif saved_theta is not None:
        rope_parameters.setdefault("rope_theta", saved_theta)
    return {**config_dict, "rope_parameters": rope_parameters}


def is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_dtype(name: str, value: Any) -> None:
    """Refuse a dtype that is neither None nor a floating-point torch dtype (given as such or by name)."""
    resolved = getattr(torch, value, None) if isinstance(value, str) else value
    if value is not None and not (isinstance(resolved, torch.dtype) and resolved.is_floating_point):
        raise ValueError(f"{name}={value!r} is not a floating-point torch dtype such as 'float32' or 'bfloat16'.")


def check_label_arguments(id2label: Any, num_labels: Any) -> None:
    """The label arguments in the form the base class reads them: `id2label` a dict keyed by label ids (ints, or
    their strings as JSON stores them), `num_labels` an int. Whether they agree is the base class's business: like
    every transformers config, a new `num_labels` replaces the label maps (re-heading a classifier)."""
    if id2label is not None and not (isinstance(id2label, dict) and all(is_label_id(key) for key in id2label)):
        raise ValueError(f"id2label={id2label!r} must be a dict keyed by the label ids 0..num_labels-1.")
    if num_labels is not None and (not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 0):
        raise ValueError(f"num_labels={num_labels!r} must be an int >= 0.")


def is_label_id(key: Any) -> bool:
    if isinstance(key, str):
        return key.isdecimal()
    return isinstance(key, int) and not isinstance(key, bool)


__all__ = ["GATED_FFN_TYPES", "PRESETS", "StackName", "VanillaTransformerConfig"]
