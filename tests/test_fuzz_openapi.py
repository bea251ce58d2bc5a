"""Property-based fuzzing of the server's own OpenAPI spec: no generated request gets a 5xx.

schemathesis reads /openapi.json from a real server on a loopback port and, for
every operation, sends bodies, query strings and headers generated from the
spec: valid ones (which really run on the engine) and ones that break it. The
server must answer each without a server error. The context is kept short and
the waiting queue small, so the valid requests stay cheap and those asking for
more than the server would ever queue are refused as 400s.
"""

import collections
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

EXAMPLES_PER_OPERATION = 15  # per operation and mode: ~20 operations × 2 modes, about a minute


@pytest.fixture(scope="module")
def server():
    """This module's own server (not conftest's shared one): a short context and a small waiting queue."""
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", "tiny",
                         "--num-kv-blocks", "64", "--max-model-len", "48", "--max-waiting-requests", "8", "--log-requests")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def api_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.update(base_url=server.url, request_timeout=60)
    return schema


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


@pytest.fixture(scope="module")
def fuzzing(api_schema) -> dict:
    """Fuzz every operation in each generation mode; for each mode, the failures found (operation, error)."""
    failures = {}
    for mode in GenerationMode:
        failures[mode] = []
        for operation in operations(api_schema):
            if mode is GenerationMode.NEGATIVE and not operation.get_request_payload_content_types() \
                    and not list(operation.iter_parameters()):
                continue  # nothing to break: GET /health takes no input

            # Driven by hand (not @schema.parametrize) so that the schema can come from a
            # server started by a fixture.
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def call(case):
                case.call_and_validate(checks=[not_a_server_error])

            try:
                call()
            except Exception as error:  # hypothesis re-raises the failure of the smallest example
                failures[mode].append((operation.label, f"{type(error).__name__}: {error}"))
    return failures


def test_the_spec_has_every_operation_the_server_serves(api_schema):
    assert {op.label for op in operations(api_schema)} >= {
        "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/messages", "GET /v1/models", "GET /health",
        "POST /tokenize", "POST /detokenize"}


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda mode: mode.value)
def test_no_generated_request_gets_a_server_error(fuzzing, mode):
    assert not fuzzing[mode], "\n\n".join(f"{label}: {error}" for label, error in fuzzing[mode])


def test_the_fuzzing_reached_the_server_and_left_it_healthy(server, fuzzing):
    statuses = collections.Counter(re.findall(r'HTTP/1.1" (\d{3}) ', server.output()))
    assert sum(statuses.values()) > 100 and statuses["200"] and statuses["400"], statuses
    assert not [status for status in statuses if status.startswith("5")], statuses
    assert "Traceback" not in server.output()
    assert httpx.get(f"{server.url}/health").status_code == 200
