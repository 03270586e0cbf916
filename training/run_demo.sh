#!/usr/bin/env bash
# The main job on a fresh machine: set up the environment, train the demo translation model (English -> German
# number sentences, built in) with the paper's recipe, then reload it through the Auto classes and decode examples.
# Usage: bash training/run_demo.sh [output_dir]   (extra settings: EXTRA_ARGS="--max_steps 2000" bash ... out/demo-2000;
# the same command run again resumes its run in output_dir, other settings need another output_dir)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/demo}"
bash scripts/setup_env.sh
# Two threads whose OpenMP workers sleep while they wait: with the default, a worker spinning on a core that another
# process also wants loses its turn, and every parallel operation waits for it (150 demo steps on a shared 2-core
# machine took 4 to 10 times as long; docs/training.md, Evidence).
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
start=$(date +%s)
.venv/bin/python training/train_seq2seq.py \
  --output_dir "$OUT" --preset demo-small --do_train --do_eval \
  --max_steps 600 --per_device_train_batch_size 64 --warmup_steps 200 \
  --tokenizer_vocab_size 1000 --max_eval_samples 200 --per_device_eval_batch_size 50 \
  --logging_steps 50 --save_steps 200 --save_total_limit 5 --seed 0 \
  --report_to none ${EXTRA_ARGS:-}
.venv/bin/python training/show_examples.py --model_dir "$OUT" --num_sentences 200 --show 5
echo "Demo finished in $(( $(date +%s) - start )) s; model, tokenizer, code and model card in $OUT"
