"""A span exporter that appends OTLP/JSON lines to a file.

This is the OpenTelemetry Collector's file format: each line is one
ExportTraceServiceRequest in OTLP/JSON (proto3's JSON mapping of the OTLP
protobuf messages, with the two exceptions OTLP makes: trace and span ids are
hex strings, not base64, and enums are integers). So:

    64-bit integers    -> decimal strings      "startTimeUnixNano": "1700000000000000000"
    ids                -> lowercase hex        "traceId": "5b8efff798038103d269b633813fc60c"
    enums              -> integers             "kind": 2   (SPAN_KIND_SERVER)
    default values     -> left out             no "parentSpanId" on a root span
    NaN, +-infinity    -> "NaN", "Infinity", "-Infinity"

The spans are rendered straight from the SDK's ReadableSpan into that JSON.
Going through the official protobuf encoder and protobuf's MessageToDict gives
the same lines (a test checks it on every kind of value) but costs several times
more CPU, and the exporter shares the CPU with the engine it is tracing.
"""

import base64
import math
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# Span.flags bits (OTLP SpanFlags): whether the parent / linked context is known to be remote.
_FLAG_HAS_IS_REMOTE = 0x100
_FLAG_IS_REMOTE = 0x200


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> dict:
    """One ExportTraceServiceRequest: spans grouped by resource, then by instrumentation scope."""
    # Resources grouped by identity: a process has one, shared by all its spans, and hashing a
    # Resource serialises its attributes every time. Scopes by value (name, version, schema URL):
    # the SDK's spans and ended_spans.py's carry equal scopes in two objects.
    by_resource: dict[int, tuple] = {}
    links: dict[int, dict] = {}  # a step links to the same few request spans again and again
    for span in spans:
        resource, by_scope = by_resource.setdefault(id(span.resource), (span.resource, {}))
        scope, rendered = by_scope.setdefault(span.instrumentation_scope, (span.instrumentation_scope, []))
        rendered.append(_span(span, links))
    resource_spans = []
    for resource, by_scope in by_resource.values():
        entry = {"resource": _with_attributes({}, resource.attributes),
                 "scopeSpans": [_scope_spans(scope, rendered) for scope, rendered in by_scope.values()]}
        if resource.schema_url:
            entry["schemaUrl"] = resource.schema_url
        resource_spans.append(entry)
    return {"resourceSpans": resource_spans}


def _scope_spans(scope, rendered: list[dict]) -> dict:
    entry = {"scope": {}, "spans": rendered}
    if scope is not None:
        if scope.name:
            entry["scope"]["name"] = scope.name
        if scope.version:
            entry["scope"]["version"] = scope.version
        _with_attributes(entry["scope"], scope.attributes)
        if scope.schema_url:
            entry["schemaUrl"] = scope.schema_url
    return entry


def _span(span: ReadableSpan, links: dict[int, dict]) -> dict:
    context = span.get_span_context()
    out = {"traceId": f"{context.trace_id:032x}", "spanId": f"{context.span_id:016x}"}
    if context.trace_state:
        out["traceState"] = ",".join(f"{key}={value}" for key, value in context.trace_state.items())
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
    out["name"] = span.name
    out["kind"] = span.kind.value + 1  # the SDK counts from INTERNAL = 0, OTLP from UNSPECIFIED = 0
    out["startTimeUnixNano"] = str(span.start_time)
    out["endTimeUnixNano"] = str(span.end_time)
    _with_attributes(out, span.attributes, span.dropped_attributes)
    if span.events:
        out["events"] = [_with_attributes({"timeUnixNano": str(event.timestamp), "name": event.name},
                                          event.attributes, event.dropped_attributes) for event in span.events]
    if span.dropped_events:
        out["droppedEventsCount"] = span.dropped_events
    if span.links:
        out["links"] = [links.get(id(link)) or links.setdefault(id(link), _link(link)) for link in span.links]
    if span.dropped_links:
        out["droppedLinksCount"] = span.dropped_links
    status = {}
    if span.status.description:
        status["message"] = span.status.description
    if span.status.status_code.value:
        status["code"] = span.status.status_code.value
    out["status"] = status
    out["flags"] = _flags(span.parent)
    return out


def _link(link) -> dict:
    out = {"traceId": f"{link.context.trace_id:032x}", "spanId": f"{link.context.span_id:016x}"}
    _with_attributes(out, link.attributes, link.dropped_attributes)
    out["flags"] = _flags(link.context)
    return out


def _flags(context) -> int:
    return _FLAG_HAS_IS_REMOTE | (_FLAG_IS_REMOTE if context is not None and context.is_remote else 0)


def _with_attributes(out: dict, attributes, dropped: int = 0) -> dict:
    if attributes:
        out["attributes"] = [{"key": key, "value": _value(value)} for key, value in attributes.items()]
    if dropped:
        out["droppedAttributesCount"] = dropped
    return out


def _value(value) -> dict:
    """One attribute value as an OTLP AnyValue (the common types by their exact type, the rest in _any_value)."""
    kind = type(value)
    if kind is str:
        return {"stringValue": value}
    if kind is int:
        return {"intValue": str(value)}
    if kind is float:
        return _double(value)
    if kind is bool:
        return {"boolValue": value}
    if (kind is tuple or kind is list) and value:
        # Token ids, timestamps, request ids, flags: long lists of one type, rendered without a call per item.
        kinds = {type(item) for item in value}
        if kinds == {int}:
            return {"arrayValue": {"values": [{"intValue": str(item)} for item in value]}}
        if kinds == {str}:
            return {"arrayValue": {"values": [{"stringValue": item} for item in value]}}
        if kinds == {bool}:
            return {"arrayValue": {"values": [{"boolValue": item} for item in value]}}
        return {"arrayValue": {"values": [_value(item) for item in value]}}
    return _any_value(value)


def _double(value: float) -> dict:
    if math.isfinite(value):
        return {"doubleValue": value}
    return {"doubleValue": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}


def _any_value(value) -> dict:
    """What _value has no fast path for: None, subclasses of the common types, bytes, other sequences, mappings."""
    if value is None:
        return {}
    for kind in (bool, str, int, float):  # bool before int: bool is an int in Python
        if isinstance(value, kind):
            return _value(kind(value))
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, Sequence):
        return {"arrayValue": {"values": [_value(item) for item in value]} if value else {}}
    if isinstance(value, Mapping):
        items = [{"key": str(key), "value": _value(item)} for key, item in value.items()]
        return {"kvlistValue": {"values": items} if items else {}}
    raise TypeError(f"cannot encode a {type(value).__name__} as an OTLP attribute value: {value!r}")


def open_owner_only(path: Path):
    """Open a trace file for appending, 0600 like the run folder's 0700: the spans carry prompts and outputs."""
    # Binary: the exporters write msgspec's UTF-8 bytes as they are.
    return open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab")


class OTLPJsonFileExporter(SpanExporter):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open_owner_only(self.path)
        self._lock = threading.Lock()
        self.num_exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = msgspec.json.encode(spans_to_otlp_json(spans))  # compact, several times faster than json
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(line + b"\n")
            self._file.flush()
            self.num_exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
