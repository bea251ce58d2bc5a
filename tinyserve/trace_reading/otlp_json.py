"""Read OTLP-JSON-lines trace files into plain `Span` objects.

Each line of a trace file is one `ExportTraceServiceRequest` in OTLP/JSON, the
format the OpenTelemetry Collector's file exporter writes:

    {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name",
                                                     "value": {"stringValue": "tinyserve-api"}}]},
                        "scopeSpans": [{"scope": {"name": "tinyserve"},
                                        "spans": [{"traceId", "spanId", "parentSpanId", "name", "kind",
                                                   "startTimeUnixNano", "endTimeUnixNano",
                                                   "attributes", "events", "links", "status"}]}]}]}

OTLP/JSON spells 64-bit integers as decimal strings ("intValue": "123",
"startTimeUnixNano": "1700000000000000000") and ids as lowercase hex; here they
become Python ints and plain hex strings, and every attribute value is decoded
to int, float, bool, str, bytes, list or dict. The reader (load_run) and the
exporters work on these objects only, never on the raw JSON.

A process that crashed may have left its last line half written: that line is
skipped with a warning. A broken line anywhere else means the file is damaged,
and is an error.
"""

import base64
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

SERVICE_NAME = "service.name"  # the OpenTelemetry resource attribute naming the process

# Span kinds and status codes as OTLP numbers them; some writers spell them as enum names.
SPAN_KINDS = ("unspecified", "internal", "server", "client", "producer", "consumer")
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
_KIND_NAMES = {f"SPAN_KIND_{name.upper()}": number for number, name in enumerate(SPAN_KINDS)}
_STATUS_NAMES = {"STATUS_CODE_UNSET": STATUS_UNSET, "STATUS_CODE_OK": STATUS_OK, "STATUS_CODE_ERROR": STATUS_ERROR}


@dataclass(slots=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict = field(default_factory=dict)


@dataclass(slots=True)
class SpanLink:
    trace_id: str
    span_id: str
    attributes: dict = field(default_factory=dict)


@dataclass(slots=True)
class SpanStatus:
    code: int = STATUS_UNSET
    message: str = ""


@dataclass(slots=True, eq=False)
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str | None  # None for a trace's root
    name: str
    service: str  # the process that emitted it (resource service.name)
    start_ns: int  # unix time, nanoseconds
    end_ns: int
    kind: int = 0  # index into SPAN_KINDS
    attributes: dict = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    links: list[SpanLink] = field(default_factory=list)
    status: SpanStatus = field(default_factory=SpanStatus)
    resource: dict = field(default_factory=dict)  # the process's attributes (host.name, ranks); shared, not copied

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def duration_s(self) -> float:
        return self.duration_ns / 1e9

    @property
    def kind_name(self) -> str:
        return SPAN_KINDS[self.kind] if 0 <= self.kind < len(SPAN_KINDS) else "unspecified"

    @property
    def is_error(self) -> bool:
        return self.status.code == STATUS_ERROR


def decode_value(value: dict):
    """One OTLP AnyValue → a Python value (an empty AnyValue is None)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])  # also takes "NaN" and "Infinity", proto3 JSON's spellings
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "arrayValue" in value:
        return [decode_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return decode_attributes(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return base64.b64decode(value["bytesValue"])
    return None


def decode_attributes(attributes: list[dict]) -> dict:
    return {item["key"]: decode_value(item.get("value", {})) for item in attributes}


def _code(value, names: dict[str, int]) -> int:
    return names.get(value, 0) if isinstance(value, str) else int(value)


def _decode_span(raw: dict, service: str, resource: dict) -> Span:
    status = raw.get("status") or {}
    return Span(
        trace_id=raw["traceId"].lower(),
        span_id=raw["spanId"].lower(),
        parent_span_id=raw.get("parentSpanId", "").lower() or None,
        name=raw["name"],
        service=service,
        start_ns=int(raw["startTimeUnixNano"]),
        end_ns=int(raw["endTimeUnixNano"]),
        kind=_code(raw.get("kind", 0), _KIND_NAMES),
        attributes=decode_attributes(raw.get("attributes", [])),
        events=[SpanEvent(e["name"], int(e["timeUnixNano"]), decode_attributes(e.get("attributes", [])))
                for e in raw.get("events", [])],
        links=[SpanLink(link["traceId"].lower(), link["spanId"].lower(), decode_attributes(link.get("attributes", [])))
               for link in raw.get("links", [])],
        status=SpanStatus(_code(status.get("code", 0), _STATUS_NAMES), status.get("message", "")),
        resource=resource,
    )


def parse_request(request: dict) -> list[Span]:
    """The spans of one ExportTraceServiceRequest (one line of a trace file)."""
    spans = []
    for resource_spans in request.get("resourceSpans", []):
        resource = decode_attributes(resource_spans.get("resource", {}).get("attributes", []))
        service = resource.get(SERVICE_NAME, "unknown_service")
        for scope_spans in resource_spans.get("scopeSpans", []):
            spans += [_decode_span(raw, service, resource) for raw in scope_spans.get("spans", [])]
    return spans


def read_spans(path: str | Path) -> list[Span]:
    """Every span in one OTLP-JSON-lines file; a truncated last line is skipped with a warning."""
    path = Path(path)
    # A line ends at "\n" only: str.splitlines also breaks at U+0085, U+2028 and the like, which JSON keeps
    # unescaped inside a string, and a generated token's text can hold them.
    lines = [(number, line) for number, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1)
             if line.strip()]
    spans = []
    for position, (number, line) in enumerate(lines):
        try:
            spans += parse_request(json.loads(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
            if position < len(lines) - 1:
                raise ValueError(f"{path}:{number} is not an OTLP/JSON ExportTraceServiceRequest: {error}") from None
            warnings.warn(f"{path}:{number}: skipping the last line, which is incomplete "
                          f"(the process probably stopped while writing it): {error}", stacklevel=2)
    return spans
