"""Export to CTranslate2: the exported model decodes the same tokens (greedy and beam 4) and gives the same per-token
log-probabilities (within 1e-4) as the torch model, for every variant CTranslate2 can represent; the rest is refused
with an error naming the config field; a non-empty output directory is never overwritten without force."""

import json
import os
import subprocess
import sys
from pathlib import Path

import ctranslate2
import pytest
import torch
from conftest import tiny_config
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_vanilla_transformer import VanillaTransformerForCausalLM, VanillaTransformerForConditionalGeneration
from hf_vanilla_transformer.ctranslate2_vanilla_transformer import export_to_ctranslate2, main

VOCAB_SIZE = 48
TOKENIZER_SIZE = 44  # smaller than the model's vocabulary: the export pads it with placeholder tokens
BOS, EOS = 1, 2
MAX_NEW_TOKENS = 16
LOG_PROB_TOLERANCE = 1e-4

SEQ2SEQ_VARIANTS = {
    "paper": {},
    "marian": dict(
        sinusoidal_layout="concatenated",
        ffn_type="swish",
        share_encoder_decoder_embeddings=False,
        tie_word_embeddings=False,
        lm_head_bias=True,
    ),
    "llama-style": dict(
        norm_position="pre",
        norm_type="rmsnorm",
        ffn_type="swiglu",
        position_embedding_type="rope",
        num_key_value_heads=2,
        use_bias=False,
        scale_embedding=False,
    ),
    "learned-gelu-mqa": dict(
        position_embedding_type="learned", ffn_type="gelu", norm_bias=False, num_key_value_heads=1, encoder_ffn_dim=48
    ),
    "sandwich-geglu": dict(norm_position="sandwich", ffn_type="geglu", encoder_attention_heads=2),
    "no-positions-glu": dict(position_embedding_type="none", ffn_type="glu", norm_position="pre", rope_theta=500.0),
    "sandwich-rms-reglu-rope": dict(
        norm_position="sandwich", norm_type="rmsnorm", ffn_type="reglu", position_embedding_type="rope"
    ),
}
CAUSAL_VARIANTS = {
    "gpt-post-norm": {},
    "llama-style": SEQ2SEQ_VARIANTS["llama-style"],
    "sandwich-learned-gelu": dict(norm_position="sandwich", position_embedding_type="learned", ffn_type="gelu"),
}


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Whitespace word-level tokenizer "<pad> <s> </s> <unk> w4 w5 ..." with the ids the model config expects."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials)} | {f"w{i}": i for i in range(len(specials), TOKENIZER_SIZE)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def random_model(
    causal: bool, **overrides
) -> VanillaTransformerForConditionalGeneration | VanillaTransformerForCausalLM:
    """A tiny random model whose norms and biases are not at their identity init (so a norm or bias exported to the
    wrong place shows), with a larger end-token output row so that in most variants some hypotheses end early."""
    torch.manual_seed(0)
    config = tiny_config(vocab_size=VOCAB_SIZE, **overrides)
    model = (VanillaTransformerForCausalLM if causal else VanillaTransformerForConditionalGeneration)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
            elif parameter.dim() == 1:
                parameter.normal_(0.0, 0.1)
        model.lm_head.weight[EOS] *= 4.0
    return model


def random_sequences(count: int, lengths: range, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths.start, lengths.stop, (count,), generator=generator).tolist()
    return [torch.randint(4, TOKENIZER_SIZE, (size,), generator=generator).tolist() for size in sizes]


def until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS)] if EOS in ids else ids


class Exported:
    """An exported model's directory with its vocabulary, to pass ids in and read ids out."""

    def __init__(self, directory: str, vocabulary_file: str):
        self.directory = directory
        self.tokens = json.loads((Path(directory) / vocabulary_file).read_text())
        self.ids = {token: i for i, token in enumerate(self.tokens)}

    def to_tokens(self, ids: list[int]) -> list[str]:
        return [self.tokens[i] for i in ids]

    def to_ids(self, tokens: list[str]) -> list[int]:
        return [self.ids[token] for token in tokens]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer()


@pytest.mark.parametrize("variant", SEQ2SEQ_VARIANTS)
def test_translator_matches_torch(variant, tokenizer, tmp_path):
    model = random_model(causal=False, **SEQ2SEQ_VARIANTS[variant])
    exported = Exported(export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer), "shared_vocabulary.json")
    translator = ctranslate2.Translator(exported.directory, device="cpu", compute_type="float32")
    sources = [ids + [EOS] for ids in random_sequences(8, range(3, 10), seed=1)]
    source_tokens = [exported.to_tokens(ids) for ids in sources]

    for beams in (1, 4):
        # CTranslate2 ends a beam search once beam_size hypotheses have finished (patience 1): HF's early_stopping=True.
        # Its min_decoding_length defaults to 1 where HF lets the end token come first.
        results = translator.translate_batch(
            source_tokens, beam_size=beams, max_decoding_length=MAX_NEW_TOKENS, min_decoding_length=0
        )
        for source, result in zip(sources, results):
            expected = model.generate(
                torch.tensor([source]),
                num_beams=beams,
                do_sample=False,
                early_stopping=True,
                length_penalty=1.0,
                max_new_tokens=MAX_NEW_TOKENS,
            )[0, 1:].tolist()
            assert exported.to_ids(result.hypotheses[0]) == until_eos(expected), (variant, beams, source)

    # Per-token log-probabilities of the beam outputs and their end token, teacher-forced in both.
    targets = [exported.to_ids(result.hypotheses[0]) for result in results]
    scores = translator.score_batch(source_tokens, [exported.to_tokens(target) for target in targets])
    for source, target, score in zip(sources, targets, scores):
        decoder_input_ids = torch.tensor([[BOS] + target])
        with torch.no_grad():
            log_probs = model(input_ids=torch.tensor([source]), decoder_input_ids=decoder_input_ids).logits
        expected = log_probs.log_softmax(-1)[0].gather(-1, torch.tensor(target + [EOS])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(score.log_probs), expected, rtol=0, atol=LOG_PROB_TOLERANCE)


@pytest.mark.parametrize("variant", CAUSAL_VARIANTS)
def test_generator_matches_torch(variant, tokenizer, tmp_path):
    model = random_model(causal=True, **CAUSAL_VARIANTS[variant])
    exported = Exported(export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer), "vocabulary.json")
    generator = ctranslate2.Generator(exported.directory, device="cpu", compute_type="float32")
    prompts = [[BOS] + ids for ids in random_sequences(6, range(5, 6), seed=2)]  # one length: no left padding

    for beams in (1, 4):
        results = generator.generate_batch(
            [exported.to_tokens(prompt) for prompt in prompts],
            beam_size=beams,
            max_length=MAX_NEW_TOKENS,
            include_prompt_in_result=False,
        )
        expected = model.generate(
            torch.tensor(prompts), num_beams=beams, do_sample=False, early_stopping=True, max_new_tokens=MAX_NEW_TOKENS
        )[:, len(prompts[0]) :].tolist()
        for result, reference in zip(results, expected):
            assert result.sequences_ids[0] == until_eos(reference), (variant, beams)

    sequences = [prompt + result.sequences_ids[0] for prompt, result in zip(prompts, results)]
    scores = generator.score_batch([exported.to_tokens(sequence) for sequence in sequences])
    for sequence, score in zip(sequences, scores):
        with torch.no_grad():
            log_probs = model(input_ids=torch.tensor([sequence])).logits.log_softmax(-1)[0, :-1]
        expected = log_probs.gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(score.log_probs), expected, rtol=0, atol=LOG_PROB_TOLERANCE)


@pytest.mark.parametrize(
    "field, value",
    [("num_experts", 2), ("norm_position", "deepnorm"), ("ffn_type", "bilinear")],
)
@pytest.mark.parametrize("causal", [False, True], ids=["seq2seq", "causal"])
def test_unrepresentable_variant_names_the_field(field, value, causal, tokenizer, tmp_path):
    model = random_model(causal=causal, **{field: value})
    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    assert not (tmp_path / "ct2").exists()


@pytest.mark.parametrize(
    "field, value",
    [
        ("norm_position", "hybrid"),
        ("norm_type", "scalenorm"),
        ("ffn_type", "squared_relu"),
        ("position_embedding_type", "alibi"),
    ],
)
def test_a_variant_the_export_does_not_know_is_refused_by_name(field, value, tokenizer, tmp_path):
    """A value the config gains later (written past the config's own check here) is named, not exported as another
    variant (an unknown position type as no positions, an unknown norm as LayerNorm after the residual add)."""
    model = random_model(causal=False)
    vars(model.config)[field] = value
    with pytest.raises(ValueError, match=f"{field}={value!r}: the export handles .* only"):
        export_to_ctranslate2(model, tmp_path / "ct2", tokenizer=tokenizer)
    assert not (tmp_path / "ct2").exists()


def test_non_empty_output_dir_needs_force(tokenizer, tmp_path):
    model = random_model(causal=False)
    output_dir = tmp_path / "ct2"
    output_dir.mkdir()
    export_to_ctranslate2(model, output_dir, tokenizer=tokenizer)  # an existing empty directory is fine
    (output_dir / "keep.txt").write_text("user data")
    with pytest.raises(ValueError, match="output_dir=.*not empty"):
        export_to_ctranslate2(model, output_dir, tokenizer=tokenizer)
    assert (output_dir / "keep.txt").read_text() == "user data"
    export_to_ctranslate2(model, output_dir, tokenizer=tokenizer, force=True)
    assert not (output_dir / "keep.txt").exists() and (output_dir / "model.bin").is_file()


def test_bad_arguments(tokenizer, tmp_path):
    model = random_model(causal=False)
    with pytest.raises(ValueError, match="quantization='int3'"):
        export_to_ctranslate2(model, tmp_path / "a", quantization="int3", tokenizer=tokenizer)
    with pytest.raises(ValueError, match="tokenizer"):
        export_to_ctranslate2(model, tmp_path / "b")  # a model instance and no tokenizer: no vocabulary to write
    with pytest.raises(TypeError, match="model_or_path"):
        export_to_ctranslate2(model.model, tmp_path / "c", tokenizer=tokenizer)


@pytest.mark.parametrize("causal", [False, True], ids=["seq2seq", "causal"])
def test_cli_exports_a_saved_folder_in_int8(causal, tokenizer, tmp_path):
    model = random_model(causal=causal)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    main([str(tmp_path / "model"), str(tmp_path / "fp32")])
    main([str(tmp_path / "model"), str(tmp_path / "int8"), "--quantization", "int8"])
    with pytest.raises(SystemExit) as exit_info:  # the output exists now: refused with a usage error
        main([str(tmp_path / "model"), str(tmp_path / "int8")])
    assert exit_info.value.code == 2

    # int8 weights: the Linear and embedding matrices shrink about 4x (scales and norms stay float32).
    size = {name: (tmp_path / name / "model.bin").stat().st_size for name in ("fp32", "int8")}
    assert size["int8"] < 0.4 * size["fp32"]
    model_class = ctranslate2.Generator if causal else ctranslate2.Translator
    loaded = model_class(str(tmp_path / "int8"), device="cpu", compute_type="int8")
    tokens = ["<s>", "w5", "w6"] if causal else ["w5", "w6", "</s>"]
    scores = loaded.score_batch([tokens]) if causal else loaded.score_batch([tokens], [["w7"]])
    assert len(scores[0].log_probs) == 2


REMOTE_EXPORT_SCRIPT = """
import sys
from transformers import AutoModelForSeq2SeqLM
model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], trust_remote_code=True)
print(type(model).__module__)
from hf_vanilla_transformer.ctranslate2_vanilla_transformer import export_to_ctranslate2
export_to_ctranslate2(model, sys.argv[2], tokenizer=sys.argv[1])
"""


def test_exports_a_model_loaded_as_remote_code(tokenizer, tmp_path):
    """A model loaded with trust_remote_code before the package was imported has transformers' copy of our class."""
    model = random_model(causal=False)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_EXPORT_SCRIPT, str(tmp_path / "model"), str(tmp_path / "ct2")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("transformers_modules.")

    source, target = [5, 6, 7, EOS], [8, 9]
    exported = Exported(str(tmp_path / "ct2"), "shared_vocabulary.json")
    translator = ctranslate2.Translator(exported.directory, device="cpu", compute_type="float32")
    (score,) = translator.score_batch([exported.to_tokens(source)], [exported.to_tokens(target)])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([source]), decoder_input_ids=torch.tensor([[BOS] + target])).logits
    expected = logits.log_softmax(-1)[0].gather(-1, torch.tensor(target + [EOS])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(score.log_probs), expected, rtol=0, atol=LOG_PROB_TOLERANCE)
