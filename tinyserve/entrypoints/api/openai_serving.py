"""POST /v1/chat/completions and /v1/completions (stage ① in, stage ⑨ out).

Each handler validates the body, renders and tokenizes the prompt, turns the
body into SamplingParams, and either streams SSE chunks as RequestOutput deltas
arrive or waits for the final output and answers with one JSON body.
"""

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tinyserve.engine.async_llm import AsyncLLM
from tinyserve.engine.core_client import EngineDeadError
from tinyserve.engine.input_processor import ProcessedPrompt
from tinyserve.engine.output_processor import OutputKind
from tinyserve.entrypoints.api.errors import APIError, openai_error_body
from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from tinyserve.entrypoints.api.sse import run_unless_disconnected, sse_data
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import NO_SPANS, start_request_spans
from tinyserve.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class ServingContext:
    engine: AsyncLLM
    model_names: list[str]  # the first is the one reported in responses
    redact_inputs: bool = False  # traces keep token counts but no text or token ids

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist. Available: {self.model_names}", "model")
        return self.model_names[0]

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None) -> int:
        """vLLM's rule: default to the rest of the context; refuse what cannot fit."""
        max_model_len = self.engine.model_info.max_model_len
        if num_prompt_tokens >= max_model_len and requested is None:
            raise APIError(400, f"prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len}", "messages")
        if requested is None:
            return max_model_len - num_prompt_tokens
        if num_prompt_tokens + requested > max_model_len:
            excess = num_prompt_tokens + requested - max_model_len
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
                f"completion), {excess} too many. Reduce the prompt or max_tokens.",
                "max_tokens",
            )
        return requested


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _tokenize(ctx: ServingContext, prompt, *, add_special_tokens: bool = True) -> ProcessedPrompt:
    try:
        processed = ctx.engine.input_processor.tokenize_prompt(prompt, add_special_tokens=add_special_tokens)
        ctx.engine.model_info.validate_prompt(processed.prompt_token_ids)
    except ValueError as error:
        raise APIError(400, str(error), "prompt") from error
    return processed


async def _final_output(ctx: ServingContext, prompt, params, request_id, priority, spans=NO_SPANS) -> RequestOutput:
    final = None
    async for output in ctx.engine.generate(prompt, params, request_id, output_kind=OutputKind.FINAL_ONLY,
                                            priority=priority, spans=spans):
        final = output
    return final


def _stream_response(events: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _guard_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """End a stream with an error event, never a hang, when the engine fails mid-stream."""
    try:
        async for event in events:
            yield event
    except (EngineDeadError, ValueError) as error:
        status = 503 if isinstance(error, EngineDeadError) else 400
        yield sse_data(openai_error_body(status, str(error)))
    yield sse_data("[DONE]")


# ---- chat ------------------------------------------------------------------


def chat_logprobs(tokenizer, output: CompletionOutput, num_top: int) -> dict | None:
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


def render_and_tokenize(ctx: ServingContext, spans, messages: list[dict], add_generation_prompt: bool,
                        requested_max_tokens: int | None, make_params):
    """Stage ②: template, tokenize, check lengths, build SamplingParams — logged on the render span."""
    with spans.stage(schema.RENDER) as render_span:
        try:
            text = ctx.engine.input_processor.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except ValueError as error:
            raise APIError(400, str(error), "messages") from error
        prompt = _tokenize(ctx, text, add_special_tokens=False)
        max_tokens = ctx.max_tokens_for(len(prompt.prompt_token_ids), requested_max_tokens)
        try:
            params = make_params(max_tokens)
        except ValueError as error:
            raise APIError(400, str(error)) from error
        spans.log_inputs(render_span, prompt=text, prompt_token_ids=prompt.prompt_token_ids, sampling_params=params,
                         messages=messages)
    return prompt, params


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    engine = ctx.engine
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    spans = start_request_spans(schema.OPERATION_CHAT, model, request_id, redact_inputs=ctx.redact_inputs)
    try:
        prompt, params = render_and_tokenize(
            ctx, spans, [m.as_template_message() for m in body.messages], body.add_generation_prompt,
            body.requested_max_tokens, lambda max_tokens: body.sampling_params(max_tokens, body.num_logprobs),
        )
    except Exception as error:
        spans.fail(error)
        raise
    created = int(time.time())
    num_top = body.top_logprobs or 0

    if body.stream:
        return _stream_response(_guard_stream(_chat_stream(ctx, body, prompt, params, request_id, created, model, num_top, spans)))

    output = await run_unless_disconnected(_final_output(ctx, prompt, params, request_id, body.priority, spans), raw_request)
    if output is None:
        return Response(status_code=499)
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": chat_logprobs(engine.tokenizer, c, num_top),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in output.outputs
    ]
    num_generated = sum(len(c.token_ids) for c in output.outputs)
    return JSONResponse({
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": _usage(len(prompt.prompt_token_ids), num_generated),
    })


async def _chat_stream(ctx, body, prompt, params, request_id, created, model, num_top, spans) -> AsyncIterator[str]:
    def chunk(choices, **extra):
        return sse_data({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                         "choices": choices, **extra})

    for index in range(params.n):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}])
    num_generated = 0
    async for output in ctx.engine.generate(prompt, params, request_id, output_kind=OutputKind.DELTA,
                                            priority=body.priority, spans=spans):
        for c in output.outputs:
            num_generated += len(c.token_ids)
            if not c.text and not c.finished and c.logprobs is None:
                continue  # nothing to show yet (e.g. held back: half a character, maybe a stop string)
            delta = {"content": c.text} if c.text else {}
            yield chunk([{"index": c.index, "delta": delta, "logprobs": chat_logprobs(ctx.engine.tokenizer, c, num_top),
                          "finish_reason": c.finish_reason, **({"stop_reason": c.stop_reason} if c.finished else {})}])
    if body.include_usage:
        yield chunk([], usage=_usage(len(prompt.prompt_token_ids), num_generated))


# ---- completions -------------------------------------------------------------


def completion_logprobs(output: CompletionOutput, num_top: int, text_start: int) -> dict | None:
    if output.logprobs is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = text_start
    for token_id, position in zip(output.token_ids, output.logprobs):
        sampled = position[token_id]
        tokens.append(sampled.decoded_token)
        token_logprobs.append(sampled.logprob)
        top_logprobs.append({lp.decoded_token: lp.logprob for lp in sorted(position.values(), key=lambda lp: lp.rank)
                             if lp.rank <= max(num_top, 0)} or None)
        text_offset.append(offset)
        offset += len(sampled.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    prompts = body.prompts
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    processed, params_list, spans_list = [], [], []
    for index, text_or_ids in enumerate(prompts):
        spans = start_request_spans(schema.OPERATION_TEXT_COMPLETION, model, f"{request_id}-{index}",
                                    redact_inputs=ctx.redact_inputs)
        spans_list.append(spans)
        try:
            with spans.stage(schema.RENDER) as render_span:
                prompt = _tokenize(ctx, text_or_ids)
                max_tokens = ctx.max_tokens_for(len(prompt.prompt_token_ids), body.max_tokens)
                try:
                    params = body.sampling_params(max_tokens, body.logprobs)
                except ValueError as error:
                    raise APIError(400, str(error)) from error
                spans.log_inputs(render_span, prompt=prompt.prompt, prompt_token_ids=prompt.prompt_token_ids,
                                 sampling_params=params)
        except Exception as error:
            for opened in spans_list:
                opened.fail(error)
            raise
        processed.append(prompt)
        params_list.append(params)
    created = int(time.time())
    tokenizer = ctx.engine.tokenizer
    echo_texts = [
        (p.prompt if p.prompt is not None else tokenizer.decode(p.prompt_token_ids)) if body.echo else "" for p in processed
    ]
    num_top = body.logprobs or 0

    if body.stream:
        return _stream_response(_guard_stream(
            _completion_stream(ctx, body, processed, params_list, spans_list, request_id, created, model, echo_texts, num_top)
        ))

    async def run_all():
        return await asyncio.gather(*[
            _final_output(ctx, p, params, f"{request_id}-{i}", body.priority, spans)
            for i, (p, params, spans) in enumerate(zip(processed, params_list, spans_list))
        ])

    outputs = await run_unless_disconnected(run_all(), raw_request)
    if outputs is None:
        return Response(status_code=499)
    choices, num_generated = [], 0
    for prompt_index, output in enumerate(outputs):
        for c in output.outputs:
            num_generated += len(c.token_ids)
            echo = echo_texts[prompt_index]
            choices.append({
                "index": prompt_index * body.n + c.index,
                "text": echo + c.text,
                "logprobs": completion_logprobs(c, num_top, len(echo)),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
    num_prompt = sum(len(p.prompt_token_ids) for p in processed)
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "usage": _usage(num_prompt, num_generated),
    })


async def _completion_stream(ctx, body, processed, params_list, spans_list, request_id, created, model, echo_texts,
                             num_top):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(prompt_index, prompt, params, spans):
        try:
            async for output in ctx.engine.generate(prompt, params, f"{request_id}-{prompt_index}",
                                                    output_kind=OutputKind.DELTA, priority=body.priority, spans=spans):
                await queue.put((prompt_index, output))
        except BaseException as error:  # delivered to the consumer, which re-raises it
            await queue.put((prompt_index, error))
        finally:
            await queue.put((prompt_index, None))

    tasks = [asyncio.create_task(pump(i, p, params, spans))
             for i, (p, params, spans) in enumerate(zip(processed, params_list, spans_list))]
    echoed = set()
    num_generated, remaining = 0, len(tasks)
    try:
        while remaining:
            prompt_index, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            for c in item.outputs:
                num_generated += len(c.token_ids)
                index = prompt_index * body.n + c.index
                prefix = ""
                if body.echo and index not in echoed:
                    echoed.add(index)
                    prefix = echo_texts[prompt_index]
                if not c.text and not prefix and not c.finished and c.logprobs is None:
                    continue
                yield sse_data({
                    "id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": prefix + c.text, "logprobs": completion_logprobs(c, num_top, 0),
                                 "finish_reason": c.finish_reason,
                                 **({"stop_reason": c.stop_reason} if c.finished else {})}],
                })
        if body.include_usage:
            num_prompt = sum(len(p.prompt_token_ids) for p in processed)
            yield sse_data({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": _usage(num_prompt, num_generated)})
    finally:
        for task in tasks:
            task.cancel()
