#!/usr/bin/env bash
# Download every wheel tinyserve needs, except torch and triton, into a folder, for
# a machine without internet: a GPU server whose own torch and triton must stay.
#
#   bash scripts/offline_wheels.sh DIR [--python-version 3.12] [--platform manylinux_2_28_x86_64]
#
# Run it where the package index can be reached; the Python and platform are those of
# the offline machine, not this one's. DIR then holds tinyserve's own wheel and one for
# every dependency (and theirs), binary wheels only. On the offline machine:
#
#   pip install --no-index --find-links DIR tinyserve
#
# pip keeps every installed package that satisfies tinyserve's requirements (torch,
# transformers, numpy... of the machine's image) and takes the rest from DIR. torch is
# never in DIR, so pip cannot replace it: if the machine's torch were too old, the
# install would fail, naming it, instead.
#
# manylinux_2_28 (glibc 2.28 and newer) is the platform of current CUDA images. A wheel
# built for an older glibc runs there too, but pip takes only the tags it is given, so
# manylinux_2_N stands for every manylinux_2_M with M <= N down to 2_17 (manylinux2014).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: bash scripts/offline_wheels.sh DIR [--python-version X.Y] [--platform TAG]" >&2; exit 2; }
[ $# -ge 1 ] || usage
dest=$1
shift
python_version=3.12
platform=manylinux_2_28_x86_64
while [ $# -gt 0 ]; do
  case $1 in
    --python-version) python_version=${2:?--python-version needs a value}; shift 2 ;;
    --platform) platform=${2:?--platform needs a value}; shift 2 ;;
    *) usage ;;
  esac
done
python=${PYTHON:-python3}
mkdir -p "$dest"

# The runtime dependencies, from pyproject.toml, less torch (and triton, which torch brings).
# A dependency that itself requires torch (xgrammar) is downloaded without its own
# dependencies, which would bring a torch; the rest of them are listed here instead.
requirements=$(mktemp)
without_deps=$(mktemp)
trap 'rm -f "$requirements" "$without_deps"' EXIT
"$python" - "$requirements" "$without_deps" <<'EOF'
import re, sys
TORCH_DEPENDENTS = {"xgrammar": ["apache-tvm-ffi>=0.1.11"]}  # besides torch, triton and what tinyserve needs anyway
text = open("pyproject.toml", encoding="utf-8").read()
block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
entries = re.findall(r'"([^"]+)"', block)
def name(entry): return re.match(r"[A-Za-z0-9_.-]+", entry).group(0).lower()
kept = [e for e in entries if name(e) not in ("torch", "triton") and name(e) not in TORCH_DEPENDENTS]
alone = [e for e in entries if name(e) in TORCH_DEPENDENTS]
kept += [dep for e in alone for dep in TORCH_DEPENDENTS[name(e)]]
open(sys.argv[1], "w", encoding="utf-8").write("\n".join(kept) + "\n")
open(sys.argv[2], "w", encoding="utf-8").write("\n".join(alone) + "\n")
EOF

echo "offline_wheels: tinyserve's own wheel" >&2
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$dest" .
platforms=(--platform "$platform")
if [[ $platform =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
  for ((glibc = BASH_REMATCH[1] - 1; glibc >= 17; glibc--)); do
    platforms+=(--platform "manylinux_2_${glibc}_${BASH_REMATCH[2]}")
  done
  platforms+=(--platform "manylinux2014_${BASH_REMATCH[2]}")
fi
echo "offline_wheels: its dependencies for Python $python_version on $platform" >&2
"$python" -m pip download --quiet --dest "$dest" --only-binary=:all: --implementation cp \
  --python-version "$python_version" "${platforms[@]}" -r "$requirements"
if [ -s "$without_deps" ]; then
  "$python" -m pip download --quiet --dest "$dest" --only-binary=:all: --implementation cp --no-deps \
    --python-version "$python_version" "${platforms[@]}" -r "$without_deps"
fi
if ls "$dest" | grep -qiE '^(torch|triton)-'; then
  echo "offline_wheels: a torch or triton wheel came in as a dependency; the offline machine's own must stay" >&2
  exit 1
fi
echo "offline_wheels: $(ls "$dest" | wc -l) wheels in $dest; on the offline machine:" >&2
echo "  pip install --no-index --find-links $dest tinyserve" >&2
