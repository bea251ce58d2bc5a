"""POST /v1/chat/completions: vLLM's chat handler (stage ① in, stage ⑨ out).

`create_chat_completion` renders the conversation (serving_engine.render_and_tokenize),
adds the request, and answers with one body, or with `chat_stream`'s SSE chunks.
"""

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest
from tinyserve.entrypoints.api.serving_engine import (
    ServingContext,
    ToolCallPlan,
    add_constrained_request,
    guard_stream,
    prompt_logprobs_json,
    render_and_tokenize,
    tool_call_plan,
    usage,
)
from tinyserve.entrypoints.api.sse import EventStreamResponse, final_outputs_unless_disconnected, sse_data
from tinyserve.entrypoints.api.tools.tool_calls import ToolCallDeltas
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.outputs import CompletionOutput


def chat_constraint(ctx: ServingContext, body: ChatCompletionRequest) -> ToolCallPlan:
    return tool_call_plan(ctx, *body.constraint(), body.effective_tool_choice, body.tools, body.parallel_tool_calls)


def chat_logprobs(output: CompletionOutput, num_top: int) -> dict | None:
    if output.logprobs is None:
        return None
    content = []
    for token_id, position in zip(output.token_ids, output.logprobs):
        sampled = position[token_id]
        top = sorted((lp for lp in position.items() if lp[1].rank <= num_top), key=lambda item: item[1].rank)
        content.append({
            "token": sampled.decoded_token,
            "logprob": sampled.logprob,
            "bytes": list((sampled.decoded_token or "").encode()),
            "top_logprobs": [
                {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list((lp.decoded_token or "").encode())}
                for _, lp in top
            ],
        })
    return {"content": content}


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    engine = ctx.engine
    engine.check_admission(body.n)  # refuse before rendering: overload should cost little
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    spans = start_request_spans(schema.OPERATION_CHAT, model, request_id, redact_inputs=ctx.redact_inputs)
    try:
        constraint, constrained_field, make_calls = chat_constraint(ctx, body)
        prompt, params = await render_and_tokenize(
            ctx, spans, [m.as_template_message() for m in body.messages], body.add_generation_prompt,
            body.requested_max_tokens,
            lambda max_tokens: body.sampling_params(max_tokens, body.num_logprobs, ctx.sampling_defaults, constraint),
            continue_final_message=body.continue_final_message, template_kwargs=body.chat_template_kwargs,
            tools=body.template_tools,
        )
        stream = await add_constrained_request(engine, constrained_field, prompt, params, request_id,
                                               priority=body.priority, spans=spans,
                                               output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
    except Exception as error:
        spans.fail(error)
        raise
    answer = ChatAnswer(request_id, int(time.time()), model, len(prompt.prompt_token_ids), params.n,
                        body.top_logprobs or 0, make_calls)
    if body.stream:
        return EventStreamResponse(guard_stream(chat_stream(answer, stream, body.include_usage)), [stream])

    outputs = await final_outputs_unless_disconnected([stream], raw_request)
    if outputs is None:
        return Response(status_code=499)
    [output] = outputs
    choices = []
    for c in output.outputs:
        calls = make_calls() if make_calls else None
        choices.append({
            "index": c.index,
            "message": {"role": "assistant", **(calls.message(c.text) if calls else {"content": c.text})},
            "logprobs": chat_logprobs(c, answer.num_top),
            "finish_reason": calls.finish_reason(c.finish_reason) if calls else c.finish_reason,
            "stop_reason": c.stop_reason,
        })
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    return JSONResponse({
        "id": request_id,
        "object": "chat.completion",
        "created": answer.created,
        "model": model,
        "choices": choices,
        "usage": usage(len(prompt.prompt_token_ids), num_generated, output.num_cached_tokens),
        **({"prompt_logprobs": prompt_logprobs_json(output)} if body.prompt_logprobs is not None else {}),
    })


@dataclass(slots=True)
class ChatAnswer:
    """What every chunk (or the one body) of a chat answer repeats, and how its choices are read."""

    request_id: str
    created: int
    model: str
    num_prompt_tokens: int
    n: int
    num_top: int  # top_logprobs
    make_calls: Callable[[], ToolCallDeltas] | None  # tool calls read out of the text (ToolCallPlan)

    def chunk(self, choices: list, **extra) -> str:
        return sse_data({"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": choices, **extra})


async def chat_stream(answer: ChatAnswer, stream, include_usage: bool) -> AsyncIterator[str]:
    """Stage ⑨ for a streamed chat: a role chunk per choice, then each RequestOutput's delta as chunks."""
    for index in range(answer.n):
        yield answer.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])
    num_generated = num_cached = 0
    calls = [answer.make_calls() for _ in range(answer.n)] if answer.make_calls else None
    async for output in stream:
        num_cached = output.num_cached_tokens
        for c in output.outputs:
            num_generated += len(c.token_ids)
            if not c.text and not c.finished() and c.logprobs is None:
                continue  # nothing to show yet (e.g. held back: half a character, maybe a stop string)
            finish_reason = c.finish_reason
            if calls:  # the text read as content and tool calls (tool_calls.py)
                deltas = calls[c.index].feed(c.text, c.finished()) or [{}]
                finish_reason = calls[c.index].finish_reason(c.finish_reason)
            else:
                deltas = [{"content": c.text} if c.text else {}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                yield answer.chunk([{"index": c.index, "delta": delta,
                                     "logprobs": chat_logprobs(c, answer.num_top) if last else None,
                                     "finish_reason": finish_reason if last else None,
                                     **({"stop_reason": c.stop_reason} if c.finished() and last else {})}])
    if include_usage:
        yield answer.chunk([], usage=usage(answer.num_prompt_tokens, num_generated, num_cached))
