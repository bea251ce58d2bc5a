#!/usr/bin/env bash
# Create the virtual environment (default .venv) and install tinyserve into it
# with its test tools. Safe to run again: it only installs what is missing.
#
# torch comes first and on purpose: on a machine without an NVIDIA GPU the CPU
# build is installed, never the multi-gigabyte CUDA one that a plain
# `pip install torch` would pull. With a GPU, PyPI's default (CUDA) build is used.
# When no torch can be installed, pip's own error is shown, then what was tried
# and what to do about it.
#
#   TINYSERVE_PYTHON=python3.13     the Python that makes a new environment (default python3)
#   TINYSERVE_TORCH_VERSION=2.x.y   the torch release to install (default 2.13.0)
set -euo pipefail
venv=${1:-.venv}
torch_version=${TINYSERVE_TORCH_VERSION:-2.13.0}
cpu_index=https://download.pytorch.org/whl/cpu

say() { echo "setup: $*" >&2; }

[ -x "$venv/bin/python" ] || "${TINYSERVE_PYTHON:-python3}" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet)
pip_shown="$venv/bin/python -m pip install"  # as the user would type it
python_version=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')

# Says what was tried ($1) and what to do instead (the options, plus $2 if given);
# pip's own error has been printed above it.
give_up() {
  say "could not install torch $torch_version for Python $python_version in $venv; pip said why, above."
  say "tried: $1"
  say "what you can do, then run the same command again:"
  say "  - another torch release, one that has a build for this Python: TINYSERVE_TORCH_VERSION=2.x.y"
  say "  - a torch wheel of your own for this Python: $pip_shown /path/to/torch-*.whl"
  say "  - another Python for the environment: rm -r $venv, then TINYSERVE_PYTHON=python3.X (3.10 to 3.13)"
  [ -z "${2:-}" ] || say "  - $2"
  exit 1
}

if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    say "an NVIDIA GPU is here: installing torch $torch_version (PyPI's CUDA build) for Python $python_version"
    "${pip[@]}" "torch==$torch_version" || give_up "pip install torch==$torch_version"
  else
    say "no NVIDIA GPU: installing torch $torch_version, CPU build, for Python $python_version"
    if ! "${pip[@]}" "torch==$torch_version+cpu"; then
      say "torch==$torch_version+cpu is not to be had from pip's indexes (see above); trying $cpu_index"
      "${pip[@]}" "torch==$torch_version" --index-url "$cpu_index" || give_up \
        "pip install torch==$torch_version+cpu, then pip install torch==$torch_version --index-url $cpu_index" \
        "PyPI's default build, which bundles CUDA (several GB) and runs on a CPU too: $pip_shown torch==$torch_version"
    fi
  fi
fi
# Triton: a CUDA build of torch brought the one it was built with. The CPU build has none,
# and the kernels' tests run through Triton's interpreter: install the release that torch's
# CUDA build of the same version pins (scripts/torch_triton_pin.py), not whichever is newest.
if [ "$(uname -sm)" = "Linux x86_64" ]; then
  torch_installed=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
  triton_pin=$("$venv/bin/python" "$(dirname "$0")/torch_triton_pin.py" "$torch_installed")
  triton_now=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null || true)
  if [ "$triton_now" != "$triton_pin" ]; then
    say "installing triton $triton_pin, the release torch $torch_installed pins"
    "${pip[@]}" "triton==$triton_pin"
  fi
fi
"${pip[@]}" -e ".[dev,ray]"  # ray: the Ray backends' tests (tinyserve/distributed/)
# Disaggregated prefill's default connector (tinyserve/distributed/kv_transfer/transports.py): Mooncake's
# transfer engine, the [pd] extra. It loads the system's libibverbs even over TCP (Debian's libibverbs1,
# which .ci/run installs with the other system packages). Without either, the ZeroMQ connector is the
# default: reported, not fatal.
if [ "$(uname -sm)" = "Linux x86_64" ]; then
  ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' >/dev/null ||
    say "no libibverbs1 here (apt-get install libibverbs1): disaggregated prefill will use the ZeroMQ connector"
  "${pip[@]}" -e ".[pd]" || say "could not install Mooncake's transfer engine (.[pd]): disaggregated prefill will use the ZeroMQ connector"
fi
