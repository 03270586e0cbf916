"""LoRA through peft on the attention (q_proj, v_proj) and FFN (fc1, fc2) projections: it trains only the adapters,
saves them, and a reload on top of the saved base model gives the same outputs.

Run: python -m pytest -q tests/test_peft.py
"""

import pytest
import torch
from conftest import padded_batch, tiny_config
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_vanilla_transformer import VanillaTransformerForCausalLM, VanillaTransformerForConditionalGeneration

TARGET_MODULES = ["q_proj", "v_proj", "fc1", "fc2"]


def training_batch(seq2seq: bool) -> dict[str, torch.Tensor]:
    """Reverse-copy for the seq2seq model, next-token prediction for the causal LM."""
    input_ids, attention_mask = padded_batch(batch=4, length=8)
    targets, target_mask = (input_ids.flip(-1), attention_mask.flip(-1)) if seq2seq else (input_ids, attention_mask)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=targets.masked_fill(target_mask == 0, -100))


@pytest.mark.parametrize(
    "head, auto_class, task_type",
    [
        (VanillaTransformerForConditionalGeneration, AutoModelForSeq2SeqLM, "SEQ_2_SEQ_LM"),
        (VanillaTransformerForCausalLM, AutoModelForCausalLM, "CAUSAL_LM"),
    ],
    ids=["seq2seq", "causal"],
)
def test_lora_trains_saves_and_reloads(tmp_path, head, auto_class, task_type):
    torch.manual_seed(0)
    # Xavier: at d_model 32 the default N(0, 0.02) weights pass the low-rank updates' gradients ~9x weaker.
    base = head(tiny_config(initialization="xavier"))
    base.save_pretrained(tmp_path / "base")
    targeted = {name for name, _ in base.named_modules() if name.rsplit(".", 1)[-1] in TARGET_MODULES}
    frozen = {name: tensor.clone() for name, tensor in base.state_dict().items()}

    lora = LoraConfig(task_type=task_type, r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGET_MODULES)
    model = get_peft_model(base, lora)
    wrapped = {name.removeprefix("base_model.model.") for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    assert wrapped == targeted and len(targeted) >= 4 * base.config.decoder_layers
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)

    batch = training_batch(seq2seq=task_type == "SEQ_2_SEQ_LM")
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(8):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses

    base_weights = model.get_base_model().state_dict()
    for name, tensor in frozen.items():  # LoRA leaves the base weights as they were
        key = name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        torch.testing.assert_close(base_weights.get(key, base_weights.get(name)), tensor, rtol=0, atol=0)

    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()

    reloaded = PeftModel.from_pretrained(auto_class.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, logits, rtol=0, atol=1e-6)
        untuned = auto_class.from_pretrained(tmp_path / "base").eval()(**batch).logits
    assert (untuned - logits).abs().max() > 1e-2  # the adapters changed the model

    generate_kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=6)
    assert torch.equal(reloaded.generate(**generate_kwargs), model.generate(**generate_kwargs))
    merged = reloaded.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(**batch).logits, logits, rtol=0, atol=1e-5)
