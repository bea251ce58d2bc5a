"""Data parallel: which engine gets the next request (stage ④, before the send).

With `--data-parallel-size N` there are N engines, each with its own scheduler
and KV cache, and nothing is shared between them. The client sends each new
request to the least loaded engine, as vLLM's DPLB client does: fewest waiting
requests, then fewest running ones, where "waiting" is what the engine last
reported plus the requests sent to it since that report. The second term is what
spreads a burst: the engines cannot report in between, so without it every
request of the burst would go to the same engine.

With `--data-parallel-size N --data-parallel-rank R` a server runs engine R alone
and a load balancer outside (nginx, Envoy, a Kubernetes gateway) spreads the
requests over the N servers: vLLM's external load balancing. Such a server has
nothing to choose; its engine still says "engine R" in metrics and traces.
"""

from collections.abc import Callable

from tinyserve.frontend.engine_client import EngineDeadError
from tinyserve.wire.messages import SchedulerStats


def check_engine_range(data_parallel_size: int, start_index: int) -> None:
    """An engine client's engines: data_parallel_size of them, from engine start_index."""
    if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
        raise ValueError(f"data_parallel_size must be at least 1, got {data_parallel_size}")
    if not isinstance(start_index, int) or start_index < 0:
        raise ValueError(f"start_index must be a non-negative integer, got {start_index}")


def data_parallel_engine_indices(data_parallel_size: int, data_parallel_rank: int | None, in_process: bool) -> range:
    """The indices of the engines this front end runs: all of 0..size-1, or the one rank given."""
    if data_parallel_rank is None:
        return range(1) if in_process else range(data_parallel_size)
    if in_process:
        raise ValueError("data_parallel_rank needs engine processes (in_process=False)")
    if data_parallel_size < 2:
        raise ValueError(f"data_parallel_rank needs data_parallel_size of at least 2, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data_parallel_rank must be in [0, {data_parallel_size}), got {data_parallel_rank}")
    return range(data_parallel_rank, data_parallel_rank + 1)


class DPLoadBalancer:
    """Picks the least loaded live engine. A rank that died (mark_dead) is never chosen again, so
    the live ones take every new request; the client refuses requests before asking once none lives."""

    def __init__(self, num_engines: int) -> None:
        self.stats = [SchedulerStats() for _ in range(num_engines)]  # latest report per engine
        self.sent_since_report = [0] * num_engines
        self.dead: set[int] = set()  # positions of the engines that died

    def choose_engine(self, exclude: set[int] = frozenset()) -> int:
        """The least loaded live engine (not one of `exclude`: those found unreachable just now)."""
        def load(index: int) -> tuple[int, int]:
            stats = self.stats[index]
            return (stats.num_waiting_reqs + self.sent_since_report[index], stats.num_running_reqs)

        live = [index for index in range(len(self.stats)) if index not in self.dead and index not in exclude]
        if not live:
            raise RuntimeError("no live engine to choose")
        return min(live, key=load)

    def send_to_least_loaded(self, send: Callable[[int], None]) -> int:
        """send(position) to the least loaded live engine; returns its position. One whose connection is gone
        (send raises EngineDeadError: a node that died, its heartbeats not yet missed) was sent nothing,
        so the next least loaded takes the request; with none left, the error is raised."""
        unreachable: set[int] = set()
        while True:
            position = self.choose_engine(exclude=unreachable)
            try:
                send(position)
                return position
            except EngineDeadError:
                unreachable.add(position)
                if len(unreachable | self.dead) >= len(self.stats):
                    raise

    def mark_dead(self, engine_index: int) -> None:
        self.dead.add(engine_index)

    def on_request_sent(self, engine_index: int) -> None:
        self.sent_since_report[engine_index] += 1

    def on_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        # A request sent after the engine made this report but before it arrived
        # is forgotten until the next report, one step later (vLLM does the same).
        self.stats[engine_index] = stats
        self.sent_since_report[engine_index] = 0
