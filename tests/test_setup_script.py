"""scripts/setup.sh, when torch cannot be installed: pip's own error, then what to do.

Where no build of the asked-for torch exists for the Python at hand, the set-up used to
send pip's first error to /dev/null and show only the fallback's connection errors. A
torch release that does not exist fails the same way on every machine, GPU or not, and
fast: pip's "ERROR:" lines must be there, and the way out after them.
"""

import os
import subprocess
import sys

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
