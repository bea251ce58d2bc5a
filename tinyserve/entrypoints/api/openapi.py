"""The OpenAPI document (/openapi.json), made to say what the server really answers.

FastAPI documents what a route returns and a 422 for a body it cannot validate. This server answers that
400, in the endpoint's own error format, and much else FastAPI cannot see: the 401 of --api-key, the 404 of
an unknown model, the 408/413/415 of the body checks, the 503 (with Retry-After when the queue is full) of
an overloaded server or a dead engine, an event stream for stream=true, the Prometheus text of /metrics, the
small JSON of /health and /load, the ORCA load report a request may ask for (load_reports.py), and the field
limits a request must keep. `make_truthful` adds all that to the document FastAPI generates, once, the first
time it is asked for.

What no document can say is whether a prompt fits the context once tokenized, whether a tool_choice names
one of the request's tools, whether a tool call's arguments string is JSON, or how long a schema takes to
compile: a request the schema allows may still be refused with a 400 that names the field at fault, and the
400's description says so. Token ids are bounded by the vocabulary, and seeds exactly by int64's bounds.
"""

from fastapi import FastAPI

from tinyserve.entrypoints.api.errors import is_anthropic_path
from tinyserve.entrypoints.api.guards.auth import needs_api_key
from tinyserve.entrypoints.api.guards.field_limits import FieldLimits
from tinyserve.entrypoints.api.openai_protocol import exact_seed_bounds

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
POOLING_PATHS = ("/v1/embeddings", "/pooling")  # answered by a pooling server (--runner pooling)
BODY_ERRORS = {  # what any request with a body may be answered
    "400": "the body is malformed, or a field is invalid (named in the error's param); also, for a body this "
           "schema allows, what no schema can say: the prompt does not fit the context once tokenized, a "
           "tool_choice names a tool the request's tools lack, a tool call's arguments are not a JSON text, "
           "or its constraint is not compiled within --structured-outputs-compile-timeout; and the route's kind "
           "is not what the model is served as (embeddings from a generative model, text from a pooling one: "
           "--runner)",
    "404": "the model is not one this server serves",
    "408": "the request did not arrive in time (--http-header-timeout, --http-body-timeout)",
    "413": "the body is larger than --max-request-body-bytes",
    "415": "the body is not JSON",
}


def make_truthful(app: FastAPI, *, model_names: list[str] | None, api_key: bool, field_limits: FieldLimits,
                  vocab_size: int | None = None, auto_tool_choice: bool = True) -> None:
    """Replace the app's OpenAPI document by FastAPI's own, completed. model_names: every name a request's model
    may take (the served names and LoRA adapters); None: not known in advance (adapters loaded at run time)."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:  # generate() keeps what it made, completed here in place
            document = generate()
            _complete(document, model_names=model_names, api_key=api_key, field_limits=field_limits,
                      auto_tool_choice=auto_tool_choice)
            if vocab_size is not None:
                _bound_token_ids(document["components"]["schemas"], vocab_size)
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


def _complete(document: dict, *, model_names: list[str] | None, api_key: bool, field_limits: FieldLimits,
              auto_tool_choice: bool = True) -> None:
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
            if path in GENERATION_PATHS or path in POOLING_PATHS:
                responses["503"] = _error("the waiting queue is full (with Retry-After), the server is shutting "
                                          "down, or the engine died", path, RETRY_AFTER)
            if api_key and needs_api_key(path):
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
    _write_limits(schemas, field_limits)
    _write_rules(schemas, auto_tool_choice)
    exact_seed_bounds(schemas, _variants)
    if model_names is None:  # adapters may be loaded at run time: any name may be served later
        return
    [model_id] = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    model_id["schema"]["enum"] = list(model_names)  # any other name is a 404
    for name in ("ChatCompletionRequest", "CompletionRequest", "ResponsesRequest", "MessagesRequest",
                 "MessagesCountTokensRequest", "TokenizeRequest", "DetokenizeRequest", "EmbeddingRequest",
                 "PoolingRequest"):
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


TOKEN_ID_FIELDS = {"ChatCompletionRequest": ("stop_token_ids", "allowed_token_ids"),
                   "CompletionRequest": ("stop_token_ids", "allowed_token_ids", "prompt"),
                   "DetokenizeRequest": ("tokens",)}


def _bound_token_ids(schemas: dict, vocab_size: int) -> None:
    """Every token id a body may hold (arrays of integers, at any depth), within [0, vocab_size)."""

    def bound(node) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer":
                node["minimum"], node["maximum"] = 0, vocab_size - 1
                node.pop("exclusiveMaximum", None)
            for child in (node.get("items"), *node.get("anyOf", ())):
                bound(child)

    for name, fields in TOKEN_ID_FIELDS.items():
        for field in fields:
            prop = schemas.get(name, {}).get("properties", {}).get(field)
            if prop is not None:
                for variant in _variants(prop):
                    if variant.get("type") == "array":
                        bound(variant["items"])


def _needs(field: str, when: dict, then: dict) -> dict:
    """The JSON Schema of a rule between fields: when `field` matches `when`, the body must match `then`."""
    return {"if": {"properties": {field: when}, "required": [field]}, "then": then}


_TOOLS_NEEDED = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}
_NO_GENERATION_PROMPT = {"required": ["add_generation_prompt"],
                         "properties": {"add_generation_prompt": {"const": False}}}
# The rules between fields that the handlers check (each a 400 naming them), said in the document, so that a
# client or a tester generating bodies from it does not make ones the server must refuse.
RULES = {
    "ChatCompletionRequest": [
        _needs("continue_final_message", {"const": True}, _NO_GENERATION_PROMPT),
        _needs("top_logprobs", {"type": "integer"}, {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
        _needs("tool_choice", {"not": {"enum": [None, "none"]}}, _TOOLS_NEEDED),
        _needs("stream_options", {"type": "object"}, {"required": ["stream"], "properties": {"stream": {"const": True}}}),
    ],
    "CompletionRequest": [
        _needs("stream_options", {"type": "object"}, {"required": ["stream"], "properties": {"stream": {"const": True}}}),
    ],
    "TokenizeRequest": [_needs("continue_final_message", {"const": True}, _NO_GENERATION_PROMPT)],
    "ResponsesRequest": [_needs("tool_choice", {"not": {"enum": [None, "none"]}}, _TOOLS_NEEDED)],
    "MessagesRequest": [_needs("tool_choice", {"type": "object", "properties": {"type": {"not": {"const": "none"}}}},
                               _TOOLS_NEEDED)],
    "MessagesCountTokensRequest": [_needs("tool_choice", {"type": "object",
                                                          "properties": {"type": {"not": {"const": "none"}}}},
                                          _TOOLS_NEEDED)],
}


_ANTHROPIC_FORCED = {"type": "object", "properties": {"type": {"enum": ["any", "tool"]}}}
_ANTHROPIC_FORMAT_RULES = [  # output_format is output_config.format's other spelling; neither with a forced tool
    _needs("output_format", {"type": "object"}, {"properties": {"output_config": {
        "anyOf": [{"type": "null"}, {"properties": {"format": {"type": "null"}}}]}}}),
    _needs("tool_choice", _ANTHROPIC_FORCED, {"properties": {
        "output_format": {"type": "null"},
        "output_config": {"anyOf": [{"type": "null"}, {"properties": {"format": {"type": "null"}}}]}}}),
]
# tool_choice "auto", and tools without a tool_choice (auto by default), need --tool-call-parser
_NO_AUTO = {
    "ChatCompletionRequest": [_needs("tool_choice", {"const": "auto"}, {"not": {}}),
                              _needs("tools", {"type": "array", "minItems": 1},
                                     {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"type": "null"}}}})],
    "ResponsesRequest": [_needs("tool_choice", {"const": "auto"}, {"not": {}}),
                         _needs("tools", {"type": "array", "minItems": 1},
                                {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"type": "null"}}}})],
    "MessagesRequest": [_needs("tool_choice", {"type": "object", "properties": {"type": {"const": "auto"}}},
                               {"not": {}}),
                        _needs("tools", {"type": "array", "minItems": 1},
                               {"required": ["tool_choice"], "properties": {"tool_choice": {"type": "object"}}})],
}


def _write_rules(schemas: dict, auto_tool_choice: bool = True) -> None:
    for name, rules in RULES.items():
        if name in schemas:
            schemas[name].setdefault("allOf", []).extend(rules)
    for name in ("MessagesRequest", "MessagesCountTokensRequest"):
        if name in schemas:
            schemas[name].setdefault("allOf", []).extend(_ANTHROPIC_FORMAT_RULES)
    if "AnthropicToolChoice" in schemas:  # a name with type "tool", and only then
        schemas["AnthropicToolChoice"].setdefault("allOf", []).append({
            "if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
            "then": {"required": ["name"], "properties": {"name": {"type": "string"}}},
            "else": {"properties": {"name": {"type": "null"}}}})
    if not auto_tool_choice:
        for name, rules in _NO_AUTO.items():
            if name in schemas:
                schemas[name].setdefault("allOf", []).extend(rules)
    if "TokenizeRequest" in schemas:  # a prompt or messages, not both, not neither
        schemas["TokenizeRequest"]["oneOf"] = [
            {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
            {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]
    # An empty prompt or input is a 400: a text, a list, an item of one. (The Responses API takes "", not [].)
    for name, field in (("CompletionRequest", "prompt"), ("EmbeddingRequest", "input"), ("PoolingRequest", "input"),
                        ("ResponsesRequest", "input")):
        for variant in _variants(schemas.get(name, {}).get("properties", {}).get(field, {})):
            for node in [variant] if name == "ResponsesRequest" else [variant, variant.get("items", {})]:
                if node.get("type") == "array":
                    node["minItems"] = 1
                elif node.get("type") == "string" and name != "ResponsesRequest":
                    node["minLength"] = 1
    for name, field in (("MessagesRequest", "stop_sequences"), ("ChatCompletionRequest", "stop"),
                        ("CompletionRequest", "stop")):
        for variant in _variants(schemas.get(name, {}).get("properties", {}).get(field, {})):
            if variant.get("type") == "array":
                variant["items"]["minLength"] = 1  # an empty stop string is a 400
            elif variant.get("type") == "string":
                variant["minLength"] = 1

