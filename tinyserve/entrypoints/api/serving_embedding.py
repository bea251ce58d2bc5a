"""POST /v1/embeddings and /pooling (stage ① in, stage ⑨ out) on a pooling server (--runner pooling).

Each input is its own engine request, with its own request span (operation "embeddings"),
all sent before any answer: the engine batches them like prompts to prefill. Each comes
back once, finished, with its vector (frontend/pooling_output.py); there is nothing to
stream. On a generating server both routes answer a 400 saying what the model is served as.
"""

import base64
import time
import uuid

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.pooling_protocol import EmbeddingRequest, PoolingRequest
from tinyserve.entrypoints.api.request_ids import client_request_id, engine_request_id
from tinyserve.entrypoints.api.serving_engine import ServingContext, tokenize
from tinyserve.entrypoints.api.sse import close_all, final_outputs_unless_disconnected
from tinyserve.errors import InvalidInputError
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import start_request_spans
from tinyserve.frontend.output_processor import OutputKind


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
    try:
        params = body.pooling_params()
    except InvalidInputError as error:
        raise APIError(400, str(error), error.param) from error
    try:
        ctx.engine.input_processor.check_runner(params)  # a generating server: a 400 saying so
    except InvalidInputError as error:
        raise APIError(400, f"The model does not support {api_name} API: {error}", "model") from error
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
                prompt = await tokenize(ctx, text_or_ids, add_special_tokens=body.add_special_tokens)
                spans.log_inputs(render_span, prompt=prompt.prompt, prompt_token_ids=prompt.prompt_token_ids,
                                 sampling_params=params)
            processed.append(prompt)
            streams.append(await ctx.engine.add_request(prompt, params, f"{engine_id}-{index}",
                                                        output_kind=OutputKind.FINAL_ONLY, priority=body.priority,
                                                        spans=spans))
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
    data = []
    for index, output in enumerate(outputs):
        if output.outputs is None:  # aborted in the engine (the server is shutting down)
            raise APIError(503, "the request was aborted before its embedding was computed")
        data.append({"index": index, "object": item_object,
                     item_field: _encode(output.outputs.data.numpy(), body.encoding_format)})
    num_prompt = sum(len(p.prompt_token_ids) for p in processed)
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()), "model": model, "data": data,
        "usage": {"prompt_tokens": num_prompt, "total_tokens": num_prompt, "completion_tokens": 0,
                  "prompt_tokens_details": None},
    })


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the float32 values' bytes, little-endian, as OpenAI's API sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
