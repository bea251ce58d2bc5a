"""POST /v1/responses (stage ① in, stage ⑨ out): OpenAI's Responses API on the same engine.

The conversation (a previous response's, then this request's input, after the
instructions) is rendered with the chat template like a chat completion, the tools with
it; tool_choice and text.format constrain the output as chat's tool_choice and
response_format do (serving_engine.tool_call_plan). The answer is one `response` object
whose output is its items: with a reasoning parser a reasoning item first (the answer
layers', answer_layers.py), a message, and a function_call per call the model made
(responses_output.py). Its status is "completed", or "incomplete" (reason
max_output_tokens) when the reply was cut short. A stream is the documented sequence of
typed events, each numbered:

    response.created, response.in_progress
    for each item: response.output_item.added, its deltas, response.output_item.done
    response.completed (or response.incomplete)

A stream that cannot finish ends with an `error` event. Finished responses are kept
for previous_response_id and GET /v1/responses/{id} (responses_protocol.ResponseStore).
"""

import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.frontend.output_processor import OutputKind
from tinyserve.entrypoints.api.answer_layers import Reading, ReadingRequest
from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.serving_engine import (
    ServingContext,
    ToolCallPlan,
    add_constrained_request,
    render_and_tokenize,
    tool_call_plan,
)
from tinyserve.entrypoints.api.other_apis.responses_output import OutputItems
from tinyserve.entrypoints.api.serving_chat import chat_logprobs
from tinyserve.entrypoints.api.other_apis.responses_protocol import ResponsesRequest, ResponseStore
from tinyserve.entrypoints.api.sse import (
    EventStreamResponse,
    final_outputs_unless_disconnected,
    sse_event,
    stream_error_status,
)
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams

ABORTED = "the request was aborted before it finished: the server is shutting down"
# The names render_and_tokenize gives a field at fault, as this API calls them.
_PARAM_NAMES = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens"}
NOT_TRUNCATED = ('; truncation "auto" would drop the start of the conversation to make it fit, and this server '
                 'never truncates the context')


def bounded_calls(plan: ToolCallPlan, max_tool_calls: int | None) -> ToolCallPlan:
    """The plan with at most max_tool_calls function calls in the output.

    OpenAI's API counts max_tool_calls against its hosted tools; function tools are the only ones
    served here, so it bounds them (vLLM takes the field and repeats it in the answer, and bounds
    nothing). The bound caps the calls parsed out of the output, as vLLM caps them to the first
    without parallel_tool_calls (it keeps the tool-call deltas of index 0): calls past the bound are
    dropped as they are read, streamed or not. Where the output is constrained anyway, a "required"
    tool_choice's array of calls, the grammar carries the bound too (maxItems, as for
    parallel_tool_calls): generation ends after the last call allowed, so no tokens are spent on
    calls that would be dropped, and usage counts only what is returned. A named function is one call.
    """
    if max_tool_calls is None or plan.make_calls is None:
        return plan
    constraint = plan.constraint
    if plan.field == "tools":  # "required": the output is a JSON array of calls (tool_calls.required_calls_schema)
        schema = constraint.json
        constraint = StructuredOutputsParams(json={**schema, "maxItems": min(schema.get("maxItems", max_tool_calls),
                                                                             max_tool_calls)})
    make_calls = plan.make_calls
    return plan._replace(constraint=constraint, make_calls=lambda: _FirstCalls(make_calls(), max_tool_calls))


class _FirstCalls:
    """A reader of tool calls (tool_calls.ToolCallDeltas) whose deltas keep only the first `limit` calls."""

    def __init__(self, calls, limit: int) -> None:
        self.calls, self.limit = calls, limit

    def feed(self, text: str, finished: bool) -> list[dict]:
        kept = []
        for delta in self.calls.feed(text, finished):
            calls = [call for call in delta.get("tool_calls") or () if call.get("index", 0) < self.limit]
            delta = {**delta, "tool_calls": calls} if calls else {k: v for k, v in delta.items() if k != "tool_calls"}
            if delta:
                kept.append(delta)
        return kept


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class _Answer:
    """One response being built: its id, its request's echo, its output items, and the object at any stage."""

    def __init__(self, body: ResponsesRequest, model: str, make_calls) -> None:
        self.body, self.model = body, model
        self.reading: Reading | None = None  # the answer layers' (a reasoning parser's), once the prompt is rendered
        self.reader = None  # its reader of the one choice
        self.id = f"resp_{uuid.uuid4().hex}"  # the id names the request
        self.created_at = int(time.time())
        self.calls = make_calls() if make_calls else None  # reads tool calls out of the text (tool_calls.py)
        self.output = OutputItems()
        self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens = 0, 0, 0
        self.prompt = None  # the rendered prompt (frontend/render.ProcessedPrompt), once rendered
        self.output_token_ids: list[int] = []
        self.finish_reason: str | None = None

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def read_with(self, reading: Reading) -> None:
        self.reading, self.reader = reading, reading.choice()

    def feed(self, text: str, token_ids: list[int], finished: bool, completion=None) -> list[tuple[str, dict]]:
        """The new text as output items' events (its reasoning and content as the answer layers read them, the
        calls read out of the content, with tools); completion: the CompletionOutput it came from, whose logprobs
        go with it when include asks for them."""
        parts = self.reader.read(text, token_ids, finished)
        if self.calls is None:
            deltas = parts
        else:
            deltas = [out for part in parts for out in (self.calls.feed(part["content"], False) if "content" in part
                                                         else [part])] + (self.calls.feed("", True) if finished else [])
        logprobs = None
        if completion is not None and completion.logprobs is not None and self.body.includes_logprobs:
            logprobs = chat_logprobs(completion, self.body.top_logprobs or 0)["content"]
        return self.output.feed(deltas, logprobs)

    def finish(self, finish_reason: str) -> list[tuple[str, dict]]:
        self.finish_reason = finish_reason
        return self.output.close(self.status)

    def reply_turn(self) -> dict:
        """The reply as the chat template's assistant turn, for a later previous_response_id."""
        turn = {"role": "assistant", "content": self.output.text}
        if self.output.calls:  # templates take the arguments as an object; a call cut short keeps its text
            turn["tool_calls"] = [{"id": call["call_id"], "type": "function", "function": {
                "name": call["name"], "arguments": _json_or_text(call["arguments"])}} for call in self.output.calls]
        return turn

    def response(self) -> dict:
        body, finished = self.body, self.finish_reason is not None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if self.status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": self.output.items if finished else [],
            "previous_response_id": body.previous_response_id,
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p, **body.echo(),
            "max_tool_calls": body.max_tool_calls, "truncation": body.truncation or "disabled", "user": body.user,
            "metadata": {},
            "usage": {
                "input_tokens": self.num_prompt_tokens,
                "input_tokens_details": {"cached_tokens": self.num_cached_tokens},
                "output_tokens": self.num_output_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reading.usage_details().get("reasoning_tokens", 0)},
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            } if finished else None,
            **(self.raw_messages() if body.enable_response_messages and finished else {}),
        }

    def raw_messages(self) -> dict:
        """vLLM's enable_response_messages: the model's raw input and output, each as its text and token ids."""
        def raw(text: str, token_ids: list[int]) -> dict:
            return {"message": text, "tokens": list(token_ids), "type": "raw_message_tokens"}

        prompt_text = self.prompt.prompt or "" if self.prompt is not None else ""
        prompt_ids = self.prompt.prompt_token_ids if self.prompt is not None else []
        return {"input_messages": [raw(prompt_text, prompt_ids)],
                "output_messages": [raw(self.output.text, self.output_token_ids)] if self.output_token_ids else []}


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
    constraint, constrained_field, make_calls = bounded_calls(
        tool_call_plan(ctx, *body.constraint, body.effective_tool_choice, body.chat_tools, body.parallel_tool_calls),
        body.max_tool_calls)
    answer = _Answer(body, model, make_calls)
    spans = start_request_spans(schema.OPERATION_CHAT, model, answer.id, redact_inputs=ctx.redact_inputs)

    def make_params(max_tokens: int) -> SamplingParams:
        return ctx.sampling_params(max_tokens, **body.sampling_fields(), structured_outputs=constraint)

    try:
        with ctx.engine.observers.observing(answer.id, spans):  # the front end finds them by the request's id
            prompt, params = await _render(ctx, answer, instructions + conversation, make_params, constrained_field)
            stream = await add_constrained_request(
                ctx.engine, constrained_field, prompt, params, answer.id, priority=body.priority,
                lora_request=ctx.lora_request(body.model), reasoning_end=answer.reading.reasoning_end,
                output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
    except APIError as error:
        spans.fail(error)
        if body.truncation == "auto" and error.param in ("prompt", "max_tokens"):  # the input does not fit
            error.message, error.param = error.message + NOT_TRUNCATED, "truncation"
        error.param = _PARAM_NAMES.get(error.param, error.param)
        raise
    except Exception as error:
        spans.fail(error)
        raise
    answer.num_prompt_tokens, answer.prompt = len(prompt.prompt_token_ids), prompt

    def keep() -> None:
        if body.store:
            store.put(answer.response(), conversation + [answer.reply_turn()])

    if body.stream:
        return EventStreamResponse(_stream(stream, answer, keep), [stream])

    outputs = await final_outputs_unless_disconnected([stream], raw_request)
    if outputs is None:
        return Response(status_code=499)
    [output] = outputs
    completion = output.outputs[0]
    if completion.finish_reason == "abort":
        raise APIError(503, ABORTED)
    answer.num_output_tokens, answer.num_cached_tokens = len(completion.token_ids), output.num_cached_tokens
    answer.output_token_ids = list(completion.token_ids)
    answer.feed(completion.text, completion.token_ids, finished=True, completion=completion)
    answer.finish(completion.finish_reason)
    keep()
    answer.reading.finish(stream.spans)
    return JSONResponse(answer.response())


async def _render(ctx: ServingContext, answer: _Answer, messages: list[dict], make_params,
                  constrained_field: str | None):
    """render_and_tokenize, the template given the reasoning effort as the answer layers pass it; then the
    answer layers' reading of the reply (a 400 where a layer cannot answer this prompt)."""
    body = answer.body
    template_kwargs = ctx.answer_layers.template_kwargs(None, body.reasoning.effort if body.reasoning else None)
    prompt, params = await render_and_tokenize(ctx, answer.id, messages, True, body.max_output_tokens, make_params,
                                               tools=body.template_tools, template_kwargs=template_kwargs)
    constrained = constrained_field if params.structured_outputs is not None else None
    answer.read_with(ctx.answer_layers.reading(ReadingRequest(prompt.prompt_token_ids, template_kwargs,
                                                              body.include_reasoning, constrained)))
    return prompt, params


async def _stream(stream, answer: _Answer, keep):
    sequence_number = 0

    def event(kind: str, **payload) -> str:
        nonlocal sequence_number
        sequence_number += 1
        return sse_event(kind, {"type": kind, "sequence_number": sequence_number - 1, **payload})

    yield event("response.created", response=answer.response())
    yield event("response.in_progress", response=answer.response())
    finish_reason = None
    try:
        async for output in stream:
            completion = output.outputs[0]
            answer.num_output_tokens += len(completion.token_ids)
            answer.output_token_ids += completion.token_ids
            answer.num_cached_tokens = output.num_cached_tokens
            if completion.finished():
                finish_reason = completion.finish_reason
            if finish_reason != "abort":
                for kind, payload in answer.feed(completion.text, completion.token_ids, completion.finished(),
                                                 completion):
                    yield event(kind, **payload)
    except Exception as error:
        status, message = stream_error_status(error)
        yield event("error", code=str(status), message=message, param=None)
        return
    if finish_reason in (None, "abort"):
        yield event("error", code="503", message=ABORTED, param=None)
        return
    for kind, payload in answer.finish(finish_reason):
        yield event(kind, **payload)
    keep()
    answer.reading.finish(stream.spans)
    yield event("response.completed" if answer.status == "completed" else "response.incomplete",
                response=answer.response())
