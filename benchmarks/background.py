"""Busy background processes for compare.py's --contend, and keeping child processes from outliving us.

A learner's laptop is rarely idle while a benchmark runs: a browser tab runs scripts,
an editor indexes the project, a notebook kernel crunches an array. A busy process here
stands for one such program: a separate Python interpreter that keeps one core busy
with a mix of what those programs do, in turns of about 50 ms each:

    pure Python    building and sorting small dicts and strings (an interpreter's work:
                   branchy, allocation-heavy, little memory traffic)
    compute        a 256×256 float32 matmul in numpy on one thread (dense arithmetic,
                   the caches and the vector units)
    memory         copying a 32 MB array (more than a last-level cache slice: memory
                   bandwidth, which a batched decode needs too)

Each one is single-threaded (BLAS held to one thread), so K busy processes take about K
cores' worth of time from whatever else runs. They start at the niceness of the process
that starts them (nice -n 19 on compare.py applies to them too), each in a session of its
own, as another program would be: Linux's scheduler (with autogroup, the default) shares
the cores fairly between sessions before it shares them between threads.

busy_processes(K) starts K of them and kills them when its block ends, by error or
Ctrl-C included; die_with_parent, run in each child before it starts, has the kernel
kill the child if its parent dies first (a kill -9 of compare.py leaves nothing behind).
"""

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None  # loaded here, not in the forked child


def die_with_parent() -> None:
    """In a child process, before exec: ask Linux to send SIGKILL when the parent dies (elsewhere: nothing)."""
    if LIBC is not None:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def python_turn(seconds: float) -> None:
    """Interpreter work: small dicts and strings, built, sorted, thrown away."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        words = {f"key{i * 7919 % 1000}": str(i) * 3 for i in range(200)}
        n += len(sorted(words, key=lambda k: words[k]))


def compute_turn(seconds: float, a, b) -> None:
    """Dense arithmetic: 256×256 float32 matmuls on one thread."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ b


def memory_turn(seconds: float, src, dst) -> None:
    """Memory bandwidth: copy a 32 MB array over and over."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        dst[:] = src


def busy_loop() -> None:
    """Run the three turns in a row forever (until killed)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a, b = rng.random((256, 256), dtype=np.float32), rng.random((256, 256), dtype=np.float32)
    src = rng.random(8 << 20, dtype=np.float32)  # 32 MB
    dst = np.empty_like(src)
    while True:
        python_turn(0.05)
        compute_turn(0.05, a, b)
        memory_turn(0.05, src, dst)


ONE_THREAD = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}


@contextlib.contextmanager
def busy_processes(k: int) -> Iterator[list[subprocess.Popen]]:
    """K busy processes for the length of the block; all killed (and waited for) when it ends."""
    processes = []
    try:
        for _ in range(k):
            processes.append(subprocess.Popen([sys.executable, __file__], env={**os.environ, **ONE_THREAD},
                                              stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
                                              start_new_session=True))
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


if __name__ == "__main__":
    busy_loop()
