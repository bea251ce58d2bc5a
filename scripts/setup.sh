#!/usr/bin/env bash
# Create the virtual environment (default .venv) and install into it one of two sets:
#
#   bash scripts/setup.sh .venv serve   what `tinyserve serve`, `chat` and `trace` need (`make serve`)
#   bash scripts/setup.sh .venv test    that, then the test tools and the optional backends (`make test`)
#
# Each step says what it installs and, once done, how long it took and how big the environment
# is now. Safe to run again: pip skips what is there.
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
set_name=${2:-serve}
torch_version=${TINYSERVE_TORCH_VERSION:-2.13.0}
cpu_index=https://download.pytorch.org/whl/cpu
here=$(dirname "$0")

say() { echo "setup: $*" >&2; }
case "$set_name" in serve | test) ;; *) say "unknown set '$set_name': serve or test"; exit 2 ;; esac

[ -x "$venv/bin/python" ] || "${TINYSERVE_PYTHON:-python3}" -m venv "$venv"
# --no-compile: the bytecode of what is imported is written on first import, not all of it now
# (torch alone is some 100 MB of it, and minutes of a small machine's time).
pip=("$venv/bin/python" -m pip install --quiet --no-compile)
pip_shown="$venv/bin/python -m pip install"  # as the user would type it
python_version=$("$venv/bin/python" -c 'import platform; print(platform.python_version())')
log="$venv/setup-pip.log"
started=$SECONDS
step_started=$SECONDS

step() {  # a step starts: "[1/3] what it installs"
  step_started=$SECONDS
  say "[$1] $2"
}

done_step() {  # how long it took, how big the environment is now
  say "      done in $((SECONDS - step_started)) s; $venv now holds $(du -sm "$venv" | cut -f1) MB"
}

# pip install "$@", naming each package as pip collects it; pip's whole output goes to $log and
# its end is shown when it fails.
pip_shown_progress() {
  "$venv/bin/python" -m pip install --no-compile --progress-bar off "$@" > "$log" 2>&1 < /dev/null &
  if ! watch_log $!; then
    grep -v "^WARNING: Location" "$log" | tail -n 40 >&2
    say "pip failed (above; all of it in $log)"
    exit 1
  fi
}

watch_log() {  # while pip ($1) runs, print the packages it collects on one growing line
  local pid=$1 shown=0 status=0
  printf 'setup:       ' >&2
  while kill -0 "$pid" 2>/dev/null; do
    shown=$(show_collected "$shown")
    sleep 1
  done
  wait "$pid" || status=$?
  shown=$(show_collected "$shown")
  printf '\n' >&2
  return $status
}

show_collected() {  # print the names collected since the $1 first ones; echo the new count
  local names new
  names=$(sed -n 's/^Collecting \([A-Za-z0-9._-]*\).*/\1/p' "$log" 2>/dev/null || true)
  new=$(echo "$names" | tail -n +$(($1 + 1)))
  [ -z "$new" ] || printf '%s ' $new >&2
  echo "$names" | grep -c . || true
}

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

install_torch() {
  if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    step "serve 1/3" "torch: $("$venv/bin/python" -c 'import torch; print(torch.__version__)') is there already"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    step "serve 1/3" "torch $torch_version, PyPI's CUDA build (an NVIDIA GPU is here), for Python $python_version: several GB"
    "${pip[@]}" "torch==$torch_version" || give_up "pip install torch==$torch_version"
  else
    step "serve 1/3" "torch $torch_version, CPU build (no NVIDIA GPU here), for Python $python_version: about 700 MB"
    if ! "${pip[@]}" "torch==$torch_version+cpu"; then
      say "torch==$torch_version+cpu is not to be had from pip's indexes (see above); trying $cpu_index"
      "${pip[@]}" "torch==$torch_version" --index-url "$cpu_index" || give_up \
        "pip install torch==$torch_version+cpu, then pip install torch==$torch_version --index-url $cpu_index" \
        "PyPI's default build, which bundles CUDA (several GB) and runs on a CPU too: $pip_shown torch==$torch_version"
    fi
  fi
  done_step
}

install_serve_set() {
  say "the serve set into $venv, for Python $python_version: torch, then tinyserve with what it"
  say "needs to serve (transformers, the server, tracing, the grammar engines, numba, the chat client)"
  install_torch
  step "serve 2/3" "tinyserve and its requirements but xgrammar: about 500 MB"
  "${pip[@]}" --no-deps -e .
  mapfile -t requirements < <("$venv/bin/python" "$here/requirements_of.py" tinyserve xgrammar)
  pip_shown_progress "${requirements[@]}"
  done_step
  # xgrammar asks for triton on Linux x86_64, for its CUDA kernels only: see requirements_of.py.
  step "serve 3/3" "xgrammar, without the triton (1 GB) it asks for on Linux for its CUDA kernels"
  mapfile -t xgrammar < <("$venv/bin/python" "$here/requirements_of.py" tinyserve | grep '^xgrammar')
  "${pip[@]}" --no-deps "${xgrammar[@]}"
  mapfile -t requirements < <("$venv/bin/python" "$here/requirements_of.py" xgrammar triton)
  pip_shown_progress "${requirements[@]}"
  done_step
}

install_test_set() {
  say "the test set into $venv: the test tools and the optional backends (triton, ray, mooncake)"
  # Triton: a CUDA build of torch brought the one it was built with. The CPU build has none,
  # and the kernels' tests run through Triton's interpreter: install the release that torch's
  # CUDA build of the same version pins (scripts/torch_triton_pin.py), not whichever is newest.
  step "test 1/3" "triton, the release torch's CUDA build pins (Linux x86_64): about 700 MB"
  if [ "$(uname -sm)" = "Linux x86_64" ]; then
    torch_installed=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("torch").split("+")[0])')
    triton_pin=$("$venv/bin/python" "$here/torch_triton_pin.py" "$torch_installed")
    triton_now=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("triton"))' 2>/dev/null || true)
    [ "$triton_now" = "$triton_pin" ] || "${pip[@]}" "triton==$triton_pin"
  fi
  done_step
  step "test 2/3" "the test tools, the clients the tests drive, and Ray (.[test,ray]): about 350 MB"
  pip_shown_progress -e ".[test,ray]"  # ray: the Ray backends' tests (tinyserve/distributed/)
  done_step
  # Disaggregated prefill's default connector (tinyserve/distributed/kv_transfer/transports.py): Mooncake's
  # transfer engine, the [pd] extra. It loads the system's libibverbs even over TCP (Debian's libibverbs1,
  # which .ci/run installs with the other system packages). Without either, the ZeroMQ connector is the
  # default: reported, not fatal.
  step "test 3/3" "Mooncake's transfer engine (.[pd], Linux x86_64): about 150 MB"
  if [ "$(uname -sm)" = "Linux x86_64" ]; then
    ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1' >/dev/null ||
      say "no libibverbs1 here (apt-get install libibverbs1): disaggregated prefill will use the ZeroMQ connector"
    "${pip[@]}" -e ".[pd]" || say "could not install Mooncake's transfer engine (.[pd]): disaggregated prefill will use the ZeroMQ connector"
  fi
  done_step
}

if [ "$set_name" = serve ] || ! "$venv/bin/python" -c "import torch, tinyserve" 2>/dev/null; then
  install_serve_set  # the test set goes on top of it
fi
[ "$set_name" = serve ] || install_test_set
say "the $set_name set is in $venv ($(du -sm "$venv" | cut -f1) MB), in $((SECONDS - started)) s"
