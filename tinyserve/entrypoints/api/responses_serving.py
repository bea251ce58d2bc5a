"""POST /v1/responses (stage ① in, stage ⑨ out): OpenAI's Responses API on the same engine, text only.

The conversation (a previous response's, then this request's input, after the
instructions) is rendered with the chat template like a chat completion. The answer
is one `response` object whose output is one assistant message; its status is
"completed", or "incomplete" (reason max_output_tokens) when the reply was cut short.
A stream is the documented sequence of typed events, each numbered:

    response.created, response.in_progress
    response.output_item.added, response.content_part.added
    response.output_text.delta ...
    response.output_text.done, response.content_part.done, response.output_item.done
    response.completed (or response.incomplete)

A stream that cannot finish ends with an `error` event. Finished responses are kept
for previous_response_id and GET /v1/responses/{id} (responses_protocol.ResponseStore).
"""

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.frontend.output_processor import OutputKind
from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.openai_serving import ServingContext, render_and_tokenize
from tinyserve.entrypoints.api.responses_protocol import ResponsesRequest, ResponseStore
from tinyserve.entrypoints.api.sse import (
    EventStreamResponse,
    final_outputs_unless_disconnected,
    sse_event,
    stream_error_status,
)
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.sampling_params import SamplingParams

ABORTED = "the request was aborted before it finished: the server is shutting down"
# The names render_and_tokenize gives a field at fault, as this API calls them.
_PARAM_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens"}


class _Answer:
    """One response being built: its ids, its request's echo, and the object at any stage."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.body, self.model = body, model
        self.id, self.message_id = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"  # the id names the request
        self.created_at = int(time.time())
        self.text, self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens = "", 0, 0, 0
        self.finish_reason: str | None = None

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def message(self) -> dict:
        return {"type": "message", "id": self.message_id, "status": self.status, "role": "assistant",
                "content": [self.part()] if self.finish_reason is not None else []}

    def response(self) -> dict:
        body, finished = self.body, self.finish_reason is not None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": [self.message()] if finished else [],
            "parallel_tool_calls": False, "previous_response_id": body.previous_response_id,
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "truncation": "disabled",
            "user": body.user, "metadata": {},
            "usage": {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                "output_tokens": self.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            } if finished else None,
        }


async def create_response(ctx: ServingContext, store: ResponseStore, body: ResponsesRequest,
                          raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    ctx.engine.check_admission(1)  # refuse before rendering: overload should cost little
    history: list[dict] = []
    if body.previous_response_id is not None:
        history = store.conversation(body.previous_response_id)
        if history is None:
            raise APIError(404, f"no stored response has the id {body.previous_response_id!r} (responses are kept "
                           f"in memory, the latest {store.max_entries})", "previous_response_id")
    conversation = history + body.new_messages()
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    answer = _Answer(body, model)
    spans = start_request_spans(schema.OPERATION_CHAT, model, answer.id, redact_inputs=ctx.redact_inputs)

    def make_params(max_tokens: int) -> SamplingParams:
        defaults = ctx.sampling_defaults
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults["temperature"] if body.temperature is None else body.temperature,
            top_p=defaults["top_p"] if body.top_p is None else body.top_p,
            top_k=defaults["top_k"], min_p=defaults["min_p"], repetition_penalty=defaults["repetition_penalty"],
        )

    try:
        prompt, params = await render_and_tokenize(ctx, spans, instructions + conversation, True,
                                                   body.max_output_tokens, make_params)
        stream = await ctx.engine.add_request(prompt, params, answer.id, spans=spans,
                                              output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
    except APIError as error:
        spans.fail(error)
        error.param = _PARAM_NAMES.get(error.param, error.param)
        raise
    except Exception as error:
        spans.fail(error)
        raise
    answer.num_prompt_tokens = len(prompt.prompt_token_ids)

    def keep() -> None:
        if body.store:
            store.put(answer.response(), conversation + [{"role": "assistant", "content": answer.text}])

    if body.stream:
        return EventStreamResponse(_stream(stream, answer, keep), [stream])

    outputs = await final_outputs_unless_disconnected([stream], raw_request)
    if outputs is None:
        return Response(status_code=499)
    [output] = outputs
    completion = output.outputs[0]
    if completion.finish_reason == "abort":
        raise APIError(503, ABORTED)
    answer.text, answer.num_output_tokens = completion.text, len(completion.token_ids)
    answer.num_cached_tokens, answer.finish_reason = output.num_cached_tokens, completion.finish_reason
    keep()
    return JSONResponse(answer.response())


async def _stream(stream, answer: _Answer, keep):
    sequence_number = 0

    def event(kind: str, **payload) -> str:
        nonlocal sequence_number
        sequence_number += 1
        return sse_event(kind, {"type": kind, "sequence_number": sequence_number - 1, **payload})

    where = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=answer.response())
    yield event("response.in_progress", response=answer.response())
    yield event("response.output_item.added", output_index=0, item=answer.message())
    yield event("response.content_part.added", **where, part=answer.part())
    try:
        async for output in stream:
            completion = output.outputs[0]
            answer.num_output_tokens += len(completion.token_ids)
            answer.num_cached_tokens = output.num_cached_tokens
            if completion.text:
                answer.text += completion.text
                yield event("response.output_text.delta", **where, delta=completion.text, logprobs=[])
            if completion.finished():
                answer.finish_reason = completion.finish_reason
    except Exception as error:
        status, message = stream_error_status(error)
        yield event("error", code=str(status), message=message, param=None)
        return
    if answer.finish_reason in (None, "abort"):
        yield event("error", code="503", message=ABORTED, param=None)
        return
    keep()
    yield event("response.output_text.done", **where, text=answer.text, logprobs=[])
    yield event("response.content_part.done", **where, part=answer.part())
    yield event("response.output_item.done", output_index=0, item=answer.message())
    yield event("response.completed" if answer.status == "completed" else "response.incomplete",
                response=answer.response())
