#!/usr/bin/env bash
# Create the virtual environment (default .venv) and install tinyserve into it
# with its test tools. Safe to run again: it only installs what is missing.
#
# torch comes first and on purpose: on a machine without an NVIDIA GPU the CPU
# build is installed, never the multi-gigabyte CUDA one that a plain
# `pip install torch` would pull. With a GPU, PyPI's default (CUDA) build is used.
set -euo pipefail
venv=${1:-.venv}
torch_version=${TINYSERVE_TORCH_VERSION:-2.13.0}

[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch==$torch_version"
  else
    "${pip[@]}" "torch==$torch_version+cpu" 2>/dev/null \
      || "${pip[@]}" "torch==$torch_version" --index-url https://download.pytorch.org/whl/cpu
  fi
fi
"${pip[@]}" -e ".[dev]"
