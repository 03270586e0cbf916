"""Variants: norms and their placement, the FFN family, position encodings, GQA, and the three head kinds.

Closed forms (RMSNorm, the 8 FFN equations of Shazeer 2020, gated 2/3 sizing, sinusoids, RoPE, DeepNet alpha/beta and
init), pre-norm parity with torch.nn.Transformer(norm_first=True), and a covering grid over the variant axes.

Run: python -m pytest -q tests/test_variants.py
"""

import math

import pytest
import torch
from conftest import padded_batch, tiny_config
from reference_copy import copy_into_torch_transformer, torch_transformer_logits
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoModelForSequenceClassification
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForSequenceClassification,
)
from hf_vanilla_transformer.modeling_vanilla_transformer import (
    RotaryEmbedding,
    SublayerConnection,
    build_feed_forward,
    build_norm,
    deepnorm_constants,
    sinusoidal_position_encoding,
)

NORM_TYPES = ["layernorm", "rmsnorm"]
NORM_POSITIONS = ["post", "pre", "sandwich", "deepnorm"]
FFN_TYPES = ["relu", "gelu", "swish", "glu", "bilinear", "reglu", "geglu", "swiglu"]
POSITION_TYPES = ["sinusoidal", "learned", "rope", "none"]
HEADS = {
    "seq2seq": (VanillaTransformerForConditionalGeneration, AutoModelForSeq2SeqLM),
    "causal": (VanillaTransformerForCausalLM, AutoModelForCausalLM),
    "classifier": (VanillaTransformerForSequenceClassification, AutoModelForSequenceClassification),
}


# --- norms -------------------------------------------------------------------------------------------------------


def test_rmsnorm_matches_its_formula() -> None:
    """RMSNorm(x) = x / sqrt(mean(x^2) + eps) * g  (Zhang & Sennrich 2019, eq. 4), with the configured eps."""
    norm = build_norm(tiny_config(norm_type="rmsnorm", norm_eps=1e-2))
    assert isinstance(norm, nn.RMSNorm) and norm.eps == 1e-2
    torch.nn.init.normal_(norm.weight)
    x = 0.1 * torch.randn(3, 5, 32)  # small inputs so that eps visibly matters
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_layernorm_eps_and_optional_bias() -> None:
    with_bias = build_norm(tiny_config(norm_eps=1e-3))
    without_bias = build_norm(tiny_config(norm_bias=False))
    assert isinstance(with_bias, nn.LayerNorm) and with_bias.eps == 1e-3 and with_bias.bias is not None
    assert without_bias.bias is None


@pytest.mark.parametrize("norm_position", NORM_POSITIONS)
def test_sublayer_connection_matches_its_formula(norm_position: str) -> None:
    """post LN(x + f(x)); pre x + f(LN(x)); sandwich x + LN2(f(LN1(x))); deepnorm LN(alpha x + f(x))."""
    config = tiny_config(norm_position=norm_position)
    connection = SublayerConnection(config, residual_scale=1.7 if norm_position == "deepnorm" else 1.0)
    for norm in (connection.norm, connection.sandwich_norm):
        if norm is not None:  # distinct non-trivial affine parameters, so a swapped or missing norm shows
            torch.nn.init.normal_(norm.weight)
            torch.nn.init.normal_(norm.bias)
    sublayer = nn.Linear(32, 32)
    x = torch.randn(2, 5, 32)
    norm, second = connection.norm, connection.sandwich_norm
    expected = {
        "post": lambda: norm(x + sublayer(x)),
        "pre": lambda: x + sublayer(norm(x)),
        "sandwich": lambda: x + second(sublayer(norm(x))),
        "deepnorm": lambda: norm(1.7 * x + sublayer(x)),
    }[norm_position]()
    assert (second is not None) == (norm_position == "sandwich")
    torch.testing.assert_close(connection(x, sublayer), expected)  # the connection places the norms itself


@pytest.mark.parametrize("norm_position", NORM_POSITIONS)
def test_norm_count_and_final_stack_norms(norm_position: str) -> None:
    """One norm per sub-layer (two for sandwich); pre-norm and sandwich stacks end with one more (Xiong et al. 2020)."""
    model = VanillaTransformerForConditionalGeneration(tiny_config(norm_position=norm_position, encoder_layers=3))
    per_sublayer = 2 if norm_position == "sandwich" else 1
    final = norm_position in ("pre", "sandwich")
    sublayers = 3 * 2 + 2 * 3  # 3 encoder layers x (self-attn, FFN) + 2 decoder layers x (self, cross, FFN)
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == per_sublayer * sublayers + 2 * final
    for stack in (model.model.encoder, model.model.decoder):
        assert (stack.layer_norm is not None) == final
    causal = VanillaTransformerForCausalLM(tiny_config(norm_position=norm_position))
    classifier = VanillaTransformerForSequenceClassification(tiny_config(norm_position=norm_position))
    assert (causal.model.layer_norm is not None) == final == (classifier.model.layer_norm is not None)


# --- DeepNorm (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers", Figure 2 / Table 1) -------------


@pytest.mark.parametrize("encoder_layers, decoder_layers", [(6, 6), (12, 6), (18, 18), (100, 200)])
def test_deepnorm_constants_match_the_paper(encoder_layers: int, decoder_layers: int) -> None:
    n, m = encoder_layers, decoder_layers
    config = tiny_config(norm_position="deepnorm", encoder_layers=n, decoder_layers=m)
    # Encoder-decoder: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16);
    #                  decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4).
    assert deepnorm_constants(config, "encoder") == pytest.approx(
        (0.81 * n ** (1 / 4) * m ** (1 / 16), 0.87 / (n ** (1 / 4) * m ** (1 / 16)))
    )
    assert deepnorm_constants(config, "decoder") == pytest.approx(((3 * m) ** 0.25, 1 / (12 * m) ** 0.25))
    # Decoder-only (M layers): alpha = (2M)^(1/4), beta = (8M)^(-1/4); encoder-only (N layers) the same with N.
    decoder_only = single_stack(VanillaTransformerForCausalLM, config)
    encoder_only = single_stack(VanillaTransformerForSequenceClassification, config)
    assert deepnorm_constants(decoder_only, "decoder") == pytest.approx(((2 * m) ** 0.25, 1 / (8 * m) ** 0.25))
    assert deepnorm_constants(encoder_only, "encoder") == pytest.approx(((2 * n) ** 0.25, 1 / (8 * n) ** 0.25))


def single_stack(head_class, config):
    """The config a decoder-only or encoder-only head runs with (is_encoder_decoder=False), without building weights."""
    with torch.device("meta"):
        return head_class(config).config


@pytest.mark.parametrize("head", HEADS)
def test_deepnorm_residual_weight_and_init(head: str) -> None:
    """Every residual is scaled by its stack's alpha; v_proj, out_proj and the FFN get Xavier-normal init with gain
    beta, q_proj and k_proj gain 1 (DeepNet Figure 2 pseudocode)."""
    torch.manual_seed(0)
    config = tiny_config(
        norm_position="deepnorm",
        d_model=128,
        encoder_ffn_dim=192,
        decoder_ffn_dim=192,
        ffn_type="swiglu" if head == "causal" else "relu",
    )
    model = HEADS[head][0](config)
    checked = set()
    for name, module in model.named_modules():
        if not (isinstance(module, nn.Linear) and ".layers." in name):
            continue
        stack = "decoder" if head == "causal" or "decoder." in name else "encoder"
        alpha, beta = deepnorm_constants(model.config, stack)
        projection = name.rsplit(".", 1)[-1]
        gain = 1.0 if projection in ("q_proj", "k_proj") else beta
        xavier_std = math.sqrt(2 / (module.in_features + module.out_features))
        assert module.weight.std().item() == pytest.approx(gain * xavier_std, rel=0.06), name
        checked.add(projection)
    expected = {"q_proj", "k_proj", "v_proj", "out_proj"} | (
        {"gate_proj", "up_proj", "down_proj"} if head == "causal" else {"fc1", "fc2"}
    )
    assert checked == expected
    for name, module in model.named_modules():
        if isinstance(module, SublayerConnection):
            stack = "decoder" if head == "causal" or "decoder." in name else "encoder"
            assert module.residual_scale == deepnorm_constants(model.config, stack)[0] > 1.0


@pytest.mark.parametrize("initialization", ["xavier", "normal"])
def test_weight_initialization(initialization: str) -> None:
    """`xavier`: Xavier-uniform linears and experts, N(0, 1/d_model) embeddings; `normal`: N(0, initializer_range)
    for all of them. The router is N(0, initializer_range) either way; biases start at zero."""
    torch.manual_seed(0)
    config = tiny_config(
        initialization=initialization,
        initializer_range=0.05,
        vocab_size=512,
        d_model=128,
        encoder_ffn_dim=192,
        decoder_ffn_dim=192,
        num_experts=2,
        num_experts_per_tok=1,
        moe_stacks="encoder",
    )
    model = VanillaTransformerForConditionalGeneration(config)
    expected_std = {}
    for name, parameter in model.named_parameters():
        if name.endswith("bias") or ".norm." in name:
            continue
        if ".mlp.gate." in name or initialization == "normal":  # `mlp.gate`: the MoE router
            expected_std[name] = 0.05
        elif name == "model.shared.weight":
            expected_std[name] = 128**-0.5
        else:  # an (out, in) matrix, or an expert bank of them
            fan_in, fan_out = parameter.shape[-1], parameter.shape[-2]
            expected_std[name] = math.sqrt(2 / (fan_in + fan_out))
    kinds = {"experts", "mlp.gate", "shared", "q_proj", "fc1"}
    assert all(any(kind in name for name in expected_std) for kind in kinds)  # every kind of weight is checked
    for name, std in expected_std.items():
        assert model.get_parameter(name).std().item() == pytest.approx(std, rel=0.1), name
    biases = [p for name, p in model.named_parameters() if name.endswith("bias") and ".norm." not in name]
    assert biases and all(torch.all(bias == 0) for bias in biases)


# --- feed-forward networks (Shazeer 2020, "GLU Variants Improve Transformer", eqs. 1-6) ----------------------------


def gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))  # x * Phi(x), Hendrycks & Gimpel 2016


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)  # Swish_1 (Ramachandran et al. 2017)


# FFN_act(x) = act(x W1) W2 for ungated types; for gated ones (act(x W) * x V) W2 with W = gate, V = up, W2 = down.
FFN_EQUATIONS = {
    "relu": lambda x, w1, w2: torch.clamp(x @ w1, min=0) @ w2,
    "gelu": lambda x, w1, w2: gelu(x @ w1) @ w2,
    "swish": lambda x, w1, w2: swish(x @ w1) @ w2,
    "glu": lambda x, w, v, w2: (torch.sigmoid(x @ w) * (x @ v)) @ w2,
    "bilinear": lambda x, w, v, w2: ((x @ w) * (x @ v)) @ w2,
    "reglu": lambda x, w, v, w2: (torch.clamp(x @ w, min=0) * (x @ v)) @ w2,
    "geglu": lambda x, w, v, w2: (gelu(x @ w) * (x @ v)) @ w2,
    "swiglu": lambda x, w, v, w2: (swish(x @ w) * (x @ v)) @ w2,
}


@pytest.mark.parametrize("ffn_type", FFN_TYPES)
def test_feed_forward_matches_its_equation(ffn_type: str) -> None:
    torch.manual_seed(0)
    ffn = build_feed_forward(tiny_config(ffn_type=ffn_type, use_bias=False), ffn_dim=64)
    x = torch.randn(2, 5, 32)
    if hasattr(ffn, "gate_proj"):
        weights = (ffn.gate_proj.weight.T, ffn.up_proj.weight.T, ffn.down_proj.weight.T)
        assert ffn.gate_proj.out_features == 48  # 2/3 * 64 rounded up to ffn_multiple_of=8
    else:
        weights = (ffn.fc1.weight.T, ffn.fc2.weight.T)
    assert all(linear.bias is None for linear in ffn.modules() if isinstance(linear, nn.Linear))
    torch.testing.assert_close(ffn(x), FFN_EQUATIONS[ffn_type](x, *weights))


@pytest.mark.parametrize("d_model, ffn_dim, use_bias", [(512, 2048, True), (1024, 4096, False), (768, 3072, True)])
@pytest.mark.parametrize("gated_type", ["glu", "swiglu"])
def test_gated_two_thirds_sizing_keeps_the_parameter_count(d_model, ffn_dim, use_bias, gated_type) -> None:
    """Three matrices of width 2/3 d_ff hold as many parameters as two of width d_ff (Shazeer 2020 §2), up to the
    rounding to ffn_multiple_of."""
    ungated = build_feed_forward(tiny_config(d_model=d_model, use_bias=use_bias), ffn_dim)
    gated = build_feed_forward(tiny_config(d_model=d_model, use_bias=use_bias, ffn_type=gated_type), ffn_dim)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert count(gated) == pytest.approx(count(ungated), rel=0.01)
    assert gated.gate_proj.out_features % 8 == 0 and gated.gate_proj.out_features >= 2 * ffn_dim / 3


def test_explicit_gated_ffn_dim_wins() -> None:
    ffn = build_feed_forward(tiny_config(ffn_type="swiglu", gated_ffn_dim=100, ffn_multiple_of=64), ffn_dim=64)
    assert ffn.gate_proj.out_features == ffn.up_proj.out_features == ffn.down_proj.in_features == 100


# --- positions -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_sinusoidal_encoding_matches_the_formula(layout: str) -> None:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...) (§3.5); Marian puts all sines first."""
    d, positions = 16, torch.arange(50)
    angles = positions[:, None].double() / 10000 ** (torch.arange(0, d, 2).double() / d)
    sines, cosines = angles.sin(), angles.cos()
    if layout == "interleaved":
        expected = torch.empty(50, d, dtype=torch.float64)
        expected[:, 0::2], expected[:, 1::2] = sines, cosines
    else:
        expected = torch.cat([sines, cosines], dim=-1)
    torch.testing.assert_close(sinusoidal_position_encoding(positions, d, layout), expected.float())


def rotate(vectors: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex multiplication (Su et al. 2021, eq. 12): pair (x_i, x_{i+d/2}) (rotate-half layout) turns by
    pos * theta^(-2i/d)."""
    half = vectors.shape[-1] // 2
    angles = positions[:, None].double() * theta ** (-torch.arange(half).double() * 2 / vectors.shape[-1])
    rotated = torch.complex(vectors[..., :half].double(), vectors[..., half:].double()) * torch.polar(
        torch.ones_like(angles), angles
    )
    return torch.cat([rotated.real, rotated.imag], dim=-1).float()


def test_rope_matches_complex_rotation() -> None:
    head_dim, positions = 16, torch.arange(40)
    rope = RotaryEmbedding(tiny_config(position_embedding_type="rope", rope_theta=500.0), head_dim)
    cos, sin = rope(torch.zeros(1, 40, 32), positions)[1]
    q, k = torch.randn(1, 1, 40, head_dim), torch.randn(1, 1, 40, head_dim)
    rotated_q, rotated_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(rotated_q[0, 0], rotate(q[0, 0], positions, 500.0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rotated_k[0, 0], rotate(k[0, 0], positions, 500.0), atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_only_on_the_position_difference() -> None:
    head_dim = 16
    rope = RotaryEmbedding(tiny_config(position_embedding_type="rope"), head_dim)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(query_position: int, key_position: int) -> float:
        cos, sin = rope(torch.zeros(1, 2, 32), torch.tensor([query_position, key_position]))[1]
        rotated_q, rotated_k = apply_rotary_pos_emb(q.expand(1, 1, 2, -1), k.expand(1, 1, 2, -1), cos, sin)
        return float(rotated_q[0, 0, 0] @ rotated_k[0, 0, 1])

    for m, n in [(0, 0), (3, 1), (1, 3), (10, 2)]:
        for shift in (1, 7, 100):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    assert abs(score(3, 1) - score(3, 2)) > 1e-3  # but they do depend on the difference


def test_rope_encoder_is_shift_invariant_and_sinusoidal_is_not() -> None:
    """Through a whole encoder: RoPE carries only relative positions, so shifting all positions changes nothing."""
    input_ids, attention_mask = padded_batch()
    shifted = torch.arange(input_ids.shape[1]) + 13
    for position_type, invariant in [("rope", True), ("sinusoidal", False)]:
        torch.manual_seed(0)
        encoder = VanillaTransformerForSequenceClassification(tiny_config(position_embedding_type=position_type)).model
        with torch.no_grad():
            plain = encoder(input_ids, attention_mask=attention_mask).last_hidden_state
            moved = encoder(input_ids, attention_mask=attention_mask, position_ids=shifted).last_hidden_state
        assert torch.allclose(plain, moved, atol=1e-5) == invariant, position_type


def test_learned_positions_raise_past_max_position_embeddings() -> None:
    config = tiny_config(position_embedding_type="learned", max_position_embeddings=8)
    causal = VanillaTransformerForCausalLM(config).eval()
    causal(torch.randint(3, 64, (1, 8)))  # the last position that has a row
    with pytest.raises(ValueError, match="max_position_embeddings"):
        causal(torch.randint(3, 64, (1, 9)))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        causal.generate(torch.randint(3, 64, (1, 6)), max_new_tokens=5, min_new_tokens=5, do_sample=False)
    seq2seq = VanillaTransformerForConditionalGeneration(config)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        seq2seq(torch.randint(3, 64, (1, 9)), decoder_input_ids=torch.ones(1, 2, dtype=torch.long))


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned"])
def test_causal_lm_static_cache_equals_dynamic_cache(position_embedding_type: str) -> None:
    """Left-padded prompts, GQA: a static cache gives the same tokens and logits as the dynamic one."""
    torch.manual_seed(0)
    config = tiny_config(position_embedding_type=position_embedding_type, num_key_value_heads=2, norm_position="pre")
    model = VanillaTransformerForCausalLM(config).eval()
    inputs = head_inputs("causal")
    settings = dict(
        max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True
    )
    prompt = dict(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
    dynamic = model.generate(**prompt, **settings)
    static = model.generate(**prompt, cache_implementation="static", **settings)
    assert torch.equal(static.sequences, dynamic.sequences)
    torch.testing.assert_close(torch.stack(static.logits), torch.stack(dynamic.logits), atol=1e-5, rtol=1e-5)


# --- parity --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ffn_type, attn_implementation", [("relu", "sdpa"), ("gelu", "eager")])
def test_pre_norm_matches_torch_transformer_norm_first(ffn_type: str, attn_implementation: str) -> None:
    """Pre-norm encoder-decoder == torch.nn.Transformer(norm_first=True) with copied weights, padded source."""
    torch.manual_seed(0)
    config = tiny_config(norm_position="pre", ffn_type=ffn_type, attn_implementation=attn_implementation)
    model = VanillaTransformerForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # move every norm (the final stack norms included) away from the identity
                parameter.add_(0.2 * torch.randn_like(parameter))
    reference = copy_into_torch_transformer(model)
    assert reference.encoder.layers[0].norm_first and reference.encoder.norm is not None
    input_ids, attention_mask = padded_batch()
    decoder_input_ids, _ = padded_batch(length=7, seed=1)
    with torch.no_grad():
        ours = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits
    theirs = torch_transformer_logits(model, reference, input_ids, attention_mask, decoder_input_ids)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)


# --- the variant grid ----------------------------------------------------------------------------------------------


def covering_grid() -> list:
    """Per head kind, 8 cases in which every value of every axis appears at least once (every FFN type once, each norm
    position, position type and norm type twice), rotated between head kinds so that the pairings differ; GQA (2 K/V
    heads) and MQA (1) in three cases per head kind."""
    cases = []
    for h, head in enumerate(HEADS):
        for i, ffn_type in enumerate(FFN_TYPES):
            fields = dict(
                norm_type=NORM_TYPES[(i // 4 + i + h) % 2],
                norm_position=NORM_POSITIONS[(i // 2 + h) % 4],
                ffn_type=ffn_type,
                position_embedding_type=POSITION_TYPES[(i + h) % 4],
                num_key_value_heads={0: 2, 3: 1, 6: 2}.get(i),
            )
            kv = f"-kv{fields['num_key_value_heads']}" if fields["num_key_value_heads"] else ""
            axes = (fields["norm_type"], fields["norm_position"], ffn_type, fields["position_embedding_type"])
            case_id = "-".join((head, *axes)) + kv
            cases.append(pytest.param(head, fields, id=case_id))
    return cases


def head_inputs(head: str) -> dict:
    """A padded batch with labels: right padding for training; the causal LM gets left padding (it generates)."""
    input_ids, attention_mask = padded_batch()
    if head == "causal":
        input_ids, attention_mask = input_ids.flip(1), attention_mask.flip(1)
        return dict(
            input_ids=input_ids, attention_mask=attention_mask, labels=input_ids.masked_fill(attention_mask == 0, -100)
        )
    if head == "classifier":
        return dict(input_ids=input_ids, attention_mask=attention_mask, labels=torch.tensor([0, 2, 1]))
    targets, target_mask = padded_batch(length=6, seed=1)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=targets.masked_fill(target_mask == 0, -100))


@pytest.mark.parametrize("head, fields", covering_grid())
def test_variant_grid(head: str, fields: dict, tmp_path) -> None:
    torch.manual_seed(0)
    head_class, auto_class = HEADS[head]
    model = head_class(tiny_config(num_labels=3, **fields))
    inputs = head_inputs(head)

    # forward and backward: a finite loss and a gradient on every parameter
    model.train()
    loss = model(**inputs).loss
    assert torch.isfinite(loss)
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient on {missing}"

    # save -> load through the Auto class: identical weights and outputs
    model.eval()
    model.save_pretrained(tmp_path)
    reloaded = auto_class.from_pretrained(tmp_path).eval()
    assert type(reloaded) is head_class
    reloaded_state = reloaded.state_dict()
    assert all(torch.equal(tensor, reloaded_state[name]) for name, tensor in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(reloaded(**inputs).logits, model(**inputs).logits)

    # greedy generation with the KV cache == without it
    if head != "classifier":
        generate_inputs = {k: v for k, v in inputs.items() if k != "labels"}
        if head == "seq2seq":  # a prompt of distinct target tokens: a decoder that only ever sees its start token
            # attends over identical values, and positions (hence cache position bugs) could not change anything
            generate_inputs["decoder_input_ids"] = torch.tensor([[1, 17, 40, 23]]).expand(3, -1)
        # The per-step logits are compared too: a tiny random model often repeats one token whatever its positions,
        # so equal tokens alone would miss a cache that gets positions wrong.
        settings = dict(max_new_tokens=5, min_new_tokens=5, do_sample=False, output_logits=True)
        cached = model.generate(**generate_inputs, use_cache=True, return_dict_in_generate=True, **settings)
        uncached = model.generate(**generate_inputs, use_cache=False, return_dict_in_generate=True, **settings)
        assert torch.equal(cached.sequences, uncached.sequences)
        torch.testing.assert_close(torch.stack(cached.logits), torch.stack(uncached.logits), atol=1e-5, rtol=1e-5)
