"""The OpenAPI document tells the truth: schemathesis with every check finds nothing against it.

`schemathesis run --checks all` (a bounded number of examples per operation,
deterministic) against a real server with --api-key: every status it answers
is documented, with its content type and body schema; a 405 says which methods
are allowed; a request without the key is refused. One check is told what no
document can say: a request the schema allows may still be refused with a 400,
when its prompt does not fit the context once tokenized or its ids are outside
the vocabulary (openapi.py), so a 400 is an accepted answer to valid data; and a
response id is a 404 unless the server kept that response.
"""

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tinyserve.testing import ServerProcess
from tests.tiny_checkpoints import tiny_model_with_tokenizer

pytestmark = pytest.mark.server  # a real `tinyserve serve` on loopback

MODEL = "tiny"
KEY = "sk-openapi-test"
MAX_EXAMPLES = 5  # per operation and phase: about a minute in all
# A response id the schema allows (any string) is a 404 unless the server answered and kept that response.
SCHEMATHESIS_CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400"]

[[operations]]
include-path-regex = "^/v1/responses"
checks.positive_data_acceptance.expected-statuses = ["2xx", "400", "404"]
"""


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL, "--api-key", KEY,
                         "--num-kv-blocks", "64", "--max-model-len", "48", "--max-waiting-requests", "8")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def document(server):
    return httpx.get(f"{server.url}/openapi.json").json()


def test_schemathesis_with_every_check_finds_no_failure(server, tmp_path):
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    command = [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config), "--no-color",
               "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", str(MAX_EXAMPLES),
               "--generation-deterministic", "--workers", "1", "--request-timeout", "60",
               "--header", f"Authorization: Bearer {KEY}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=540, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "17 selected" in result.stdout


def test_no_422_is_documented_and_every_body_error_is(document):
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            if method == "post":
                assert {"400", "404", "408", "413", "415"} <= set(responses), (method, path)
                schema = responses["400"]["content"]["application/json"]["schema"]["$ref"]
                assert schema.endswith("AnthropicError" if path.startswith("/v1/messages") else "OpenAIError")
            if path.startswith("/v1"):
                assert "401" in responses, (method, path)


def test_generation_routes_document_their_stream_and_the_503_with_retry_after(document):
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        responses = document["paths"][path]["post"]["responses"]
        assert {"application/json", "text/event-stream"} <= set(responses["200"]["content"])
        assert "Retry-After" in responses["503"]["headers"]


def test_health_and_metrics_declare_their_content_and_answer_with_it(server, document):
    health = document["paths"]["/health"]["get"]["responses"]
    assert set(health) == {"200", "503"}
    assert set(health["200"]["content"]) == {"application/json"}
    response = httpx.get(f"{server.url}/health")
    assert response.headers["content-type"] == "application/json"
    assert response.json()["status"] == health["200"]["content"]["application/json"]["schema"]["properties"][
        "status"]["const"]
    assert set(document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert httpx.get(f"{server.url}/metrics").headers["content-type"].startswith("text/plain")


def test_the_field_limits_are_in_the_schemas(document):
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    [stop_list] = [variant for variant in chat["stop"]["anyOf"] if variant.get("type") == "array"]
    assert stop_list["maxItems"] == 32 and chat["messages"]["maxItems"] == 10_000
    [model] = [variant for variant in chat["model"]["anyOf"] if variant.get("type") == "string"]
    assert model["enum"] == [MODEL]


def test_a_405_says_which_methods_are_allowed(server):
    response = httpx.request("TRACE", f"{server.url}/health")
    assert response.status_code == 405 and response.headers["allow"] == "GET"
    response = httpx.get(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 405 and response.headers["allow"] == "POST"


def _valid(document, schema_name: str, body: dict) -> bool:
    import jsonschema

    root = {"$ref": f"#/components/schemas/{schema_name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(root).is_valid(body)


CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.mark.parametrize("schema_name, path, body, accepted", [
    # rules between fields, in the document as the server applies them
    ("ChatCompletionRequest", "/v1/chat/completions", {**CHAT_BODY, "continue_final_message": True}, False),
    ("ChatCompletionRequest", "/v1/chat/completions", {**CHAT_BODY, "top_logprobs": 2}, False),
    ("ChatCompletionRequest", "/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "user"}]}, False),
    ("ChatCompletionRequest", "/v1/chat/completions", {**CHAT_BODY, "top_logprobs": 2, "logprobs": True}, True),
    ("CompletionRequest", "/v1/completions", {**COMPLETION_BODY, "stream_options": {"include_usage": True}}, False),
    ("CompletionRequest", "/v1/completions", {**COMPLETION_BODY, "prompt": ""}, False),
    # an empty input is a 400 (the embeddings' on this generative server whatever it holds: the schema says a
    # pooling server's truth), a chat turn's role any non-empty string the template takes (hardening-4, Low)
    ("EmbeddingRequest", "/v1/embeddings", {"model": MODEL, "input": ""}, False),
    ("EmbeddingRequest", "/v1/embeddings", {"model": MODEL, "input": [[]]}, False),
    ("ResponsesRequest", "/v1/responses", {"model": MODEL, "input": [], "max_output_tokens": 4}, False),
    ("ResponsesRequest", "/v1/responses", {"model": MODEL, "input": "", "max_output_tokens": 4}, True),
    ("ChatCompletionRequest", "/v1/chat/completions", {**CHAT_BODY, "messages": [{"role": "0", "content": "hi"}]},
     True),
    ("TokenizeRequest", "/tokenize", {"model": MODEL}, False),
    ("TokenizeRequest", "/tokenize", {"model": MODEL, "prompt": "hi"}, True),
    # bounds a float-comparing validator holds exactly; token ids within the vocabulary
    ("CompletionRequest", "/v1/completions", {**COMPLETION_BODY, "seed": 2**63 - 1}, True),  # any int64, as vLLM
    ("CompletionRequest", "/v1/completions", {**COMPLETION_BODY, "seed": 2**63}, False),
    ("CompletionRequest", "/v1/completions", {**COMPLETION_BODY, "seed": -(2**63)}, True),
    ("DetokenizeRequest", "/detokenize", {"model": MODEL, "tokens": [512]}, False),
    ("DetokenizeRequest", "/detokenize", {"model": MODEL, "tokens": [511]}, True),
    # 1.0 is an integer to JSON Schema, and so to the server
    ("CompletionRequest", "/v1/completions", {**COMPLETION_BODY, "max_tokens": 2.0, "min_tokens": 1.0}, True),
])
def test_the_document_and_the_server_agree_on_rules_between_fields_and_bounds(server, document, schema_name, path,
                                                                              body, accepted):
    assert _valid(document, schema_name, body) is accepted
    response = httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert (response.status_code == 200) is accepted, response.text
    if not accepted:
        assert response.status_code == 400
