"""A watchdog over the tensor-parallel ranks: a rank that stops answering fails the engine, naming it.

A rank that dies breaks the next collective on the others (its sockets close), and the
step raises. A rank that is alive but does not answer (stopped with SIGSTOP, swapped out,
stuck in a kernel or a deadlock) breaks nothing: rank 0 waits in `all_reduce` for the
process group's timeout (minutes), no token is produced, and /health still says ok.

Rank 0 waits for the others only inside all_reduce, and between two all_reduces a rank does
one layer's work: so one all_reduce that has waited `timeout_s` (the engine's
`tensor_parallel_watchdog_s`, `--tensor-parallel-watchdog-timeout`, default 30 s, 0: off)
means a rank is not coming. The watchdog thread then names the ranks it can see are not
running (stopped, dead), kills ranks 1..N-1, and so turns the hang into the failure a dead
rank is: rank 0's collective raises, TensorParallelRunner re-raises with the watchdog's
message, and the engine fails its requests; a server's engine-death path takes over
(/health fails, the server exits or keeps alive as its flags say). vLLM bounds a whole
step the same way (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s by default); a bound on one
collective can be much tighter, since no collective waits for a whole step's work.

The engine loop pays two clock reads per all_reduce (GroupTimer.waiting_since); the thread
looks a few times per timeout.
"""

import logging
import signal
import threading
import time

logger = logging.getLogger("tinyserve.engine")


class CollectiveWatchdog:
    def __init__(self, timer, processes: list, timeout_s: float) -> None:
        """timer: the group's GroupTimer (its waiting_since); processes: ranks 1..N-1, in order."""
        self.timer = timer
        self.processes = processes
        self.timeout_s = timeout_s
        self.fired: str | None = None  # the message, once the watchdog has acted
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tp-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll_s):
            since = self.timer.waiting_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._act(time.monotonic() - since)
                return

    def _act(self, waited_s: float) -> None:
        states = {rank: rank_state(process) for rank, process in enumerate(self.processes, start=1)}
        silent = [f"rank {rank} ({state})" for rank, state in states.items() if state != "running"]
        who = ", ".join(silent) if silent else f"one of ranks 1..{len(self.processes)} (all still running)"
        self.fired = (f"tensor-parallel {who} did not answer: rank 0 waited {waited_s:.0f} s in one all_reduce "
                      f"(--tensor-parallel-watchdog-timeout {self.timeout_s:g} s); the ranks were killed")
        logger.error("%s", self.fired)
        for process in self.processes:
            if process.exitcode is None:
                process.kill()  # SIGKILL reaches a stopped process too: its sockets close, the collective fails


def rank_state(process) -> str:
    """"running", "stopped" (SIGSTOP, a debugger), "dead (…)" or what /proc says, for the message."""
    if getattr(process, "reason", None):  # a Ray actor's handle says how it ended (actor_process.py)
        return f"dead, {process.reason}"
    if process.exitcode is not None:
        code = process.exitcode
        return f"dead, {'killed by ' + signal.Signals(-code).name if code < 0 else f'exit code {code}'}"
    try:
        with open(f"/proc/{process.pid}/stat", encoding="ascii") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]  # the field after the command's name
    except (OSError, IndexError):
        return "running"  # no /proc (macOS): nothing more to tell
    return {"T": "stopped", "t": "stopped", "Z": "dead", "D": "in uninterruptible I/O"}.get(state, "running")
