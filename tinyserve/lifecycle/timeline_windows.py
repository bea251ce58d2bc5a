"""The engine_timeline spans: an engine's steps grouped into one trace per TIMELINE_WINDOW_S.

An OTLP viewer lists traces. A step span in a trace of its own would make that list one
entry per engine step; so the steps of each window of time are the children of one
tinyserve.engine_timeline span (a trace of its own), and the viewer lists the requests and
a bounded number of timelines. The notebooks and `load_run` read the steps as before.
Both ways are linked: each step links to the requests it served (engine_spans.py), and each
request's prefill and decode spans link to the timelines that hold its steps (`links_of`).

Used by the span builder's thread only (or the caller's, offline): no locks.
"""

from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanContext

from tinyserve.lifecycle import schema


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TimelineWindows:
    def __init__(self, tracer, engine_index: int) -> None:
        self.tracer = tracer
        self.engine_index = engine_index
        self._window = None  # the open engine_timeline span
        self._start = self._end = 0.0  # its first step's start, its last step's end
        self._timelines_of: dict[str, list] = {}  # per running request, the timelines its steps are in

    def context_for(self, start: float, end: float, request_ids) -> SpanContext:
        """The parent of a step from start to end (the open window's, or a new one's once the
        window has run TIMELINE_WINDOW_S); the step's traced requests are noted as served in it."""
        if self._window is not None and start - self._start >= schema.TIMELINE_WINDOW_S:
            self.end()
        if self._window is None:
            self._window = self.tracer.start_span(schema.ENGINE_TIMELINE, context=Context(), start_time=_ns(start),
                                                  attributes={schema.ENGINE_INDEX: self.engine_index})
            self._start = start
        self._end = max(self._end, end)
        window = self._window.get_span_context()
        for request_id in request_ids:
            seen = self._timelines_of.setdefault(request_id, [])
            if not seen or seen[-1] != window:
                seen.append(window)
        return window

    def links_of(self, request_id: str) -> list[Link]:
        """Links to the timelines a finished request's steps are in (forgotten here)."""
        return [Link(context) for context in self._timelines_of.pop(request_id, ())]

    def end(self) -> None:
        """End the open window (a flush, the engine's shutdown): its span goes out with its steps."""
        if self._window is not None:
            self._window.end(end_time=_ns(self._end))
            self._window = None
