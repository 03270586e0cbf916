import pytest
import torch
from huggingface_hub.errors import StrictDataclassError

import hf_vanilla_transformer  # noqa: F401  (registers the Auto classes)
from hf_vanilla_transformer import VanillaTransformerConfig

# What a refused config raises: huggingface_hub's strict-dataclass errors for a field's type or range and for the rules
# between fields (each names the field), ValueError for what transformers' base class or `__post_init__` refuses.
CONFIG_ERRORS = (ValueError, StrictDataclassError)

torch.set_num_threads(2)


def tiny_config(**overrides) -> VanillaTransformerConfig:
    """A model small enough for CPU tests; dropout off so outputs are deterministic."""
    fields = dict(
        vocab_size=64,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        dropout=0.0,
        max_position_embeddings=64,
    )
    return VanillaTransformerConfig(**{**fields, **overrides})


@pytest.fixture
def config() -> VanillaTransformerConfig:
    return tiny_config()


def padded_batch(vocab_size: int = 64, batch: int = 3, length: int = 9, seed: int = 0):
    """Random token ids (avoiding the special ids 0-2) and a mask with right padding on all but the first row."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, vocab_size, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row in range(1, batch):
        attention_mask[row, length - 2 * row :] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    return input_ids, attention_mask


def run_without_package(script: str, *arguments: str, tmp_path) -> dict:
    """Runs `script` in a fresh process in `tmp_path`, offline, where the scripts hide hf_vanilla_transformer so that
    only saved code files can be imported; its last line of output, parsed as JSON."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", script, *arguments],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": ""},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
