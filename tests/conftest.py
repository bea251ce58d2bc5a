"""Shared test set-up: the environment, and the one shared server.

TRITON_INTERPRET must be set before any @triton.jit function is created, so it is
set here, before tinyserve's kernels can be imported. HF_HUB_OFFLINE keeps
transformers from trying the network for a name it does not find locally.

The markers server, notebook, interpreter and slow are described in pyproject.toml;
`make test-fast` runs the tests that carry none of them.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests import cpu_kinds  # noqa: E402

cpu_kinds.take_the_kind_asked_for()  # tests/test_cpu_kinds.py runs some modules again as the other kind of CPU

from tests import shared_server  # noqa: E402
from tinyserve.testing import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def server():
    """One `tinyserve serve` of the tiny Llama (tests/shared_server.py), shared by every test that asks for it.

    Tests on it leave it as they found it: idle, every KV block free. They may not
    assume a fresh server: counters are read as differences, the log is searched for
    their own request.
    """
    proc = ServerProcess(shared_server.model_folder(), *shared_server.FLAGS)
    yield proc
    proc.stop()
