"""summarize(run): a run's latencies, stages and engine load as plain-text tables.

    tinyserve trace summarize traces/my-run

prints the request metrics (TTFT, TPOT, ITL, E2E; defined in tinyserve.trace_reading.run),
each stage's latency (with n > 1, every completion's queue/prefill/decode is one
sample), per engine: requests served, steps, batch size in requests and tokens, peak
KV-cache usage and preemptions; and then the requests themselves, one line each (the id
`tinyserve trace request RUN ID` takes, endpoint, prompt/output tokens, TTFT, finish).

Steps, in the header and the engine table alike, are the steps that ran requests. An
engine also records empty steps, which only told its worker of blocks released after a
request ended (lifecycle/engine_spans.py): they are counted apart, as "empty", and are
in the stage table's tinyserve.step samples (steps + empty).
"""

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.run import Run

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile with linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = int(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    """Columns padded to their widest cell: the first `left` aligned left, the rest right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: list[str]) -> str:
        return "  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))

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


def _is_empty(step) -> bool:
    return not step.num_requests  # a step that only told the worker of released blocks


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
        busy = [s for s in steps if not _is_empty(s)]
        rows.append([f"engine {index}", str(len(requests)), str(len(busy)), str(len(steps) - len(busy)),
                     _mean_max([s.num_requests for s in busy]), _mean_max([s.num_scheduled_tokens for s in busy]),
                     peak, str(preemptions)])
    return rows


_MAX_FAILED_LISTED = 20
MAX_REQUESTS_LISTED = 30  # summarize(run, max_requests=None) lists them all (`trace summarize --all-requests`)


def endpoint(request) -> str:
    """The route the request came in by (POST /v1/chat/completions); an offline LLM's has no HTTP span."""
    if request.http_span is None:
        return f"offline {request.operation}"
    attributes = request.http_span.attributes
    return attributes.get("http.route") or attributes.get("url.path") or request.http_span.name


def _request_rows(requests) -> list[list[str]]:
    rows = []
    for r in sorted(requests, key=lambda r: r.arrival_ns):
        ttft = r.ttft_s
        prompt = r.num_prompt_tokens
        finish = ", ".join(str(reason) for reason in r.finish_reasons) or ("error" if r.error else "-")
        rows.append([r.request_id, endpoint(r), "-" if prompt is None else str(prompt), str(r.num_output_tokens),
                     "-" if ttft is None else f"{ttft * 1e3:.2f}", finish])
    return rows


def _request_table(run: Run, max_requests: int | None) -> list[str]:
    rows = _request_rows(run.requests)
    shown = rows if max_requests is None else rows[:max_requests]
    if not rows:
        return ["no requests in this run"]
    lines = [f"requests, by arrival (`tinyserve trace request {run.path} ID` shows one):",
             *_table(["id", "endpoint", "prompt", "output", "TTFT ms", "finish"], shown, left=2)]
    if len(rows) > len(shown):
        lines.append(f"... and {len(rows) - len(shown)} more (tinyserve trace summarize --all-requests lists them)")
    return lines


def model_name(manifest: dict) -> str:
    """The served name, then the model given; a run of the built-in model has no model path ("None")."""
    return manifest.get("served_model_name") or manifest.get("model") or "tinyserve-default (built in)"


def summarize(run: Run, max_requests: int | None = MAX_REQUESTS_LISTED) -> str:
    """The run's tables, then its requests (the first max_requests by arrival; None: all)."""
    requests = run.requests
    operations = {}
    for r in requests:
        operations[r.operation] = operations.get(r.operation, 0) + 1
    kinds = ", ".join(f"{count} {operation}" for operation, count in operations.items())
    failed = [r for r in requests if r.error is not None]
    lines = [
        f"run {run.name}: model {model_name(run.manifest)}, {len(requests)} requests"
        + (f" ({kinds})" if kinds else "") + f", {_step_counts(run)}, {len(run.engine_indices)} engine(s)",
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
    header = ["engine", "requests", "steps", "empty", "batch requests mean/max", "batch tokens mean/max", "KV usage peak",
              "preemptions"]
    lines += _table(header, _engine_rows(run)) if run.engine_indices else ["no engine spans in this run"]
    lines += ["", *_request_table(run, max_requests)]
    return "\n".join(lines)


def _step_counts(run: Run) -> str:
    """The engine table's steps, summed: those that ran requests, and the empty ones apart."""
    empty = sum(1 for s in run.steps if _is_empty(s))
    return f"{len(run.steps) - empty} engine steps" + (f" (+{empty} empty, releasing blocks)" if empty else "")
