"""The HTTP span is named after the route's template, and requests refused before routing leave no trace."""

import signal

import httpx
import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans

pytestmark = pytest.mark.server

KEY = "secret-key"


def test_only_routed_authorized_requests_are_traced_under_their_route_template(tmp_path):
    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", "tiny", "--trace",
                           "--trace-dir", str(tmp_path), "--num-kv-blocks", "64", "--api-key", KEY)
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        assert httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=auth, timeout=60).status_code == 200
        assert httpx.get(f"{server.url}/v1/models", headers=auth, timeout=10).status_code == 200
        for _ in range(5):  # refused: no key, a path that does not exist, a method the route does not take
            assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=10).status_code == 401
            assert httpx.get(f"{server.url}/v1/no-such-thing", headers=auth, timeout=10).status_code == 404
            assert httpx.get(f"{server.url}/v1/chat/completions", headers=auth, timeout=10).status_code == 405
    finally:
        server.stop(signal.SIGINT)
    [run] = list(tmp_path.iterdir())
    spans = read_spans(run / "api.jsonl")
    roots = sorted(s.name for s in spans if not s.parent_span_id and s.name.startswith(("GET ", "POST ")))
    assert roots == ["GET /v1/models", "POST /v1/chat/completions"]
    assert all(s.attributes.get("http.route") in (None, "/v1/models", "/v1/chat/completions") for s in spans)
