"""The engine processes themselves: start them, tell how one ended, stop them.

MPClient (core_client.py) talks to the engines over sockets; this is the part
that deals with them as operating-system processes, one per data-parallel rank,
each running engine_core_proc.run_engine_core. The i-th engine started here has
engine index first_index + i: 0..N-1 usually, R alone for a server started with
--data-parallel-rank R, a headless node's ranks from --data-parallel-start-rank on
(engine/headless.py). Its metrics, traces and process title say that index.
"""

import os
import signal

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.child_process import ChildProcess
from tinyserve.engine.engine_core_proc import run_engine_core
from tinyserve.utils import sigint_ignored

SHUTDOWN_TIMEOUT_S = 5.0  # SIGTERM, then SIGKILL after this long


class EngineProcesses:
    def __init__(self, args: EngineArgs, model_info: ModelInfo, num_engines: int, first_index: int = 0, *,
                 make_engine_core) -> None:
        """num_engines processes on this machine, serving data-parallel ranks first_index, first_index + 1, ...

        make_engine_core: what builds each engine in its process (tinyserve/assemble.py's build_engine_core,
        a module-level function: it reaches the child pickled, by name)."""
        self.args = args
        self.make_engine_core = make_engine_core
        self.model_info = model_info
        self.num_engines = num_engines
        self.first_index = first_index
        self.processes: list[ChildProcess] = []  # processes[i] serves rank first_index + i

    def start(self, input_addresses: list[str] | list[list[str]], output_address: str | list[str]) -> None:
        """Start engine first_index + i reading requests from input_addresses[i]; all write to output_address.

        With several API processes (--api-server-count) input_addresses[i] lists each one's input socket
        for engine i, and output_address each one's output socket, in client index order."""
        # A new interpreter, not a fork: a forked copy of a process with torch and ZeroMQ threads
        # can deadlock; and not multiprocessing's spawn, which imports the user's script again
        # (child_process.py). The arguments below reach the child pickled, over a pipe that only
        # the two processes hold; everything after the start goes over the sockets as msgspec.
        num_threads = None
        if self.args.torch_device.type == "cpu" and self.num_engines > 1:
            # Engines on one CPU split its cores: thread pools that overlap slow each other down.
            num_threads = max(1, (os.cpu_count() or 1) // self.num_engines)
        for engine_index, input_address in enumerate(input_addresses, start=self.first_index):
            process = ChildProcess(
                target=run_engine_core,
                name=f"tinyserve-engine-{engine_index}",
                kwargs=dict(
                    args=self.args,
                    engine_index=engine_index,
                    input_address=input_address,
                    output_address=output_address,
                    parent_pid=os.getpid(),
                    make_engine_core=self.make_engine_core,
                    model_info=self.model_info,
                    num_threads=num_threads,
                ),
            )  # ended with this interpreter, if it is still running then
            with sigint_ignored():
                process.start()
            self.processes.append(process)

    def on_ready(self, pids: list[int]) -> None:
        """Nothing: these are our children, watched from their start (frontend/attached_engines.py differs)."""

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def has_exited(self, position: int) -> bool:
        return self.processes[position].exitcode is not None

    def exit_reason(self, position: int) -> str:
        """How the engine at `position` ended ("exit code 1", "killed by SIGKILL"), reaping it first."""
        process = self.processes[position]
        process.join(timeout=0.1)  # reap it, so exitcode is known
        if process.exitcode is None:
            return "still running"
        if process.exitcode < 0:
            return f"killed by {signal.Signals(-process.exitcode).name}"
        return f"exit code {process.exitcode}"

    def terminate(self) -> None:
        """SIGTERM every engine still running: each closes its sockets, flushes its spans and exits."""
        for process in self.processes:
            if process.exitcode is None:
                process.terminate()

    def stop(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Terminate every engine and wait for it; SIGKILL one still there after timeout_s."""
        self.terminate()
        for process in self.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
                process.join()
