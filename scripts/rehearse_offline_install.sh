#!/usr/bin/env bash
# Rehearse, on this machine's CPU, installing tinyserve on an offline GPU server
# (README: "Installing on an offline GPU server"), then run benchmarks/gpu_check.py --smoke there.
#
#   bash scripts/rehearse_offline_install.sh WORKDIR
#
# 1. The GPU server's image: a venv of Python 3.12 (TINYSERVE_REHEARSAL_PYTHON) holding torch
#    (PyPI's build, which brings its pinned triton and runs on a CPU too) and the packages
#    such images carry (transformers, tokenizers, safetensors, numpy, jinja2,
#    prometheus-client, httpx, msgpack), none of tinyserve's other dependencies. It is
#    ~5 GB and takes minutes to make, so it is made once, in the cache folder
#    (TINYSERVE_REHEARSAL_CACHE, default ~/.cache/tinyserve), and reused: it is never
#    installed into.
# 2. scripts/offline_wheels.sh downloads the wheels for that Python into WORKDIR/wheels.
# 3. The server's environment: a fresh venv WORKDIR/venv that sees the image's packages
#    (a .pth file: what --system-site-packages gives a venv on a server whose system
#    Python holds torch), then `pip install --no-index --find-links WORKDIR/wheels tinyserve`
#    with no configuration and no index: only the folder.
# 4. torch and triton must be the image's still, then gpu_check.py --smoke runs there,
#    writing its rows to WORKDIR/gpu-check.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: bash scripts/rehearse_offline_install.sh WORKDIR" >&2; exit 2; }
work=$(mkdir -p "$1" && cd "$1" && pwd)
python=${TINYSERVE_REHEARSAL_PYTHON:-python3.12}
torch_version=${TINYSERVE_TORCH_VERSION:-2.13.0}
say() { echo "rehearsal: $*" >&2; }

version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cache=${TINYSERVE_REHEARSAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tinyserve}
image=$cache/gpu-image-python$version-torch$torch_version
site_packages() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

if [ ! -x "$image/bin/python" ]; then
  say "making the GPU image's environment (once): $image"
  building=$image.building.$$
  rm -rf "$building"
  "$python" -m venv "$building"
  "$building/bin/python" -m pip install --quiet "torch==$torch_version" transformers tokenizers safetensors numpy \
    jinja2 prometheus-client httpx msgpack
  mv "$building" "$image"  # whole or not at all: a venv run by its python alone may move
fi

say "downloading the wheels for Python $version"
rm -rf "$work/wheels" "$work/venv" "$work/gpu-check"
PYTHON="$image/bin/python" bash scripts/offline_wheels.sh "$work/wheels" --python-version "$version"

say "installing offline into a fresh environment beside the image's torch"
"$python" -m venv "$work/venv"
site_packages "$image" > "$(site_packages "$work/venv")/gpu-image.pth"
torch_before=$("$work/venv/bin/python" -c 'import torch, triton; print(torch.__version__, torch.__file__, triton.__version__)')
PIP_CONFIG_FILE=/dev/null "$work/venv/bin/python" -m pip install --quiet --no-index --find-links "$work/wheels" \
  tinyserve
torch_after=$("$work/venv/bin/python" -c 'import torch, triton; print(torch.__version__, torch.__file__, triton.__version__)')
if [ "$torch_after" != "$torch_before" ]; then
  say "the install changed torch or triton: before $torch_before, after $torch_after"
  exit 1
fi
say "torch and triton untouched: $torch_after"

say "benchmarks/gpu_check.py --smoke in that environment"
env -u PYTHONPATH "$work/venv/bin/python" benchmarks/gpu_check.py --smoke --out "$work/gpu-check"
