"""VanillaTransformerConfig: every invalid field value or combination is refused with an error naming the field, at
construction and from a config.json; every valid config saves and loads back exactly; the generic size names that
transformers' caches read describe the stack a model runs.

The property-based tests draw configs with hypothesis (derandomized, bounded) around a valid core: all variant axes,
values at the edges of their ranges, ints where floats are allowed, the inherited fields the package relies on.
"""

import json
import math
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import CONFIG_ERRORS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, EncoderDecoderCache, StaticCache

from hf_vanilla_transformer import VanillaTransformerConfig, VanillaTransformerForCausalLM

PROPERTY_SETTINGS = settings(
    max_examples=120, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

TINY = dict(
    vocab_size=32,
    d_model=16,
    encoder_layers=1,
    decoder_layers=3,  # deeper than the encoder: caches must size themselves from the decoder
    encoder_attention_heads=4,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
)
DECODER_ONLY = dict(is_encoder_decoder=False, is_decoder=True)

ENCODER_ONLY = dict(is_encoder_decoder=False, is_decoder=False)


# ---------------------------------------------------------------- drawing configs


def unit_interval() -> st.SearchStrategy:
    """[0, 1), ints included."""
    return st.floats(0, 1, exclude_max=True) | st.just(0)


def at_least(minimum: float, top: float) -> st.SearchStrategy:
    return st.floats(minimum, top) | st.integers(math.ceil(minimum), math.floor(top))


@st.composite
def valid_fields(draw) -> dict[str, Any]:
    """Keyword arguments of a valid config."""
    is_encoder_decoder, is_decoder = draw(st.booleans()), draw(st.booleans())
    used = ("encoder", "decoder") if is_encoder_decoder else ("decoder",) if is_decoder else ("encoder",)
    position = draw(st.sampled_from(["sinusoidal", "learned", "rope", "none"]))
    rope_parameters = draw(rope_scalings())
    dynamic_rope = position == "rope" and (rope_parameters or {}).get("rope_type") == "dynamic"
    head_dim = draw(st.sampled_from([4, 6] if dynamic_rope else [2, 4, 6] if position == "rope" else [1, 2, 3, 4]))
    d_model = 4 * head_dim  # divisible by every head count a used stack draws
    # A stack the model does not run may have any positive head count.
    heads = {
        stack: draw(st.sampled_from([1, 2, 4] if stack in used else [1, 3, 5])) for stack in ("encoder", "decoder")
    }
    common_divisors = [k for k in (1, 2, 4) if all(heads[stack] % k == 0 for stack in used)]
    norm_position = draw(st.sampled_from(["post", "pre", "sandwich", "deepnorm"]))
    # An encoder may be empty; a decoder that runs needs a layer (the KV cache counts the decoded length in them).
    layers = {
        stack: draw(st.integers(int(stack == "decoder" and stack in used), 3)) for stack in ("encoder", "decoder")
    }
    vocab_size = draw(st.integers(8, 100))
    token_id = st.none() | st.integers(0, vocab_size - 1)
    end_tokens = token_id | st.lists(st.integers(0, vocab_size - 1), min_size=1, max_size=3)
    num_experts = draw(st.integers(0, 4))
    fields = dict(
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=layers["encoder"],
        decoder_layers=layers["decoder"],
        encoder_attention_heads=heads["encoder"],
        decoder_attention_heads=heads["decoder"],
        num_key_value_heads=draw(st.sampled_from([None, *common_divisors])),
        encoder_ffn_dim=draw(st.integers(1, 64)),
        decoder_ffn_dim=draw(st.integers(1, 64)),
        max_position_embeddings=draw(st.integers(1, 128)),
        dropout=draw(unit_interval()),
        attention_dropout=draw(unit_interval()),
        activation_dropout=draw(unit_interval()),
        classifier_dropout=draw(unit_interval()),
        norm_type=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        norm_position=norm_position,
        norm_eps=draw(at_least(1e-12, 1.0)),
        norm_bias=draw(st.booleans()),
        ffn_type=draw(st.sampled_from(["relu", "gelu", "swish", "glu", "bilinear", "reglu", "geglu", "swiglu"])),
        gated_ffn_dim=draw(st.none() | st.integers(1, 64)),
        ffn_multiple_of=draw(st.integers(1, 16)),
        use_bias=draw(st.booleans()),
        lm_head_bias=draw(st.booleans()),
        position_embedding_type=position,
        sinusoidal_layout=draw(st.sampled_from(["interleaved", "concatenated"])),
        rope_theta=draw(at_least(1.0, 1e7)),  # the keyword of earlier versions: it goes into rope_parameters
        rope_parameters=rope_parameters,
        scale_embedding=draw(st.booleans()),
        share_encoder_decoder_embeddings=draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        num_experts=num_experts,
        num_experts_per_tok=draw(st.integers(1, max(num_experts, 1))),
        moe_stacks=draw(st.sampled_from(["encoder", "decoder", "both"])),
        moe_layer_frequency=draw(st.integers(1, 3)),
        num_shared_experts=draw(st.integers(0, 2)),
        norm_topk_prob=draw(st.booleans()),
        router_jitter_noise=draw(unit_interval()),
        router_aux_loss_coef=draw(at_least(0.0, 10.0)),
        router_z_loss_coef=draw(at_least(0.0, 10.0)),
        expert_capacity_factor=draw(st.none() | at_least(1e-3, 8.0)),
        output_router_logits=draw(st.booleans()),
        classifier_pooling=draw(st.sampled_from(["mean", "first"])),
        initialization=draw(st.sampled_from(["xavier", "normal"])),
        initializer_range=draw(at_least(0.0, 1.0)),
        use_cache=draw(st.booleans()),
        is_encoder_decoder=is_encoder_decoder,
        is_decoder=is_decoder,
        pad_token_id=draw(token_id),
        bos_token_id=draw(token_id),
        eos_token_id=draw(end_tokens),
        decoder_start_token_id=draw(token_id),
        forced_eos_token_id=draw(end_tokens),
        # Inherited fields.
        output_hidden_states=draw(st.sampled_from([None, False, True])),
        return_dict=draw(st.sampled_from([None, False, True])),
        output_attentions=draw(st.booleans()),
        dtype=draw(st.sampled_from([None, "float32", "bfloat16", torch.float16])),
        architectures=draw(st.sampled_from([None, ["VanillaTransformerForCausalLM"]])),
        chunk_size_feed_forward=draw(st.integers(0, 4)),
    )
    return {**fields, **draw(label_fields())}


def rope_scalings() -> st.SearchStrategy:
    """`rope_parameters` without a theta (the drawn `rope_theta` keyword gives it): none, plain, or a scaled type
    with its required keys (the original context defaults to max_position_embeddings)."""
    factor = at_least(1.0, 64.0)
    return st.one_of(
        st.none(),
        st.just({"rope_type": "default"}),
        st.fixed_dictionaries({"rope_type": st.sampled_from(["linear", "dynamic", "yarn"]), "factor": factor}),
        st.fixed_dictionaries(
            {
                "rope_type": st.just("llama3"),
                "factor": factor,
                "low_freq_factor": st.just(1.0),
                "high_freq_factor": st.just(4.0),
                "original_max_position_embeddings": st.integers(1, 128),
            }
        ),
    )


@st.composite
def label_fields(draw) -> dict[str, Any]:
    num_labels = draw(st.integers(1, 5))
    problem_types = [None, "regression", "multi_label_classification"]
    problem_type = draw(st.sampled_from(problem_types + (["single_label_classification"] if num_labels > 1 else [])))
    if draw(st.booleans()):
        return dict(num_labels=num_labels, problem_type=problem_type)
    id2label = {i: f"class {i}" for i in range(num_labels)}
    label2id = draw(st.sampled_from([None, {label: i for i, label in id2label.items()}]))
    return dict(id2label=id2label, label2id=label2id, problem_type=problem_type)


# The valid range of every numeric field, written out independently of the implementation: (smallest value, whether
# None is allowed). Integers must be ints (not bools); floats accept ints and must be finite. `rope_theta` is a keyword
# (earlier versions' field) that goes into `rope_parameters`.
INT_RANGES = {
    "vocab_size": (1, False),
    "d_model": (1, False),
    "encoder_layers": (0, False),
    "decoder_layers": (0, False),
    "encoder_ffn_dim": (1, False),
    "decoder_ffn_dim": (1, False),
    "gated_ffn_dim": (1, True),
    "ffn_multiple_of": (1, False),
    "max_position_embeddings": (1, False),
    "num_experts": (0, False),
    "num_experts_per_tok": (1, False),
    "moe_layer_frequency": (1, False),
    "num_shared_experts": (0, False),
    "num_key_value_heads": (1, True),
    "encoder_attention_heads": (1, False),
    "decoder_attention_heads": (1, False),
}
# (smallest value, whether it is allowed, largest value excluded or None, whether None is allowed)
FLOAT_RANGES = {
    "dropout": (0, True, 1, False),
    "attention_dropout": (0, True, 1, False),
    "activation_dropout": (0, True, 1, False),
    "classifier_dropout": (0, True, 1, False),
    "router_jitter_noise": (0, True, 1, False),
    "norm_eps": (0, False, None, False),
    "rope_theta": (1, True, None, False),
    "router_aux_loss_coef": (0, True, None, False),
    "router_z_loss_coef": (0, True, None, False),
    "expert_capacity_factor": (0, False, None, True),
    "initializer_range": (0, True, None, False),
}
LITERALS = {
    "norm_type": ("layernorm", "rmsnorm"),
    "norm_position": ("post", "pre", "sandwich", "deepnorm"),
    "ffn_type": ("relu", "gelu", "swish", "glu", "bilinear", "reglu", "geglu", "swiglu"),
    "position_embedding_type": ("sinusoidal", "learned", "rope", "none"),
    "sinusoidal_layout": ("interleaved", "concatenated"),
    "moe_stacks": ("encoder", "decoder", "both"),
    "classifier_pooling": ("mean", "first"),
    "initialization": ("xavier", "normal"),
}
BOOLS = {  # name: whether None is allowed
    "norm_bias": False,
    "use_bias": False,
    "lm_head_bias": False,
    "scale_embedding": False,
    "share_encoder_decoder_embeddings": False,
    "tie_word_embeddings": False,
    "norm_topk_prob": False,
    "output_router_logits": False,
    "use_cache": False,
    "is_encoder_decoder": False,
    "is_decoder": False,
}
NOT_FINITE = [math.nan, math.inf, -math.inf]


def edge_invalid_values(fields: dict[str, Any]) -> dict[str, list[Any]]:
    """For each field, the invalid values at its edges (just out of range, not finite, wrong types) given the rest
    of `fields`; the error must name the field."""
    vocab_size, d_model = fields["vocab_size"], fields["d_model"]
    used = VanillaTransformerConfig(**fields).stacks
    values: dict[str, list[Any]] = {}
    for name, (minimum, optional) in INT_RANGES.items():
        values[name] = [minimum - 1, minimum - 10, "3", 3.0, True, [3]] + ([] if optional else [None])
    for stack in used:  # head counts only have to divide d_model where the stack runs
        values[f"{stack}_attention_heads"] += [d_model + 1, 2 * d_model + 1]
    if "decoder" in used:
        values["decoder_layers"].append(0)
    values["num_key_value_heads"] += [k for k in range(2, 10) if any(fields[f"{s}_attention_heads"] % k for s in used)]
    for name, (low, low_allowed, high, optional) in FLOAT_RANGES.items():
        out_of_range = [low - 0.5, low - 1e-9] + ([] if low_allowed else [low, int(low)]) + ([high] if high else [])
        values[name] = out_of_range + NOT_FINITE + ["0.5", True, [0.5]] + ([] if optional else [None])
    for name, choices in LITERALS.items():
        values[name] = ["", choices[0].upper(), 1, True, None]
    for name, optional in BOOLS.items():
        values[name] = [0, 1, "true", 1.0] + ([] if optional else [None])
    for name in ("pad_token_id", "bos_token_id", "decoder_start_token_id", "eos_token_id", "forced_eos_token_id"):
        values[name] = [-1, vocab_size, vocab_size + 7, 1.0, True, "1"]
    for name in ("eos_token_id", "forced_eos_token_id"):
        values[name] += [[], [vocab_size], [-1], [True], [0, vocab_size], ["1"]]
    values["dtype"] = ["nonsense", "int8", "auto", torch.int64, 3]
    values["rope_parameters"] = [
        "linear",
        [1.0],
        {"rope_type": "nonsense"},
        {"rope_type": "yarn"},  # without its factor
        {"rope_type": "linear", "factor": math.nan},
        {"rope_type": "linear", "factor": 0.0},
        {"rope_type": "default", "rope_theta": math.inf},
    ]
    return values


def out_of_range(name: str) -> st.SearchStrategy:
    """Random numbers outside a numeric field's range (the edges are drawn from `edge_invalid_values`)."""
    if name in INT_RANGES:
        return st.integers(max_value=INT_RANGES[name][0] - 1)
    if name not in FLOAT_RANGES:
        return st.nothing()
    low, low_allowed, high, _ = FLOAT_RANGES[name]
    below = st.floats(max_value=low, exclude_max=low_allowed, allow_nan=False)
    return below | (st.floats(min_value=high) if high is not None else st.nothing())


LABEL_FIELDS = ("num_labels", "id2label", "label2id", "problem_type")


@st.composite
def invalid_label_fields(draw) -> tuple[dict[str, Any], str]:
    """Label settings transformers' configs refuse too (a `num_labels` that disagrees with `id2label` is not one:
    it replaces the label maps), and the field to name."""
    return draw(
        st.sampled_from(
            [
                (dict(num_labels=-2), "num_labels"),
                (dict(num_labels=1.5), "num_labels"),
                (dict(num_labels=True), "num_labels"),
                (dict(id2label={"x": "a"}), "id2label"),
                (dict(id2label=["a"]), "id2label"),
                (dict(num_labels=1, problem_type="single_label_classification"), "problem_type"),
            ]
        )
    )


# Both stacks run, with head counts that fit any d_model: a combination's own error is the first one raised.
ENCODER_DECODER_ANY_HEADS = dict(
    is_encoder_decoder=True, encoder_attention_heads=1, decoder_attention_heads=1, num_key_value_heads=None
)


@st.composite
def invalid_fields(draw) -> tuple[dict[str, Any], str]:
    """A valid config with one field or combination made invalid, and the field the error must name."""
    fields = draw(valid_fields())
    kind = draw(st.sampled_from(["value", "labels", "combination"]))
    if kind == "labels":
        overrides, name = draw(invalid_label_fields())
        return {**{k: v for k, v in fields.items() if k not in LABEL_FIELDS}, **overrides}, name
    if kind == "combination":
        combinations = [
            (dict(num_experts=2, num_experts_per_tok=3), "num_experts_per_tok"),
            (
                dict(ENCODER_DECODER_ANY_HEADS, norm_position="deepnorm", encoder_layers=2, decoder_layers=0),
                "decoder_layers",
            ),
            (
                dict(ENCODER_DECODER_ANY_HEADS, is_encoder_decoder=False, is_decoder=True, decoder_layers=0),
                "decoder_layers",
            ),
            (dict(output_attentions=True, attn_implementation="sdpa"), "output_attentions"),
            (
                dict(ENCODER_DECODER_ANY_HEADS, d_model=12, position_embedding_type="rope", encoder_attention_heads=4),
                "position_embedding_type",
            ),
        ]
        overrides, name = draw(st.sampled_from(combinations))
        return {**fields, **overrides}, name
    edges = edge_invalid_values(fields)
    name = draw(st.sampled_from(sorted(edges)))
    return {**fields, name: draw(st.sampled_from(edges[name]) | out_of_range(name))}, name


# ---------------------------------------------------------------- property-based tests


def saved_and_loaded(config: VanillaTransformerConfig) -> VanillaTransformerConfig:
    with tempfile.TemporaryDirectory() as directory:
        config.save_pretrained(directory)
        return AutoConfig.from_pretrained(directory)


def field_values(config: VanillaTransformerConfig) -> dict[str, Any]:
    """Every field (`transformers_version` is stamped on save) and the derived generic names."""
    names = [*config.to_diff_dict(), "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "num_labels"]
    return {name: getattr(config, name) for name in names if name != "transformers_version"}


@PROPERTY_SETTINGS
@given(fields=valid_fields())
def test_valid_configs_save_and_load_exactly(fields):
    config = VanillaTransformerConfig(**fields)
    loaded = saved_and_loaded(config)
    assert type(loaded) is VanillaTransformerConfig
    assert loaded.to_diff_dict() == config.to_diff_dict()
    assert field_values(loaded) == field_values(config)
    assert saved_and_loaded(loaded).to_diff_dict() == config.to_diff_dict()


def as_config_json(fields: dict[str, Any]) -> str | None:
    """`fields` as a config.json would hold them (NaN and infinities as Python's json writes them), or None when
    a value has no JSON form (a torch dtype object)."""
    try:
        return json.dumps({"model_type": VanillaTransformerConfig.model_type, **fields})
    except TypeError:
        return None


@PROPERTY_SETTINGS
@given(case=invalid_fields())
def test_invalid_configs_raise_a_value_error_naming_the_field(case):
    fields, name = case
    with tempfile.TemporaryDirectory() as directory:
        messages = refusals(fields, Path(directory))
    assert all(name in message for message in messages), messages


def refusals(fields: dict[str, Any], directory: Path) -> list[str]:
    """What the constructor, and `from_pretrained` of a config.json holding `fields`, say about them: the
    ValueError's message, or 'accepted'."""
    loads = [lambda: VanillaTransformerConfig(**fields)]
    config_json = as_config_json(fields)
    if config_json is not None:
        (directory / "config.json").write_text(config_json)
        loads.append(lambda: AutoConfig.from_pretrained(directory))
    messages = []
    for load in loads:
        try:
            load()
            messages.append("accepted")
        except CONFIG_ERRORS as err:
            messages.append(str(err))
    return messages


@pytest.mark.parametrize("stack_fields", [{}, DECODER_ONLY, ENCODER_ONLY], ids=["enc-dec", "decoder", "encoder"])
def test_every_edge_invalid_value_is_refused_naming_its_field(stack_fields, tmp_path):
    fields = {**TINY, **stack_fields}
    VanillaTransformerConfig(**fields)  # the base is valid
    unnamed = [
        (name, value, message)
        for name, values in edge_invalid_values(fields).items()
        for value in values
        for message in refusals({**fields, name: value}, tmp_path)
        if name not in message
    ]
    assert unnamed == []


# ---------------------------------------------------------------- the cases the fuzzer reported


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_experts=2, expert_capacity_factor=math.nan), "expert_capacity_factor"),
        (dict(num_experts=2, expert_capacity_factor=math.inf), "expert_capacity_factor"),
        (dict(norm_eps=math.nan), "norm_eps"),
        (dict(rope_theta=math.inf), "rope_theta"),
        (dict(position_embedding_type="rope", rope_theta=1e-300), "rope_theta"),
        (dict(eos_token_id=-1), "eos_token_id"),
        (dict(eos_token_id=32), "eos_token_id"),
        (dict(eos_token_id=[]), "eos_token_id"),
        (dict(forced_eos_token_id=[2, 40]), "forced_eos_token_id"),
        (dict(initializer_range=-0.02), "initializer_range"),
        (dict(num_labels=-1), "num_labels"),
        (dict(norm_position="deepnorm", decoder_layers=0), "decoder_layers"),
        (dict(DECODER_ONLY, decoder_layers=0), "decoder_layers"),  # cached decoding would stay at position 0
    ],
    ids=lambda value: value if isinstance(value, str) else None,
)
def test_reported_invalid_values_are_refused(overrides, field):
    with pytest.raises(CONFIG_ERRORS, match=field):
        VanillaTransformerConfig(**{**TINY, **overrides})


def test_an_int_is_accepted_wherever_a_float_is():
    config = VanillaTransformerConfig(**TINY, num_experts=2, expert_capacity_factor=1, rope_theta=10000, dropout=0)
    assert (config.expert_capacity_factor, config.rope_parameters["rope_theta"], config.dropout) == (1, 10000, 0)


def test_label_maps_follow_transformers_conventions(tmp_path):
    # ConfigTester's maps (label2id values as strings) and a one-label regression head load, as in transformers.
    config = VanillaTransformerConfig(**TINY, id2label={0: "label"}, label2id={"label": "0"})
    assert config.num_labels == 1
    assert VanillaTransformerConfig(**TINY, num_labels=1, problem_type="regression").num_labels == 1
    # A new num_labels replaces the maps (re-heading a classifier), at construction and as a load override.
    three = VanillaTransformerConfig(**TINY, id2label={0: "a", 1: "b", 2: "c"})
    assert VanillaTransformerConfig(**three.to_dict() | {"num_labels": 5}).id2label == {
        i: f"LABEL_{i}" for i in range(5)
    }
    three.save_pretrained(tmp_path)
    assert VanillaTransformerConfig.from_pretrained(tmp_path, num_labels=5).num_labels == 5


def test_fields_of_a_stack_the_model_does_not_run_are_not_constrained():
    # 24 is not divisible by the unused encoder's 5 heads; an encoder-only model has no decoder to check.
    VanillaTransformerConfig(**{**TINY, "d_model": 24, "decoder_attention_heads": 5}, **ENCODER_ONLY)
    VanillaTransformerConfig(
        **{**TINY, "d_model": 24, "encoder_attention_heads": 5, "encoder_layers": 0}, **DECODER_ONLY
    )
    with pytest.raises(CONFIG_ERRORS, match="encoder_attention_heads"):
        VanillaTransformerConfig(**{**TINY, "d_model": 24, "encoder_attention_heads": 5})


def test_changes_after_construction_are_checked_on_assignment_save_and_load_overrides(tmp_path):
    config = VanillaTransformerConfig(**TINY)
    config.save_pretrained(tmp_path)
    with pytest.raises(CONFIG_ERRORS, match="rope_theta"):
        VanillaTransformerConfig.from_pretrained(tmp_path, rope_theta=0.5)  # goes into rope_parameters
    with pytest.raises(CONFIG_ERRORS, match="d_model"):  # a rule between fields, checked after the overrides
        VanillaTransformerConfig.from_pretrained(tmp_path, d_model=18)
    with pytest.raises(CONFIG_ERRORS, match="norm_eps"):
        config.norm_eps = math.nan  # a field's own range: refused when set
    config.d_model = 18  # a rule between fields: refused when the config is validated or saved
    with pytest.raises(CONFIG_ERRORS, match="d_model"):
        config.save_pretrained(tmp_path)


def test_rope_settings_take_transformers_form_and_keep_the_callers_dict(tmp_path):
    """A top-level `rope_theta` (a keyword, or a config.json of earlier versions) goes into `rope_parameters`, which
    gets its defaults as in transformers' configs; the dict given is not changed; load overrides apply."""
    given = {"rope_type": "yarn", "factor": 4.0}
    config = VanillaTransformerConfig(**TINY, max_position_embeddings=64, rope_parameters=given, rope_theta=500.0)
    assert config.rope_parameters == {**given, "rope_theta": 500.0, "original_max_position_embeddings": 64}
    assert given == {"rope_type": "yarn", "factor": 4.0}
    assert VanillaTransformerConfig(**TINY).rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}

    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "vanilla_transformer", "rope_theta": 321}))
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == {"rope_type": "default", "rope_theta": 321}
    config.save_pretrained(tmp_path)
    assert "rope_theta" not in json.loads((tmp_path / "config.json").read_text())
    assert VanillaTransformerConfig.from_pretrained(tmp_path, rope_theta=700).rope_parameters["rope_theta"] == 700
    dynamic = VanillaTransformerConfig.from_pretrained(tmp_path, rope_parameters={"rope_type": "dynamic", "factor": 2})
    assert dynamic.rope_parameters == {"rope_type": "dynamic", "factor": 2, "rope_theta": 500.0}  # the saved theta


def test_a_model_refuses_a_bad_config_json_before_reading_weights(tmp_path):
    bad = {**TINY, **DECODER_ONLY, "model_type": "vanilla_transformer", "eos_token_id": [2, 99]}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CONFIG_ERRORS, match="eos_token_id"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_asking_for_attention_weights_picks_eager_attention():
    assert VanillaTransformerConfig(**TINY, output_attentions=True)._attn_implementation == "eager"
    assert VanillaTransformerConfig(**TINY)._attn_implementation is None


# ---------------------------------------------------------------- the stack the generic names describe


@pytest.mark.parametrize(
    "kind, stack_fields, layers, heads",
    [
        ("encoder-decoder", {}, 1, 4),  # BART's convention: the encoder's sizes at the top level
        ("decoder-only", DECODER_ONLY, 3, 2),
        ("encoder-only", ENCODER_ONLY, 1, 4),
    ],
)
def test_generic_names_describe_the_stack_the_model_runs(kind, stack_fields, layers, heads):
    config = VanillaTransformerConfig(**TINY, **stack_fields)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (layers, heads, heads)
    assert config.hidden_size == config.d_model == 16
    config.num_hidden_layers, config.num_attention_heads = 2, 8  # generation's early exit sets the layer count
    stack = "decoder" if kind == "decoder-only" else "encoder"
    assert (getattr(config, f"{stack}_layers"), getattr(config, f"{stack}_attention_heads")) == (2, 8)


@pytest.mark.parametrize("stack_fields", [{}, DECODER_ONLY], ids=["encoder-decoder", "decoder-only"])
def test_caches_size_themselves_from_the_decoder(stack_fields):
    config = VanillaTransformerConfig(**TINY, **stack_fields)
    decoder = config.get_text_config(decoder=True)
    assert (decoder.num_hidden_layers, decoder.num_attention_heads, decoder.num_key_value_heads) == (3, 2, 2)
    assert len(DynamicCache(config=config).layers) == 3
    assert len(StaticCache(config=config, max_cache_len=8).layers) == 3
    if config.is_encoder_decoder:
        cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config))
        assert len(cache.self_attention_cache.layers) == len(cache.cross_attention_cache.layers) == 3


def test_causal_lm_with_a_decoder_deeper_than_the_encoder_generates():
    torch.manual_seed(0)
    model = VanillaTransformerForCausalLM(VanillaTransformerConfig(**TINY, **DECODER_ONLY)).eval()
    prompt = torch.randint(3, 32, (2, 4))
    dynamic = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4)
    static = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4, cache_implementation="static")
    uncached = model.generate(prompt, max_new_tokens=4, do_sample=False, min_new_tokens=4, use_cache=False)
    assert dynamic.shape == (2, 8) and torch.equal(dynamic, static) and torch.equal(dynamic, uncached)


def test_for_single_stack_is_a_validated_copy():
    config = VanillaTransformerConfig(**TINY)
    decoder_only = config.for_single_stack("decoder")
    assert decoder_only.stacks == ("decoder",) and decoder_only.num_hidden_layers == 3
    assert config.stacks == ("encoder", "decoder")  # the original is untouched
    assert config.for_single_stack("encoder").stacks == ("encoder",)
    encoder_only = VanillaTransformerConfig(**{**TINY, "d_model": 24, "decoder_attention_heads": 5}, **ENCODER_ONLY)
    with pytest.raises(CONFIG_ERRORS, match="decoder_attention_heads"):
        encoder_only.for_single_stack("decoder")
    with pytest.raises(ValueError, match="stack"):
        config.for_single_stack("both")


# ---------------------------------------------------------------- num_key_value_heads


def test_key_value_heads_follow_each_stack_unless_given():
    config = VanillaTransformerConfig(**TINY)
    assert (config.key_value_heads(config.encoder_attention_heads), config.key_value_heads(2)) == (4, 2)
    grouped = VanillaTransformerConfig(**TINY, num_key_value_heads=1)
    assert grouped.num_key_value_heads == grouped.key_value_heads(4) == grouped.key_value_heads(2) == 1


def test_saved_config_keeps_num_key_value_heads_as_given(tmp_path):
    VanillaTransformerConfig(**TINY).save_pretrained(tmp_path / "default")
    VanillaTransformerConfig(**TINY, num_key_value_heads=2).save_pretrained(tmp_path / "grouped")
    saved = {name: json.loads((tmp_path / name / "config.json").read_text()) for name in ("default", "grouped")}
    assert saved["default"]["num_key_value_heads"] is None and saved["grouped"]["num_key_value_heads"] == 2
    for name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "stacks", "num_labels"):
        assert name not in saved["default"]


def test_a_config_saved_before_is_decoder_and_filled_key_value_heads_loads_the_same(tmp_path):
    # What `save_pretrained` wrote before this field existed: no `is_decoder`, `num_key_value_heads` null.
    old = {**TINY, "model_type": "vanilla_transformer", "num_key_value_heads": None, "is_encoder_decoder": True}
    (tmp_path / "config.json").write_text(json.dumps(old))
    config = AutoConfig.from_pretrained(tmp_path)
    assert config.is_decoder is False and config.stacks == ("encoder", "decoder")
    assert (config.key_value_heads(config.encoder_attention_heads), config.key_value_heads(2)) == (4, 2)


@pytest.mark.parametrize("padding_free", [True, False])
def test_a_config_saved_with_padding_free_loads_and_saves_without_it(tmp_path, padding_free):
    """`padding_free` was a field until the training scripts chose the layout from the device: a config.json that
    carries it (either value) loads as the same config, and saving writes it no more."""
    old = {**TINY, "model_type": "vanilla_transformer", "padding_free": padding_free}
    (tmp_path / "old" / "config.json").parent.mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    config = AutoConfig.from_pretrained(tmp_path / "old")
    assert config.to_diff_dict() == VanillaTransformerConfig(**TINY).to_diff_dict()
    assert not hasattr(config, "padding_free")
    config.save_pretrained(tmp_path / "new")
    assert "padding_free" not in json.loads((tmp_path / "new" / "config.json").read_text())
