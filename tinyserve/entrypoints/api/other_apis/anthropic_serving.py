"""POST /v1/messages: the Anthropic Messages API on the same engine.

Anthropic names things differently from OpenAI: `stop_sequences` for stop,
`stop_reason` of "end_turn" / "max_tokens" / "stop_sequence", and a stream of
typed events: message_start, content_block_start, ping, content_block_delta…,
content_block_stop, message_delta (stop reason, usage), message_stop.
A stream that cannot finish (the engine died, the server shut down and aborted
it) ends with an `error` event instead, as Anthropic's own API does. A final
assistant message is a prefill: the reply continues it rather than opening a new
turn. Tools, tool_choice and tool_use / tool_result blocks are anthropic_tools.py's;
`output_config.format` ({"type": "json_schema", "schema"}: the anthropic client's
messages.parse, and the beta API's top-level `output_format`) constrains the reply to the
schema with the structured outputs chat's response_format uses. vLLM's extras: `chat_template_kwargs`
(more variables for the chat template, as chat's) and `ignore_eos` (generate max_tokens tokens, as
vLLM's benchmarks ask). Extended thinking is not implemented, and a request that asks for it is
refused (request_fields.py); with --reasoning-parser, as in vLLM, the reply is read by the answer
layers as chat's is (its reasoning a "thinking" block, before the text), and a constraint starts
after the reasoning the prompt leaves open.
/v1/messages/count_tokens counts the prompt as /v1/messages would render it, tools included.
"""

import uuid
from typing import Any, ClassVar, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator, model_validator

from tinyserve.frontend.output_processor import OutputKind
from tinyserve.entrypoints.api.answer_layers import Reading, ReadingRequest
from tinyserve.entrypoints.api.errors import APIError, anthropic_error_body
from tinyserve.entrypoints.api.other_apis.anthropic_tools import (
    AnthropicTool,
    AnthropicToolChoice,
    BlockEvents,
    ContentBlock,
    TextBlock,
    check_tools,
    content_blocks,
    template_messages,
    template_tools,
    tool_plan,
    with_thinking,
)
from tinyserve.entrypoints.api.serving_chat import message_deltas
from tinyserve.entrypoints.api.serving_engine import ServingContext, add_constrained_request, render_and_tokenize
from tinyserve.entrypoints.api.guards.strict_body import StrictBody, Text
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


class Message(StrictBody):
    role: Literal["user", "assistant"]
    content: Text | list[ContentBlock]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content if isinstance(block, TextBlock))


class Metadata(StrictBody):
    user_id: Text | None = None


class JsonOutputFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictBody):
    format: JsonOutputFormat | None = None
    # Refused unless null (the model has no reasoning effort), which the schema says too
    effort: Text | None = Field(None, json_schema_extra=lambda schema: schema.update(
        {"anyOf": [{"type": "null"}], "description": "not supported: the model has no reasoning effort to set"}))

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value):
        if value is not None:
            raise ValueError("is not supported by this server: the model has no reasoning effort to set")
        return value


class MessagesCountTokensRequest(StrictBody):
    """What /v1/messages/count_tokens takes: the prompt part of a messages request."""

    refused_fields: ClassVar[str] = "messages"
    model: Text
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the beta API's spelling of output_config.format
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template (enable_thinking)

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_within_limits(cls, value):
        return cls.limits.check_messages(value)

    @property
    def prefilled(self) -> bool:
        """A final assistant message is the start of the reply: the model continues it."""
        return self.messages[-1].role == "assistant"

    @model_validator(mode="after")
    def _prefill_without_trailing_whitespace(self) -> "MessagesCountTokensRequest":
        if self.prefilled and self.messages[-1].text != self.messages[-1].text.rstrip():
            raise ValueError("final assistant content cannot end with trailing whitespace")
        check_tools(self.tools, self.tool_choice)
        if self.output_format is not None and self.output_config is not None and self.output_config.format:
            raise ValueError("output_format is the beta spelling of output_config.format: give one")
        if self.format_constraint is not None and self.tool_choice is not None and self.tool_choice.type in (
                "any", "tool"):
            raise ValueError(f'tool_choice {{"type": "{self.tool_choice.type}"}} constrains the output itself: '
                             "it cannot be combined with output_config.format")
        return self

    @property
    def format_constraint(self) -> StructuredOutputsParams | None:
        """What output_config.format (or output_format) constrains the reply to."""
        output_format = self.output_format or (self.output_config.format if self.output_config else None)
        return StructuredOutputsParams(json=output_format.schema_) if output_format is not None else None

    def conversation(self) -> list[dict]:
        turns = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            turns.append({"role": "system", "content": system})
        return turns + [turn for m in self.messages for turn in template_messages(m.role, m.content)]


class MessagesRequest(MessagesCountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=2**31)  # the sampler's int32
    stream: bool = False
    metadata: Metadata | None = None
    ignore_eos: bool = False  # vLLM's: go on past the end-of-sequence token, up to max_tokens

    @field_validator("stop_sequences", mode="before")
    @classmethod
    def _stop_within_limits(cls, value):
        return cls.limits.check_stop(value)


async def count_tokens(ctx: ServingContext, body: MessagesCountTokensRequest) -> dict:
    """The prompt's tokens, rendered exactly as /v1/messages would render it."""
    ctx.check_model(body.model)
    try:
        prompt = await ctx.engine.render_threads.tokenize_chat(
            body.conversation(), fit_context=False, add_generation_prompt=not body.prefilled,
            continue_final_message=body.prefilled, template_kwargs=body.chat_template_kwargs,
            tools=template_tools(body.tools))
    except ValueError as error:
        raise APIError(400, str(error), getattr(error, "param", None) or "messages") from error
    return {"input_tokens": len(prompt.prompt_token_ids)}


def _stop_reason(finish_reason: str | None, stop_reason, calls=None) -> str:
    if calls is not None and calls.finish_reason(finish_reason) == "tool_calls":
        return "tool_use"
    if finish_reason == "length":
        return "max_tokens"
    if isinstance(stop_reason, str):
        return "stop_sequence"
    return "end_turn"


async def create_message(ctx: ServingContext, body: MessagesRequest, raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    ctx.engine.check_admission(1)  # refuse before rendering: overload should cost little
    message_id = f"msg_{uuid.uuid4().hex}"
    try:  # before the request's spans open: a refused tool plan leaves none behind
        constraint, tool_calls = tool_plan(body.tools, body.tool_choice, ctx.tool_call_parser)
    except ValueError as error:
        raise APIError(400, str(error), "tool_choice") from error
    spans = start_request_spans(schema.OPERATION_CHAT, model, message_id, redact_inputs=ctx.redact_inputs)
    constrained_field = "tools" if constraint is not None else "output_config"
    constraint = constraint or body.format_constraint

    def make_params(max_tokens: int) -> SamplingParams:
        return ctx.sampling_params(max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                                   stop=body.stop_sequences or None, ignore_eos=body.ignore_eos,
                                   structured_outputs=constraint)

    try:
        with ctx.engine.observers.observing(message_id, spans):  # the front end finds them by the request's id
            prompt, params = await render_and_tokenize(
                ctx, message_id, body.conversation(), not body.prefilled, body.max_tokens, make_params,
                continue_final_message=body.prefilled, template_kwargs=body.chat_template_kwargs,
                tools=template_tools(body.tools))
            reading = ctx.answer_layers.reading(ReadingRequest(  # the answer layers' (a reasoning parser's)
                prompt.prompt_token_ids, body.chat_template_kwargs,
                constrained_field=constrained_field if constraint is not None else None))
            stream = await add_constrained_request(
                ctx.engine, constrained_field, prompt, params, message_id,
                lora_request=ctx.lora_request(body.model), reasoning_end=reading.reasoning_end,
                output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
    except Exception as error:
        spans.fail(error)
        raise
    num_prompt = len(prompt.prompt_token_ids)

    if body.stream:
        return EventStreamResponse(_stream(stream, message_id, model, num_prompt, tool_calls, reading, spans),
                                   [stream])

    outputs = await final_outputs_unless_disconnected([stream], raw_request)
    if outputs is None:
        return Response(status_code=499)
    completion = outputs[0].outputs[0]
    if completion.finish_reason == "abort":
        raise APIError(503, ABORTED)
    calls = tool_calls() if tool_calls else None
    parts = reading.choice().read(completion.text, completion.token_ids, finished=True)
    text = "".join(part["content"] for part in parts if "content" in part)
    reading.finish(spans)
    return JSONResponse({
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": with_thinking("".join(part.get("reasoning", "") for part in parts),
                                 content_blocks(calls, text) if calls else [{"type": "text", "text": text}]),
        "stop_reason": _stop_reason(completion.finish_reason, completion.stop_reason, calls),
        "stop_sequence": completion.stop_reason if isinstance(completion.stop_reason, str) else None,
        "usage": {"input_tokens": num_prompt, "output_tokens": len(completion.token_ids)},
    })


async def _stream(stream, message_id, model, num_prompt, tool_calls, reading: Reading, spans):
    yield sse_event("message_start", {"type": "message_start", "message": {
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": num_prompt, "output_tokens": 0},
    }})
    # Without tools or answer layers, one text block; else blocks open as the reasoning, text and calls come.
    calls = tool_calls() if tool_calls else None
    blocks = BlockEvents() if tool_calls or reading.readings else None
    reader = reading.choice()
    if blocks is None:
        yield sse_event("content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
    yield sse_event("ping", {"type": "ping"})  # as Anthropic's own stream does, before the first delta
    num_generated, finish_reason, stop_reason = 0, None, None
    try:
        async for output in stream:
            completion = output.outputs[0]
            num_generated += len(completion.token_ids)
            finish_reason, stop_reason = completion.finish_reason, completion.stop_reason
            if blocks is not None:
                parts = reader.read(completion.text, completion.token_ids, completion.finished())
                for event in blocks.events(message_deltas(parts, calls, completion.finished())):
                    yield event
            elif completion.text:
                yield sse_event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                        "delta": {"type": "text_delta", "text": completion.text}})
    except Exception as error:
        yield sse_event("error", anthropic_error_body(*stream_error_status(error)))
        return
    if finish_reason == "abort":
        yield sse_event("error", anthropic_error_body(503, ABORTED))
        return
    reading.finish(spans)
    for event in blocks.close() if blocks is not None else [sse_event(
            "content_block_stop", {"type": "content_block_stop", "index": 0})]:
        yield event
    yield sse_event("message_delta", {
        "type": "message_delta",
        "delta": {"stop_reason": _stop_reason(finish_reason, stop_reason, calls),
                  "stop_sequence": stop_reason if isinstance(stop_reason, str) else None},
        "usage": {"output_tokens": num_generated},
    })
    yield sse_event("message_stop", {"type": "message_stop"})
