"""POST /v1/chat/completions: vLLM's chat handler (stage ① in, stage ⑨ out).

`create_chat_completion` renders the conversation (serving_engine.render_and_tokenize),
adds the request, and answers with one body, or with `chat_stream`'s SSE chunks.
"""

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest
from tinyserve.entrypoints.api.request_ids import client_request_id, engine_request_id
from tinyserve.entrypoints.api.serving_engine import (
    ServingContext,
    ToolCallPlan,
    add_constrained_request,
    guard_stream,
    json_logprob,
    logprob_token,
    prompt_logprobs_json,
    render_and_tokenize,
    tool_call_plan,
    running_usage,
    usage,
)
from tinyserve.entrypoints.api.sse import EventStreamResponse, final_outputs_unless_disconnected, sse_data
from tinyserve.entrypoints.api.tools.tool_calls import ToolCallDeltas
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.errors import InvalidInputError
from tinyserve.outputs import CompletionOutput


def chat_constraint(ctx: ServingContext, body: ChatCompletionRequest) -> ToolCallPlan:
    return tool_call_plan(ctx, *body.constraint(), body.effective_tool_choice, body.tools, body.parallel_tool_calls)


def chat_logprobs(output: CompletionOutput, num_top: int, as_token_id: bool = False) -> dict | None:
    """OpenAI's chat logprobs of a choice: each token with its `num_top` most likely alternatives (-1: all
    the engine sent, the whole vocabulary); tokens named "token_id:N" with as_token_id."""
    if output.logprobs is None:
        return None

    def entry(token_id: int, lp) -> dict:
        token = logprob_token(token_id, lp.decoded_token, as_token_id)
        return {"token": token, "logprob": json_logprob(lp.logprob), "bytes": list((token or "").encode())}

    content = []
    for token_id, position in zip(output.token_ids, output.logprobs):
        top = sorted((item for item in position.items() if num_top < 0 or item[1].rank <= num_top),
                     key=lambda item: item[1].rank)
        content.append(entry(token_id, position[token_id]) | {"top_logprobs": [entry(*item) for item in top]})
    return {"content": content}


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    engine = ctx.engine
    engine.check_admission(body.n)  # refuse before rendering: overload should cost little
    given_id = client_request_id(raw_request.headers, body.request_id)
    request_id = f"chatcmpl-{given_id or uuid.uuid4().hex}"  # the answer's id, as vLLM's
    engine_id = engine_request_id(request_id, given_id is not None)
    spans = start_request_spans(schema.OPERATION_CHAT, model, engine_id, redact_inputs=ctx.redact_inputs)
    try:
        constraint, constrained_field, make_calls = chat_constraint(ctx, body)
        prompt, params = await render_and_tokenize(
            ctx, spans, [m.as_template_message() for m in body.messages], body.add_generation_prompt,
            body.requested_max_tokens,
            lambda max_tokens: body.sampling_params(max_tokens, body.num_logprobs, ctx.sampling_defaults, constraint),
            continue_final_message=body.continue_final_message, template_kwargs=body.chat_template_kwargs,
            tools=body.template_tools,
        )
        stream = await add_constrained_request(engine, constrained_field, prompt, params, engine_id,
                                               priority=body.priority, spans=spans,
                                               lora_request=ctx.lora_request(body.model),
                                               output_kind=OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY)
    except InvalidInputError as error:
        spans.fail(error)
        if error.param == "logprobs":  # the engine's name for what chat calls top_logprobs
            raise APIError(400, str(error).replace("logprobs=", "top_logprobs=", 1), "top_logprobs") from error
        raise
    except Exception as error:
        spans.fail(error)
        raise
    answer = ChatAnswer(request_id, int(time.time()), model, len(prompt.prompt_token_ids), params.n,
                        body.top_logprobs or 0, ctx.tokens_as_ids(body.return_tokens_as_token_ids), make_calls)
    if body.stream:
        events = chat_stream(answer, stream, body.include_usage, body.echoed_text, body.continuous_usage)
        return EventStreamResponse(guard_stream(events), [stream])

    outputs = await final_outputs_unless_disconnected([stream], raw_request)
    if outputs is None:
        return Response(status_code=499)
    [output] = outputs
    choices = []
    for c in output.outputs:
        calls = make_calls() if make_calls else None
        message = {"role": "assistant", **(calls.message(c.text) if calls else {"content": c.text})}
        if body.echoed_text:
            message["content"] = body.echoed_text + (message.get("content") or "")
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c, answer.num_top, answer.tokens_as_ids),
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
        "prompt_logprobs": prompt_logprobs_json(output) if body.prompt_logprobs is not None else None,
        "kv_transfer_params": output.kv_transfer_params,  # vLLM's: where a disaggregated prefill's K/V wait
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
    tokens_as_ids: bool  # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    make_calls: Callable[[], ToolCallDeltas] | None  # tool calls read out of the text (ToolCallPlan)

    def chunk(self, choices: list, **extra) -> str:
        return sse_data({"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": choices, **extra})


async def chat_stream(answer: ChatAnswer, stream, include_usage: bool, echoed: str = "",
                      continuous_usage: bool = False) -> AsyncIterator[str]:
    """Stage ⑨ for a streamed chat: with the first RequestOutput, as vLLM, a role chunk per choice (and the
    echoed text's, with echo); then each RequestOutput's delta as chunks. A client's first chunk is thus the
    first token's. With continuous_usage (vLLM's continuous_usage_stats) every chunk carries the usage so
    far: the prompt's tokens and its own choice's generated ones, as vLLM counts."""
    generated = [0] * answer.n  # per choice

    def so_far(index: int) -> dict:
        return {"usage": running_usage(answer.num_prompt_tokens, generated[index])} if continuous_usage else {}

    def opening() -> Iterator[str]:
        for index in range(answer.n):
            yield answer.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **so_far(index))
            if echoed:
                yield answer.chunk([{"index": index, "delta": {"content": echoed}, "logprobs": None,
                                     "finish_reason": None}], **so_far(index))

    num_generated = num_cached = 0
    opened = False
    calls = [answer.make_calls() for _ in range(answer.n)] if answer.make_calls else None
    async for output in stream:
        if not opened:
            opened = True
            for chunk in opening():
                yield chunk
        num_cached = output.num_cached_tokens
        for c in output.outputs:
            num_generated += len(c.token_ids)
            generated[c.index] += len(c.token_ids)
            if not c.text and not c.finished() and c.logprobs is None and (calls or not c.token_ids):
                # Nothing new. Without tool calls, a token whose text is held back (half a character, maybe a
                # stop string) still gets its chunk, {"content": ""}, as in vLLM; the tool-call reader waits.
                continue
            finish_reason = c.finish_reason
            if calls:  # the text read as content and tool calls (tool_calls.py)
                deltas = calls[c.index].feed(c.text, c.finished()) or [{}]
                finish_reason = calls[c.index].finish_reason(c.finish_reason)
            else:
                deltas = [{"content": c.text} if c.text or not c.finished() else {}]
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                yield answer.chunk([{"index": c.index, "delta": delta,
                                     "logprobs": chat_logprobs(c, answer.num_top, answer.tokens_as_ids) if last else None,
                                     "finish_reason": finish_reason if last else None,
                                     **({"stop_reason": c.stop_reason} if c.finished() and last else {})}],
                                   **so_far(c.index))
    if not opened:  # a stream that ended without an output still opens
        for chunk in opening():
            yield chunk
    if include_usage:
        yield answer.chunk([], usage=usage(answer.num_prompt_tokens, num_generated, num_cached))
