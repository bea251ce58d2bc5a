"""The tests whose numbers depend on the CPU's bf16 instructions, run again as the other kind of CPU.

The suite runs as the machine's own kind; this runs the CPU kernels', packed linears',
fused elementwise steps' and parity tests once more in a new pytest process as the other
kind (tests/cpu_kinds.py says how each is made), so that both pass on any machine.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import cpu_kinds

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CPU_DEPENDENT = [
    "tests/test_cpu_attention.py",
    "tests/test_torch_attention.py",
    "tests/test_cpu_elementwise.py",
    "tests/test_rms_norm.py",
    "tests/test_packed_linear.py",
    "tests/test_model_parity.py",
    "tests/test_llm_parity.py",
    "tests/test_kv_cache_dtype.py",
]


def test_the_cpu_dependent_tests_pass_as_the_other_kind_of_cpu():
    environment = cpu_kinds.other_kind_environment()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not interpreter",
                           *CPU_DEPENDENT], cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, **environment})
    assert done.returncode == 0, f"as {environment}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
    assert " passed" in done.stdout.splitlines()[-1]


def test_the_other_kind_is_the_other_kind():
    env = {**os.environ, **cpu_kinds.other_kind_environment()}
    script = "from tests import cpu_kinds; cpu_kinds.take_the_kind_asked_for(); print(cpu_kinds.native_kind())"
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == env[cpu_kinds.KIND_VARIABLE] != cpu_kinds.native_kind()
