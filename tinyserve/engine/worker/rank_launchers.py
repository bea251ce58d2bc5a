"""What starts tensor-parallel ranks 1..N-1 for tensor_parallel_workers.py, by --distributed-executor-backend.

    mp   (the default) each rank a child process of the engine process, on its machine: ProcessRanks
    ray  each rank a Ray actor, in a placement group, on any node (distributed/ray_ranks.py, the Ray
         layer's launcher, handed over by the assembly)

Either way a rank runs the same `run_worker`, joins the same torch.distributed group through
rank 0's store at `host`, and comes back as something with a child process's face
(`exitcode`, `join`, `kill`, `pid`), which is all the start-up checks and the watchdog read.
"""

import os

from tinyserve.engine.child_process import ChildProcess
from tinyserve.utils import sigint_ignored


class ProcessRanks:
    """--distributed-executor-backend mp: each rank a child process of the engine, on this machine."""

    host = "127.0.0.1"

    def __init__(self) -> None:
        self.parent_pid = os.getpid()  # each rank exits when this process is gone

    def start(self, rank: int, name: str, target, kwargs: dict) -> ChildProcess:
        process = ChildProcess(target, name=name, kwargs=kwargs)
        with sigint_ignored():
            process.start()
        return process

    def shutdown(self) -> None:
        pass
