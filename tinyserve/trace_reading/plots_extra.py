"""More plots of one run for the walkthrough notebooks: each function returns a matplotlib Figure.

    from tinyserve.trace_reading import plots_extra
    plots_extra.plot_ttft_breakdown(run)            TTFT cut into render, IPC, queue and prefill, per request
    plots_extra.plot_step_occupancy(run)            who got how many tokens in each engine step
    plots_extra.plot_kv_pressure(run)               KV blocks in use over time, and the preemptions they caused
    plots_extra.plot_prefix_cache_hits(run)         prompt tokens served from the prefix cache, per request
    plots_extra.plot_block_tables(snapshots, n)     which request holds each physical KV block, step by step
    plots_extra.plot_engine_balance(run)            data parallel: how requests were spread over the engines

Plots that set several runs side by side are in plots_compare.py. Like plots.py,
figures use matplotlib's object API: no pyplot, no backend chosen here.
"""

import itertools

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.plots import PALETTE, STAGE_COLORS
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.ttft import TTFT_PIECES, ttft_breakdown  # ttft_breakdown: chapter 1 reads it here

# Consecutive intervals from a request's arrival to its first token (ttft.py: ttft_breakdown, the one
# breakdown chapter 1 and `tinyserve trace request` both print), each with its colour.
TTFT_SEGMENTS = dict(zip(TTFT_PIECES, ("tab:olive", "tab:green", "tab:cyan", "tab:purple", "tab:pink",
                                       STAGE_COLORS[schema.QUEUE], STAGE_COLORS[schema.PREFILL]), strict=True))


def _short(request_id: str) -> str:
    """The tail of a long request id: enough to tell requests apart on a crowded axis."""
    return request_id if len(request_id) <= 12 else "…" + request_id[-8:]


def plot_ttft_breakdown(run: Run, request_ids: list[str] | None = None, max_requests: int = 40) -> Figure:
    """One stacked bar per request (default: the first `max_requests` to arrive): its TTFT, interval by interval."""
    requests = [run.request(r) for r in request_ids] if request_ids else list(run.requests)[:max_requests]
    rows = [(r, ttft_breakdown(r)) for r in requests if r.first_token_ns is not None]
    fig = Figure(figsize=(11, 0.35 * max(len(rows), 1) + 2.2), layout="constrained")
    ax = fig.add_subplot()
    for row, (_, parts) in enumerate(rows):
        left = 0.0
        for name, seconds in parts.items():
            ax.barh(row, seconds * 1e3, left=left, color=TTFT_SEGMENTS[name], height=0.7)
            left += seconds * 1e3
    ax.set_yticks(range(len(rows)), [r.request_id for r, _ in rows])
    ax.invert_yaxis()
    ax.set(title=f"Where the time to first token goes, run {run.name}", xlabel="time since arrival (ms)",
           ylabel="request (by arrival)")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in TTFT_SEGMENTS.items()], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def _first_engine(run: Run, engine_index: int | None) -> int:
    if engine_index is not None:
        return engine_index
    return run.engine_indices[0] if run.engine_indices else 0


def plot_step_occupancy(run: Run, engine_index: int | None = None, step_range: tuple[int, int] | None = None) -> Figure:
    """A grid of engine steps (x) by requests (y): a cell per request scheduled in that step.

    Orange cells are prompt chunks (more than one token; the chunk size is written in the
    cell when few enough steps are shown), blue cells are decode steps (one token), a red x
    marks a preemption. `step_range` (first, last step id) zooms in. Requests joining and
    leaving the running batch show up as rows starting and ending mid-run.
    """
    index = _first_engine(run, engine_index)
    steps = [s for s in run.engine_steps(index)
             if step_range is None or (s.step_id is not None and step_range[0] <= s.step_id <= step_range[1])]
    order: dict[str, int] = {}
    for step in steps:
        for request_id in step.request_ids:
            order.setdefault(request_id, len(order))
    fig = Figure(figsize=(12, 0.3 * max(len(order), 1) + 2.4), layout="constrained")
    ax = fig.add_subplot()
    annotate = len(steps) <= 60
    for step in steps:
        x = step.step_id
        for request_id, tokens in zip(step.request_ids, step.num_tokens_per_request):
            color = STAGE_COLORS[schema.PREFILL] if tokens > 1 else STAGE_COLORS[schema.DECODE]
            ax.broken_barh([(x - 0.5, 1.0)], (order[request_id] - 0.4, 0.8), color=color, edgecolor="white",
                           linewidth=0.5 if annotate else 0)
            if tokens > 1 and annotate:
                ax.text(x, order[request_id], str(tokens), ha="center", va="center", fontsize="x-small")
        for request_id in step.preempted_request_ids:
            if request_id in order:
                ax.scatter([x], [order[request_id]], marker="x", color="red", s=40, zorder=3)
    names = []
    for request_id in order:
        try:
            names.append(run.request(request_id).request_id)
        except ValueError:  # a step served a request whose request span is not in the run
            names.append(request_id)
    ax.set_yticks(range(len(order)), names)
    ax.invert_yaxis()
    shown = f", steps {step_range[0]}-{step_range[1]}" if step_range else ""
    ax.set(title=f"Engine {index}: which requests each step computed, run {run.name}{shown}", xlabel="engine step",
           ylabel="request (by first step)")
    handles = [Patch(color=STAGE_COLORS[schema.PREFILL], label="prompt chunk (tokens written in the cell)"),
               Patch(color=STAGE_COLORS[schema.DECODE], label="decode (1 token)")]
    handles.append(ax.scatter([], [], marker="x", color="red", label="preempted in this step"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def plot_kv_pressure(run: Run, engine_index: int | None = None) -> Figure:
    """Top: KV blocks in use after each step, the pool size, and the steps that preempted.
    Bottom: each request queued / prefilling / decoding, with its preemptions (red triangles)."""
    index = _first_engine(run, engine_index)
    steps = [s for s in run.engine_steps(index) if s.kv_blocks_used is not None]
    requests = [r for r in run.requests if any(s.engine_index == index for s in r.sequences)]
    fig = Figure(figsize=(12, 3.5 + min(0.28 * len(requests), 12)), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[1, 2])
    origin = run.origin_ns
    times = [(s.start_ns - origin) / 1e9 for s in steps]
    top.step(times, [s.kv_blocks_used for s in steps], where="post", color="tab:blue", label="blocks in use")
    totals = [s.kv_blocks_total for s in steps if s.kv_blocks_total is not None]
    if totals:
        top.axhline(max(totals), color="black", linestyle="--", label="pool size")
    for time, step in zip(times, steps):
        if step.preempted_request_ids:
            top.axvline(time, color="red", alpha=0.5, linewidth=1)
    top.plot([], [], color="red", alpha=0.5, label="a step that preempted")
    top.set(title=f"Engine {index}: KV-cache pressure, run {run.name}", ylabel="KV blocks")
    top.set_ylim(bottom=0)
    top.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    for row, request in enumerate(requests):
        for sequence in request.sequences:
            for name, span in sequence.stages.items():
                if name in STAGE_COLORS:
                    bottom.barh(row, span.duration_s, left=(span.start_ns - origin) / 1e9, color=STAGE_COLORS[name],
                                height=0.7)
            for name, start_ns, end_ns in recompute_segments(sequence, steps):
                bottom.barh(row, (end_ns - start_ns) / 1e9, left=(start_ns - origin) / 1e9,
                            color=STAGE_COLORS[name], height=0.7)
            preempted = [(t - origin) / 1e9 for t in sequence.preemption_times_ns]
            bottom.scatter(preempted, [row] * len(preempted), marker="v", color="red", s=50, zorder=3)
    bottom.set_yticks(range(len(requests)), [r.request_id for r in requests])
    bottom.invert_yaxis()
    bottom.set(xlabel="time since the run started (s)", ylabel="request (by arrival)", title="Requests")
    handles = [Patch(color=c, label=n) for n, c in STAGE_COLORS.items()]
    handles.append(bottom.scatter([], [], marker="v", color="red", label="preempted"))
    bottom.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def recompute_segments(sequence, steps: list) -> list[tuple[str, int, int]]:
    """What a preemption adds to a request's decode span: (stage, start_ns, end_ns) pieces.

    After each preemption the request waits again (queue) until a step schedules it, then
    recomputes its prompt and the tokens it had generated (prefill: its steps carry more than
    one token), then decodes on. `steps` are the engine's step records, by start time.
    """
    segments = []
    for preempted_ns in sequence.preemption_times_ns:
        mine = [(s, n) for s in steps if s.end_ns > preempted_ns
                for rid, n in zip(s.request_ids, s.num_tokens_per_request) if rid == sequence.request_id]
        if not mine:
            continue
        resumed = mine[0][0].start_ns
        segments.append((schema.QUEUE, preempted_ns, resumed))
        chunks = [step for step, _ in itertools.takewhile(lambda pair: pair[1] > 1, mine)]
        if chunks:
            segments.append((schema.PREFILL, resumed, chunks[-1].end_ns))
    return segments


def plot_prefix_cache_hits(run: Run) -> Figure:
    """Per request: prompt tokens found in the prefix cache vs computed, and the TTFT (right axis)."""
    requests = [r for r in run.requests if r.sequences and r.num_prompt_tokens is not None]
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax = fig.add_subplot()
    x = range(len(requests))
    cached = [r.sequences[0].num_cached_tokens or 0 for r in requests]
    computed = [r.num_prompt_tokens - c for r, c in zip(requests, cached)]
    ax.bar(x, cached, color="tab:green", label="prompt tokens from the prefix cache")
    ax.bar(x, computed, bottom=cached, color="tab:orange", label="prompt tokens computed")
    ax.set_xticks(list(x), [_short(r.request_id) for r in requests], rotation=45, ha="right", fontsize="small")
    ax.set(title=f"Prefix-cache hits per request, run {run.name}", xlabel="request (by arrival)",
           ylabel="prompt tokens")
    ttft_ax = ax.twinx()
    ttft_ax.plot(list(x), [(r.ttft_s or 0) * 1e3 for r in requests], color="black", marker="o", linestyle="",
                 label="TTFT")
    ttft_ax.set_ylabel("TTFT (ms)")
    ttft_ax.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()[0] + ttft_ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.08, 1.0))
    return fig


def plot_block_tables(snapshots: list[dict[str, list[int]]], num_blocks: int, step_ids: list[int] | None = None,
                      cached_free_blocks: list[set[int]] | None = None, title: str = "Physical KV blocks") -> Figure:
    """Which request holds each physical KV block (y) after each step (x).

    `snapshots[i]` is the block tables after step i, {request_id: [block ids]} (what
    KVCacheManager.req_to_blocks holds); a block in several tables is shared (a prefix-cache
    hit). `cached_free_blocks[i]`, if given, are the free blocks that still hold a cached prefix.
    """
    requests = list(dict.fromkeys(r for tables in snapshots for r in tables))
    colors = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(requests)}
    fig = Figure(figsize=(12, min(0.16 * num_blocks + 2.2, 14)), layout="constrained")
    ax = fig.add_subplot()
    x_values = step_ids or list(range(len(snapshots)))
    for i, (x, tables) in enumerate(zip(x_values, snapshots)):
        holders: dict[int, list[str]] = {}
        for request_id, block_ids in tables.items():
            for block_id in block_ids:
                holders.setdefault(block_id, []).append(request_id)
        for block_id, owners in holders.items():
            shared = len(owners) > 1
            ax.broken_barh([(x - 0.5, 1.0)], (block_id - 0.5, 1.0), color="black" if shared else colors[owners[0]])
        for block_id in (cached_free_blocks[i] if cached_free_blocks else ()):
            ax.broken_barh([(x - 0.5, 1.0)], (block_id - 0.5, 1.0), color="lightgray")
    ax.set_ylim(num_blocks - 0.5, -0.5)
    ax.set(title=title, xlabel="engine step", ylabel="physical block id")
    handles = [Patch(color=colors[r], label=f"request {r}") for r in requests]
    handles.append(Patch(color="black", label="shared by several requests"))
    if cached_free_blocks:
        handles.append(Patch(color="lightgray", label="free, still holds a cached prefix"))
    handles.append(Patch(facecolor="white", edgecolor="gray", label="free"))
    ax.legend(handles=handles, fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_engine_balance(run: Run) -> Figure:
    """Data parallel: requests each engine served (left), and its running + waiting requests over time (right)."""
    engines = run.engine_indices or [0]
    fig = Figure(figsize=(12, 4), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[1, 3])
    served = [sum(1 for r in run.requests for s in r.sequences if s.engine_index == i) for i in engines]
    left.bar([f"engine {i}" for i in engines], served, color=PALETTE[: len(engines)])
    left.set(title="Requests per engine", xlabel="engine", ylabel="requests served")
    for i, color in zip(engines, PALETTE):
        steps = [s for s in run.engine_steps(i) if s.num_running is not None]
        times = [(s.start_ns - run.origin_ns) / 1e9 for s in steps]
        right.step(times, [s.num_running for s in steps], where="post", color=color, label=f"engine {i} running")
        right.step(times, [s.num_waiting or 0 for s in steps], where="post", color=color, linestyle=":",
                   label=f"engine {i} waiting")
    right.set(title=f"Load per engine over time, run {run.name}", xlabel="time since the run started (s)",
              ylabel="requests")
    right.legend(fontsize="small")
    return fig
