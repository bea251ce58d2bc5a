"""The engine watchdog: an engine that holds requests and says nothing for too long is failed, named, and killed.

An engine process that dies is noticed at once (its sentinel, core_client.py). One that is
alive but does not step breaks nothing the front end would notice: stopped (SIGSTOP, a
debugger), frozen, swapped out, or stuck inside a step. Its requests would wait for ever,
every stream open, and /health would say ok.

While an engine has requests its loop sends something at least every ENGINE_HEARTBEAT_S:
a step's outputs, or a heartbeat when the step had nothing to say (a grammar compiling, a
KV transfer awaited; engine_core_proc.py). So the gap between two of its messages is at
most one step, and an engine this front end has requests on that has sent nothing for
`timeout_s` (`--engine-iteration-timeout`, vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S, whose
V0 engine loop failed the same way) is not stepping. The watchdog then fails it as if it
had died (core_client.MPClient._mark_dead: its requests end with a 503 naming the stall,
/health follows, the server stops or keeps alive as its flags say) and SIGKILLs its
process, which reaches a stopped or stuck one too, so that nothing it held (memory, a
GPU) stays taken. An engine on a headless node is failed, not killed: it is its node's.

A tick that comes late (this event loop was held, this process was descheduled, or the whole
server was stopped and continued) must not be taken for the engine's silence, in two ways:
- the engines' messages may be waiting, unread, on the socket: a stall seen on a late tick is
  named only if it is still there on the next tick, after the loop has had its turn to read;
- the engine may have been stopped with us and be mid-step: a silence is forgiven its longest
  late tick. Only the longest, not each one: on a busy machine where most ticks are late,
  forgiving each left a tick only poll_s of silence to count, however long it took, so a
  stopped engine went unnamed for as long as the ticks kept coming late (at 8 s apart, over a
  minute for an 8 s bound). Forgiving one gap bounds it: an engine silent from t is named by
  t + timeout + the longest gap + two ticks, however late each comes.

What the bound must allow is the longest step: a prefill of the whole --max-num-batched-tokens
budget on a slow machine, which benchmarks/longest_step.py times (BENCHMARKS.md: tens of
seconds for a 0.5B model on a busy 2-core CPU). The default, 300 s, is vLLM's own bound on one
step (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS). The bounds inside a step are tighter and name the
rank: --tensor-parallel-watchdog-timeout.
"""

import asyncio
import collections
import time
from collections.abc import Callable

from tinyserve.engine.worker.tp_watchdog import rank_state
from tinyserve.wire.ipc import ENGINE_HEARTBEAT_S

LATE_TICK_S = 1.0  # a tick later than this may have left messages unread, or found the engines stopped with us


class EngineWatchdog:
    def __init__(self, timeout_s: float, start_index: int) -> None:
        """timeout_s: 0 turns it off; start_index: the engine index of the client's first engine."""
        if 0 < timeout_s < 2 * ENGINE_HEARTBEAT_S:
            raise ValueError(f"engine_iteration_timeout_s must be 0 (off) or at least {2 * ENGINE_HEARTBEAT_S:g}: "
                             f"a busy engine's heartbeat comes every {ENGINE_HEARTBEAT_S:g} s, got {timeout_s}")
        self.timeout_s = timeout_s
        self.start_index = start_index
        self.poll_s = min(1.0, timeout_s / 4)
        self.quiet_since: dict[int, float] = {}  # engine index -> its last message, or when it got work after none
        self.forgiven: dict[int, float] = {}  # engine index -> the longest late tick of its silence: ours, not its
        self._busy: set[int] = set()
        self._past: set[int] = set()  # the engines past the timeout at the last tick
        self._last_tick: float | None = None
        self._task: asyncio.Task | None = None

    def heard(self, engine_index: int) -> None:
        """A message came from this engine (its outputs or its heartbeat)."""
        self.quiet_since[engine_index] = time.monotonic()
        self.forgiven[engine_index] = 0.0

    def start(self, in_flight: dict[str, int], processes: Callable[[], list],
              on_stall: Callable[[int, str], None]) -> None:
        """in_flight: the client's request id -> engine index; processes(): its local engines' processes, by
        position; on_stall(engine index, reason): fail that engine's requests."""
        if self.timeout_s > 0:
            self._task = asyncio.create_task(self._watch(in_flight, processes, on_stall), name="engine-watchdog")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self, in_flight: dict[str, int], processes: Callable[[], list],
                     on_stall: Callable[[int, str], None]) -> None:
        self._last_tick = time.monotonic()
        while True:
            await asyncio.sleep(self.poll_s)
            for index, count, quiet in self.stalled(collections.Counter(in_flight.values()), time.monotonic()):
                position = index - self.start_index
                local = processes()
                process = local[position] if position < len(local) else None
                on_stall(index, self.reason(quiet, count, process))
                if process is not None:
                    process.kill()  # SIGKILL: a stopped or stuck process goes too, and frees what it held

    def stalled(self, busy: collections.Counter, now: float) -> list[tuple[int, int, float]]:
        """One tick: (engine index, its requests in flight, seconds quiet) of each engine with work that has been
        quiet past the timeout. busy: engine index -> requests in flight there."""
        late = 0.0 if self._last_tick is None else now - self._last_tick - self.poll_s
        self._last_tick = now
        if late > LATE_TICK_S:
            for index, since in self.quiet_since.items():  # no more than its silence: it may have spoken since
                self.forgiven[index] = max(self.forgiven.get(index, 0.0), min(late, now - since))
        for index in busy.keys() - self._busy:  # work after none: the engine's silence counts from now
            self.quiet_since[index], self.forgiven[index] = now, 0.0
        self._busy = set(busy)
        quiet = {index: now - self.quiet_since[index] - self.forgiven.get(index, 0.0) for index in busy}
        past = {index for index in busy if quiet[index] > self.timeout_s}
        named = past if late <= LATE_TICK_S else past & self._past  # late: what waits unread is read by the next
        self._past = past
        return [(index, busy[index], quiet[index]) for index in busy if index in named]

    def reason(self, quiet_s: float, count: int, process) -> str:
        pid = getattr(process, "pid", None)  # a Ray actor's on another node: none to read
        where = f"; its process {pid} is {rank_state(process)}" if pid is not None else ""
        killed = ", so it was killed" if process is not None else ""
        return (f"it stopped answering: nothing came from it for {quiet_s:.1f} s while it held {count} request(s) "
                f"(--engine-iteration-timeout {self.timeout_s:g} s{where}){killed}")
