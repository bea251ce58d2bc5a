"""Tracer set-up for one process: where its spans go, and turning it all off.

Each process (the API server, every engine, or the offline LLM) has its own
TracerProvider with its own `service.name`. Spans go through a batch processor
to an OTLP/JSON-lines file in the run folder and/or to an OTLP/HTTP endpoint
(Jaeger, Tempo, a collector). The queue is made large enough that a burst of
requests never drops a span, and `shutdown_tracing()` flushes everything.

When tracing is off, `get_tracer()` returns OpenTelemetry's no-op tracer and the
code that builds spans checks `tracing_enabled()` first, so off costs nothing.
"""

import importlib.metadata
import itertools
import json
import logging
import os
import socket
import time
from pathlib import Path

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.otlp_capped import CappedOTLPJsonFileExporter
from tinyserve.lifecycle.otlp_file import OTLPJsonFileExporter

try:  # the installed distribution's version; lifecycle imports nothing else of tinyserve
    VERSION = importlib.metadata.version("tinyserve")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "unknown"

logger = logging.getLogger(__name__)

_QUEUE_SIZE = 1 << 20  # spans held before export: far more than any run produces between flushes
MAX_LINKS = 1024  # a step serving 256 requests keeps every link
TRACER_NAME = "tinyserve"  # the instrumentation scope of every span tinyserve makes
_propagator = TraceContextTextMapPropagator()
_provider: TracerProvider | None = None
_kept_images_dir: Path | None = None  # keep_images_in


def host_name() -> str:
    """This host's name in traces and manifests: the host.name OpenTelemetry's OTEL_RESOURCE_ATTRIBUTES gives
    (host.name=...), else the machine's."""
    return OTELResourceDetector().detect().attributes.get(schema.RESOURCE_HOST) or socket.gethostname()


def setup_tracing(service_name: str, trace_file: str | Path | None = None, otlp_endpoint: str | None = None, *,
                  export_every_ms: int = 500, max_bytes: int | None = None,
                  resource: dict | None = None) -> bool:
    """Install this process's tracer provider. Returns False (and stays a no-op) if given nowhere to send.

    Ended spans are exported every export_every_ms (or sooner when 4096 are waiting),
    on the batch processor's thread, and at every flush_tracing(). max_bytes caps the
    trace file and its step segments (otlp_capped.py); the OTLP endpoint gets every span.
    """
    global _provider
    if trace_file is None and otlp_endpoint is None:
        return False
    provider = TracerProvider(
        resource=Resource.create({"service.name": service_name, "service.version": VERSION,
                                  schema.RESOURCE_HOST: host_name(), **(resource or {})}),
        span_limits=SpanLimits(max_links=MAX_LINKS, max_attributes=256, max_events=4096, max_span_attributes=256),
    )
    if trace_file is not None:
        exporter = OTLPJsonFileExporter(trace_file) if max_bytes is None else \
            CappedOTLPJsonFileExporter(trace_file, max_bytes)
        provider.add_span_processor(_batch(exporter, export_every_ms))
    if otlp_endpoint is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(_batch(OTLPSpanExporter(endpoint=_traces_url(otlp_endpoint)), export_every_ms))
    _provider = provider
    return True


def _batch(exporter, export_every_ms: int) -> BatchSpanProcessor:
    return BatchSpanProcessor(exporter, max_queue_size=_QUEUE_SIZE, schedule_delay_millis=export_every_ms,
                              max_export_batch_size=4096)


def _traces_url(endpoint: str) -> str:
    """Accept a collector's base URL (http://host:4318) or the full /v1/traces URL."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def keep_images_in(run_dir: Path | None) -> None:
    """Have this process keep the images its requests carry in <run_dir>/images/ (schema.RUN_IMAGES_DIR): a span
    logs an image's content hash, and replay reads its pixels back from there. Not for a run that redacts its
    inputs (--trace-redact-inputs): an image is as private as a prompt."""
    global _kept_images_dir
    _kept_images_dir = None if run_dir is None else Path(run_dir) / schema.RUN_IMAGES_DIR


def kept_images_dir() -> Path | None:
    """Where this process keeps its requests' images (keep_images_in), or None."""
    return _kept_images_dir


def logged_json(messages) -> str:
    """A chat's messages as logged: a data: URL as its media type and size (the run keeps an image's pixels by its
    hash), an object JSON has no form for (an offline chat's PIL image) as its type's name."""
    def shown(value):
        if isinstance(value, str) and value.startswith("data:") and len(value) > 256:
            return f"{value[:value.find(',') + 1]}... ({len(value)} characters)"
        if isinstance(value, dict):
            return {key: shown(item) for key, item in value.items()}
        return [shown(item) for item in value] if isinstance(value, (list, tuple)) else value

    return json.dumps(shown(messages), ensure_ascii=False, default=lambda value: f"<{type(value).__name__}>")


def tracing_enabled() -> bool:
    return _provider is not None


def get_tracer() -> trace.Tracer:
    if _provider is None:
        return trace.NoOpTracer()
    return _provider.get_tracer(TRACER_NAME, VERSION)


def flush_tracing() -> None:
    """Export every span ended so far (the run folder's files are then complete up to now)."""
    if _provider is not None:
        _provider.force_flush()


def shutdown_tracing() -> None:
    """Flush every pending span and close the exporters (idempotent)."""
    global _provider
    if _provider is not None:
        _provider.force_flush()
        _provider.shutdown()
        _provider = None


# ---- W3C trace context across the process boundary --------------------------


def inject_context(context: Context | None = None) -> dict[str, str]:
    """The traceparent/tracestate carrier for EngineCoreRequest.trace_context."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


def extract_context(carrier: dict[str, str]) -> Context | None:
    if not carrier:
        return None
    return _propagator.extract(carrier, getter=DefaultGetter())


# ---- run folders -----------------------------------------------------------------


def new_run_dir(trace_dir: str | Path) -> Path:
    """traces/<YYYYmmdd-HHMMSS>-<pid>[-2, -3, ...]: one folder per run, readable by its owner only.

    Traces hold prompts and outputs, so the folder is created 0700 (its files 0600,
    otlp_file.py). Two runs of one process in the same second (two traced LLMs, say)
    get the next free suffix instead of one another's folder.
    """
    Path(trace_dir).mkdir(parents=True, exist_ok=True)
    name = time.strftime("%Y%m%d-%H%M%S") + f"-{os.getpid()}"
    for attempt in itertools.count(1):
        run_dir = Path(trace_dir) / (name if attempt == 1 else f"{name}-{attempt}")
        try:
            run_dir.mkdir(mode=0o700)
        except FileExistsError:
            continue
        run_dir.chmod(0o700)  # mkdir's mode is cut by the umask
        return run_dir


def trace_cap_bytes(trace_max_mb: float | None) -> int | None:
    """--trace-max-mb in bytes: the cap of the whole run folder, which each of its processes checks."""
    if trace_max_mb is None:
        return None
    if not trace_max_mb > 0:
        raise ValueError(f"trace_max_mb must be positive, got {trace_max_mb}")
    return max(1, int(trace_max_mb * 1e6))


def write_manifest(run_dir: Path, *, model: str | None, served_model_name: str, engine_args: dict,
                   data_parallel_size: int, model_fingerprint: str | None = None,
                   trace_max_mb: float | None = None, node: dict | None = None) -> None:
    """model_fingerprint: tinyserve.models.fingerprint's, which replay checks before anything else.

    node: which machine wrote the folder: {"host", "headless", "ranks"} (`trace merge` reads it).
    """
    manifest = {
        "tinyserve_version": VERSION,
        "model": model,
        "model_fingerprint": model_fingerprint,
        "served_model_name": served_model_name,
        "engine_args": engine_args,
        "data_parallel_size": data_parallel_size,
        "start_time_unix_nano": time.time_ns(),
        "trace_max_mb": trace_max_mb,  # and, once anything was dropped for it, "dropped" (otlp_capped.py)
    }
    if node is not None:
        manifest[schema.MANIFEST_NODE] = node
    path = run_dir / schema.MANIFEST_FILE
    path.touch(mode=0o600)
    path.write_text(json.dumps(manifest, indent=2, default=str))
