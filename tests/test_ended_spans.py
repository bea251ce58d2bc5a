"""Spans recorded after the fact (ended_spans.py) against the SDK's own start_span/end.

The engine builds its spans from recorded timestamps by making the SDK's ReadableSpan
itself. The reference is the same span made by the SDK's tracer: with the same ids, both
must export the same OTLP (our file encoder and the official protobuf encoder), and
sampling and the link limit must decide as the SDK decides.
"""

import itertools

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Link, SpanContext, Status, StatusCode, TraceFlags, set_span_in_context

from tinyserve.lifecycle.ended_spans import EndedSpans, span_context_of
from tinyserve.lifecycle.otlp_file import spans_to_otlp_json
from tinyserve.lifecycle.tracing import MAX_LINKS, TRACER_NAME, VERSION, extract_context
from tests.test_otlp_file import reference

REMOTE = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "vendor=value"}
UNSAMPLED = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}


class CountingIds(IdGenerator):
    """Ids 1, 2, 3...: two runs of the same spans get the same ids."""

    def __init__(self) -> None:
        self.counter = itertools.count(1)

    def generate_span_id(self) -> int:
        return next(self.counter)

    def generate_trace_id(self) -> int:
        return next(self.counter)


def record(build, sampler=None) -> list:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "tinyserve-engine-0"}),
                              id_generator=CountingIds(), **({"sampler": sampler} if sampler else {}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    build(provider.get_tracer(TRACER_NAME, VERSION))
    provider.shutdown()
    return list(exporter.get_finished_spans())


ATTRIBUTES = {"tinyserve.request_id": "cmpl-1", "ints": [1, 2, 3], "strs": ["a", "b"], "float": 0.5,
              "flag": True, "empty": [], "absent": None}
LINKS = [Link(SpanContext(0x51, 0x52, is_remote=True, trace_flags=TraceFlags(1)))]


def with_sdk(tracer) -> None:
    queue = tracer.start_span("tinyserve.queue", context=extract_context(REMOTE), attributes=ATTRIBUTES,
                              links=LINKS, start_time=1_000)
    queue.add_event("tinyserve.prefill_chunk", {"tinyserve.chunk_tokens": 16}, timestamp=1_500)
    queue.add_event("tinyserve.preempted", timestamp=1_600)
    queue.set_status(Status(StatusCode.ERROR, "aborted"))
    queue.end(end_time=2_000)
    child = tracer.start_span("tinyserve.schedule", context=set_span_in_context(queue), start_time=1_100)
    child.end(end_time=1_200)


def with_ended_spans(tracer) -> None:
    spans = EndedSpans(tracer)
    queue = spans.record("tinyserve.queue", span_context_of(extract_context(REMOTE)), 1_000, 2_000, dict(ATTRIBUTES),
                         LINKS, [Event("tinyserve.prefill_chunk", {"tinyserve.chunk_tokens": 16}, 1_500),
                                 Event("tinyserve.preempted", None, 1_600)], Status(StatusCode.ERROR, "aborted"))
    spans.record("tinyserve.schedule", queue, 1_100, 1_200)


def test_an_ended_span_exports_as_the_sdks_span_does():
    made, expected = record(with_ended_spans), record(with_sdk)
    assert [span.name for span in made] == ["tinyserve.queue", "tinyserve.schedule"]
    assert spans_to_otlp_json(made) == spans_to_otlp_json(expected)
    assert reference(made) == reference(expected)
    assert made[0].attributes["ints"] == (1, 2, 3)  # a tuple, as the SDK makes it: nothing can change it later
    assert made[0].parent.span_id == 0xb7ad6b7169203331 and made[1].parent.span_id == made[0].context.span_id


def test_a_child_of_an_unsampled_parent_is_not_recorded():
    def build(tracer):
        context = EndedSpans(tracer).record("tinyserve.queue", span_context_of(extract_context(UNSAMPLED)), 1, 2)
        assert not context.trace_flags.sampled and context.trace_id == 0x0af7651916cd43dd8448eb211c80319c

    assert record(build) == []


@pytest.mark.parametrize("sampler, recorded", [(sampling.ALWAYS_ON, 1), (sampling.ALWAYS_OFF, 0)])
def test_a_span_without_a_parent_asks_the_tracers_sampler(sampler, recorded):
    spans = record(lambda tracer: EndedSpans(tracer).record("tinyserve.engine_timeline", None, 1, 2), sampler)
    assert len(spans) == recorded
    assert all(span.parent is None and span.context.trace_flags.sampled for span in spans)


def test_links_beyond_the_limit_are_dropped_and_counted():
    links = [Link(SpanContext(0x51, 0x100 + i, is_remote=True)) for i in range(MAX_LINKS + 3)]
    (span,) = record(lambda tracer: EndedSpans(tracer).record("tinyserve.step", None, 1, 2, links=links))
    assert len(span.links) == MAX_LINKS and span.dropped_links == 3
    assert spans_to_otlp_json([span])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["droppedLinksCount"] == 3
