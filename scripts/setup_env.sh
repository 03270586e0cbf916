#!/usr/bin/env bash
# Creates a virtual environment with this package and its training and test extras, from nothing.
#
#   bash scripts/setup_env.sh                 # ./.venv, the newest releases the package admits
#   bash scripts/setup_env.sh 5.22.2          # ... with this transformers release
#   VENV=.venv-oldest bash scripts/setup_env.sh oldest
#                                             # the oldest releases the package declares (pyproject.toml's lower
#                                             # bounds) of torch, transformers, tokenizers, accelerate, datasets,
#                                             # huggingface_hub
#
# The transformers release may also come as TRANSFORMERS_VERSION. CI runs the test suite in both of the last two.
# Without an NVIDIA GPU it installs PyTorch's CPU build: the default Linux wheel on PyPI pulls several GB of CUDA
# libraries that a CPU machine cannot use.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${VENV:-.venv}"
release="${1:-${TRANSFORMERS_VERSION:-newest}}"
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
# torch 2.13.0 (its CPU build lies on the project's VM), or with "oldest" pyproject.toml's lower bound.
torch_release=2.13.0
[ "$release" = oldest ] && torch_release=$(sed -nE 's/^ *"torch>=([^,"]+).*/\1/p' pyproject.toml)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "${pip[@]}" "torch==$torch_release"
  else
    "${pip[@]}" --retries 1 --timeout 20 "torch==$torch_release" --extra-index-url https://download.pytorch.org/whl/cpu
  fi
fi
case "$release" in
  newest) pins=() ;;
  oldest)  # each "name>=X" of these dependencies in pyproject.toml, as "name==X"
    mapfile -t pins < <(sed -nE 's/^ *"(transformers|tokenizers|accelerate|datasets|huggingface_hub)>=([^,"]+).*/\1==\2/p' pyproject.toml) ;;
  *) pins=("transformers==$release") ;;
esac
"${pip[@]}" -e ".[test]" "${pins[@]}"
"$venv/bin/python" -c "import transformers; print('transformers', transformers.__version__, 'in $venv')"
