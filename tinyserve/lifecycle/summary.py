"""summarize(run): a run's latencies, stages and engine load as plain-text tables.

    tinyserve trace summarize traces/my-run

prints the request metrics (TTFT, TPOT, ITL, E2E; defined in tinyserve.lifecycle.run),
each stage's latency (with n > 1, every completion's queue/prefill/decode is one
sample), and per engine: requests served, steps, batch size in requests and
tokens, peak KV-cache usage and preemptions.
"""

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.run import Run

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = int(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))

    return [line(header), *(line(row) for row in rows)]


def _latency_row(label: str, seconds: list[float]) -> list[str]:
    if not seconds:
        return [label, "0"] + ["-"] * (1 + len(PERCENTILES))
    ms = [s * 1e3 for s in seconds]
    return [label, str(len(ms)), f"{sum(ms) / len(ms):.2f}", *(f"{percentile(ms, q):.2f}" for q in PERCENTILES)]


def _latency_table(rows: list[tuple[str, list[float]]], title: str) -> list[str]:
    header = [title, "count", "mean", *(f"p{q}" for q in PERCENTILES)]
    return _table(header, [_latency_row(label, values) for label, values in rows])


def _mean_max(values: list[float]) -> str:
    return f"{sum(values) / len(values):.1f} / {max(values):g}" if values else "-"


def _engine_rows(run: Run) -> list[list[str]]:
    rows = []
    for index in run.engine_indices:
        steps = run.engine_steps(index)
        requests = [s for r in run.requests for s in r.sequences if s.engine_index == index]
        usage = [s.kv_usage for s in steps if s.kv_usage is not None]
        used = [s.kv_blocks_used for s in steps if s.kv_blocks_used is not None]
        total = max((s.kv_blocks_total for s in steps if s.kv_blocks_total is not None), default=None)
        peak = f"{max(usage):.0%}" if usage else "-"
        if used and total:
            peak += f" ({max(used)}/{total} blocks)"
        preemptions = sum(len(s.preempted_request_ids) for s in steps)
        busy = [s for s in steps if s.num_requests]  # not the empty steps that only told the worker of releases
        rows.append([f"engine {index}", str(len(requests)), str(len(busy)),
                     _mean_max([s.num_requests for s in busy]), _mean_max([s.num_scheduled_tokens for s in busy]),
                     peak, str(preemptions)])
    return rows


_MAX_FAILED_LISTED = 20


def model_name(manifest: dict) -> str:
    """The served name, then the model given; a run of the built-in model has no model path ("None")."""
    return manifest.get("served_model_name") or manifest.get("model") or "tinyserve-default (built in)"


def summarize(run: Run) -> str:
    requests = run.requests
    operations = {}
    for r in requests:
        operations[r.operation] = operations.get(r.operation, 0) + 1
    kinds = ", ".join(f"{count} {operation}" for operation, count in operations.items())
    failed = [r for r in requests if r.error is not None]
    lines = [
        f"run {run.name}: model {model_name(run.manifest)}, {len(requests)} requests"
        + (f" ({kinds})" if kinds else "") + f", {len(run.steps)} engine steps, {len(run.engine_indices)} engine(s)",
        *([f"capped at {run.manifest.get('trace_max_mb')} MB: the {run.dropped_steps} oldest engine steps were "
           f"dropped"] if run.dropped_steps else []),
        f"errors: {len(failed)}",
        *(f"  {r.request_id}: {r.error}" for r in failed[:_MAX_FAILED_LISTED]),
        *([f"  ... and {len(failed) - _MAX_FAILED_LISTED} more"] if len(failed) > _MAX_FAILED_LISTED else []),
        "",
    ]
    lines += _latency_table([
        ("TTFT", [t for r in requests if (t := r.ttft_s) is not None]),
        ("TPOT", [t for r in requests if (t := r.tpot_s) is not None]),
        ("ITL", [itl for r in requests for itl in r.itls_s]),
        ("E2E", [r.e2e_s for r in requests]),
    ], "request latency (ms)")
    lines.append("")
    stage_names = (*schema.REQUEST_STAGES, schema.STEP, schema.SCHEDULE, schema.EXECUTE, schema.UPDATE)
    samples = {name: [] for name in stage_names}
    for r in requests:
        for span in r.stage_spans():
            samples[span.name].append(span.duration_s)
    for s in run.steps:
        samples[schema.STEP].append(s.duration_s)
        phases = {schema.SCHEDULE: s.schedule_s, schema.EXECUTE: s.execute_s, schema.UPDATE: s.update_s}
        for name, seconds in phases.items():
            if seconds is not None:
                samples[name].append(seconds)
    lines += _latency_table([(name, samples[name]) for name in stage_names], "stage latency (ms)")
    lines.append("")
    header = ["engine", "requests", "steps", "batch requests mean/max", "batch tokens mean/max", "KV usage peak",
              "preemptions"]
    lines += _table(header, _engine_rows(run)) if run.engine_indices else ["no engine spans in this run"]
    return "\n".join(lines)
