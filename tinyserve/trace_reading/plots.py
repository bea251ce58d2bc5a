"""Plots of a loaded run, for notebooks: each function takes a Run and returns a matplotlib Figure.

    from tinyserve.trace_reading import load_run, plots
    run = load_run("traces/my-run")
    plots.plot_request_waterfall(run)          one request's stages on a time axis, colored by process
    plots.plot_latency_histograms(run)         TTFT and TPOT distributions
    plots.plot_batch_composition(run)          prefill vs decode tokens (and requests) in each engine step
    plots.plot_kv_usage(run)                   KV-cache blocks in use over time, per engine
    plots.plot_stage_breakdown(run)            mean time per stage
    plots.plot_requests_timeline(run)          every request as a row: queue, prefill, decode

Figures are built with matplotlib's object API (no pyplot, no global state, no
backend chosen here): a notebook displays them, `fig.savefig(...)` writes them.
"""

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.summary import percentile
from tinyserve.trace_reading.timeline import RequestTimeline, process_sort_key

STAGE_COLORS = {schema.QUEUE: "tab:gray", schema.PREFILL: "tab:orange", schema.DECODE: "tab:blue"}
# One color per request, run or engine, in order.
PALETTE = [f"tab:{c}" for c in ("blue", "orange", "green", "red", "purple", "brown", "pink", "olive", "cyan")]


def _process_colors(services) -> dict[str, str]:
    """API/offline first, then the engines: one color each, stable across plots."""
    palette = ["tab:green", "tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:brown", "tab:pink", "tab:olive"]
    ordered = sorted(set(services), key=process_sort_key)
    return {service: palette[i % len(palette)] for i, service in enumerate(ordered)}


# Legends go right of the axes, where they never cover a line.
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.08, 1.0), "fontsize": "small"}
OFF_SCALE = 4  # a limit more than this many times the data's peak is named in the legend, not drawn


def _limit_line(ax, limit: float, peak: float, label: str, color: str) -> float:
    """A dashed line at a limit (a token budget, a pool size), or only a legend entry when drawing
    it would squash the data (a light run's 1-token decodes under a 2048-token budget).
    Returns the top the y axis needs to show the data and the line, if drawn."""
    if limit <= OFF_SCALE * max(peak, 1):
        ax.axhline(limit, color=color, linestyle="--", label=f"{label}: {limit:g}")
        return limit * 1.05
    ax.plot([], [], color=color, linestyle="--", label=f"{label}: {limit:g} (above the axis)")
    return max(peak, 1) * 1.15


def _empty(ax, title: str, xlabel: str, ylabel: str, message: str) -> None:
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)


def _pick_request(run: Run, request_id: str | None) -> RequestTimeline:
    if request_id is not None:
        return run.request(request_id)
    if not run.requests:
        raise ValueError(f"run {run.name} has no requests to plot")
    return run.requests[0]


def plot_request_waterfall(run: Run, request_id: str | None = None) -> Figure:
    """One request (default: the first to arrive) from HTTP to the last byte: one bar per span."""
    request = _pick_request(run, request_id)
    stage_order = {name: i for i, name in enumerate(schema.REQUEST_STAGES)}
    stages = sorted(request.stage_spans(), key=lambda s: (stage_order[s.name], s.start_ns))
    spans = [s for s in (request.http_span, request.request_span) if s is not None] + stages
    completion_of = {span.span_id: i for i, sequence in enumerate(request.sequences) for span in sequence.stages.values()}
    origin = spans[0].start_ns
    colors = _process_colors(s.service for s in spans)
    fig = Figure(figsize=(12, 0.45 * len(spans) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    labels = []
    for row, span in enumerate(spans):
        several = span.span_id in completion_of and len(request.sequences) > 1
        labels.append(f"{span.name} [completion {completion_of[span.span_id]}]" if several else span.name)
        start, length = (span.start_ns - origin) / 1e6, span.duration_ns / 1e6
        ax.barh(row, length, left=start, color=colors[span.service], height=0.6)
        # the duration next to the bar: sub-millisecond stages are invisible at this scale
        ax.text(start + length, row, f" {length:.2f} ms", va="center", fontsize="x-small")
        if span.name == schema.DECODE:
            times = [(t - origin) / 1e6 for t in span.attributes.get(schema.TOKEN_TIMES, [])]
            ax.scatter(times, [row] * len(times), marker="|", color="black", s=80, zorder=3)
        for event in span.events:
            marker = "v" if event.name == schema.EVENT_PREEMPTED else "|"
            ax.scatter([(event.time_ns - origin) / 1e6], [row], marker=marker, color="red", s=60, zorder=3)
    ax.set_yticks(range(len(spans)), labels)
    ax.invert_yaxis()
    ax.margins(x=0.12)  # room for the last duration label
    ttft = f"{request.ttft_s * 1e3:.1f} ms" if request.ttft_s is not None else "n/a"
    ax.set(xlabel="time since the request's first span (ms)", ylabel="span",
           title=f"Request {request.request_id}\nits stages over time: TTFT {ttft}, E2E {request.e2e_s * 1e3:.1f} ms")
    handles = [Patch(color=color, label=service) for service, color in colors.items()]
    handles += [Line2D([], [], marker="|", color="black", linestyle="", label="output token"),
                Line2D([], [], marker="|", color="red", linestyle="", label="span event (prefill chunk, preemption)")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig


def _histogram(ax, values_ms: list[float], title: str, xlabel: str) -> None:
    if not values_ms:
        _empty(ax, title, xlabel, "requests", "no data")
        return
    ax.hist(values_ms, bins=min(30, max(5, len(values_ms) // 2)), color="tab:blue", alpha=0.8, label="requests")
    for q, style in ((50, "-"), (90, "--"), (99, ":")):
        ax.axvline(percentile(values_ms, q), color="black", linestyle=style, label=f"p{q}")
    ax.set(title=f"{title} ({len(values_ms)} requests)", xlabel=xlabel, ylabel="requests")
    ax.legend(fontsize="small")


def plot_latency_histograms(run: Run) -> Figure:
    """TTFT (arrival → first token) and TPOT (mean gap between output tokens), one histogram each."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    left, right = fig.subplots(1, 2)
    ttfts = [t * 1e3 for r in run.requests if (t := r.ttft_s) is not None]
    tpots = [t * 1e3 for r in run.requests if (t := r.tpot_s) is not None]
    _histogram(left, ttfts, "Time to first token", "TTFT (ms)")
    _histogram(right, tpots, "Time per output token", "TPOT (ms)")
    fig.suptitle(f"Request latency distributions, run {run.name}")
    return fig


def plot_batch_composition(run: Run, engine_index: int | None = None) -> Figure:
    """Per engine step: prefill and decode tokens stacked (left axis), requests in the batch (right axis)."""
    engines = [engine_index] if engine_index is not None else run.engine_indices or [0]
    fig = Figure(figsize=(11, 3.5 * len(engines)), layout="constrained")
    for ax, index in zip(fig.subplots(len(engines), 1, squeeze=False)[:, 0], engines):
        steps = run.engine_steps(index)
        title = f"Engine {index}: what each step computed"
        if not steps:
            _empty(ax, title, "engine step", "tokens scheduled", "no steps")
            continue
        x = [s.step_id if s.step_id is not None else i for i, s in enumerate(steps)]
        prefill = [s.num_prefill_tokens for s in steps]
        ax.bar(x, prefill, color="tab:orange", label="prefill tokens", width=1.0)
        decode = [s.num_decode_tokens for s in steps]
        ax.bar(x, decode, bottom=prefill, color="tab:blue", label="decode tokens", width=1.0)
        budgets = [s.token_budget for s in steps if s.token_budget is not None]
        if budgets:
            ax.set_ylim(0, _limit_line(ax, max(budgets), max(p + d for p, d in zip(prefill, decode)), "token budget",
                                       "black"))
        ax.set(title=title, xlabel="engine step", ylabel="tokens scheduled")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        requests_ax = ax.twinx()
        requests_ax.plot(x, [s.num_requests for s in steps], color="tab:green", marker=".", label="requests in batch")
        requests_ax.set_ylabel("requests in batch")
        requests_ax.set_ylim(bottom=0)
        requests_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        handles = ax.get_legend_handles_labels()[0] + requests_ax.get_legend_handles_labels()[0]
        ax.legend(handles=handles, **LEGEND_OUTSIDE)
    fig.suptitle(f"Batch composition per engine step, run {run.name}")
    return fig


def plot_kv_usage(run: Run) -> Figure:
    """KV-cache blocks in use after each step, per engine, with the pool size as a dashed line."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax = fig.add_subplot()
    title = "KV-cache blocks in use per engine"
    xlabel, ylabel = "time since the run started (s)", "KV blocks in use"
    plotted, top = False, 1.0
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for color, index in zip(palette, run.engine_indices):
        steps = [s for s in run.engine_steps(index) if s.kv_blocks_used is not None]
        if not steps:
            continue
        times = [(s.start_ns - run.origin_ns) / 1e9 for s in steps]
        used = [s.kv_blocks_used for s in steps]
        ax.step(times, used, where="post", color=color, label=f"engine {index} used")
        totals = [s.kv_blocks_total for s in steps if s.kv_blocks_total is not None]
        if totals:
            top = max(top, _limit_line(ax, max(totals), max(used), f"engine {index} pool", color))
        top = max(top, max(used) * 1.15)
        plotted = True
    if not plotted:
        _empty(ax, title, xlabel, ylabel, "no KV-cache data in the step spans")
        return fig
    ax.set(title=f"{title}, run {run.name}", xlabel=xlabel, ylabel=ylabel)
    ax.set_ylim(0, top)
    ax.legend(**LEGEND_OUTSIDE)
    return fig


def plot_stage_breakdown(run: Run) -> Figure:
    """Mean time spent in each stage (every completion's engine stages count with n > 1), with p90."""
    samples = {name: [] for name in schema.REQUEST_STAGES}
    for request in run.requests:
        for span in request.stage_spans():
            samples[span.name].append(span.duration_s * 1e3)
    names = [name for name in schema.REQUEST_STAGES if samples[name]]
    fig = Figure(figsize=(9, 0.45 * max(len(names), 1) + 1.8), layout="constrained")
    ax = fig.add_subplot()
    title, xlabel, ylabel = f"Time per stage, run {run.name}", "time (ms)", "stage"
    if not names:
        _empty(ax, title, xlabel, ylabel, "no stage spans")
        return fig
    means = [sum(samples[n]) / len(samples[n]) for n in names]
    p90s = [percentile(samples[n], 90) for n in names]
    ax.barh(names, means, color="tab:blue", label="mean")
    ax.scatter(p90s, names, color="black", marker="x", zorder=3, label="p90")
    ax.invert_yaxis()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.legend(fontsize="small")
    return fig


def plot_requests_timeline(run: Run) -> Figure:
    """Every request as a row over the run: in the API (light), queued, prefilling, decoding."""
    requests = list(run.requests)
    fig = Figure(figsize=(11, min(0.3 * len(requests) + 1.8, 20)), layout="constrained")
    ax = fig.add_subplot()
    title = f"Requests over time, run {run.name}"
    xlabel, ylabel = "time since the run started (ms)", "request (by arrival)"
    if not requests:
        _empty(ax, title, xlabel, ylabel, "no requests")
        return fig
    for row, request in enumerate(requests):
        span = request.request_span
        ax.barh(row, span.duration_ns / 1e6, left=(span.start_ns - run.origin_ns) / 1e6, color="tab:green",
                alpha=0.25, height=0.8)
        # With n > 1 the row is split in n thin lanes, one per completion.
        height = 0.8 / max(len(request.sequences), 1)
        for lane, sequence in enumerate(request.sequences):
            for name, stage in sequence.stages.items():
                if name not in STAGE_COLORS:  # ipc.send: too short to see at this scale
                    continue
                ax.barh(row - 0.4 + (lane + 0.5) * height, stage.duration_ns / 1e6, height=height,
                        left=(stage.start_ns - run.origin_ns) / 1e6, color=STAGE_COLORS[name])
    readable = len(requests) <= 40  # beyond that the ids would overlap
    ax.set_yticks(range(len(requests)), [r.request_id if readable else "" for r in requests])
    ax.invert_yaxis()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    handles = [Patch(color="tab:green", alpha=0.25, label="request span (API)")]
    handles += [Patch(color=color, label=name) for name, color in STAGE_COLORS.items()]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return fig
