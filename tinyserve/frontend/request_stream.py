"""RequestStream: one request's outputs as AsyncLLM's output task delivers them.

AsyncLLM puts each RequestOutput (or the error that ends the request) on the stream's
queue; the caller reads them with `async for` and then closes the stream, which
aborts the request in the engine if it has not finished (the reader left).
"""

import asyncio

from tinyserve.errors import InvalidInputError
from tinyserve.outputs import RequestOutput
from tinyserve.structured_output import GrammarError

def engine_refusal(output) -> InvalidInputError:
    """The error of a request the engine ended itself, saying why (EngineCoreOutput.error): a GrammarError for
    a constraint (its field named by the stream, constraint_field), else the field the engine names."""
    if output.error_param == "structured_outputs":
        return GrammarError(output.error)
    return InvalidInputError(output.error, output.error_param)


# Put on a stream's queue by AsyncLLM.abort: the iterator ends there, without a final output.
ABORTED = object()


def end_now(queue: asyncio.Queue) -> None:
    """For AsyncLLM.abort: outputs not read yet go with the request, and the iterator ends at once."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(ABORTED)


class RequestStream:
    """The outputs of one request as they arrive: `async for output in stream`, then `close()`."""

    def __init__(self, engine, request_id: str) -> None:
        """engine: the AsyncLLM that feeds this stream (and has the request's spans, if traced)."""
        self.engine = engine
        self.request_id = request_id
        self.spans = engine.observers.get(request_id)  # an error that ends the request ends them too
        # RequestOutputs, then possibly the error or the ABORTED mark that ends the request.
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        # The request field the constraint came from (response_format, tools, ...), set by the API: an
        # error about the constraint (the engine could not compile it in time) names that field.
        self.constraint_field: str | None = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is ABORTED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            self.spans.fail(item)
            if isinstance(item, GrammarError) and self.constraint_field is not None:
                item.param = self.constraint_field
            raise item
        self.finished = item.finished
        return item

    async def close(self) -> None:
        """Abort the request if it has not finished (the reader left); safe to call twice."""
        if self.engine.queues.get(self.request_id) is self.queue:
            del self.engine.queues[self.request_id]
        if not self.finished:
            self.finished = True
            await self.engine._abort_quietly(self.request_id)
