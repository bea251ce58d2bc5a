"""Export a run for the two trace viewers: Jaeger (JSON upload) and Perfetto (Chrome trace events).

    tinyserve trace export traces/my-run --format jaeger -o run.jaeger.json      Jaeger UI → Search → JSON File
    tinyserve trace export traces/my-run --format perfetto -o run.perfetto.json  ui.perfetto.dev → Open trace file

Jaeger shows one trace at a time: a request from the HTTP span down to its engine
stages, or one engine step. Span links (step → the requests it served) become
FOLLOWS_FROM references.

Perfetto shows the whole run on one time axis, one process track per service:

    tinyserve-api        each request is an async slice (ph b/e) with its stages nested inside
    tinyserve-engine-N   each completion's queue → prefill → decode as async slices;
                         engine steps as complete slices (ph X) with schedule/execute/update
                         inside; counter tracks (ph C) for KV blocks, KV usage, batch
                         size and the waiting/running queues
    arrows               tinyserve.ipc.send (api) → tinyserve.queue (engine): Perfetto's
                         flow events bound to the two slices (bind_id + flow_out/flow_in)

Arrows are flow-v2 fields on the slices themselves because legacy flow events
(ph s/f) bind only to thread slices (B/E/X), never to async ones.
"""

import itertools
import json
from pathlib import Path

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import Span
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.step_record import StepRecord
from tinyserve.trace_reading.timeline import process_sort_key

FORMATS = ("jaeger", "perfetto")


# ---- Jaeger ------------------------------------------------------------------------------


def _jaeger_tag(key: str, value) -> dict:
    if isinstance(value, bool):
        return {"key": key, "type": "bool", "value": value}
    if isinstance(value, int):
        return {"key": key, "type": "int64", "value": value}
    if isinstance(value, float):
        return {"key": key, "type": "float64", "value": value}
    if isinstance(value, str):
        return {"key": key, "type": "string", "value": value}
    # Jaeger tags have no list type: arrays (token ids, token times) are shown as JSON text.
    return {"key": key, "type": "string", "value": json.dumps(value, default=str)}


def _jaeger_span(span: Span, process_id: str) -> dict:
    references = []
    if span.parent_span_id:
        references.append({"refType": "CHILD_OF", "traceID": span.trace_id, "spanID": span.parent_span_id})
    references += [{"refType": "FOLLOWS_FROM", "traceID": link.trace_id, "spanID": link.span_id} for link in span.links]
    tags = [_jaeger_tag(key, value) for key, value in span.attributes.items()]
    tags.append(_jaeger_tag("span.kind", span.kind_name))
    if span.is_error:
        tags += [_jaeger_tag("error", True), _jaeger_tag("otel.status_description", span.status.message)]
    logs = [{"timestamp": event.time_ns // 1000,
             "fields": [_jaeger_tag("event", event.name), *(_jaeger_tag(k, v) for k, v in event.attributes.items())]}
            for event in span.events]
    return {"traceID": span.trace_id, "spanID": span.span_id, "operationName": span.name, "references": references,
            "startTime": span.start_ns // 1000, "duration": span.end_ns // 1000 - span.start_ns // 1000,
            "tags": tags, "logs": logs, "processID": process_id, "warnings": None, "flags": 1}


def to_jaeger(run: Run) -> dict:
    """Jaeger UI's JSON upload format: {"data": [one trace per trace id]}, times in microseconds."""
    traces: dict[str, list[Span]] = {}
    for span in run.spans:
        traces.setdefault(span.trace_id, []).append(span)
    data = []
    for trace_id, spans in traces.items():
        process_ids, resources = {}, {}
        for span in spans:
            process_ids.setdefault(span.service, f"p{len(process_ids) + 1}")
            resources.setdefault(span.service, span.resource)
        data.append({
            "traceID": trace_id,
            "spans": [_jaeger_span(span, process_ids[span.service]) for span in spans],
            "processes": {pid: {"serviceName": service, "tags": _process_tags(resources[service])}
                          for service, pid in process_ids.items()},
            "warnings": None,
        })
    return {"data": data}


def _process_tags(resource: dict) -> list[dict]:
    """The process's resource attributes but its name (host.name, its ranks), as Jaeger shows under Process."""
    return [_jaeger_tag(key, value) for key, value in resource.items() if key != "service.name"]


# ---- Perfetto (Chrome trace-event JSON) ------------------------------------------------------

STEPS_TID = 1  # the engine's step loop: its own thread track


def _nested_lanes(spans: list[Span]) -> list[list[Span]]:
    """Split spans into lanes in which every two spans either nest or do not overlap.

    Async slices with one id must nest like a call stack; a span that overlaps a
    sibling without containing it (respond outliving the request span, say) gets
    the next lane, which Perfetto draws as one more row.
    """
    lanes: list[list[Span]] = []
    open_ends: list[list[int]] = []  # per lane, the end times of the spans still open
    for span in sorted(spans, key=lambda s: (s.start_ns, -s.end_ns)):
        for lane, ends in zip(lanes, open_ends):
            while ends and ends[-1] <= span.start_ns:
                ends.pop()
            if not ends or span.end_ns <= ends[-1]:
                break
        else:
            lanes.append([])
            open_ends.append([])
            lane, ends = lanes[-1], open_ends[-1]
        lane.append(span)
        ends.append(span.end_ns)
    return lanes


def _args(attributes: dict) -> dict:
    return {key: value if isinstance(value, (bool, int, float, str, list)) else str(value)
            for key, value in attributes.items()}


class _PerfettoWriter:
    """Collects trace events; times are microseconds after the run's first span."""

    def __init__(self, run: Run) -> None:
        self.origin = run.origin_ns
        self.events: list[dict] = []
        services = sorted({span.service for span in run.spans}, key=process_sort_key)
        self.pids = {service: pid for pid, service in enumerate(services, 1)}
        for service, pid in self.pids.items():
            self.events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": service}})
            self.events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                                "args": {"sort_index": pid}})
        for service in sorted({s.span.service for s in run.steps}, key=process_sort_key):
            self.events.append({"ph": "M", "name": "thread_name", "pid": self.pids[service], "tid": STEPS_TID,
                                "args": {"name": "engine steps"}})

    def us(self, time_ns: int) -> float:
        return (time_ns - self.origin) / 1000

    def async_slices(self, spans: list[Span], track_id: str, flows: dict[str, dict]) -> None:
        """Each lane: b/e pairs in stack order, span events as instants (ph n) on the same track."""
        for number, lane in enumerate(_nested_lanes(spans)):
            common = {"cat": "request", "id": f"{track_id}/{number}"}
            stack: list[Span] = []
            for span in lane:
                while stack and stack[-1].end_ns <= span.start_ns:
                    self._end(stack.pop(), common)
                pid = self.pids[span.service]
                self.events.append({"ph": "b", "name": span.name, "pid": pid, "tid": 0, "ts": self.us(span.start_ns),
                                    **common, "args": _args({**span.attributes, "span_id": span.span_id}),
                                    **flows.get(span.span_id, {})})
                self.events += [{"ph": "n", "name": e.name, "pid": pid, "tid": 0, "ts": self.us(e.time_ns), **common,
                                 "args": _args(e.attributes)} for e in span.events]
                stack.append(span)
            while stack:
                self._end(stack.pop(), common)

    def _end(self, span: Span, common: dict) -> None:
        self.events.append({"ph": "e", "name": span.name, "pid": self.pids[span.service], "tid": 0,
                            "ts": self.us(span.end_ns), **common})

    def step(self, record: StepRecord, phases: list[Span]) -> None:
        """The step and its schedule/execute/update as complete slices, and its counters."""
        span = record.span
        pid = self.pids[span.service]
        for s in (span, *phases):
            self.events.append({"ph": "X", "name": s.name, "cat": "step", "pid": pid, "tid": STEPS_TID,
                                "ts": self.us(s.start_ns), "dur": s.duration_ns / 1000, "args": _args(s.attributes)})
        counters = {
            "KV cache blocks": {"used": record.kv_blocks_used, "total": record.kv_blocks_total},
            "KV cache usage": {"usage": record.kv_usage},
            "batch requests": {"prefill": record.num_prefill_requests, "decode": record.num_decode_requests},
            "batch tokens": {"prefill": record.num_prefill_tokens, "decode": record.num_decode_tokens},
            "scheduler queues": {"waiting": record.num_waiting, "running": record.num_running},
        }
        for name, values in counters.items():
            values = {key: value for key, value in values.items() if value is not None}
            if values:
                self.events.append({"ph": "C", "name": name, "pid": pid, "tid": STEPS_TID, "ts": self.us(span.start_ns),
                                    "args": values})


def _flows(requests) -> dict[str, dict]:
    """span id → the flow fields that draw an arrow from each completion's ipc.send to its queue."""
    flows = {}
    flow_ids = itertools.count(1)
    for request in requests:
        for sequence in request.sequences:
            send, queue = sequence.stages.get(schema.IPC_SEND), sequence.queue
            if send is not None and queue is not None:
                flow_id = next(flow_ids)
                flows[send.span_id] = {"bind_id": flow_id, "flow_out": True}
                flows[queue.span_id] = {"bind_id": flow_id, "flow_in": True}
    return flows


def to_perfetto(run: Run) -> dict:
    """Chrome trace-event JSON: {"traceEvents": [...], "displayTimeUnit": "ms"}, times in microseconds."""
    writer = _PerfettoWriter(run)
    traces: dict[str, list[Span]] = {}
    children: dict[str, list[Span]] = {}
    for span in run.spans:  # by start time
        traces.setdefault(span.trace_id, []).append(span)
        if span.parent_span_id:
            children.setdefault(span.parent_span_id, []).append(span)
    flows = _flows(run.requests)
    step_traces = {s.span.trace_id for s in run.steps}
    for trace_id, spans in traces.items():
        if trace_id in step_traces:
            continue
        # One track group per process, and in an engine one per completion (n > 1 runs them side by side).
        tracks: dict[str, list[Span]] = {}
        for span in spans:
            track = f"{trace_id}/{span.service}"
            if span.name in schema.ENGINE_STAGES:
                track += f"/{span.attributes.get(schema.REQUEST_ID, '')}"
            tracks.setdefault(track, []).append(span)
        for track_id, group in tracks.items():
            writer.async_slices(group, track_id, flows)
    for record in run.steps:
        writer.step(record, children.get(record.span.span_id, []))
    return {"traceEvents": writer.events, "displayTimeUnit": "ms",
            "otherData": {"run": run.name, "origin_unix_nano": run.origin_ns}}


def write_export(run: Run, format: str, path: str | Path) -> Path:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    document = to_jaeger(run) if format == "jaeger" else to_perfetto(run)
    path = Path(path)
    path.write_text(json.dumps(document), encoding="utf-8")
    return path
