#!/usr/bin/env bash
# What pretraining buys, in one command: pretrain a causal LM (GPT route) and a masked LM (BERT route) on unlabelled
# text of the built-in topic language, fine-tune classifiers from them on 48 labelled sentences, and compare with the
# same classifiers trained from scratch over several seeds. The table and learning curves go into
# model_cards/pretrain-finetune-demo/ (README.md + learning_curves.png); checkpoints into the output directory.
# Usage: bash training/run_pretrain_finetune_demo.sh [output_dir]   (more settings: EXTRA_ARGS="--seeds 5" bash ...)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-out/pretrain-finetune-demo}"
PYTHON="${PYTHON:-.venv/bin/python}"
# Tiny matrices: one thread per process is as fast as two and does not fight other processes for the cores.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" training/pretrain_finetune_demo.py \
  --output_dir "$OUT" --card_dir model_cards/pretrain-finetune-demo ${EXTRA_ARGS:-}
