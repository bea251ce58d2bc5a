"""How many CPU threads the forward pass uses: all the engine's cores, fewer while it cannot have them.

torch runs each op of the forward pass on a team of OpenMP threads (libgomp), one per
core the engine was given. Every op ends at a barrier: the team waits for its slowest
thread, spinning. A decode step of the ~27M-parameter model is some 400 such ops.

On a machine shared with other programs, a thread of the team is often off its core,
waiting for its time slice behind someone else's process, and every op waits for it.
The cost is not the share of the core that was lost but a multiple of it. Measured on
the 2-core machine BENCHMARKS.md describes, beside two busy processes in another
session, in generated tokens per second:

    2 threads   37 tok/s  (0.65 CPU seconds per wall second)
    1 thread   142 tok/s  (0.67)

The team got two-thirds of one core either way, and two threads used it four times
worse than one. transformers' generate falls the same way (37 against 96), so this is
not tinyserve's own: it is what spinning at a barrier costs when a core is taken away.

The governor watches what each execute got: the process's CPU seconds per wall second
of the forward pass. A team of T threads that owns its cores uses about T (waiting
threads spin, and spinning counts), so falling well short of T is the sign of cores
taken away. Then it gives up a thread, down to one. With fewer
threads than cores it tries one more now and then (a probe, two steps long: on a busy
machine those are slow steps) and keeps it if the team got its cores; a failed probe
waits twice as long for the next one, up to MAX_PROBE_INTERVAL_S. On a quiet machine it
does not move, except for a model so small that torch splits none of its ops: then the
other threads sleep, the team uses one CPU second a second, and one thread is all it
needed anyway.

A thread is given up only after two windows in a row fell short, by more than three
quarters of a core. On a quiet 2-core VM a single window sometimes does: the hypervisor
holds a core back for a moment (no steal time is reported inside the VM), or a stretch
of small ops lets a thread sleep. Measured there, bf16, with the machine otherwise idle,
one window at 1.49 CPU seconds a second cost a thread for the 2.2 s until the next probe,
a third of a 7 s run at one thread: a moment of the machine's turned into seconds of the
engine's, one source of the run-to-run swings BENCHMARKS.md measures. A core taken by
another program stays taken (one CPU second a second, or less, for two threads), so
the second window costs a busy machine 0.2 s.

A burst, after idle. The governor judges windows of steps, so it cannot see the first
step after the engine was idle. When a burst of requests arrives, the engine starts a
step as soon as the first one reaches it, while the API process is still taking in the
others (parsing, validating, tokenizing: ~2 ms of CPU each, 70-110 ms for 64 of them on
the 2-core machine). That step's team then shares its cores with the API process: traced,
a 128-token fp32 prefill took 118 ms there against 38 ms offline, and every request behind
it waited that long for its own prefill. So an engine in a process of its own watches the
process that feeds it requests (its parent, the API process: `watch_feeder`): a step after
IDLE_S without an execute, while the feeder is on a CPU, runs on one thread fewer, leaving
it a core. In the same burst traced again, that step took 55 ms and the next one, 16
prompts, began 62 ms sooner. What it gains depends on how far the intake has got when
the step ends (the next step takes what has arrived); in alternating rounds of 64-request
bursts the median time to first token moved 1-4 % sooner. A lone request finds its feeder
asleep (it has sent the request and waits), so it keeps every thread. A step run at a
count other than the governor's is not one the governor judges.

The engine applies the count with torch.set_num_threads before each execute (a setting of
the whole process: two LLMs in one process each set their own; the caller's torch code
gets whatever the last step used). EngineArgs.cpu_threads fixes the count instead (a
benchmark that must compare like with like).
"""

import contextlib
import time
from dataclasses import dataclass

import torch

WINDOW_S = 0.2  # wall time of execute to average over before deciding
MIN_STEPS = 3  # nor fewer steps than this
PROBE_STEPS = 2  # a probe's window: two steps, however short (a failed one costs little)
SHORTFALL = 0.75  # T threads using less than T - 0.75 CPU seconds a second: cores were taken away
SHORT_WINDOWS_TO_DROP = 2  # ...in this many windows in a row (one alone is a moment of the machine's)
FIRST_PROBE_INTERVAL_S = 2.0  # wall time in execute before trying one more thread
MAX_PROBE_INTERVAL_S = 16.0
IDLE_S = 0.05  # no execute for this long: the next step is the first of what arrives now


def process_is_running(pid: int) -> bool:
    """Whether process `pid`'s main thread is on a CPU or waiting for one now (state R in
    /proc/<pid>/stat); False where there is no /proc or no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return False
    state = text[text.rindex(b")") + 2:].split(b" ", 1)[0]  # after the name, which may hold spaces and ")"
    return state == b"R"


class ThreadGovernor:
    """Decides the forward pass's thread count from what each execute got; see the module's docstring."""

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.threads = max_threads  # what the next execute should run with
        self._steps = 0
        self._wall = 0.0
        self._cpu = 0.0
        self._probing_from: int | None = None  # the count to go back to if the probe fails
        self._probe_interval = FIRST_PROBE_INTERVAL_S
        self._since_probe = 0.0  # wall time in execute since the last probe or drop
        self._short_windows = 0  # windows in a row that fell short, since the last change
        self.changes: list[tuple[float, int, float]] = []  # (time.time(), new count, CPU per wall that moved it)
        self.feeder_pid: int | None = None  # the process that sends this engine its requests (watch_feeder)
        self._last_end = float("-inf")  # time.monotonic() when the last execute ended

    def watch_feeder(self, pid: int) -> None:
        """Leave process `pid` a core in the first step after idle while it runs (the module's docstring)."""
        self.feeder_pid = pid

    def threads_for_next_step(self) -> int:
        """The count the next execute runs with: the governor's, or one fewer for the first step
        after idle while the feeder is taking in a burst."""
        if (self.threads > 1 and self.feeder_pid is not None and time.monotonic() - self._last_end >= IDLE_S
                and process_is_running(self.feeder_pid)):
            return self.threads - 1
        return self.threads

    def observe(self, wall_s: float, cpu_s: float, threads: int | None = None) -> None:
        """One execute took wall_s seconds, in which the process used cpu_s seconds of CPU, on `threads`
        threads (None: the governor's count). A step run at another count is not judged."""
        self._last_end = time.monotonic()
        if threads is not None and threads != self.threads:
            return
        self._steps += 1
        self._wall += wall_s
        self._cpu += cpu_s
        self._since_probe += wall_s
        if self._probing_from is not None:
            if self._steps < PROBE_STEPS:
                return
        elif self._wall < WINDOW_S or self._steps < MIN_STEPS:
            return
        usage = self._cpu / self._wall
        self._steps, self._wall, self._cpu = 0, 0.0, 0.0
        self._decide(usage)

    def _decide(self, usage: float) -> None:
        got_its_cores = usage >= self.threads - SHORTFALL
        if self._probing_from is not None:  # the probe's window is over
            back_to, self._probing_from = self._probing_from, None
            if got_its_cores:
                self._probe_interval = FIRST_PROBE_INTERVAL_S
            else:
                self._probe_interval = min(2 * self._probe_interval, MAX_PROBE_INTERVAL_S)
                self._change(back_to, usage)
            self._since_probe = 0.0
            return
        self._short_windows = 0 if got_its_cores else self._short_windows + 1
        if self._short_windows >= SHORT_WINDOWS_TO_DROP and self.threads > 1:
            self._change(self.threads - 1, usage)
            self._since_probe = 0.0
        elif self.threads < self.max_threads and self._since_probe >= self._probe_interval:
            self._probing_from = self.threads
            self._change(self.threads + 1, usage)

    def _change(self, threads: int, usage: float) -> None:
        self.threads = threads
        self._short_windows = 0
        self.changes.append((time.time(), threads, usage))


_cores_found: int | None = None


def engine_cores() -> int:
    """The thread count torch had when this process's first engine started: the engine's cores.

    Later engines in the same process (the offline LLM, built again) start from it too,
    not from whatever count the previous engine's governor left behind.
    """
    global _cores_found
    if _cores_found is None:
        _cores_found = torch.get_num_threads()
    return _cores_found


class ExecuteThreads:
    """The forward pass's CPU threads around one execute: `with threads.running() as used:`.

    Sets torch's thread count before it (the governor's, or the fixed --cpu-threads; None
    leaves torch alone: a GPU, or a tensor-parallel rank that keeps its share), and after
    it tells the governor what the execute got. `used` holds the count and the process's
    CPU seconds during the execute, for the step's record.
    """

    def __init__(self, governor: ThreadGovernor | None, fixed: int | None) -> None:
        self.governor = governor
        self.fixed = fixed

    @contextlib.contextmanager
    def running(self):
        threads = self.governor.threads_for_next_step() if self.governor is not None else self.fixed
        if threads is not None and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        used = ThreadsUsed(threads)
        wall_before, cpu_before = time.time(), time.process_time()
        yield used
        used.cpu_s = time.process_time() - cpu_before
        if self.governor is not None:
            self.governor.observe(time.time() - wall_before, used.cpu_s, threads)


@dataclass(slots=True)
class ThreadsUsed:
    threads: int | None
    cpu_s: float = 0.0
