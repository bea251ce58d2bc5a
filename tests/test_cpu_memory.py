"""cpu_memory.keep_freed_memory: the large tensors one step frees are reused by the next without page faults.

Each case runs in a process of its own (malloc's settings are the whole process's): a
"step" makes a few activations of a 2,048-token prefill's size (gate_up's output is
11 MB) and frees them, and the minor page faults of each of twenty steps are counted,
after ten more. With the heap kept, a step now and then still takes one block's worth
of fresh pages: the small blocks torch and Python allocate between the large ones are
carved from the freed holes, a hole is left one block short, and the heap grows by a
block. Which steps do it depends on the process's memory layout (on things as remote as
the length of its environment's strings): most steps fault nothing, and in 60 layouts
tried at most 4 of the 20 grew it, all in the first eight. The control pins glibc's mmap
threshold where it starts: each block then comes fresh from the kernel and goes back to
it. (Left alone, glibc moves its thresholds with what is freed, and whether a step's
blocks come back fresh then depends on the process's history: in an engine they did,
8,700-13,300 faults a prefill step; in a small probe like this one, not always.)
"""

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, resource, sys
import torch
from tinyserve.engine.worker.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    kept = keep_freed_memory()
else:  # glibc's starting mmap threshold, 128 KiB, pinned (it would move with what is freed)
    import ctypes
    kept = False
    assert ctypes.CDLL(None).mallopt(-3, 128 << 10) == 1

def step():  # large activations, alive together, all freed at the step's end
    x = torch.ones(2048, 512, dtype=torch.bfloat16)
    gate_up = torch.cat([x] * 5, dim=1)
    a, b = gate_up + 1, gate_up * 2
    return (a * b).sum()

for _ in range(10):  # the heap settles: a freed block is reused once one of its size has been freed
    step()
faults = []
for _ in range(20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": faults}))
"""
PAGES = 2048 * 2560 * 2 // 4096  # the 4 KiB pages of one of the step's largest tensors: 2,560


def probe(mode: str, **env) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={**environment, "OMP_NUM_THREADS": "1", **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_activation_is_reused_without_faulting_its_pages_in_again():
    plain, kept = probe("plain"), probe("keep")
    assert min(plain["faults"]) > PAGES // 2  # each block given back when freed: its pages fault in again
    assert kept["kept"]
    assert sorted(kept["faults"])[10] < PAGES // 20, kept  # most steps fault nothing
    assert sum(kept["faults"]) < sum(plain["faults"]) // 4, (kept, plain)  # the heap grows now and then, by a block


def test_a_users_own_malloc_settings_are_left_alone():
    assert probe("keep", MALLOC_MMAP_THRESHOLD_="131072")["kept"] is False
    assert probe("keep", GLIBC_TUNABLES="glibc.malloc.trim_threshold=131072")["kept"] is False
