"""The offline install, rehearsed: wheels downloaded here, installed with no index beside a GPU image's torch.

scripts/rehearse_offline_install.sh plays the GPU server on this CPU: an environment of
Python 3.12 holding torch and what such images carry, none of tinyserve's other
dependencies; the wheels of scripts/offline_wheels.sh installed into it with no index;
then benchmarks/gpu_check.py --smoke, end to end, in it; then `tinyserve serve` from it,
answering /health and a completion and exiting 0 on SIGTERM (tens of seconds more).

Cost, measured on a 2-core machine: the image (torch with its CUDA libraries, ~5 GB)
takes about 3 minutes to make, once per machine: it is cached outside the checkout
(~/.cache/tinyserve) and only ever read, because installing torch for every run would
be most of the test. The rest runs every time: the wheels (~90 MB, ~50 s, seconds once
pip's cache holds them), the fresh environment and the offline install (~35 s), the
smoke run (~60 s). About 2.5 minutes then, so it is marked slow; `make test` runs it.
"""

import os
import re
import subprocess

import pytest

from tests.pythons import ROOT, find_pythons
from tests.required_tools import missing
from tests.test_gpu_check import check_smoke_run

TARGET = "3.12"  # the Python of the GPU images this rehearses


def rehearsal_python() -> str:
    python = find_pythons().get(TARGET)
    if python is None:
        missing(f"no Python {TARGET} on this machine for the offline-install rehearsal")
    return python


@pytest.mark.slow
@pytest.mark.timeout(1500)  # a fresh machine first makes the image: minutes of downloads, beside the other worker's tests
def test_an_offline_install_beside_the_images_torch_runs_the_gpu_check_smoke_and_tinyserve_serve(tmp_path):
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["TINYSERVE_REHEARSAL_PYTHON"] = rehearsal_python()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "rehearse_offline_install.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "rehearsal: torch and triton untouched" in done.stderr

    wheels = sorted(path.name for path in (tmp_path / "wheels").iterdir())
    assert any(name.startswith("tinyserve-") for name in wheels)
    assert any(name.startswith("msgspec-") and "cp312" in name for name in wheels)  # built for the target
    assert not [name for name in wheels if name.startswith(("torch-", "triton-"))]
    installed = {path.name.split("-")[0].lower() for path in
                 (tmp_path / "venv" / "lib" / f"python{TARGET}" / "site-packages").glob("*.dist-info")}
    assert {"tinyserve", "msgspec", "pyzmq", "opentelemetry_sdk", "fastapi"} <= installed
    assert not installed & {"torch", "triton", "numpy", "transformers"}  # the image's own, kept
    check_smoke_run(done.stdout, tmp_path / "gpu-check")
    # then the server a newcomer starts, from that fresh environment: it answered, and exited 0 on SIGTERM
    assert re.search(r"rehearsal: tinyserve serve answered '.+' and exited 0", done.stderr), done.stderr[-3000:]
