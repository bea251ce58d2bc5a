"""POST /v1/chat/completions: vLLM's chat handler (stage ① in, stage ⑨ out).

`create_chat_completion` renders the conversation (serving_engine.render_and_tokenize; its token ids
truncated to truncate_prompt_tokens when asked, truncation.py), adds the request, and answers with one
body, or with `chat_stream`'s SSE chunks.
"""

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.entrypoints.api.answer_layers import ChoiceReader, Reading, ReadingRequest
from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest
from tinyserve.entrypoints.api.per_request_metrics import per_request_metrics
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
from tinyserve.entrypoints.api.truncation import prompt_truncation
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import NO_SPANS, start_request_spans
from tinyserve.errors import InvalidInputError
from tinyserve.outputs import CompletionOutput, RequestOutput


def chat_constraint(ctx: ServingContext, body: ChatCompletionRequest) -> ToolCallPlan:
    return tool_call_plan(ctx, *body.constraint(), body.effective_tool_choice, body.tools, body.parallel_tool_calls)


def chat_logprobs(output: CompletionOutput, num_top: int | None, as_token_id: bool = False) -> dict | None:
    """OpenAI's chat logprobs of a choice: each token with its `num_top` most likely alternatives (-1: all
    the engine sent, the whole vocabulary); tokens named "token_id:N" with as_token_id. num_top None
    (logprob_token_ids): every token the engine sent, in its order (the sampled one, then those asked
    for), as vLLM gives them."""
    if output.logprobs is None:
        return None

    def entry(token_id: int, lp) -> dict:
        token = logprob_token(token_id, lp.decoded_token, as_token_id)
        return {"token": token, "logprob": json_logprob(lp.logprob), "bytes": list((token or "").encode())}

    content = []
    for token_id, position in zip(output.token_ids, output.logprobs):
        if num_top is None:
            content.append(entry(token_id, position[token_id])
                           | {"top_logprobs": [entry(*item) for item in position.items()]})
            continue
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
    truncation = prompt_truncation(body.truncate_prompt_tokens, body.truncation_side, engine.model_info.max_model_len)
    spans = start_request_spans(schema.OPERATION_CHAT, model, engine_id, redact_inputs=ctx.redact_inputs)
    try:
        constraint, constrained_field, make_calls = chat_constraint(ctx, body)
        template_kwargs = ctx.answer_layers.template_kwargs(body.chat_template_kwargs, body.reasoning_effort)
        with engine.observers.observing(engine_id, spans):  # the front end finds them by the request's id
            prompt, params = await render_and_tokenize(
                ctx, engine_id, [m.as_template_message() for m in body.messages], body.add_generation_prompt,
                body.requested_max_tokens,
                lambda max_tokens: body.sampling_params(max_tokens, body.num_logprobs, ctx.sampling_defaults,
                                                        constraint),
                continue_final_message=body.continue_final_message, template_kwargs=template_kwargs,
                tools=body.template_tools, truncation=truncation,
            )
            reading = ctx.answer_layers.reading(ReadingRequest(  # the answer layers' (a reasoning parser's)
                prompt.prompt_token_ids, template_kwargs, body.include_reasoning,
                constrained_field if constraint is not None else None))
            stream = await add_constrained_request(
                engine, constrained_field, prompt, params, engine_id, priority=body.priority,
                lora_request=ctx.lora_request(body.model), reasoning_end=reading.reasoning_end,
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
                        None if body.logprob_token_ids else body.top_logprobs or 0,
                        ctx.tokens_as_ids(body.return_tokens_as_token_ids), make_calls, reading, spans,
                        per_request_metrics=ctx.per_request_metrics and body.n == 1,
                        prompt_token_ids=prompt.prompt_token_ids if body.return_token_ids else None)
    if body.stream:
        events = chat_stream(answer, stream, body.include_usage, body.echoed_text, body.continuous_usage)
        return EventStreamResponse(guard_stream(events), [stream])

    outputs = await final_outputs_unless_disconnected([stream], raw_request)
    if outputs is None:
        return Response(status_code=499)
    [output] = outputs
    answered = chat_completion_body(answer, body, output)
    reading.finish(spans)
    return JSONResponse(answered)


@dataclass(slots=True)
class ChatAnswer:
    """What every chunk (or the one body) of a chat answer repeats, and how its choices are read."""

    request_id: str
    created: int
    model: str
    num_prompt_tokens: int
    n: int
    num_top: int | None  # top_logprobs; None: logprob_token_ids (chat_logprobs)
    tokens_as_ids: bool  # return_tokens_as_token_ids: logprob tokens as "token_id:N"
    make_calls: Callable[[], ToolCallDeltas] | None  # tool calls read out of the text (ToolCallPlan)
    # the answer layers' reading of the choices (answer_layers.py: a reasoning parser's); none: the text is the content
    reading: Reading = field(default_factory=lambda: Reading([]))
    spans: object = NO_SPANS  # the request's, where the answer layers record what they read
    per_request_metrics: bool = False  # --enable-per-request-metrics, and one sequence: the usage chunk's `metrics`
    # return_token_ids: the prompt's ids (on each choice's role chunk), and each chunk's own as its choice's token_ids
    prompt_token_ids: list[int] | None = None

    def chunk(self, choices: list, **extra) -> str:
        return sse_data({"id": self.request_id, "object": "chat.completion.chunk", "created": self.created,
                         "model": self.model, "choices": choices, **extra})


def chat_completion_body(answer: ChatAnswer, body: ChatCompletionRequest, output: RequestOutput) -> dict:
    """The one body of a non-streamed chat answer: each choice's message (its tool calls read out of the text),
    then the usage."""
    choices = []
    for c in output.outputs:
        calls = answer.make_calls() if answer.make_calls else None
        reader = answer.reading.choice()
        content = whole_content(reader, c)
        message = {"role": "assistant", **(calls.message(content) if calls and content is not None
                                           else {"content": content}), **reader.message_fields()}
        if body.echoed_text:
            message["content"] = body.echoed_text + (message.get("content") or "")
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c, answer.num_top, answer.tokens_as_ids),
            "finish_reason": calls.finish_reason(c.finish_reason) if calls else c.finish_reason,
            "stop_reason": c.stop_reason,
            **({"token_ids": c.token_ids} if body.return_token_ids else {}),
        })
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    return {
        "id": answer.request_id,
        "object": "chat.completion",
        "created": answer.created,
        "model": answer.model,
        "choices": choices,
        "usage": usage(answer.num_prompt_tokens, num_generated, output.num_cached_tokens,
                       answer.reading.usage_details()),
        "prompt_logprobs": prompt_logprobs_json(output) if body.prompt_logprobs is not None else None,
        **({"prompt_token_ids": answer.prompt_token_ids} if body.return_token_ids else {}),  # vLLM's
        "kv_transfer_params": output.kv_transfer_params,  # vLLM's: where a disaggregated prefill's K/V wait
        **({"metrics": per_request_metrics(output.metrics, num_generated)} if answer.per_request_metrics else {}),
    }


def whole_content(reader: ChoiceReader, c: CompletionOutput) -> str | None:
    """A whole choice's content as the answer layers leave it (its text, with none); None when they left none."""
    parts = [delta["content"] for delta in reader.read(c.text, c.token_ids, finished=True) if "content" in delta]
    return "".join(parts) if parts else None


def message_deltas(parts: list[dict], calls: ToolCallDeltas | None, finished: bool) -> list[dict]:
    """A piece's deltas as the answer layers read it, the content then read for tool calls (with calls)."""
    if calls is None:
        return [delta for delta in parts if delta != {"content": ""} or not finished] or [{}]
    deltas = [out for delta in parts for out in (calls.feed(delta["content"], False) if "content" in delta
                                                   else [delta])]
    return (deltas + (calls.feed("", True) if finished else [])) or [{}]


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
            prompt_ids = {} if answer.prompt_token_ids is None else {"prompt_token_ids": answer.prompt_token_ids}
            yield answer.chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **so_far(index), **prompt_ids)
            if echoed:
                yield answer.chunk([{"index": index, "delta": {"content": echoed}, "logprobs": None,
                                     "finish_reason": None}], **so_far(index))

    num_generated = num_cached = 0
    opened, times = False, None  # times: the engine's timestamps, on the last output
    calls = [answer.make_calls() for _ in range(answer.n)] if answer.make_calls else None
    readers = [answer.reading.choice() for _ in range(answer.n)]
    async for output in stream:
        if not opened:
            opened = True
            for chunk in opening():
                yield chunk
        num_cached = output.num_cached_tokens
        times = output.metrics or times
        for c in output.outputs:
            num_generated += len(c.token_ids)
            generated[c.index] += len(c.token_ids)
            with_ids = answer.prompt_token_ids is not None
            if not c.text and not c.finished() and c.logprobs is None and (calls and not with_ids or not c.token_ids):
                # Nothing new. Without tool calls, a token whose text is held back (half a character, maybe a
                # stop string) still gets its chunk, {"content": ""}, as in vLLM; the tool-call reader waits.
                continue
            parts = readers[c.index].read(c.text, c.token_ids, c.finished())  # content, and the layers' own
            if not parts and not c.finished() and c.logprobs is None and not with_ids:
                continue  # a marker the layers dropped (</think>, say): no chunk, as in vLLM
            deltas = message_deltas(parts, calls[c.index] if calls else None, c.finished())  # with tool calls
            finish_reason = calls[c.index].finish_reason(c.finish_reason) if calls else c.finish_reason
            for i, delta in enumerate(deltas):
                last = i == len(deltas) - 1
                yield answer.chunk([{"index": c.index, "delta": delta,
                                     "logprobs": chat_logprobs(c, answer.num_top, answer.tokens_as_ids) if last else None,
                                     "finish_reason": finish_reason if last else None,
                                     **({"stop_reason": c.stop_reason} if c.finished() and last else {}),
                                     **({"token_ids": c.token_ids if last else []} if with_ids else {})}],
                                   **so_far(c.index))
    if not opened:  # a stream that ended without an output still opens
        for chunk in opening():
            yield chunk
    if include_usage:
        metrics = {"metrics": per_request_metrics(times, num_generated)} if answer.per_request_metrics else {}
        yield answer.chunk([], usage=usage(answer.num_prompt_tokens, num_generated, num_cached,
                                           answer.reading.usage_details()), **metrics)
    answer.reading.finish(answer.spans)
