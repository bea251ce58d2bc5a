"""The KV transfer span (schema.KV_TRANSFER), in the request's own trace, on both engines: the producer's
from the first pull to the consumer's PullDone, the consumer's from asking to landed. Built by the
transfer threads, never by the engine loop."""

from tinyserve.lifecycle import schema
from tinyserve.lifecycle.tracing import extract_context, get_tracer, tracing_enabled


def transfer_span(role: str, spec, start: float, end: float, num_blocks: int, num_bytes: int, connector: str,
                  error: str | None) -> None:
    if not tracing_enabled():
        return
    from opentelemetry.trace import Status, StatusCode

    span = get_tracer().start_span(schema.KV_TRANSFER, context=extract_context(spec.trace_context),
                                   start_time=int(start * 1e9), attributes={
        schema.REQUEST_ID: spec.request_id, schema.KV_TRANSFER_ROLE: role, schema.KV_TRANSFER_CONNECTOR: connector,
        schema.KV_TRANSFER_NUM_BLOCKS: num_blocks, schema.KV_TRANSFER_NUM_BYTES: num_bytes,
        schema.KV_TRANSFER_TIME: max(end - start, 0.0),
    })
    if error is not None:
        span.set_attribute(schema.ERROR_REASON, error)
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=int(end * 1e9))
