"""A span exporter that appends OTLP/JSON lines to a file.

This is the OpenTelemetry Collector's file format: each line is one
ExportTraceServiceRequest in OTLP/JSON, where trace and span ids are hex strings,
64-bit integers are decimal strings and enums are integers. The protobuf encoder
of the official OTLP exporter builds the message; only the JSON rendering of the
ids differs from protobuf's default (base64), so it is fixed up here.
"""

import base64
import json
import threading
from collections.abc import Sequence
from pathlib import Path

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

_ID_KEYS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(node) -> None:
    """Rewrite base64 ids to hex, in place, wherever they occur."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in _ID_KEYS and isinstance(value, str):
                node[key] = base64.b64decode(value).hex()
            else:
                _hex_ids(value)
    elif isinstance(node, list):
        for item in node:
            _hex_ids(item)


def spans_to_otlp_json(spans: Sequence[ReadableSpan]) -> dict:
    message = MessageToDict(encode_spans(spans), use_integers_for_enums=True)
    _hex_ids(message)
    return message


class OTLPJsonFileExporter(SpanExporter):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self.num_exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = json.dumps(spans_to_otlp_json(spans), separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(line + "\n")
            self._file.flush()
            self.num_exported += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
