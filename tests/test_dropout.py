"""The models' dropout is torch's `nn.Dropout`; `optimize_for_cpu_training` swaps in `CpuDropout`, a cheaper mask, on
CPUs where torch samples it per element.

The mask must be the same distribution as torch's (each element dropped with probability p, independently, the kept
ones scaled by 1 / (1 - p)), its gradient the same map, and everywhere the cheaper mask does not apply the module must
be nn.Dropout itself.

python -m pytest -q tests/test_dropout.py
"""

import copy
import math
from unittest import mock

import pytest
import torch
from conftest import tiny_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_vanilla_transformer import (
    VanillaTransformerConfig,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForImageClassification,
    VanillaTransformerForSequenceClassification,
    image_classification_config,
)
from hf_vanilla_transformer import cpu_training_vanilla_transformer as cpu_training
from hf_vanilla_transformer.cpu_training_vanilla_transformer import CpuDropout, optimize_for_cpu_training


def per_element_cpu(answer: bool):
    """Pretend the CPU is (True) or is not (False) one where torch samples dropout masks element by element."""
    return mock.patch.object(cpu_training, "cpu_samples_dropout_per_element", return_value=answer)


def within_binomial_bounds(successes: int, trials: int, probability: float, sigmas: float = 5.0) -> bool:
    return abs(successes - trials * probability) <= sigmas * math.sqrt(trials * probability * (1 - probability))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_drops_each_element_with_probability_p_and_scales_the_rest(p, dtype):
    torch.manual_seed(0)
    inputs = torch.ones(1_000_003, dtype=dtype)  # odd: the last draw's second half is unused
    outputs = CpuDropout(p).train()(inputs)
    kept = outputs != 0
    assert within_binomial_bounds(int((~kept).sum()), inputs.numel(), p)
    torch.testing.assert_close(outputs[kept], torch.full_like(outputs[kept], 1 / (1 - p)))


def test_mask_elements_are_independent_within_and_across_draws():
    """Elements 2i and 2i+1 share one 64-bit draw, 2i+1 and 2i+2 do not: both pairs drop together with p^2."""
    torch.manual_seed(0)
    dropped = ~cpu_training.keep_mask(torch.Size([2_000_000]), 2**31)  # p = 1/2
    same_draw, next_draw = dropped[0::2] & dropped[1::2], dropped[1:-1:2] & dropped[2::2]
    for pairs in (same_draw, next_draw):
        assert within_binomial_bounds(int(pairs.sum()), pairs.numel(), 0.25)


def test_gradient_is_the_mask_scaled():
    torch.manual_seed(0)
    inputs = torch.randn(64, 17, 64, requires_grad=True)
    outputs = CpuDropout(0.1).train()(inputs)
    upstream = torch.randn_like(outputs)
    outputs.backward(upstream)
    kept = outputs != 0
    assert 0 < kept.float().mean() < 1
    torch.testing.assert_close(outputs, torch.where(kept, inputs / 0.9, 0.0))
    torch.testing.assert_close(inputs.grad, torch.where(kept, upstream / 0.9, 0.0))


def test_masks_follow_torch_seed():
    module, inputs = CpuDropout(0.3).train(), torch.ones(4096)
    torch.manual_seed(7)
    first, second = module(inputs), module(inputs)
    torch.manual_seed(7)
    assert torch.equal(module(inputs), first)
    assert not torch.equal(first, second)


@pytest.mark.parametrize("case", ["eval", "p=0", "p=1", "inplace", "compiling"])
def test_everywhere_else_it_is_torch_dropout(case):
    """Bit for bit torch's dropout (same seed, same output) and the cheaper mask is never drawn."""
    p = {"p=0": 0.0, "p=1": 1.0}.get(case, 0.25)
    module = CpuDropout(p, inplace=case == "inplace").train(case != "eval")
    reference = torch.nn.Dropout(p, inplace=case == "inplace").train(case != "eval")
    compiling = mock.patch.object(cpu_training, "is_torchdynamo_compiling", return_value=case == "compiling")
    drawn = mock.patch.object(cpu_training, "keep_mask", side_effect=AssertionError("cheaper mask drawn"))
    with compiling, drawn:
        torch.manual_seed(3)
        outputs = module(torch.randn(4096))
        torch.manual_seed(3)
        expected = reference(torch.randn(4096))
    assert torch.equal(outputs, expected)


@pytest.mark.parametrize(
    ("mkl", "vendor", "per_element"),
    [
        (True, "vendor_id\t: GenuineIntel\n", False),
        (True, "vendor_id\t: AuthenticAMD\n", True),
        (False, "vendor_id\t: GenuineIntel\n", True),  # a build without MKL samples per element everywhere
        (True, "", True),  # Arm and unknown CPUs
    ],
)
def test_which_cpus_sample_per_element(mkl, vendor, per_element):
    cpu_training.cpu_samples_dropout_per_element.cache_clear()
    try:
        with (
            mock.patch.object(torch.backends.mkl, "is_available", return_value=mkl),
            mock.patch.object(cpu_training, "cpu_vendor", return_value=vendor),
        ):
            assert cpu_training.cpu_samples_dropout_per_element() is per_element
    finally:
        cpu_training.cpu_samples_dropout_per_element.cache_clear()


@pytest.mark.parametrize(
    "build",
    [
        lambda: VanillaTransformerForConditionalGeneration(tiny_config(dropout=0.1, activation_dropout=0.1)),
        lambda: VanillaTransformerForConditionalGeneration(tiny_config(num_experts=2, num_experts_per_tok=1)),
        lambda: VanillaTransformerForSequenceClassification(
            VanillaTransformerConfig(**{**tiny_config().to_dict(), "is_encoder_decoder": False})
        ),
        lambda: VanillaTransformerForImageClassification(
            image_classification_config(
                d_model=16,
                encoder_layers=1,
                encoder_attention_heads=2,
                encoder_ffn_dim=32,
                image_size=8,
                patch_size=4,
                num_labels=3,
            )
        ),
    ],
    ids=["seq2seq", "moe", "classifier", "image"],
)
def test_the_models_use_torch_dropout_and_the_opt_in_swaps_it_where_the_cpu_samples_per_element(build):
    """Every dropout of a model is `nn.Dropout`; `optimize_for_cpu_training` makes each a `CpuDropout` on a CPU that
    samples masks per element, and leaves them on one with MKL's sampler (Intel)."""
    for per_element, expected in ((False, torch.nn.Dropout), (True, CpuDropout)):
        model = build()
        assert all(type(module) is torch.nn.Dropout for module in model.modules() if isinstance(module, torch.nn.Dropout))
        with per_element_cpu(per_element):
            optimize_for_cpu_training(model)
        dropouts = [module for module in model.modules() if isinstance(module, torch.nn.Dropout)]
        assert dropouts and all(type(module) is expected for module in dropouts)


def test_a_training_step_draws_every_mask_cheaply_and_reproducibly():
    """Each dropout of the model (p > 0) draws its mask with `keep_mask` once per forward, and the seed fixes them."""
    config = tiny_config(dropout=0.3, activation_dropout=0.2)
    with per_element_cpu(True):
        model = optimize_for_cpu_training(VanillaTransformerForConditionalGeneration(config).train())
    active = sum(1 for module in model.modules() if isinstance(module, CpuDropout) and module.p > 0)
    batch = dict(input_ids=torch.randint(4, 32, (3, 7)), labels=torch.randint(4, 32, (3, 5)))
    with mock.patch.object(cpu_training, "keep_mask", wraps=cpu_training.keep_mask) as keep_mask:
        losses = []
        for _ in range(2):
            torch.manual_seed(11)
            losses.append(model(**batch).loss)
    assert keep_mask.call_count == 2 * active
    assert torch.equal(losses[0], losses[1])


def test_gradient_checkpointing_recomputes_the_same_masks():
    """The recomputed forward of a checkpointed layer must draw the masks of the first forward (torch's checkpoint
    restores the CPU generator's state), or its gradients would belong to other masks."""
    torch.manual_seed(0)
    plain = VanillaTransformerForConditionalGeneration(tiny_config(dropout=0.3, activation_dropout=0.2)).train()
    with per_element_cpu(True):
        optimize_for_cpu_training(plain)
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    batch = dict(input_ids=torch.randint(4, 64, (3, 7)), labels=torch.randint(4, 64, (3, 5)))
    for model in (plain, checkpointed):
        torch.manual_seed(5)
        model(**batch).loss.backward()
    for name, parameter in plain.named_parameters():
        torch.testing.assert_close(checkpointed.get_parameter(name).grad, parameter.grad, msg=name)


@settings(max_examples=60, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
    p=st.floats(0.01, 0.99),
    transposed=st.booleans(),
)
def test_any_shape_keeps_or_zeroes_each_element(shape, p, transposed):
    inputs = torch.randn(*shape, 2) + 3.0  # never 0, so a 0 output is a dropped element
    inputs = (inputs.transpose(0, -1) if transposed else inputs).requires_grad_()
    outputs = CpuDropout(p).train()(inputs)
    assert outputs.shape == inputs.shape
    kept = outputs != 0
    torch.testing.assert_close(outputs, torch.where(kept, inputs / (1 - p), 0.0))
    outputs.sum().backward()
    torch.testing.assert_close(inputs.grad, torch.where(kept, 1 / (1 - p), 0.0))
