"""Padding-free layers (`config.padding_free`): the same function as the padded computation, with less work."""

import copy

import pytest
import torch
from conftest import tiny_config

from hf_vanilla_transformer import (
    VanillaTransformerForCausalLM,
    VanillaTransformerForConditionalGeneration,
    VanillaTransformerForSequenceClassification,
)
from hf_vanilla_transformer.moe_vanilla_transformer import dropped_token_counts
from hf_vanilla_transformer.packing_vanilla_transformer import PackedTokens, positions_the_loss_needs

VARIANTS = {
    "paper": {},
    "pre-rmsnorm-rope-swiglu-gqa": dict(
        norm_position="pre",
        norm_type="rmsnorm",
        position_embedding_type="rope",
        ffn_type="swiglu",
        num_key_value_heads=2,
    ),
    "learned-positions-eager": dict(position_embedding_type="learned", attn_implementation="eager"),
    # Capacity-limited experts: the same tokens must compete for the same room, packed or not.
    "moe-capacity-shared": dict(
        num_experts=4, num_experts_per_tok=2, ffn_type="swiglu", expert_capacity_factor=1.0, num_shared_experts=1
    ),
}


def padded_pair(model_class, **overrides):
    """The same weights twice: padding-free (the default) and padded (`padding_free=False`)."""
    attn_implementation = overrides.pop("attn_implementation", "sdpa")
    torch.manual_seed(0)
    packed = model_class._from_config(tiny_config(**overrides), attn_implementation=attn_implementation)
    padded = copy.deepcopy(packed)
    for module in padded.modules():
        if hasattr(module, "config"):
            module.config.padding_free = False
    return packed, padded


def translation_batch():
    """Source padding in two rows; label padding (-100) at the end of two rows and in the middle of one."""
    generator = torch.Generator().manual_seed(1)
    source = torch.randint(3, 64, (3, 9), generator=generator)
    source_mask = torch.ones_like(source)
    source_mask[0, 6:] = 0
    source_mask[2, 2:] = 0
    labels = torch.randint(3, 64, (3, 7), generator=generator)
    labels[1, 4:] = -100
    labels[2, 1:] = -100
    labels[0, 2] = -100
    return source, source_mask, labels


def test_packed_tokens_round_trip_and_skip_full_masks():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    packing = PackedTokens.of(mask)
    values = torch.arange(6.0).view(2, 3, 1)
    assert packing.pack(values).flatten().tolist() == [0.0, 1.0, 3.0]
    assert packing.unpack(packing.pack(values)).flatten().tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.0]
    assert PackedTokens.of(torch.ones(2, 3)) is None  # nothing to skip
    assert PackedTokens.of(None) is None
    assert PackedTokens.of(torch.ones(2, 1, 3, 3)) is None  # a 4D mask is taken as built by the caller


def test_positions_the_loss_needs():
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, -100, -100], [5, 6, 7, 8]])
    expected = [[True, True, True, False], [False, False, False, False], [True, True, True, True]]
    assert positions_the_loss_needs(labels != -100, None).tolist() == expected
    # Left padding is skipped, but a counted position is computed even where the attention mask hides it.
    attention_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1]])
    expected = [[False, True, True, False], [False, False, False, False], [True, True, True, True]]
    assert positions_the_loss_needs(labels != -100, attention_mask).tolist() == expected


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_training_step_equals_the_padded_computation(variant):
    packed, padded = padded_pair(VanillaTransformerForConditionalGeneration, **VARIANTS[variant])
    source, source_mask, labels = translation_batch()
    outputs = {}
    for name, model in (("packed", packed), ("padded", padded)):
        model.train()  # dropout is 0 in tiny_config, so both steps are deterministic
        outputs[name] = model(input_ids=source, attention_mask=source_mask, labels=labels)
        outputs[name].loss.backward()
    torch.testing.assert_close(outputs["packed"].loss, outputs["padded"].loss, rtol=0, atol=1e-6)
    if packed.config.num_experts:  # balancing and z losses over the same rows, and the same dropped assignments
        for field in ("encoder_aux_loss", "decoder_aux_loss", "encoder_z_loss", "decoder_z_loss"):
            torch.testing.assert_close(getattr(outputs["packed"], field), getattr(outputs["padded"], field))
        assert dropped_token_counts(packed) == dropped_token_counts(padded)
    for (name, p_packed), p_padded in zip(packed.named_parameters(), padded.parameters()):
        torch.testing.assert_close(p_packed.grad, p_padded.grad, rtol=1e-5, atol=1e-6, msg=name)
    counted = labels != -100
    packed_logits, padded_logits = outputs["packed"].logits, outputs["padded"].logits
    assert packed_logits.shape == padded_logits.shape
    torch.testing.assert_close(packed_logits[counted], padded_logits[counted], rtol=1e-5, atol=1e-5)
    assert packed_logits[~counted].abs().max() == 0  # not computed: only counted labels need logits in training


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_inference_equals_the_padded_computation_at_real_tokens(variant):
    packed, padded = padded_pair(VanillaTransformerForConditionalGeneration, **VARIANTS[variant])
    source, source_mask, labels = translation_batch()
    decoder_mask = positions_the_loss_needs(labels != -100, None).long()
    decoder_input_ids = packed.prepare_decoder_input_ids_from_labels(labels)
    with torch.no_grad():
        packed_out, padded_out = (
            model.eval()(
                input_ids=source,
                attention_mask=source_mask,
                decoder_input_ids=decoder_input_ids,
                decoder_attention_mask=decoder_mask,
            )
            for model in (packed, padded)
        )
    real_source, real_target = source_mask.bool(), decoder_mask.bool()
    torch.testing.assert_close(
        packed_out.encoder_last_hidden_state[real_source], padded_out.encoder_last_hidden_state[real_source]
    )
    assert packed_out.encoder_last_hidden_state[~real_source].abs().max() == 0
    torch.testing.assert_close(packed_out.logits[real_target], padded_out.logits[real_target], rtol=1e-5, atol=1e-5)


def test_padding_free_skips_the_padding_in_every_linear_map():
    """The work is really skipped: every linear map of both stacks, and the vocabulary projection, sees the real
    tokens only."""
    packed, _ = padded_pair(VanillaTransformerForConditionalGeneration)
    source, source_mask, labels = translation_batch()
    rows_seen = {}

    def record(name):
        def hook(module, args, output):
            rows_seen[name] = args[0].shape[:-1].numel()

        return hook

    for name, module in packed.named_modules():
        if isinstance(module, torch.nn.Linear) and "k_proj" not in name and "v_proj" not in name:
            module.register_forward_hook(record(name))
    packed.train()(input_ids=source, attention_mask=source_mask, labels=labels)
    real_source = int(source_mask.sum())
    real_target = int(positions_the_loss_needs(labels != -100, None).sum())
    assert {rows for name, rows in rows_seen.items() if name.startswith("model.encoder.")} == {real_source}
    decoder_rows = {rows for name, rows in rows_seen.items() if name.startswith("model.decoder.")}
    assert decoder_rows == {real_target}
    assert rows_seen["lm_head"] == int((labels != -100).sum())
    assert real_source < source.numel() and real_target < labels.numel()


def test_cross_attention_projects_the_real_source_tokens_only():
    packed, _ = padded_pair(VanillaTransformerForConditionalGeneration)
    source, source_mask, labels = translation_batch()
    rows = []
    packed.model.decoder.layers[0].encoder_attn.k_proj.register_forward_hook(
        lambda module, args, output: rows.append(args[0].shape[0])
    )
    packed.train()(input_ids=source, attention_mask=source_mask, labels=labels)
    assert rows == [int(source_mask.sum())]


def test_generation_and_hidden_states_are_unchanged():
    packed, padded = padded_pair(VanillaTransformerForConditionalGeneration)
    source, source_mask, _ = translation_batch()
    options = dict(attention_mask=source_mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    for num_beams in (1, 3):
        assert torch.equal(
            packed.eval().generate(source, num_beams=num_beams, **options),
            padded.eval().generate(source, num_beams=num_beams, **options),
        )
    with torch.no_grad():  # all hidden states asked for: the layers keep the padded shape
        states = packed(
            input_ids=source, attention_mask=source_mask, decoder_input_ids=source[:, :4], output_hidden_states=True
        ).encoder_hidden_states
    assert all(state.shape == (*source.shape, packed.config.d_model) for state in states)


def test_gradient_checkpointing_with_packed_layers():
    packed, padded = padded_pair(VanillaTransformerForConditionalGeneration)
    packed.gradient_checkpointing_enable()
    source, source_mask, labels = translation_batch()
    for model in (packed, padded):
        model.train()(input_ids=source, attention_mask=source_mask, labels=labels).loss.backward()
    for p_packed, p_padded in zip(packed.parameters(), padded.parameters()):
        torch.testing.assert_close(p_packed.grad, p_padded.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_class", [VanillaTransformerForCausalLM, VanillaTransformerForSequenceClassification])
def test_single_stack_heads_equal_the_padded_computation(model_class):
    packed, padded = padded_pair(model_class)
    source, source_mask, _ = translation_batch()
    labels = torch.tensor([0, 1, 1]) if model_class is VanillaTransformerForSequenceClassification else source
    outputs = []
    for model in (packed, padded):
        outputs.append(model.train()(input_ids=source, attention_mask=source_mask, labels=labels))
        outputs[-1].loss.backward()
    torch.testing.assert_close(outputs[0].loss, outputs[1].loss, rtol=0, atol=1e-6)
    for p_packed, p_padded in zip(packed.parameters(), padded.parameters()):
        torch.testing.assert_close(p_packed.grad, p_padded.grad, rtol=1e-5, atol=1e-6)


def test_causal_lm_with_given_shift_labels_equals_the_padded_computation():
    """Labels already shifted by the caller (transformers' `shift_labels`, as under context parallelism) are packed
    the same way, including targets predicted from padding."""
    packed, padded = padded_pair(VanillaTransformerForCausalLM)
    source, source_mask, _ = translation_batch()
    shift_labels = torch.nn.functional.pad(source[:, 1:], (0, 1), value=-100)
    losses = [
        model.train()(input_ids=source, attention_mask=source_mask, labels=source, shift_labels=shift_labels).loss
        for model in (packed, padded)
    ]
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("with_attention_mask", [False, True])
def test_moe_causal_lm_balances_the_same_tokens_packed_or_not(with_attention_mask):
    """Labels ignored at the end of rows narrow what the decoder computes; the router statistics must then count the
    same rows in both computations."""
    packed, padded = padded_pair(VanillaTransformerForCausalLM, num_experts=4, num_experts_per_tok=2, ffn_type="swiglu")
    input_ids = torch.randint(3, 64, (3, 8), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[1, 5:], labels[2, 3:] = -100, -100
    attention_mask = torch.ones_like(input_ids)
    attention_mask[2, 6:] = 0
    outputs = [
        model.train()(
            input_ids=input_ids, attention_mask=attention_mask if with_attention_mask else None, labels=labels
        )
        for model in (packed, padded)
    ]
    torch.testing.assert_close(outputs[0].aux_loss, outputs[1].aux_loss)
    torch.testing.assert_close(outputs[0].z_loss, outputs[1].z_loss)
    torch.testing.assert_close(outputs[0].loss, outputs[1].loss, rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "moe-capacity-shared"])
def test_padded_computation_returns_zeros_at_the_padding_too(variant):
    """Every path gives the same value at every position, padding included (0): padding-free layers, the padded
    computation (also what torch.compile and torch.export run), so outputs of any two paths compare exactly."""
    packed, padded = padded_pair(VanillaTransformerForConditionalGeneration, **VARIANTS[variant])
    source, source_mask, labels = translation_batch()
    decoder_mask = positions_the_loss_needs(labels != -100, None).long()
    inputs = dict(
        input_ids=source,
        attention_mask=source_mask,
        decoder_input_ids=packed.prepare_decoder_input_ids_from_labels(labels),
        decoder_attention_mask=decoder_mask,
    )
    with torch.no_grad():
        packed_out, padded_out = (model.eval().model(**inputs) for model in (packed, padded))
    assert padded_out.encoder_last_hidden_state[source_mask == 0].abs().max() == 0
    assert padded_out.last_hidden_state[decoder_mask == 0].abs().max() == 0
    torch.testing.assert_close(packed_out.encoder_last_hidden_state, padded_out.encoder_last_hidden_state)
    torch.testing.assert_close(packed_out.last_hidden_state, padded_out.last_hidden_state)


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_bfloat16_packed_sequences_equal_the_left_padded_batch(attn_implementation):
    """Sequences packed in one row (position_ids restarting at 0, as `DataCollatorWithFlattening` gives them) and the
    same sequences as a left-padded batch, in bf16. Every position-wise step is the same arithmetic on the same rows:
    with eager attention the logits are equal bit for bit. torch's CPU sdpa kernel blocks its sums by the layout, so
    there they may differ by a step of bf16 rounding relative to the logits' size; with the default N(0, 0.02) init
    the logits of a new model are small, and the two agree within transformers' common-test tolerance (bf16 epsilon,
    absolute and relative). Xavier's order-1 logits exceed that absolute tolerance."""
    torch.manual_seed(0)
    config = tiny_config(is_encoder_decoder=False, attn_implementation=attn_implementation)
    model = VanillaTransformerForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    lengths = [7, 5, 3, 1]
    input_ids = torch.randint(3, 64, (len(lengths), 7), generator=torch.Generator().manual_seed(0))
    attention_mask = (torch.arange(7) >= 7 - torch.tensor(lengths)[:, None]).long()  # left padding
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    packed_positions = torch.cat([torch.arange(length) for length in lengths])[None]
    with torch.no_grad():
        padded = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
        packed = model(input_ids=input_ids[attention_mask.bool()][None], position_ids=packed_positions).logits[0]
    padded = padded[attention_mask.bool()]
    if attn_implementation == "eager":
        assert torch.equal(packed, padded)
    else:
        tolerance = torch.finfo(torch.bfloat16).eps
        torch.testing.assert_close(packed, padded, rtol=tolerance, atol=tolerance)
