"""Spans recorded after the fact: the SDK's finished-span record, made straight from known times.

The engine's spans (engine_spans.py) are built after the work they describe, from timestamps
the busy loop took: a step's start, end and attributes are all known at once. OpenTelemetry's
`Tracer.start_span` is made for a span that is open while its work runs: it asks the sampler,
takes a lock, copies the attributes into a `BoundedAttributes` that checks every element of
every list one at a time, copies the links into a bounded list, and only at `end()` makes the
`ReadableSpan` that span processors and exporters receive. For a span that is already over, all
of that is cost without use: it was over a third of what tracing added to an offline bf16 run
(engine steps of ~25 ms, four spans each; BENCHMARKS.md, "What tracing costs").

So `EndedSpans.record` makes that `ReadableSpan` itself and hands it to the tracer's span
processors (`on_end`, which is what `Span.end` calls). What the SDK still does for us: the ids
(the tracer's id generator), the resource and instrumentation scope every span carries, the
batching and export (the processors and exporters of tracing.py), and the record's type, which
every exporter reads. What we do in its place:

- sampling: a span with a parent is recorded exactly when its parent was (its trace flags and
  trace state are the parent's). Every sampler the SDK configures (parent-based, always on or
  off, a ratio of the trace id, which parent and child share) decides so for a child; the
  processors drop unsampled spans themselves. A span without a parent asks the tracer's sampler.
- attributes: ours, of the types OTLP takes (schema.py), so there is nothing to check; lists
  become tuples, as the SDK makes them, so nothing can change them while they wait for export.
- links: at most the provider's max_links (tracing.py), the rest dropped and counted, as the
  SDK counts them.
"""

from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util import BoundedList
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from tinyserve.lifecycle.tracing import MAX_LINKS, TRACER_NAME, VERSION

_UNSET = Status(StatusCode.UNSET)


class EndedSpans:
    """Records spans that have already ended, through one SDK tracer's processors."""

    def __init__(self, tracer) -> None:
        self.tracer = tracer
        self.scope = InstrumentationScope(TRACER_NAME, VERSION)

    def record(self, name: str, parent: SpanContext | None, start_ns: int, end_ns: int, attributes: dict | None = None,
               links: list[Link] | tuple = (), events: list[Event] | tuple = (),
               status: Status = _UNSET) -> SpanContext:
        """Record one ended span (a child of parent; None: the root of a new trace); returns its context."""
        ids = self.tracer.id_generator
        if parent is not None and parent.is_valid:
            context = SpanContext(parent.trace_id, ids.generate_span_id(), is_remote=False,
                                  trace_flags=parent.trace_flags, trace_state=parent.trace_state)
        else:
            parent, trace_id = None, ids.generate_trace_id()
            decision = self.tracer.sampler.should_sample(None, trace_id, name, SpanKind.INTERNAL, attributes, links)
            flags = TraceFlags.SAMPLED if decision.decision.is_sampled() else TraceFlags.DEFAULT
            context = SpanContext(trace_id, ids.generate_span_id(), is_remote=False,
                                  trace_flags=TraceFlags(flags | (TraceFlags.RANDOM_TRACE_ID
                                                                  if ids.is_trace_id_random() else 0)),
                                  trace_state=decision.trace_state)
        if not context.trace_flags.sampled:
            return context  # the processors would drop it: nothing to build
        if attributes:
            attributes = {key: tuple(value) if type(value) is list else value for key, value in attributes.items()}
        self.tracer.span_processor.on_end(ReadableSpan(
            name, context, parent, self.tracer.resource, attributes or None, events,
            BoundedList.from_seq(MAX_LINKS, links) if len(links) > MAX_LINKS else tuple(links),
            SpanKind.INTERNAL, None, status, start_ns, end_ns, self.scope))
        return context


def span_context_of(context) -> SpanContext | None:
    """The span context a propagated Context (tracing.extract_context's) carries, or None."""
    return None if context is None else trace.get_current_span(context).get_span_context()
