"""The OpenAPI document (/openapi.json), made to say what the server really answers.

FastAPI documents what a route returns and a 422 for a body it cannot
validate. This server answers that 400, in the endpoint's own error format, and
much else FastAPI cannot see: the 401 of --api-key, the 404 of an unknown
model, the 408/413/415 of the body checks, the 503 (with Retry-After when the
queue is full) of an overloaded server or a dead engine, an event stream for
stream=true, the Prometheus text of /metrics, the small JSON of /health and
/load, the ORCA load report a request may ask for (load_reports.py), and
the field limits a request must keep. `make_truthful` adds all that to the
document FastAPI generates, once, the first time it is asked for.

What no document can say is whether a prompt fits the context once tokenized,
or whether its token ids are in the vocabulary: a request the schema allows may
still be refused with a 400 that names the field at fault.
"""

from fastapi import FastAPI

from tinyserve.entrypoints.api.errors import is_anthropic_path
from tinyserve.entrypoints.api.guards.field_limits import FieldLimits

OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}},
    }},
}
ANTHROPIC_ERROR = {
    "type": "object", "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
    }},
}
SSE_EVENT = {  # one event of a stream=true answer
    "type": "object", "required": ["data"],
    "properties": {"event": {"type": "string", "description": "Anthropic's event type; OpenAI streams have none"},
                   "data": {"type": "string", "description": "the chunk as JSON, or [DONE] to end an OpenAI stream"}},
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying, when the waiting queue is full",
                               "schema": {"type": "integer"}}}
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")
BODY_ERRORS = {  # what any request with a body may be answered
    "400": "the body is malformed, or a field is invalid (named in the error's param)",
    "404": "the model is not one this server serves",
    "408": "the request did not arrive in time (--http-header-timeout, --http-body-timeout)",
    "413": "the body is larger than --max-request-body-bytes",
    "415": "the body is not JSON",
}


def make_truthful(app: FastAPI, *, model_names: list[str], api_key: bool, field_limits: FieldLimits) -> None:
    """Replace the app's OpenAPI document by FastAPI's own, completed."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:  # generate() keeps what it made, completed here in place
            _complete(generate(), model_names=model_names, api_key=api_key, field_limits=field_limits)
        return app.openapi_schema

    app.openapi = openapi


def _error(description: str, path: str, headers: dict | None = None) -> dict:
    name = "AnthropicError" if is_anthropic_path(path) else "OpenAIError"
    response = {"description": description,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}}
    return response | ({"headers": headers} if headers else {})


LOAD = {"type": "object", "required": ["server_load"], "properties": {"server_load": {"type": "integer"}}}
ORCA_REPORT = {"endpoint-load-metrics": {
    "description": "the ORCA load report, when the request asked for one with endpoint-load-metrics-format: "
                   "text or json (not on streams)", "schema": {"type": "string"}}}
HEALTH_OK = {"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}
HEALTH_UNAVAILABLE = {"type": "object", "required": ["status", "reason"],
                      "properties": {"status": {"const": "unavailable"}, "reason": {"type": "string"}}}


def _json(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"text/plain": {"schema": schema}}}


def _complete(document: dict, *, model_names: list[str], api_key: bool, field_limits: FieldLimits) -> None:
    components = document.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    schemas["OpenAIError"], schemas["AnthropicError"] = OPENAI_ERROR, ANTHROPIC_ERROR
    if api_key:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                         "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            responses.pop("422", None)
            if "requestBody" in operation:
                responses |= {status: _error(text, path) for status, text in BODY_ERRORS.items()}
            if path in GENERATION_PATHS:
                responses["200"]["content"]["text/event-stream"] = {"itemSchema": SSE_EVENT}  # OpenAPI 3.2's way
                responses["503"] = _error("the waiting queue is full (with Retry-After), the server is shutting "
                                          "down, or the engine died", path, RETRY_AFTER)
            if path.startswith("/v1") and api_key:
                responses["401"] = _error("the API key is missing or wrong", path)
                operation["security"] = [{"bearer": []}, {"x-api-key": []}]
    document["paths"]["/health"]["get"]["responses"] = {
        "200": _json("the server and its engines are up", HEALTH_OK),
        "503": _json("an engine is not available", HEALTH_UNAVAILABLE),
    }
    document["paths"]["/load"]["get"]["responses"] = {
        "200": _json("generation requests in flight (0 without --enable-server-load-tracking)", LOAD),
    }
    for path in ("/v1/chat/completions", "/v1/completions"):
        document["paths"][path]["post"]["responses"]["200"]["headers"] = ORCA_REPORT
    document["paths"]["/metrics"]["get"]["responses"] = {
        "200": _text("Prometheus' text exposition format, version 0.0.4", {"type": "string"}),
    }
    for path, what in (("/v1/models/{model_id}", "the model is not one this server serves"),
                       ("/v1/responses/{response_id}", "no response with this id is kept (or was ever made)")):
        document["paths"][path]["get"]["responses"]["404"] = _error(what, path)
    document["paths"]["/v1/responses/{response_id}"]["get"]["responses"]["400"] = _error(
        "the id is not of the form this server gives (resp_ and 32 hexadecimal digits)", "/v1/responses/{response_id}")
    [model_id] = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    model_id["schema"]["enum"] = list(model_names)  # any other name is a 404
    _write_limits(schemas, field_limits)
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest",
                 "MessagesCountTokensRequest", "TokenizeRequest", "DetokenizeRequest"):
        for variant in _variants(schemas[name]["properties"]["model"]):
            if variant.get("type") == "string":
                variant["enum"] = list(model_names)  # any other name is a 404


def _variants(prop: dict) -> list[dict]:
    """The alternatives of a property that may be one of several types (or null)."""
    return prop.get("anyOf", [prop])


def _write_limits(schemas: dict, limits: FieldLimits) -> None:
    """The field limits, where a schema can say them (the stop strings' total length it cannot)."""
    for name, stop_field in (("ChatCompletionRequest", "stop"), ("CompletionRequest", "stop"),
                             ("MessagesRequest", "stop_sequences")):
        for variant in _variants(schemas[name]["properties"][stop_field]):
            if variant.get("type") == "array":
                variant["maxItems"] = limits.max_stop_strings
                variant["items"]["maxLength"] = limits.max_stop_string_chars
            elif variant.get("type") == "string":
                variant["maxLength"] = limits.max_stop_string_chars
    for name in ("ChatCompletionRequest", "MessagesRequest", "MessagesCountTokensRequest", "TokenizeRequest"):
        for variant in _variants(schemas[name]["properties"]["messages"]):
            if variant.get("type") == "array":
                variant["maxItems"] = limits.max_messages
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        for variant in _variants(schemas[name]["properties"]["logit_bias"]):
            if variant.get("type") == "object":
                variant["maxProperties"] = limits.max_logit_bias_entries
