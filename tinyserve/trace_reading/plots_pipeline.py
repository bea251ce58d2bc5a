"""Pipeline parallelism, read from traces: each stage's busy and idle time, and the bubble between.

    from tinyserve.trace_reading import plots_pipeline
    plots_pipeline.stage_intervals(run)        per stage: (step, start, wait end, end) of every batch it ran
    plots_pipeline.pipeline_bubble(run)        per stage: its compute, its wait for the stage before, its idle time
    plots_pipeline.plot_pipeline(run)          the stages as rows on one time axis, a colour per batch

Under --pipeline-parallel-size each step span has one tinyserve.execute per rank of each stage
(tinyserve.pp.stage), and tinyserve.pp.recv_wait_time_s says how much of its start the rank spent
waiting for the previous stage's hidden states; the rest is its own layers. A stage is idle
between its batches: that, and the waits, is the pipeline's bubble.
"""

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from tinyserve.trace_reading.plots import PALETTE
from tinyserve.trace_reading.run import Run


def stage_intervals(run: Run) -> dict[int, list[tuple[int, int, int, int]]]:
    """Per stage (its first tensor-parallel rank): (step_id, start_ns, end of its wait, end_ns) per batch, in order."""
    stages: dict[int, list] = {}
    for step in run.steps:
        for rank in step.ranks:
            if "stage" in rank and rank["rank"] == 0:
                wait_end = rank["start_ns"] + int(rank["recv_wait_s"] * 1e9)
                stages.setdefault(rank["stage"], []).append((step.step_id, rank["start_ns"], wait_end, rank["end_ns"]))
    if not stages:
        raise ValueError(f"run {run.name} has no pipeline-parallel steps (no tinyserve.pp.stage on its executes)")
    return {stage: sorted(rows, key=lambda row: row[1]) for stage, rows in sorted(stages.items())}


def pipeline_bubble(run: Run) -> dict[int, dict[str, float]]:
    """Per stage, over the span from the first batch's start to the last batch's end on any stage: seconds
    computing, waiting for the previous stage, and idle (no batch at all), and the bubble, the share
    of the span not computing."""
    intervals = stage_intervals(run)
    first = min(rows[0][1] for rows in intervals.values())
    last = max(rows[-1][3] for rows in intervals.values())
    span_s = (last - first) / 1e9
    result = {}
    for stage, rows in intervals.items():
        compute = sum(end - wait_end for _, _, wait_end, end in rows) / 1e9
        wait = sum(wait_end - start for _, start, wait_end, _ in rows) / 1e9
        result[stage] = {"compute_s": compute, "wait_s": wait, "idle_s": span_s - compute - wait,
                         "bubble": 1 - compute / span_s, "batches": len(rows)}
    return result


def plot_pipeline(run: Run, first_step: int = 0, num_steps: int = 12) -> Figure:
    """The stages as rows: each batch a colour, solid while the stage computes it, hatched while it waits
    for the stage before; a white gap is the stage idle. num_steps batches from the first_step-th."""
    intervals = stage_intervals(run)
    steps = sorted({row[0] for rows in intervals.values() for row in rows})[first_step:first_step + num_steps]
    colour = {step: PALETTE[i % len(PALETTE)] for i, step in enumerate(steps)}
    origin = min(row[1] for rows in intervals.values() for row in rows if row[0] in colour)
    fig = Figure(figsize=(12, 1.2 + 0.8 * len(intervals)), layout="constrained")
    ax = fig.subplots()
    for stage, rows in intervals.items():
        for step, start, wait_end, end in rows:
            if step not in colour:
                continue
            ms = lambda ns: (ns - origin) / 1e6  # noqa: E731
            ax.broken_barh([(ms(start), ms(wait_end) - ms(start))], (stage - 0.35, 0.7), facecolors="white",
                           edgecolors=colour[step], hatch="//", linewidth=0.5)
            ax.broken_barh([(ms(wait_end), ms(end) - ms(wait_end))], (stage - 0.35, 0.7), facecolors=colour[step])
            ax.text((ms(wait_end) + ms(end)) / 2, stage, str(step), ha="center", va="center", fontsize=7)
    ax.set_yticks(list(intervals), [f"stage {stage}" for stage in intervals])
    ax.invert_yaxis()
    ax.set(xlabel="ms from the first batch shown", title=f"{len(intervals)} pipeline stages, batches "
           f"{steps[0]}–{steps[-1]} (numbered by step), run {run.name}")
    ax.legend(handles=[Patch(facecolor="grey", label="computing its layers"),
                       Patch(facecolor="white", edgecolor="grey", hatch="//", label="waiting for the stage before")],
              fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
