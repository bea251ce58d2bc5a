"""scripts/setup.sh, when torch cannot be installed: pip's own error, then what to do.

Where no build of the asked-for torch exists for the Python at hand, the set-up used to
send pip's first error to /dev/null and show only the fallback's connection errors. A
torch release that does not exist fails the same way on every machine, GPU or not, and
fast: pip's "ERROR:" lines must be there, and the way out after them.

It also installs, beside a CPU build of torch, the triton release that torch's CUDA
build pins: the interpreter the kernels' tests run through is then the GPU's release.
"""

import importlib.metadata
import os
import subprocess
import sys

import pytest

from tests.pythons import ROOT


def test_a_failing_torch_install_prints_pips_error_and_a_next_step(tmp_path):
    env = {**os.environ, "TINYSERVE_PYTHON": sys.executable, "TINYSERVE_TORCH_VERSION": "0.0.0", "PIP_RETRIES": "0"}
    command = ["bash", str(ROOT / "scripts" / "setup.sh"), str(tmp_path / "venv")]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert result.returncode == 1
    messages = result.stderr
    assert "ERROR:" in messages and "torch==0.0.0" in messages  # pip's own words
    assert "setup: could not install torch 0.0.0" in messages
    assert messages.index("ERROR:") < messages.index("setup: could not install")
    assert "TINYSERVE_TORCH_VERSION=" in messages and "TINYSERVE_PYTHON=" in messages
    assert not (tmp_path / "venv" / "bin" / "tinyserve").exists()  # it stopped before installing tinyserve


@pytest.mark.slow
def test_the_environments_triton_is_the_release_its_torch_pins():
    # torch's CPU build requires no triton; setup.sh installs the one its CUDA build pins.
    import torch

    version = torch.__version__.split("+")[0]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "torch_triton_pin.py"), version],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == importlib.metadata.version("triton")
