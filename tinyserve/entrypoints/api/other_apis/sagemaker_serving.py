"""POST /invocations: SageMaker's inference route, answered by chat, completions or embeddings as vLLM routes it.

SageMaker sends every request to this one route (and asks /ping, which server.py answers as /health).
The body's own shape picks the handler, so the route takes the server's chat, completion and embedding body
types, bound to its field limits, and answers exactly as /v1/chat/completions, /v1/completions or (on a
pooling server) /v1/embeddings would.
"""

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from tinyserve.entrypoints.api.errors import APIError
from tinyserve.entrypoints.api.guards.strict_body import with_ignored_fields
from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from tinyserve.entrypoints.api.pooling_protocol import EmbeddingRequest
from tinyserve.entrypoints.api.serving_chat import create_chat_completion
from tinyserve.entrypoints.api.serving_completion import create_completion
from tinyserve.entrypoints.api.serving_embedding import create_embedding
from tinyserve.entrypoints.api.serving_engine import ServingContext


def add_invocations_route(app: FastAPI, ctx: ServingContext, Chat: type[ChatCompletionRequest],
                          Completion: type[CompletionRequest], Embedding: type[EmbeddingRequest]) -> None:
    """Chat, Completion and Embedding: the body types of their /v1 routes (server.BodyTypes)."""

    @app.post("/invocations", include_in_schema=False)  # its bodies are documented at their own routes
    async def invocations(request: Request):
        """SageMaker's inference route, as vLLM routes it: the body is answered by the first of chat and
        completions that it validates as (a body with messages is a chat, one with prompt a completion); on a
        pooling server (--runner pooling), by embeddings (input, or messages). A body that is none is a 400:
        the errors of the route its shape names, else vLLM's message."""
        try:
            body = json.loads(await request.body())
        except json.JSONDecodeError as error:
            raise APIError(400, f"the request body is not valid JSON: {error.msg} (at character {error.pos})") \
                from None
        except RecursionError:
            raise APIError(400, "the request body nests too deeply") from None
        errors = {}
        routes = {"messages": (Chat, create_chat_completion), "prompt": (Completion, create_completion)}
        if ctx.engine.input_processor.runner == "pooling":  # vLLM's: only the routes of the served task
            routes = {"input": (Embedding, create_embedding), "messages": (Embedding, create_embedding)}
        for shape, (body_type, create) in routes.items():
            try:
                parsed = body_type.model_validate(body)
            except ValidationError as error:
                errors[shape] = error
                continue
            return with_ignored_fields(await create(ctx, parsed, request), parsed)
        shape = next((shape for shape in errors if isinstance(body, dict) and shape in body), None)
        if shape is None:
            expected = sorted({body_type.__name__ for body_type, _ in routes.values()})
            raise APIError(400, f"Cannot find suitable handler for request. Expected one of: {expected} (a body "
                           f"with {' or '.join(routes)})")
        raise RequestValidationError(errors[shape].errors())
