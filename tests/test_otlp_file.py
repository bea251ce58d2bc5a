"""The OTLP/JSON file encoder against the official one.

tinyserve renders spans to OTLP/JSON itself, for speed. The reference is what
the OpenTelemetry exporter's protobuf encoder gives, rendered by protobuf's
MessageToDict (with ids as hex, as OTLP/JSON wants): both must be the same dict
for every kind of span, value, event, link and status tinyserve can produce.
"""

import base64
import json
import math

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode, set_span_in_context

from tinyserve.lifecycle.otlp_file import OTLPJsonFileExporter, spans_to_otlp_json
from tinyserve.lifecycle.tracing import extract_context
from tinyserve.trace_reading.otlp_json import read_spans

ID_KEYS = ("traceId", "spanId", "parentSpanId")


def reference(spans) -> dict:
    """The official encoder's message as proto3 JSON, ids rewritten from base64 to hex."""
    def hex_ids(node):
        if isinstance(node, dict):
            return {key: base64.b64decode(value).hex() if key in ID_KEYS else hex_ids(value)
                    for key, value in node.items()}
        if isinstance(node, list):
            return [hex_ids(item) for item in node]
        return node

    return hex_ids(MessageToDict(encode_spans(spans), use_integers_for_enums=True))


def record_spans(service: str, build) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service, "service.version": "0.1"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build(provider.get_tracer("tinyserve", "0.1"))
    provider.shutdown()
    return list(exporter.get_finished_spans())


def every_kind_of_span(tracer) -> None:
    remote = extract_context({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                              "tracestate": "vendor=value"})
    attributes = {
        "str": "text", "empty_str": "", "int": 7, "negative": -3, "big": 2**62, "zero": 0,
        "float": 0.25, "whole_float": 2.0, "nan": math.nan, "inf": math.inf, "minus_inf": -math.inf,
        "true": True, "false": False, "ints": [1, 2, 3], "strs": ["a", "b"], "floats": [0.5, 1.5],
        "bools": [True, False], "empty": [],
    }
    http = tracer.start_span("POST /v1/chat/completions", context=remote, kind=SpanKind.SERVER,
                             attributes=attributes, start_time=1_700_000_000_000_000_000)
    http.add_event("prefill_chunk", {"tinyserve.chunk_tokens": 16}, timestamp=1_700_000_000_000_000_500)
    http.add_event("preempted", timestamp=1_700_000_000_000_000_600)
    inside = set_span_in_context(http)
    client = tracer.start_span("tinyserve.ipc.send", context=inside, kind=SpanKind.CLIENT, start_time=1_700_000_000_000_001_000)
    client.set_status(Status(StatusCode.ERROR, "engine died"))
    client.end(end_time=1_700_000_000_000_002_000)
    ok = tracer.start_span("tinyserve.respond", context=inside, kind=SpanKind.PRODUCER, start_time=1_700_000_000_000_003_000)
    ok.set_status(Status(StatusCode.OK))
    ok.end(end_time=1_700_000_000_000_004_000)
    step = tracer.start_span("tinyserve.step", kind=SpanKind.CONSUMER, start_time=1_700_000_000_000_005_000, links=[
        Link(http.get_span_context(), {"tinyserve.request_id": "cmpl-1"}),
        Link(client.get_span_context()),
    ])
    step.end(end_time=1_700_000_000_000_006_000)
    http.end(end_time=1_700_000_000_000_009_000)


def test_the_encoder_gives_what_the_official_protobuf_encoder_gives():
    spans = record_spans("tinyserve-api", every_kind_of_span)
    spans += record_spans("tinyserve-engine-0", lambda tracer: tracer.start_span("tinyserve.queue").end())
    assert len(spans) == 5
    assert spans_to_otlp_json(spans) == reference(spans)


def test_a_line_is_strict_json_the_reader_takes_back(tmp_path):
    spans = record_spans("tinyserve-api", every_kind_of_span)
    exporter = OTLPJsonFileExporter(tmp_path / "api.jsonl")
    exporter.export(spans)
    exporter.shutdown()
    line = (tmp_path / "api.jsonl").read_text().strip()
    json.loads(line, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(f"bare {name} in the line")))
    (http,) = [span for span in read_spans(tmp_path / "api.jsonl") if span.name.startswith("POST")]
    assert http.parent_span_id == "b7ad6b7169203331"  # the remote parent from the traceparent
    assert math.isnan(http.attributes["nan"]) and http.attributes["inf"] == math.inf
    assert http.attributes["big"] == 2**62 and http.attributes["floats"] == [0.5, 1.5]


def test_a_string_holding_unicode_line_breaks_stays_on_its_line(tmp_path):
    # JSON leaves U+0085, U+2028 and U+2029 unescaped; a generated text held U+0085 and its trace file was unreadable
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\x0cg"
    spans = record_spans("tinyserve-api", lambda tracer: tracer.start_span("x", attributes={"text": text}).end())
    spans += record_spans("tinyserve-api", lambda tracer: tracer.start_span("y").end())
    exporter = OTLPJsonFileExporter(tmp_path / "api.jsonl")
    for span in spans:
        exporter.export([span])
    exporter.shutdown()
    assert [(span.name, span.attributes.get("text")) for span in read_spans(tmp_path / "api.jsonl")] == [
        ("x", text), ("y", None)]
