"""RequestObservers: each request's spans, found by its request id.

Whoever opens a request's spans (the HTTP layer, the offline LLM) registers them under the
request id for as long as it renders the request and hands it to the engine:

    with engine.observers.observing(request_id, spans):
        prompt, params = await render_and_tokenize(ctx, request_id, ...)
        stream = await engine.add_request(prompt, params, request_id)

The front end (AsyncLLM, LLMEngine, the output processors, RequestStream) takes no spans
parameter: it looks them up with `get(request_id)` and reports what it did (the enqueue and
ipc.send spans, the detokenizer's clock, the end), as in vLLM v1, where the lifecycle records
events and the tracing code makes spans of them (lifecycle/request_spans.py). What needs
the spans after `add_request` (the output processor, the stream) keeps what it found there.

With tracing off nothing is registered and every look-up gives NO_SPANS, whose methods do
nothing.
"""

from contextlib import contextmanager

from tinyserve.errors import InvalidInputError
from tinyserve.lifecycle.request_spans import NO_SPANS


class RequestObservers:
    def __init__(self) -> None:
        self._spans: dict[str, object] = {}  # request id -> its RequestSpans, while it is being added

    @contextmanager
    def observing(self, request_id: str, spans):
        """`spans` are request_id's inside the block. One request at a time per id: a second one
        while the first is still being added is refused, as the output processor refuses it."""
        if spans is NO_SPANS:
            yield
            return
        if request_id in self._spans:
            raise InvalidInputError(f"request_id {request_id!r} is already in use", "request_id")
        self._spans[request_id] = spans
        try:
            yield
        finally:
            del self._spans[request_id]

    def get(self, request_id: str):
        """The request's RequestSpans; NO_SPANS when none are registered (tracing is off)."""
        return self._spans.get(request_id, NO_SPANS)
