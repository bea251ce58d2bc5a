"""The engines of an API process that did not start them (`--api-server-count N`).

With several API processes the server's main process starts the engines and the API
processes beside them (cli/api_servers.py); each API process's MPClient is then one
client of engines that are not its children. This stands in for EngineProcesses there,
with the part of its interface MPClient reads: each engine's pid (from its READY
handshake) and a sentinel that becomes readable when it exits, a pidfd, which Linux
gives for any process, not only a child. So an API process notices an engine's death at
once, as a lone server does, and fails the requests it held there.

Starting, stopping and reaping the engines is the main process's: `start`, `terminate`
and `stop` do nothing here (`kill` is the engine watchdog's), and how an engine ended (its exit status) is known only there.
"""

import contextlib
import os
import select
import signal


class AttachedEngine:
    """One engine process by its pid: `sentinel`, `exitcode` and `terminate`, as ChildProcess has them."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 once it has exited (its real status is its parent's to read)."""
        readable, _, _ = select.select([self.sentinel], [], [], 0)
        return 0 if readable else None

    def terminate(self) -> None:
        """Nothing: the main process stops its engines."""

    def kill(self) -> None:
        """SIGKILL by its pidfd: the engine watchdog's, for an engine that stopped stepping (engine_watchdog.py)."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.sentinel, signal.SIGKILL)

    def close(self) -> None:
        os.close(self.sentinel)


class AttachedEngines:
    def __init__(self) -> None:
        self.processes: list[AttachedEngine] = []  # filled by on_ready, in engine position order

    def start(self, input_addresses, output_address) -> None:
        """Nothing: the main process started the engines already."""

    def on_ready(self, pids: list[int]) -> None:
        """Every engine reported ready: watch each by the pid its handshake gave."""
        self.processes = [AttachedEngine(pid) for pid in pids]

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]

    def has_exited(self, position: int) -> bool:
        return position < len(self.processes) and self.processes[position].exitcode is not None

    def exit_reason(self, position: int) -> str:
        return "exited; the server's main process has its exit status"

    def terminate(self) -> None:
        """Nothing: the main process stops its engines."""

    def stop(self) -> None:
        for process in self.processes:
            process.close()
        self.processes = []
