"""POST /v1/completions (stage ① in, stage ⑨ out): one or more prompts, text or token ids.

Each prompt is its own engine request (with its own request span), all sent
before the answer starts: if one cannot be sent, none stays. A streamed answer
interleaves the prompts' chunks as they come, indexed prompt × n + sample.
"""

import asyncio
import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.frontend.request_stream import RequestStream
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.entrypoints.api.answer_layers import ReadingRequest
from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.openai_protocol import CompletionRequest
from tinyserve.entrypoints.api.per_request_metrics import per_request_metrics
from tinyserve.entrypoints.api.request_ids import client_request_id, engine_request_id
from tinyserve.entrypoints.api.serving_engine import (
    ServingContext,
    add_constrained_request,
    guard_stream,
    json_logprob,
    logprob_token,
    prompt_logprobs_json,
    running_usage,
    tokenize,
    usage,
)
from tinyserve.entrypoints.api.sse import EventStreamResponse, close_all, final_outputs_unless_disconnected, sse_data
from tinyserve.entrypoints.api.truncation import fitted_max_tokens, prompt_truncation
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.outputs import CompletionOutput, RequestOutput


def completion_logprobs(output: CompletionOutput, text_start: int, echoed: RequestOutput | None = None,
                        tokenizer=None, as_token_id: bool = False) -> dict | None:
    """The legacy logprobs object; text_start is the text_offset of its first token.

    Each position's top_logprobs holds the sampled token and the `logprobs` most likely
    ones (so logprobs + 1 entries when the sampled token is not among them), as OpenAI's
    legacy API and vLLM give it. With `echoed` (echo=true) the prompt's tokens come first,
    scored by its prompt logprobs; the first has none (null), as nothing predicts it.
    With as_token_id (return_tokens_as_token_ids) every token is named "token_id:N", and
    text_offset counts those names, as vLLM counts them.
    """
    if output.logprobs is None:
        return None
    token_ids, positions = output.token_ids, output.logprobs
    if echoed is not None and echoed.prompt_logprobs is not None:
        token_ids = echoed.prompt_token_ids + token_ids
        positions = echoed.prompt_logprobs + positions
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = text_start
    for token_id, position in zip(token_ids, positions):
        if position is None:
            text = logprob_token(token_id, tokenizer.decode([token_id]), as_token_id)
            tokens.append(text)
            token_logprobs.append(None)
            top_logprobs.append(None)
            text_offset.append(offset)
            offset += len(text)
            continue
        sampled = position[token_id]
        token = logprob_token(token_id, sampled.decoded_token, as_token_id)
        tokens.append(token)
        token_logprobs.append(json_logprob(sampled.logprob))
        # The engine sends the sampled token first, then the top ones by rank. Tokens whose
        # text is the same (byte fragments all read "\ufffd") share a key: the first one keeps it,
        # so the sampled token's own logprob is always found under its text.
        top = {}
        for top_id, lp in position.items():
            top.setdefault(logprob_token(top_id, lp.decoded_token, as_token_id), json_logprob(lp.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(token or "")
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offset}


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw_request: Request) -> Response:
    model = ctx.check_model(body.model)
    prompts = body.prompts
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    ctx.engine.check_admission(len(prompts) * body.n)  # all prompts or none
    given_id = client_request_id(raw_request.headers, body.request_id)
    request_id = f"cmpl-{given_id or uuid.uuid4().hex}"  # the answer's id, as vLLM's
    engine_id = engine_request_id(request_id, given_id is not None)  # each prompt's: engine_id-index
    truncation = prompt_truncation(body.truncate_prompt_tokens, body.truncation_side,
                                   ctx.engine.model_info.max_model_len)
    processed, params_list, spans_list = [], [], []
    for index, text_or_ids in enumerate(prompts):
        spans = start_request_spans(schema.OPERATION_TEXT_COMPLETION, model, f"{engine_id}-{index}",
                                    redact_inputs=ctx.redact_inputs)
        spans_list.append(spans)
        try:
            with spans.stage(schema.RENDER) as render_span:
                prompt, params = await _prompt_and_params(ctx, body, text_or_ids, truncation)
                spans.log_inputs(render_span, prompt=prompt.prompt, prompt_token_ids=prompt.prompt_token_ids,
                                 sampling_params=params, mm_features=prompt.mm_features)
        except Exception as error:
            for opened in spans_list:
                opened.fail(error)
            raise
        processed.append(prompt)
        params_list.append(params)
    streams = await _add_all(ctx, body, engine_id, processed, params_list, spans_list)
    created = int(time.time())
    tokenizer = ctx.engine.tokenizer
    as_token_id = ctx.tokens_as_ids(body.return_tokens_as_token_ids)
    # With return_token_ids the echoed prompt is its token ids alone, its text left out, as in vLLM.
    echo_texts = [
        (p.prompt if p.prompt is not None else tokenizer.decode(p.prompt_token_ids))
        if body.echo and not body.return_token_ids else "" for p in processed
    ]

    if body.stream:
        events = _completion_stream(body, streams, processed, request_id, created, model, echo_texts, tokenizer,
                                    as_token_id, ctx.per_request_metrics and len(streams) == 1 and body.n == 1)
        return EventStreamResponse(guard_stream(events), streams)

    outputs = await final_outputs_unless_disconnected(streams, raw_request)
    if outputs is None:
        return Response(status_code=499)
    with_metrics = ctx.per_request_metrics and len(outputs) == 1 and body.n == 1
    return JSONResponse(_completion_body(body, outputs, processed, request_id, created, model, echo_texts,
                                         tokenizer, as_token_id, with_metrics))


async def _prompt_and_params(ctx: ServingContext, body: CompletionRequest, text_or_ids, truncation):
    """One prompt tokenized (truncated if asked) and its SamplingParams, max_tokens fitted to what is left."""
    prompt = await tokenize(ctx, text_or_ids, truncation=truncation)
    # Echo only (max_tokens 0): the engine computes the prompt and one token, which is dropped.
    requested = 1 if body.echo_only else body.max_tokens
    if truncation is not None:  # capped to what is left, as vLLM caps it
        requested = fitted_max_tokens(requested, len(prompt.prompt_token_ids), ctx.engine.model_info.max_model_len)
    max_tokens = ctx.max_tokens_for(len(prompt.prompt_token_ids), requested)
    try:
        params = body.sampling_params(max_tokens, body.logprobs, ctx.sampling_defaults, body.constraint()[0])
        if body.echo and body.logprobs is not None and params.prompt_logprobs is None:
            params = params.clone(prompt_logprobs=body.logprobs)  # the echoed prompt is scored too
    except ValueError as error:
        raise APIError(400, str(error)) from error
    return prompt, ctx.engine.input_processor.seeded(params)  # traced: a seed, so the run replays


def _as_answered(output: CompletionOutput, body: CompletionRequest) -> CompletionOutput:
    """What the client is shown of a sample: with echo and max_tokens 0, none of the token the engine made."""
    if not body.echo_only:
        return output
    return dataclasses.replace(output, text="", token_ids=[], logprobs=None if output.logprobs is None else [],
                               finish_reason="length" if output.finished() else None, stop_reason=None)


def _completion_body(body: CompletionRequest, outputs: list[RequestOutput], processed, request_id: str,
                     created: int, model: str, echo_texts: list[str], tokenizer, as_token_id: bool,
                     with_metrics: bool = False) -> dict:
    """The one body of a non-streamed answer: every prompt's samples as choices (prompt × n + sample), then
    the usage of them all; with_metrics: --enable-per-request-metrics' `metrics`, for one sequence."""
    choices, num_generated = [], 0
    for prompt_index, output in enumerate(outputs):
        for c in output.outputs:
            c = _as_answered(c, body)
            num_generated += len(c.token_ids)
            echo = echo_texts[prompt_index]
            choices.append({
                "index": prompt_index * body.n + c.index,
                "text": echo + c.text,
                "logprobs": completion_logprobs(c, 0, output if body.echo else None, tokenizer, as_token_id),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(output) if body.prompt_logprobs is not None else None,
                **({"prompt_token_ids": processed[prompt_index].prompt_token_ids, "token_ids": c.token_ids}
                   if body.return_token_ids else {}),
            })
    num_prompt = sum(len(p.prompt_token_ids) for p in processed)
    num_cached = sum(output.num_cached_tokens for output in outputs)
    return {
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": choices, "usage": usage(num_prompt, num_generated, num_cached),
        "kv_transfer_params": outputs[0].kv_transfer_params,  # vLLM's: a disaggregated prefill's (the first prompt's)
        **({"metrics": per_request_metrics(outputs[0].metrics, num_generated)} if with_metrics else {}),
    }


async def _add_all(ctx, body, engine_id, processed, params_list, spans_list) -> list[RequestStream]:
    """Send one engine request per prompt (engine_id-index); if one cannot be sent, none stays. A constraint
    starts where the answer layers say, by each prompt's tokens: with a reasoning parser and a prompt that leaves
    the reasoning open, after it, as vLLM's engine starts it (the text stays whole: no layer reads it)."""
    streams = []
    kind = OutputKind.DELTA if body.stream else OutputKind.FINAL_ONLY
    field = body.constraint()[1]
    try:
        for index, (prompt, params, spans) in enumerate(zip(processed, params_list, spans_list)):
            reasoning_end = ctx.answer_layers.reasoning_end(ReadingRequest(prompt.prompt_token_ids, None,
                                                                           constrained_field=field))
            with ctx.engine.observers.observing(f"{engine_id}-{index}", spans):  # found by the request's id
                streams.append(await add_constrained_request(ctx.engine, field, prompt, params,
                                                             f"{engine_id}-{index}", output_kind=kind,
                                                             priority=body.priority, reasoning_end=reasoning_end,
                                                             lora_request=ctx.lora_request(body.model)))
    except Exception as error:
        for spans in spans_list:
            spans.fail(error)
        await close_all(streams)
        raise
    return streams


async def _completion_stream(body, streams, processed, request_id, created, model, echo_texts, tokenizer,
                             as_token_id, with_metrics: bool = False):
    queue: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(queue, i, stream)) for i, stream in enumerate(streams)]
    echoed = set()
    ids_sent = set()  # return_token_ids: the choices whose prompt_token_ids went out, with their first chunk
    next_offsets: dict[int, int] = {}  # per choice index, the next token's text_offset
    num_generated, remaining = 0, len(tasks)
    generated: dict[int, int] = {}  # per choice index: its tokens so far (continuous_usage_stats counts them)
    num_cached = [0] * len(streams)
    times = None  # the engine's timestamps, on the last output (with_metrics: of the one prompt)
    try:
        while remaining:
            prompt_index, item = await queue.get()
            if item is None:
                remaining -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            num_cached[prompt_index] = item.num_cached_tokens
            times = item.metrics or times
            for c in item.outputs:
                c = _as_answered(c, body)
                num_generated += len(c.token_ids)
                index = prompt_index * body.n + c.index
                generated[index] = generated.get(index, 0) + len(c.token_ids)
                prefix = ""
                if body.echo and index not in echoed:
                    echoed.add(index)
                    prefix = echo_texts[prompt_index]
                if not c.text and not prefix and not c.token_ids and not c.finished() and not c.logprobs:
                    continue  # nothing new. A token whose text is held back (half a character, maybe a stop
                    # string) still gets its chunk, with "text": "", as in vLLM: its first token is its first chunk
                ids = _token_ids_fields(body, c, index, ids_sent, processed[prompt_index].prompt_token_ids)
                # The echoed prompt's tokens come first, in the chunk that carries the prompt text.
                logprobs = completion_logprobs(c, next_offsets.get(index, 0), item if prefix else None, tokenizer,
                                               as_token_id)
                if logprobs is not None and logprobs["tokens"]:
                    # Counted in token texts, as a non-streamed answer counts them: the streamed
                    # text can lag behind its tokens (an unfinished character is held back).
                    next_offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1] or "")
                yield sse_data({
                    "id": request_id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": index, "text": prefix + c.text, "logprobs": logprobs,
                                 "finish_reason": c.finish_reason,
                                 **({"stop_reason": c.stop_reason} if c.finished() else {}), **ids}],
                    # vLLM's continuous_usage_stats: the usage so far of this choice, with its prompt's tokens
                    **({"usage": running_usage(len(processed[prompt_index].prompt_token_ids), generated[index])}
                       if body.continuous_usage else {}),
                })
        if body.include_usage:
            num_prompt = sum(len(p.prompt_token_ids) for p in processed)
            yield sse_data({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage(num_prompt, num_generated, sum(num_cached)),
                            **({"metrics": per_request_metrics(times, num_generated)} if with_metrics else {})})
    finally:
        for task in tasks:
            task.cancel()


def _token_ids_fields(body: CompletionRequest, c: CompletionOutput, index: int, ids_sent: set[int],
                      prompt_token_ids: list[int]) -> dict:
    """return_token_ids (vLLM's): each chunk's own tokens; the prompt's with its choice's first chunk."""
    if not body.return_token_ids:
        return {}
    ids = {"token_ids": c.token_ids}
    if index not in ids_sent:
        ids_sent.add(index)
        ids["prompt_token_ids"] = prompt_token_ids
    return ids


async def _pump(queue: asyncio.Queue, prompt_index: int, stream: RequestStream) -> None:
    """One prompt's outputs into the queue the stream interleaves, tagged with the prompt; then its error, if it
    failed, and None when it is done."""
    try:
        async for output in stream:
            await queue.put((prompt_index, output))
    except BaseException as error:  # delivered to the consumer, which re-raises it
        await queue.put((prompt_index, error))
    finally:
        await queue.put((prompt_index, None))
