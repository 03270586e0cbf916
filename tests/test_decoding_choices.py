"""benchmarks/multi30k_decoding_choices.py scores a finished run's end-of-run choices as the recipe does: its last
weights and its average of the last 2 checkpoints, decoded with the run's beam and alpha, score the validation BLEU
that train_seq2seq.py itself reported for them."""

import sys
from pathlib import Path

import pytest
from test_safe_scripts import PAIRS, write_pairs
from test_training_scripts import QUIET, TINY_MODEL

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import multi30k_decoding_choices  # noqa: E402
import train_seq2seq  # noqa: E402


def test_the_runs_own_choices_score_what_the_run_reported(tmp_path):
    train = write_pairs(tmp_path / "train.jsonl", PAIRS)
    write_pairs(tmp_path / "validation.jsonl", PAIRS[:2] + [("she has forty-two books", "sie hat zweiundvierzig")])
    run_dir = tmp_path / "run"
    metrics = train_seq2seq.main(
        [*TINY_MODEL, *QUIET, "--output_dir", str(run_dir), "--do_train", "--do_eval"]
        + ["--train_file", str(train), "--validation_file", str(tmp_path / "validation.jsonl")]
        + ["--tokenizer_vocab_size", "120", "--per_device_train_batch_size", "4", "--max_steps", "30"]
        + ["--warmup_steps", "4", "--save_steps", "10", "--average_last_checkpoints", "2"]
        + ["--metric_for_best_model", "bleu", "--generation_num_beams", "2", "--max_new_tokens_over_source", "6"]
    )
    rows = multi30k_decoding_choices.main(
        [str(run_dir), str(tmp_path), "--average", "1", "2", "--beams", "2", "1", "--alphas", "0.6", "1.0"]
        + ["--max_new_tokens_over_source", "6", "--output", str(tmp_path / "choices.json")]
    )
    assert len(rows) == 2 * 2 * 2 and (tmp_path / "choices.json").exists()
    chosen = {(len(row["averaged_checkpoints"]), row["beams"], row["alpha"]): row for row in rows}
    assert chosen[1, 2, 0.6]["bleu"] == pytest.approx(metrics["eval_bleu_last"], abs=0.01)
    assert chosen[2, 2, 0.6]["bleu"] == pytest.approx(metrics["eval_bleu_averaged"], abs=0.01)
    kept = chosen[metrics["averaged_checkpoints"], 2, 0.6]  # BLEU can be 0 for so small a model; chrF is not
    assert kept["chrf"] == pytest.approx(metrics["eval_chrf"], abs=0.01) and kept["chrf"] > 0
