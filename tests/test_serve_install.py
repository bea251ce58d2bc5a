"""`make serve`'s set (scripts/setup.sh serve): what serving needs, and no test tool or optional backend.

Installing it for real takes 2 to 6 minutes on this project's 2-core machine (torch alone is
700 MB to unpack; the README gives the figures), too long for a test, so this resolves it instead,
as the set-up does, step for step: tinyserve installed without its requirements into a fresh
environment, its requirements listed by scripts/requirements_of.py less xgrammar, xgrammar's less
triton; then pip resolves them (`--dry-run --report`, metadata only) and the test reads what it
would install. About 80 s on two busy cores, most of it pip reading the package index: marked slow.
"""

import json
import re
import subprocess
import sys

import pytest

from tests.pythons import ROOT

pytestmark = pytest.mark.slow

SERVING = {"transformers", "tokenizers", "safetensors", "fastapi", "uvicorn", "pyzmq", "msgspec",
           "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http", "llguidance", "numba", "openai",
           "matplotlib", "prometheus-client", "apache-tvm-ffi"}
# The test set and the extras: `make test` or `pip install 'tinyserve[...]'` brings them.
NOT_SERVING = {"triton", "ray", "mooncake-transfer-engine-non-cuda", "pytest", "pytest-timeout", "anthropic",
               "schemathesis", "ipykernel", "nbclient", "nbformat", "langchain-openai", "peft", "psutil",
               "jsonschema", "opentelemetry-proto-json", "cmake", "ninja"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def run(*command: str, cwd=ROOT) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def test_the_serve_set_is_what_serving_needs_and_no_test_tool_or_extra(tmp_path):
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv))
    python = str(venv / "bin" / "python")
    pip = (python, "-m", "pip", "install", "--quiet", "--no-compile")
    run(*pip, "--no-deps", "-e", ".")  # tinyserve alone, as scripts/setup.sh's step 2 begins
    run(*pip, "--no-deps", *[line for line in run(python, "scripts/requirements_of.py", "tinyserve").split()
                             if line.startswith("xgrammar")])
    # torch left out: step 1 installs it first, from the CPU index, and pip must not fetch another build here.
    requirements = run(python, "scripts/requirements_of.py", "tinyserve", "xgrammar", "torch").split()
    requirements += run(python, "scripts/requirements_of.py", "xgrammar", "triton", "torch").split()
    assert not [line for line in requirements if canonical(line).startswith(("xgrammar", "triton"))]

    report = tmp_path / "report.json"
    run(*pip, "--dry-run", "--ignore-installed", "--report", str(report), *requirements)
    resolved = {canonical(item["metadata"]["name"]) for item in json.loads(report.read_text())["install"]}
    assert SERVING <= resolved
    assert not resolved & NOT_SERVING, sorted(resolved & NOT_SERVING)
