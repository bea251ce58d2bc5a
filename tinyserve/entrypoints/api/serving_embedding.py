"""POST /v1/embeddings and /pooling (stage ① in, stage ⑨ out) on a pooling server (--runner pooling).

Each input is its own engine request, with its own request span (operation "embeddings"),
all sent before any answer: the engine batches them like prompts to prefill. Each comes
back once, finished, with its vector (frontend/pooling_output.py); there is nothing to
stream. On a generating server both routes answer a 400 saying what the model is served as.
"""

import base64
import json
import sys
import time
import uuid

import torch
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.pooling_protocol import EmbeddingRequest, PoolingRequest
from tinyserve.entrypoints.api.request_ids import client_request_id, engine_request_id
from tinyserve.entrypoints.api.serving_engine import ServingContext, tokenize
from tinyserve.entrypoints.api.sse import close_all, final_outputs_unless_disconnected
from tinyserve.entrypoints.api.truncation import prompt_truncation
from tinyserve.errors import InvalidInputError
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.frontend.render import ProcessedPrompt


async def create_embedding(ctx: ServingContext, body: EmbeddingRequest, raw_request: Request) -> Response:
    return await _pool(ctx, body, raw_request, "Embeddings", "embd", "embedding", "embedding")


async def create_pooling(ctx: ServingContext, body: PoolingRequest, raw_request: Request) -> Response:
    return await _pool(ctx, body, raw_request, "Pooling", "pool", "pooling", "data")


async def _pool(ctx: ServingContext, body: EmbeddingRequest, raw_request: Request, api_name: str, id_prefix: str,
                item_object: str, item_field: str) -> Response:
    """Send one pooling request per input, wait for all, answer their vectors as `item_field` of each item."""
    model = ctx.check_model(body.model)
    inputs = body.inputs
    if not inputs:
        raise APIError(400, "input must not be empty", "input")
    pad_id = _pad_token_id(ctx, body)
    params = _pooling_params(ctx, body, api_name)
    truncation = prompt_truncation(body.truncate_prompt_tokens, body.truncation_side,
                                   ctx.engine.model_info.max_model_len, pooling=True)
    ctx.engine.check_admission(len(inputs))  # all inputs or none
    given_id = client_request_id(raw_request.headers, body.request_id)
    request_id = f"{id_prefix}-{given_id or uuid.uuid4().hex}"
    engine_id = engine_request_id(request_id, given_id is not None)  # each input's: engine_id-index
    processed, streams, spans_list = [], [], []
    try:
        for index, text_or_ids in enumerate(inputs):
            spans = start_request_spans(schema.OPERATION_EMBEDDINGS, model, f"{engine_id}-{index}",
                                        redact_inputs=ctx.redact_inputs)
            spans_list.append(spans)
            with spans.stage(schema.RENDER) as render_span:
                prompt = await _input_prompt(ctx, body, text_or_ids, truncation, pad_id)
                spans.log_inputs(render_span, prompt=prompt.prompt, prompt_token_ids=prompt.prompt_token_ids,
                                 sampling_params=params)
            processed.append(prompt)
            with ctx.engine.observers.observing(f"{engine_id}-{index}", spans):  # found by the request's id
                streams.append(await ctx.engine.add_request(prompt, params, f"{engine_id}-{index}",
                                                            output_kind=OutputKind.FINAL_ONLY, priority=body.priority))
    except Exception as error:
        for spans in spans_list:
            spans.fail(error)
        await close_all(streams)
        if isinstance(error, InvalidInputError):
            raise APIError(400, str(error), error.param) from error
        raise
    outputs = await final_outputs_unless_disconnected(streams, raw_request)
    if outputs is None:
        return Response(status_code=499)
    if any(output.outputs is None for output in outputs):  # aborted in the engine (the server is shutting down)
        raise APIError(503, "the request was aborted before its embedding was computed")
    num_prompt = sum(len(p.prompt_token_ids) for p in processed)
    created = int(time.time())
    if body.encoding_format in ("bytes", "bytes_only"):
        return _bytes_response(body, [output.outputs.data for output in outputs], request_id, created, model,
                               num_prompt)
    data = [{"index": index, "object": item_object,
             item_field: _encode(output.outputs.data, body.encoding_format, body.embed_dtype, body.endianness)}
            for index, output in enumerate(outputs)]
    return JSONResponse({
        "id": request_id, "object": "list", "created": created, "model": model, "data": data,
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })


def _pooling_params(ctx: ServingContext, body: EmbeddingRequest, api_name: str):
    """The request's PoolingParams, checked against what the server runs (a generating one: a 400 saying so)."""
    try:
        params = body.pooling_params()
    except InvalidInputError as error:
        raise APIError(400, str(error), error.param) from error
    try:
        ctx.engine.input_processor.check_runner(params)
    except InvalidInputError as error:
        raise APIError(400, f"The model does not support {api_name} API: {error}", "model") from error
    return params


async def _input_prompt(ctx: ServingContext, body: EmbeddingRequest, text_or_ids, truncation, pad_id: int | None):
    """One input tokenized: a conversation rendered (pooling_protocol.py), or text or token ids; truncated if
    asked, and padded to max_model_len tokens with the pad token for padding "max_length"."""
    if body.messages is not None:
        prompt = await _render(ctx, body, text_or_ids, truncation)
    else:
        prompt = await tokenize(ctx, text_or_ids, add_special_tokens=body.special_tokens, truncation=truncation)
    if pad_id is not None:
        prompt.prompt_token_ids = prompt.prompt_token_ids + [pad_id] * (
            ctx.engine.model_info.max_model_len - len(prompt.prompt_token_ids))
    return prompt


async def _render(ctx: ServingContext, body: EmbeddingRequest, messages: list[dict], truncation):
    """A conversation as the chat template renders it (vLLM's embeddings `messages`), truncated if asked."""
    try:
        prompt = await ctx.engine.render_threads.tokenize_chat(
            messages, fit_context=truncation is None, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, template_kwargs=body.chat_template_kwargs)
    except ValueError as error:
        raise APIError(400, str(error), getattr(error, "param", None) or "messages") from error
    if body.add_special_tokens:  # on top of what the template adds, as vLLM's flag says
        prompt = ProcessedPrompt(prompt.prompt, ctx.engine.render_threads.input_processor.encode(prompt.prompt))
    return prompt if truncation is None else truncation.apply_to(prompt)


def _pad_token_id(ctx: ServingContext, body: EmbeddingRequest) -> int | None:
    if body.padding != "max_length":
        return None
    pad_id = ctx.engine.tokenizer.pad_token_id
    if pad_id is None:
        raise APIError(400, "padding \"max_length\" needs a pad token, and this model's tokenizer has none", "padding")
    return pad_id


# vLLM's embed_dtype: the type the values are stored as, and the type whose bytes are sent (numpy has no
# bfloat16 or fp8: their bits go as 16- and 8-bit integers)
_DTYPES = {"float32": (torch.float32, torch.float32), "float16": (torch.float16, torch.float16),
           "bfloat16": (torch.bfloat16, torch.int16), "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
           "fp8_e5m2": (torch.float8_e5m2, torch.uint8)}


def _bytes(vector: torch.Tensor, embed_dtype: str, endianness: str) -> bytes:
    stored, sent = _DTYPES[embed_dtype]
    array = vector.to(stored).flatten().contiguous().view(sent).numpy()
    if endianness != "native" and endianness != sys.byteorder:
        array = array.byteswap()
    return array.tobytes()


def _encode(vector: torch.Tensor, encoding_format: str, embed_dtype: str = "float32",
            endianness: str = "native") -> list[float] | str:
    """float: a JSON list (float32); base64: the values' bytes (embed_dtype, endianness), as vLLM sends them."""
    if encoding_format == "base64":
        return base64.b64encode(_bytes(vector, embed_dtype, endianness)).decode("ascii")
    return vector.tolist()


def _bytes_response(body: EmbeddingRequest, vectors: list[torch.Tensor], request_id: str, created: int, model: str,
                    num_prompt: int) -> Response:
    """vLLM's "bytes": every vector's bytes one after the other as the body; its `metadata` header (JSON) says
    where each lies (start, end), its shape, dtype and byte order, and the usage. "bytes_only": no header."""
    chunks = [_bytes(vector, body.embed_dtype, body.endianness) for vector in vectors]
    items, offset = [], 0
    for index, (chunk, vector) in enumerate(zip(chunks, vectors)):
        items.append({"index": index, "embed_dtype": body.embed_dtype, "endianness": body.endianness,
                      "start": offset, "end": offset + len(chunk), "shape": list(vector.shape)})
        offset += len(chunk)
    headers = None if body.encoding_format == "bytes_only" else {"metadata": json.dumps({
        "id": request_id, "created": created, "model": model, "data": items,
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt}})}
    return Response(b"".join(chunks), media_type="application/octet-stream", headers=headers)
