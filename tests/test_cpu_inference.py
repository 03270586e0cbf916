"""optimize_for_cpu_inference: float32 keeps the function, int8/bfloat16 round only the Linear weights.

python -m pytest -q tests/test_cpu_inference.py
"""

import copy
import importlib

import pytest
import torch
from conftest import padded_batch, tiny_config

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration
from hf_vanilla_transformer import cpu_inference_vanilla_transformer as cpu_inference
from hf_vanilla_transformer.cpu_inference_vanilla_transformer import PrepackedLinear, optimize_for_cpu_inference

LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2", "gate_proj", "up_proj", "down_proj", "lm_head")


def model_and_optimized(precision: str, **config_overrides):
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config(**config_overrides)).eval()
    return model, optimize_for_cpu_inference(copy.deepcopy(model), precision)


def logits(model, input_ids, attention_mask) -> torch.Tensor:
    decoder_input_ids = torch.randint(3, 64, (input_ids.shape[0], 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids).logits


def generated(model, input_ids, attention_mask, num_beams: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, num_beams=num_beams, max_new_tokens=12, do_sample=False
        )


@pytest.mark.parametrize(
    "overrides", [{}, {"ffn_type": "swiglu", "use_bias": False, "norm_position": "pre", "num_key_value_heads": 2}]
)
def test_float32_keeps_logits_and_tokens(overrides):
    model, optimized = model_and_optimized("float32", **overrides)
    input_ids, attention_mask = padded_batch()
    torch.testing.assert_close(
        logits(optimized, input_ids, attention_mask), logits(model, input_ids, attention_mask), rtol=0, atol=1e-5
    )
    for num_beams in (1, 4):
        assert torch.equal(
            generated(optimized, input_ids, attention_mask, num_beams),
            generated(model, input_ids, attention_mask, num_beams),
        )


def test_float32_changes_layout_not_values_and_keeps_embeddings_row_major():
    model, optimized = model_and_optimized("float32")
    for (name, original), (_, relaid) in zip(model.named_parameters(), optimized.named_parameters()):
        assert torch.equal(relaid, original), name
        if name.endswith("weight") and name.split(".")[-2] in LINEAR_NAMES:
            assert relaid.t().is_contiguous() and not relaid.is_contiguous(), name
    # The tied output projection gets its own (in, out) copy; the embedding lookups keep the row-major table.
    assert optimized.model.shared.weight.is_contiguous()
    assert optimized.lm_head.weight.data_ptr() != optimized.model.shared.weight.data_ptr()
    assert not optimized.training and not any(p.requires_grad for p in optimized.parameters())


@pytest.mark.parametrize("dtype, many_rows, tolerance", [(torch.float32, 8, 1e-5), (torch.bfloat16, 1, 1e-2)])
@pytest.mark.parametrize("rows", [1, 7, 8, 40])
def test_prepacked_linear_either_memory_order_gives_the_product(dtype, many_rows, tolerance, rows):
    """Below `many_rows` rows the product reads the (in, out) copy, from it on oneDNN's packed copy (and the copy
    torch.compile reads is the (in, out) one): each equals `F.linear` with the weight in `dtype`, for 2-D and 3-D
    float32 inputs, and returns float32."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80)
    optimized = PrepackedLinear(linear, dtype, many_rows)
    torch._dynamo.reset()  # each case compiles the same forward for new shapes: keep under the recompile limit
    compiled = torch.compile(optimized, fullgraph=True)
    for shape in ((rows, 48), (1, rows, 48)):
        input = torch.randn(shape)
        expected = torch.nn.functional.linear(input.to(dtype), linear.weight.to(dtype), linear.bias.to(dtype))
        for output in (optimized(input), compiled(input)):
            assert output.dtype == torch.float32
            torch.testing.assert_close(output, expected.float(), rtol=0, atol=tolerance)


def test_int8_weights_are_per_channel_absmax_roundings():
    model, optimized = model_and_optimized("int8")
    linear, quantized = model.model.decoder.layers[0].mlp.fc1, optimized.model.decoder.layers[0].mlp.fc1
    scales, absmax = quantized.weight_scale, linear.weight.detach().abs().amax(dim=1)
    # Symmetric int8: the largest weight of each output channel maps to the end of [-128, 127].
    torch.testing.assert_close(scales, absmax / 127.5, rtol=1e-5, atol=0)
    assert quantized.int8_weight.dtype == torch.int8
    dequantized = quantized.int8_weight.float() * scales[:, None]
    assert (dequantized - linear.weight).abs().le(scales[:, None] / 2 + 1e-7).all()
    assert torch.equal(quantized.bias, linear.bias.detach())


@pytest.mark.parametrize("precision, tolerance", [("int8", 0.05), ("bfloat16", 0.02)])
def test_lower_precision_linear_is_close_to_float32(precision, tolerance):
    model, optimized = model_and_optimized(precision)
    rows = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    reference = model.model.decoder.layers[1].mlp.fc1(rows)
    relative_error = (optimized.model.decoder.layers[1].mlp.fc1(rows) - reference).norm() / reference.norm()
    assert relative_error < tolerance
    assert not any(type(module) is torch.nn.Linear for module in optimized.modules())


@pytest.mark.parametrize("precision", ["int8", "bfloat16"])
def test_lower_precision_decodes_the_float32_tokens(precision):
    """The rounding moves the logits by less than this model's margins between its best tokens (as on 3 of 3 seeds
    tried): greedy and beam search pick the float32 model's tokens."""
    model, optimized = model_and_optimized(precision)
    input_ids, attention_mask = padded_batch()
    for num_beams in (1, 4):
        assert torch.equal(
            generated(optimized, input_ids, attention_mask, num_beams),
            generated(model, input_ids, attention_mask, num_beams),
        )


def test_bad_arguments_are_named():
    model = VanillaTransformerForConditionalGeneration(tiny_config())
    with pytest.raises(ValueError, match="precision"):
        optimize_for_cpu_inference(model, "float16")
    with pytest.raises(TypeError, match="model"):
        optimize_for_cpu_inference("not a model")
    with pytest.raises(ValueError, match="float32 weights on the CPU"):
        optimize_for_cpu_inference(model.to(torch.bfloat16))


@pytest.mark.parametrize("precision", ["none", "float32", "bfloat16", "int8"])
def test_compiled_decoding_step_has_no_graph_breaks(precision):
    """`generate()` with a static cache compiles its decoding step (on the CPU only when asked with
    `_compile_all_devices`): one graph per step shape, the same tokens as eager decoding."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    model, optimized = model_and_optimized("float32" if precision == "none" else precision)
    model = model if precision == "none" else optimized
    input_ids, attention_mask = padded_batch()
    compile_config = CompileConfig(fullgraph=False)
    compile_config._compile_all_devices = True
    options = {"max_new_tokens": 6, "do_sample": False, "cache_implementation": "static"}
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = model.generate(input_ids, attention_mask=attention_mask, compile_config=compile_config, **options)
        eager = model.generate(input_ids, attention_mask=attention_mask, disable_compile=True, **options)
    assert torch.equal(compiled, eager)
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.fixture
def reload_with_changed_op(monkeypatch):
    """Imports the module anew on a torch whose op `torch.ops.<namespace>.<name>` has another schema (aten's mm)."""

    def reload(namespace: str, name: str):
        monkeypatch.setattr(getattr(torch.ops, namespace), name, torch.ops.aten.mm, raising=False)
        with pytest.warns(UserWarning, match=name):
            return importlib.reload(cpu_inference)

    yield reload
    monkeypatch.undo()
    importlib.reload(cpu_inference)


@pytest.mark.parametrize(
    "precision, namespace, name",
    [
        ("float32", "mkldnn", "_linear_pointwise"),
        ("bfloat16", "mkldnn", "_linear_pointwise"),
        ("int8", "onednn", "qlinear_pointwise"),
    ],
)
def test_without_the_onednn_op_products_fall_back_to_f_linear(reload_with_changed_op, precision, namespace, name):
    """Beam search on 3 sentences multiplies 12 rows, where the packed copy would be read: the fallback never calls
    the changed op (aten's mm would refuse its arguments) and decodes the float32 model's tokens."""
    module = reload_with_changed_op(namespace, name)
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    optimized = module.optimize_for_cpu_inference(copy.deepcopy(model), precision)
    input_ids, attention_mask = padded_batch()
    if precision == "float32":
        torch.testing.assert_close(
            logits(optimized, input_ids, attention_mask), logits(model, input_ids, attention_mask), rtol=0, atol=1e-5
        )
    beam_tokens = generated(optimized, input_ids, attention_mask, 4)
    assert torch.equal(beam_tokens, generated(model, input_ids, attention_mask, 4))


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "int8"])
def test_no_deprecation_warning_from_torch(precision):
    """The CPU paths call no deprecated torch API (its eager dynamic quantization warns from torch 2.14 on): optimizing
    and decoding with greedy and beam search warn of nothing deprecated on the installed torch."""
    import warnings

    input_ids, attention_mask = padded_batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, optimized = model_and_optimized(precision)
        for num_beams in (1, 2):
            generated(optimized, input_ids, attention_mask, num_beams)
    # torch 2.15 says it in a UserWarning ("... quantized tensor creation functions ... are deprecated").
    deprecations = [
        str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, FutureWarning))
        or "deprecat" in str(w.message).lower()
    ]  # fmt: skip
    assert not deprecations, deprecations
