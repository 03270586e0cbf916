"""The core model with the rest of the ecosystem: Trainer's gradient accumulation and the Hub remote-code path."""

import json
import textwrap

import torch
from conftest import padded_batch, run_without_package, tiny_config
from datasets import Dataset
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

from hf_vanilla_transformer import VanillaTransformerForConditionalGeneration


def uneven_seq2seq_dataset(size: int = 8) -> Dataset:
    """Rows whose label counts differ a lot, so a per-micro-batch mean loss differs from the per-token mean."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for row in range(size):
        n_labels = 2 if row < size // 2 else 9
        labels = torch.randint(3, 64, (n_labels,), generator=generator).tolist() + [-100] * (9 - n_labels)
        source = torch.randint(3, 64, (9,), generator=generator).tolist()
        rows.append({"input_ids": source, "attention_mask": [1] * 9, "labels": labels})
    return Dataset.from_list(rows)


def first_step_grad_norm(tmp_path, batch_size: int, accumulation: int) -> float:
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config())
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / f"bs{batch_size}_ga{accumulation}"),
        per_device_train_batch_size=batch_size,
        gradient_accumulation_steps=accumulation,
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        data_seed=0,
        train_sampling_strategy="sequential",  # micro-batch 1 = the short-label rows, micro-batch 2 = the long ones
    )
    trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=uneven_seq2seq_dataset())
    trainer.train()
    return next(log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log)


def test_gradient_accumulation_is_exact(tmp_path):
    """bs 8 x GA 1 and bs 4 x GA 2 see the same 8 rows; the loss is normalised by all label tokens of the step."""
    full_batch = first_step_grad_norm(tmp_path, batch_size=8, accumulation=1)
    accumulated = first_step_grad_norm(tmp_path, batch_size=4, accumulation=2)
    assert abs(full_batch - accumulated) <= 1e-4 * full_batch


HIDDEN_PACKAGE_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, json, sys

    class HidePackage(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "hf_vanilla_transformer":
                raise ImportError("hf_vanilla_transformer is hidden in this process")

    sys.meta_path.insert(0, HidePackage())
    import torch
    from transformers import AutoModelForSeq2SeqLM

    try:
        import hf_vanilla_transformer  # noqa: F401
        raise SystemExit("the package should not be importable here")
    except ImportError:
        pass
    folder, inputs = sys.argv[1], json.loads(sys.argv[2])
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert model.__class__.__module__.startswith("transformers_modules"), model.__class__.__module__
    ids, mask = torch.tensor(inputs["input_ids"]), torch.tensor(inputs["attention_mask"])
    logits = model(ids, attention_mask=mask, decoder_input_ids=ids[:, :4]).logits
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=2)
    print(json.dumps({"logits": logits.tolist(), "generated": generated.tolist()}))
    """
)


def test_remote_code_load_without_the_package(tmp_path):
    torch.manual_seed(0)
    model = VanillaTransformerForConditionalGeneration(tiny_config()).eval()
    model.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForSeq2SeqLM"}

    input_ids, attention_mask = padded_batch()
    inputs = json.dumps({"input_ids": input_ids.tolist(), "attention_mask": attention_mask.tolist()})
    remote = run_without_package(HIDDEN_PACKAGE_SCRIPT, str(tmp_path / "saved"), inputs, tmp_path=tmp_path)
    logits = model(input_ids, attention_mask=attention_mask, decoder_input_ids=input_ids[:, :4]).logits
    torch.testing.assert_close(torch.tensor(remote["logits"]), logits, atol=1e-6, rtol=0)
    generated = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=6, num_beams=2)
    assert remote["generated"] == generated.tolist()
