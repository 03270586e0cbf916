#!/usr/bin/env bash
# Creates ./.venv with this package and its training and test extras, from nothing.
# Without an NVIDIA GPU it installs PyTorch's CPU build: the default Linux wheel on PyPI pulls several GB of CUDA
# libraries that a CPU machine cannot use.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" "torch==2.13.0"
  else
    "${pip[@]}" --retries 1 --timeout 20 "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${pip[@]}" -e ".[test]"
