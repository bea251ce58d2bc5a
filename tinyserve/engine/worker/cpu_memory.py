"""Keep the memory one step frees for the next: glibc's malloc, set once in a CPU engine's process.

torch takes a CPU tensor's memory from malloc. glibc serves a block above its mmap
threshold (128 KiB at first) with fresh pages from the kernel, and gives them back when
the block is freed; having seen such a block freed, it raises the threshold to that size
(up to 32 MiB) and serves the next ones from its heap, but it trims the heap's top, giving
it back to the kernel, whenever more than twice that is free there. A step frees all of
its activations at its end, tens of MB at 2,048 batched tokens (gate_up's output alone is
[2048, 2752] bf16, 11 MB), so the heap is trimmed after every step and the next step gets
fresh pages again; the kernel zero-fills each 4 KiB page on its first touch, a page fault
each. A matmul whose output lands in fresh pages ran 1.5-2x slower in a step than the
same matmul timed alone.

`keep_freed_memory` sets the mmap threshold to glibc's largest (32 MiB) and the trim
threshold to 1 GiB: the blocks are carved from the heap, and what a step frees stays
there for the next step. The cost: the process keeps its largest step's working set
(tens of MB at 2,048 batched tokens) between steps. Measured on the 2-core Xeon with AMX
of BENCHMARKS.md, a 2,048-token bf16 prefill step of the benchmark model: 8,700-13,300
page faults and 107-118 ms without, none and 95-102 ms with. vLLM's CPU build does the
same job differently where it finds tcmalloc (it preloads it), which keeps freed memory
in caches of its own. Whatever else the engine process allocates gains too: xgrammar
compiled a 1,500-property JSON schema in 2.2 s instead of 7.0 there.

A user's own settings win: with MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or
GLIBC_TUNABLES in the environment nothing is changed. So does a C library without
mallopt (musl).
"""

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for the mmap threshold on 64-bit machines
TRIM_THRESHOLD = 1 << 30
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_freed_memory() -> bool:
    """Set glibc's thresholds as the module docstring says; True if they were set here."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in USER_SETTINGS):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library the process already runs on
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
