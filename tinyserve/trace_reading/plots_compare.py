"""Plots that set several runs side by side: each function returns a matplotlib Figure.

    from tinyserve.trace_reading import plots_compare
    plots_compare.plot_latency_by_run(runs)         TTFT / TPOT / ITL distributions, one box per run
    plots_compare.plot_stage_comparison(runs)       mean time per stage, one bar per run
    plots_compare.plot_completion_cdf(runs)         share of the requests finished over time, one line per run
    plots_compare.plot_run_comparison(runs)         steps, tokens per step, run time, TTFT and TPOT, per run

`runs` is a dict {label: Run}, in the order the boxes, bars and lines should appear.
The last two also count in engine steps (clock="steps"): exact, and what time follows on
a GPU, where a step costs about the same whatever its batch.
Like plots.py, figures use matplotlib's object API: no pyplot, no backend chosen here.
"""

import bisect

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.plots import PALETTE
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.timeline import RequestTimeline


def _latencies(run: Run, metric: str) -> list[float]:
    if metric == "itl":
        return [itl * 1e3 for r in run.requests for itl in r.itls_s]
    values = (getattr(r, f"{metric}_s") for r in run.requests)
    return [v * 1e3 for v in values if v is not None]


_METRIC_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token", "itl": "Inter-token latency",
                  "e2e": "End-to-end latency"}


def plot_latency_by_run(runs: dict[str, Run], metrics: tuple[str, ...] = ("ttft", "tpot", "itl")) -> Figure:
    """One panel per metric (ttft, tpot, itl, e2e), one box per run: median, quartiles, whiskers at p5/p95."""
    unknown = [m for m in metrics if m not in _METRIC_TITLES]
    if unknown:
        raise ValueError(f"metrics must be among {sorted(_METRIC_TITLES)}, got {unknown}")
    fig = Figure(figsize=(4.2 * len(metrics), 4), layout="constrained")
    for ax, metric in zip(fig.subplots(1, len(metrics), squeeze=False)[0], metrics):
        data = [_latencies(run, metric) or [float("nan")] for run in runs.values()]
        ax.boxplot(data, tick_labels=list(runs), whis=(5, 95), showmeans=True, flierprops={"markersize": 2})
        ax.set(title=_METRIC_TITLES[metric], xlabel="run", ylabel=f"{metric.upper()} (ms)")
        ax.tick_params(axis="x", labelsize="small")
    key = "median (line), mean (triangle); box p25-p75, whiskers p5-p95"
    fig.legend(handles=[Patch(color="tab:orange", label=key)], loc="outside lower center", fontsize="small")
    return fig


def plot_stage_comparison(runs: dict[str, Run]) -> Figure:
    """Mean time per request in each stage, one bar per run, on a log axis (stages span µs to seconds)."""
    stages = [name for name in schema.REQUEST_STAGES
              if any(name in (s.name for s in r.stage_spans()) for run in runs.values() for r in run.requests)]
    fig = Figure(figsize=(11, 0.22 * len(stages) * max(len(runs), 1) + 2.0), layout="constrained")
    ax = fig.add_subplot()
    height = 0.8 / max(len(runs), 1)
    for i, ((label, run), color) in enumerate(zip(runs.items(), PALETTE)):
        means = []
        for name in stages:
            samples = [span.duration_s * 1e3 for r in run.requests for span in r.stage_spans() if span.name == name]
            means.append(sum(samples) / len(samples) if samples else 0.0)
        ax.barh([row - 0.4 + (i + 0.5) * height for row in range(len(stages))], means, height=height, color=color,
                label=label)
    ax.set_yticks(range(len(stages)), stages)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set(title="Mean time per stage", xlabel="mean time per request (ms, log scale)", ylabel="stage")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _run_span_ns(run: Run) -> tuple[int, int]:
    """First arrival and last request end of the run."""
    spans = [r.request_span for r in run.requests]
    return min(s.start_ns for s in spans), max(s.end_ns for s in spans)


def _steps_until(run: Run, times_ns: list[int]) -> list[int]:
    """For each time, how many engine steps (of all engines) had started by then."""
    starts = sorted(s.start_ns for s in run.steps)
    return [bisect.bisect_right(starts, t) for t in times_ns]


def plot_completion_cdf(runs: dict[str, Run], clock: str = "time") -> Figure:
    """The share of requests finished (solid) and given their first token (dotted), one line per run.

    clock="time": seconds since each run's first arrival. clock="steps": engine steps since
    the run's first step — what batching saves on a GPU, where a step costs about the same
    whatever the size of its batch (on a CPU a step's time grows with its tokens).
    """
    if clock not in ("time", "steps"):
        raise ValueError(f"clock must be 'time' or 'steps', got {clock!r}")
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.add_subplot()
    for (label, run), color in zip(runs.items(), PALETTE):
        if not run.requests:
            continue
        start, _ = _run_span_ns(run)
        count = len(run.requests)
        curves = (("finished", "-", [r.request_span.end_ns for r in run.requests]),
                  ("first token", ":", [r.first_token_ns for r in run.requests if r.first_token_ns is not None]))
        for what, style, times in curves:
            xs = sorted(_steps_until(run, times) if clock == "steps" else [(t - start) / 1e9 for t in times])
            ax.step([0, *xs], [i / count for i in range(len(xs) + 1)], where="post", color=color, linestyle=style,
                    label=f"{label}: {what}")
    xlabel = {"steps": "engine steps since the run's first step", "time": "time since the first request arrived (s)"}
    ax.set(title="Requests served over time", xlabel=xlabel[clock], ylabel="share of the requests")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    return fig


def _mean(values) -> float:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else 0.0


def _run_time_s(run: Run) -> float:
    start, end = _run_span_ns(run)
    return (end - start) / 1e9


def _ttft_steps(run: Run, request: RequestTimeline) -> int | None:
    """Engine steps that started between the request's arrival and its first token, on its engine."""
    first = request.first_token_ns
    if first is None:
        return None
    steps = run.engine_steps(request.engine_index) if request.engine_index is not None else run.steps
    starts = sorted(s.start_ns for s in steps)
    return bisect.bisect_right(starts, first) - bisect.bisect_left(starts, request.arrival_ns)


def _busy(run: Run) -> list:
    """The steps that scheduled work: not the empty ones that only told the worker of released requests."""
    return [step for step in run.steps if step.num_requests]


def _largest_decode_step(run: Run) -> int:
    """The most tokens in a step that also decoded: a decoding request waits for all of them."""
    return max((step.num_scheduled_tokens for step in run.steps if 1 in step.num_tokens_per_request), default=0)


_COMPARISONS = {  # clock -> {(title, y label): the value of one run}
    "time": {
        ("Engine steps", "steps"): lambda run: len(_busy(run)),
        ("Tokens per step", "mean tokens scheduled"): lambda run: _mean(s.num_scheduled_tokens for s in _busy(run)),
        ("Run time", "first arrival → last finish (s)"): _run_time_s,
        ("Mean TTFT", "TTFT (ms)"): lambda run: _mean(r.ttft_s for r in run.requests) * 1e3,
        ("Mean TPOT", "TPOT (ms)"): lambda run: _mean(r.tpot_s for r in run.requests) * 1e3,
    },
    "steps": {
        ("Engine steps", "steps"): lambda run: len(_busy(run)),
        ("Tokens per step", "mean tokens scheduled"): lambda run: _mean(s.num_scheduled_tokens for s in _busy(run)),
        ("Mean TTFT, in steps", "steps from arrival to first token"):
            lambda run: _mean(_ttft_steps(run, r) for r in run.requests),
        ("Largest decode step", "most tokens in a step that decodes"): _largest_decode_step,
    },
}


def plot_run_comparison(runs: dict[str, Run], clock: str = "time") -> Figure:
    """Side by side, one bar per run: engine steps and tokens per step, then

    clock="time": run time, mean TTFT and mean TPOT, in seconds and milliseconds as measured;
    clock="steps": TTFT counted in engine steps, and the largest step a decoding request
    was part of — on a GPU, where a step costs a fixed overhead plus a share per token,
    that step is the longest wait between two output tokens. Step counts are exact and
    repeat from run to run; measured times vary with what else the machine is doing.
    """
    if clock not in _COMPARISONS:
        raise ValueError(f"clock must be 'time' or 'steps', got {clock!r}")
    panels = _COMPARISONS[clock]
    fig = Figure(figsize=(3 * len(panels), 3.6), layout="constrained")
    colors = PALETTE[: len(runs)]
    for ax, ((title, ylabel), value) in zip(fig.subplots(1, len(panels)), panels.items()):
        ax.bar(list(runs), [value(run) for run in runs.values()], color=colors)
        ax.set(title=title, xlabel="run", ylabel=ylabel)
        ax.tick_params(axis="x", labelsize="small", rotation=30)
    return fig
