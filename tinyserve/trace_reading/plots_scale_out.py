"""Scale-out, read from traces: why each request went to its engine, and where a TP step's time goes.

    from tinyserve.trace_reading import plots_scale_out
    plots_scale_out.balancer_decisions(run)          the internal load balancer's rule, replayed per request
    plots_scale_out.plot_balancer_decisions(run)     what the rule saw at each send, and what it chose
    plots_scale_out.least_connections(run)           an external router's view: requests in flight per rank
    plots_scale_out.plot_tensor_parallel_steps(run)  compute and all-reduce of every rank, step by step
    plots_scale_out.trace_hops(request)              one request's spans: which process, host and rank
    plots_scale_out.api_processes_in_steps(run, 0)   --api-server-count: whose requests each engine step served
    plots_scale_out.plot_api_processes_in_steps(run, 0)

The internal balancer (frontend/dp_client.py) sends a request to the engine with the
fewest waiting requests, then the fewest running, where waiting is the engine's last
report plus what was sent to it since. Each report is the stats after one of its steps,
so the trace holds them all: the step spans' tinyserve.num_waiting / num_running, as of
the step's end. `balancer_decisions` replays the rule from them at each request's
ipc.send. Where it picks another engine than the real one, the report the balancer had
was not the one the trace shows yet: a report is on its way for a moment after the step
ends (the report's lag), and the replay cannot know which had arrived.
"""

from collections import Counter
from dataclasses import dataclass

from matplotlib.figure import Figure

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.plots import PALETTE
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.timeline import RequestTimeline


@dataclass(slots=True)
class BalancerDecision:
    request_id: str  # the engine request id
    sent_ns: int  # the start of its tinyserve.ipc.send
    engine_index: int  # where it went
    loads: dict[int, tuple[int, int]]  # per engine: (waiting as reported + sent since, running as reported)
    report_age_s: dict[int, float | None]  # per engine: how old its last report was (None: none yet)

    @property
    def replayed_engine(self) -> int:
        """The engine the rule picks from these loads: fewest waiting, then running, then the lowest index."""
        return min(self.loads, key=lambda engine: (*self.loads[engine], engine))

    @property
    def agrees(self) -> bool:
        return self.replayed_engine == self.engine_index


def balancer_decisions(run: Run) -> list[BalancerDecision]:
    """The internal balancer's choice for every engine request of a data-parallel run, replayed from its steps."""
    engines = run.engine_indices
    reports = {e: sorted((s for s in run.engine_steps(e) if s.num_waiting is not None), key=lambda s: s.end_ns)
               for e in engines}
    sends = sorted((seq.stages[schema.IPC_SEND].start_ns, seq.request_id, seq.engine_index)
                   for request in run.requests for seq in request.sequences
                   if schema.IPC_SEND in seq.stages and seq.engine_index is not None)
    decisions = []
    for number, (sent_ns, request_id, engine_index) in enumerate(sends):
        loads, ages = {}, {}
        for engine in engines:
            last = next((s for s in reversed(reports[engine]) if s.end_ns <= sent_ns), None)
            since = last.end_ns if last is not None else 0
            sent_since = sum(1 for t, _, e in sends[:number] if e == engine and t > since)
            waiting, running = (last.num_waiting, last.num_running or 0) if last is not None else (0, 0)
            loads[engine] = (waiting + sent_since, running)
            ages[engine] = None if last is None else (sent_ns - last.end_ns) / 1e9
        decisions.append(BalancerDecision(request_id, sent_ns, engine_index, loads, ages))
    return decisions


def plot_balancer_decisions(run: Run) -> Figure:
    """Per request in the order sent: each engine's load as the rule saw it, the engine chosen, the replay's misses."""
    decisions = balancer_decisions(run)
    fig = Figure(figsize=(12, 4.5), layout="constrained")
    ax = fig.subplots()
    order = range(len(decisions))
    for engine, color in zip(run.engine_indices, PALETTE):
        ax.step(order, [d.loads[engine][0] for d in decisions], where="mid", color=color,
                label=f"engine {engine}: waiting (reported + sent since)")
        ax.step(order, [d.loads[engine][1] for d in decisions], where="mid", color=color, linestyle=":",
                label=f"engine {engine}: running (reported)")
        chosen = [i for i, d in enumerate(decisions) if d.engine_index == engine]
        ax.scatter(chosen, [-0.6] * len(chosen), color=color, marker="s", s=30)
    misses = [i for i, d in enumerate(decisions) if not d.agrees]
    ax.scatter(misses, [-1.2] * len(misses), color="tab:red", marker="x", s=40,
               label="replay picks the other engine (a report in flight)")
    ax.set(title=f"Where each request went, and the loads the balancer compared, run {run.name}",
           xlabel="request, in the order sent (squares: the engine it went to)", ylabel="requests")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def least_connections(requests: list[RequestTimeline]) -> list[dict]:
    """At each request's arrival, how many requests each rank had in flight (arrived, not finished).

    An external router such as nginx's `least_conn` sees connections, not engine reports:
    requests sent to each server and not yet answered. The ranks come from the engines
    that served the requests; a rank with nothing in flight counts as 0.
    """
    served = [(r.arrival_ns, r.request_span.end_ns, r.sequences[0].engine_index)
              for r in requests if r.sequences and r.sequences[0].engine_index is not None]
    ranks = sorted({rank for *_, rank in served})
    rows = []
    for arrival, _, rank in sorted(served):
        in_flight = {k: sum(1 for a, end, e in served if e == k and a < arrival < end) for k in ranks}
        fewest = min(in_flight.values())
        rows.append({"arrival_ns": arrival, "rank": rank, "in_flight": in_flight,
                     "went_to_a_least_loaded_rank": in_flight[rank] == fewest})
    return rows


def plot_tensor_parallel_steps(run: Run, max_steps: int = 60) -> Figure:
    """Every rank's execute time per step, cut into its own compute and the time it waited in all-reduces."""
    every = [s for s in run.steps if s.ranks]
    steps = every[:max_steps]
    if not steps:
        raise ValueError(f"run {run.name} has no tensor-parallel steps (no tinyserve.execute per rank)")
    size = len(steps[0].ranks)
    fig = Figure(figsize=(12, 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / size
    for rank in range(size):
        x = [i + rank * width for i in range(len(steps))]
        waited = [s.ranks[rank]["all_reduce_s"] * 1e3 for s in steps]
        compute = [s.ranks[rank]["execute_s"] * 1e3 - w for s, w in zip(steps, waited)]
        ax.bar(x, compute, width, color=PALETTE[rank], label=f"rank {rank}: compute")
        ax.bar(x, waited, width, bottom=compute, color=PALETTE[rank], alpha=0.35, hatch="//",
               label=f"rank {rank}: in all-reduce")
    shown = f"the first {len(steps)} of {len(every)} steps" if len(steps) < len(every) else f"all {len(steps)} steps"
    ax.set(title=f"One engine over {size} tensor-parallel ranks: each step's execute, run {run.name} ({shown})",
           xlabel="engine step", ylabel="ms")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def trace_hops(request: RequestTimeline, spans) -> list[dict]:
    """The spans of one request's trace in start order: name, process, host, ranks, and times from arrival."""
    mine = sorted((s for s in spans if s.trace_id == request.trace_id), key=lambda s: s.start_ns)
    return [{"span": s.name, "service": s.service, "host": s.resource.get(schema.RESOURCE_HOST),
             "dp_rank": s.resource.get(schema.RESOURCE_DP_RANK), "tp_rank": s.resource.get(schema.RESOURCE_TP_RANK),
             "start_ms": (s.start_ns - request.arrival_ns) / 1e6, "duration_ms": s.duration_ns / 1e6}
            for s in mine]


def api_processes_in_steps(run: Run, engine_index: int = 0) -> list[dict]:
    """One row per step of an engine: how many of its requests each API process sent (by the process, its
    service, that wrote the request's span: tinyserve-api-<i> with --api-server-count)."""
    sender = {sequence.request_id: timeline.service for timeline in run.requests for sequence in timeline.sequences}
    return [{"step_id": step.step_id, "start_ms": (step.start_ns - run.origin_ns) / 1e6,
             "by_api_process": dict(sorted(Counter(sender.get(r, "unknown") for r in step.request_ids).items()))}
            for step in run.engine_steps(engine_index)]


def plot_api_processes_in_steps(run: Run, engine_index: int = 0, max_steps: int = 80) -> Figure:
    """Each step's batch on one engine, stacked by the API process that sent each request."""
    rows = [row for row in api_processes_in_steps(run, engine_index) if row["by_api_process"]][:max_steps]
    if not rows:
        raise ValueError(f"run {run.name} has no steps with requests on engine {engine_index}")
    senders = sorted({service for row in rows for service in row["by_api_process"]})
    fig = Figure(figsize=(12, 3.5), layout="constrained")
    ax = fig.subplots()
    bottom = [0] * len(rows)
    for color, service in zip(PALETTE, senders):
        counts = [row["by_api_process"].get(service, 0) for row in rows]
        ax.bar(range(len(rows)), counts, bottom=bottom, color=color, label=service)
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set(title=f"Engine {engine_index}'s steps: the requests of each batch, by the API process that sent them "
                 f"(run {run.name})", xlabel="engine step", ylabel="requests")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
