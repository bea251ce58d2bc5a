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


def pytest_configure(config):
    """Compile the CPU kernels into numba's disk cache once, before any test worker or server needs them.

    On a fresh checkout the cache is empty: each process then compiles them itself until one has written
    them, and the two workers' first servers, compiling side by side with their tests on two cores, took
    over two minutes to start. A worker's session server failing once fails every test after it that uses it.
    """
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the controller has compiled them
        return
    import torch

    from tinyserve.kernels import cpu_decode_attention, cpu_elementwise

    threads = torch.get_num_threads()
    cpu_elementwise.warm_up()
    cpu_decode_attention.warm_up()  # every KV-cache dtype's signature
    torch.set_num_threads(threads)  # numba's threads set it to all the cores


# The files that take longest on two busy cores (a run on a fresh clone, 2026-12-07), first, longest first: two
# workers then end together, where pytest-xdist's own order (most tests first) left one running the offline-install
# rehearsal alone at the end. The Makefile's --no-loadscope-reorder keeps this order under xdist.
LONGEST_FIRST = ["test_offline_install.py", "test_notebooks.py", "test_readme_examples.py",
                 "test_server_structured_outputs.py", "test_replay_runs.py", "test_router.py", "test_tensor_parallel.py",
                 "test_openapi_truth.py", "test_engine_process.py", "test_server_errors.py", "test_overload_and_shutdown.py",
                 "test_cpu_kinds.py", "test_trace_views.py", "test_spec_decode.py", "test_multi_node.py",
                 "test_dp_rank_loss.py"]


def pytest_collection_modifyitems(config, items):
    """Run the longest files first (a stable sort: each file's tests keep their order, the others theirs)."""
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


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


_collected_at_mb = [0]  # the process's resident size after its last full collection here


@pytest.fixture(autouse=True)
def collect_when_memory_piles_up():
    """A full collection after a test that left this process 1.5 GB bigger than the last one did. An offline LLM
    that a test dropped (or shut down) keeps its KV cache in reference cycles until the collector runs, and
    tensors do not count towards its thresholds: a file replaying a dozen runs grew a worker by 6 GB."""
    yield
    if _resident_mb() > _collected_at_mb[0] + 1536:
        import gc

        gc.collect()
        _collected_at_mb[0] = _resident_mb()


def _resident_mb() -> int:
    with open("/proc/self/statm", encoding="ascii") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20
