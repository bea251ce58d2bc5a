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

# 5. The server a newcomer starts, from that environment: `tinyserve serve` on the built-in model, answering
#    /health and one completion, then stopped with SIGTERM (it drains and exits 0).
say "tinyserve serve in that environment"
env -u PYTHONPATH HF_HUB_OFFLINE=1 "$work/venv/bin/python" - "$work/venv/bin/tinyserve" <<'PY'
import json, socket, subprocess, sys, time, urllib.request

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = subprocess.Popen([sys.argv[1], "serve", "--port", str(port)], stdout=sys.stderr, stderr=sys.stderr)
url = f"http://127.0.0.1:{port}"
deadline = time.monotonic() + 300  # a start takes seconds idle, a minute or more beside the other tests
while True:
    if server.poll() is not None:
        sys.exit(f"tinyserve serve exited with {server.returncode} before answering /health")
    try:
        if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
            break
    except OSError:
        if time.monotonic() > deadline:
            server.kill()
            sys.exit("tinyserve serve did not answer /health within 300 s")
        time.sleep(0.5)
body = json.dumps({"model": "tinyserve-default", "prompt": "Beautiful is better than", "max_tokens": 8,
                   "temperature": 0}).encode()
request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=120))
server.terminate()
code = server.wait(60)
print(f"rehearsal: tinyserve serve answered {answer['choices'][0]['text']!r} and exited {code}", file=sys.stderr)
sys.exit(code)
PY
