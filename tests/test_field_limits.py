"""Fields that could hold unbounded work are limited, each with a 400 naming the limit and its flag.

Stop strings (how many, and their characters together), messages and
logit_bias entries, at their documented defaults on one server and raised or
lowered by their flags on another; the limit itself is accepted, one more is
not. JSON nested too deeply for the parser is a 400 that says so.
"""

import httpx
import pytest

from tinyserve.testing import ServerProcess
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.cli.main import main
from tinyserve.entrypoints.api.guards import field_limits

pytestmark = pytest.mark.server  # a real `tinyserve serve` on loopback

MODEL = "tiny"
HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": HI, "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
MESSAGE = {"model": MODEL, "max_tokens": 2, "messages": HI}


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL, "--num-kv-blocks", "64")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def flagged_server():
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL, "--num-kv-blocks", "64",
                         "--max-stop-strings", "40", "--max-stop-string-chars", "100", "--max-messages", "8",
                         "--max-logit-bias-entries", "3")
    yield proc
    proc.stop()


def post(server, path, body):
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def assert_refused(response, param, *words):
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def stops(n: int) -> list[str]:
    return [f"stop-{i:05d}" for i in range(n)]


def test_5000_stop_strings_are_refused_naming_the_limit_and_its_flag(server):
    for path, body in [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)]:
        assert_refused(post(server, path, {**body, "stop": stops(5000)}), "stop",
                       "5000 stop strings", f"limit of {field_limits.DEFAULT_MAX_STOP_STRINGS}", "--max-stop-strings")
    response = post(server, "/v1/messages", {**MESSAGE, "stop_sequences": stops(5000)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "--max-stop-strings" in error["message"]


def test_the_default_limits_are_accepted_and_one_more_is_refused(server):
    limit = field_limits.DEFAULT_MAX_STOP_STRINGS
    assert post(server, "/v1/chat/completions", {**CHAT, "stop": stops(limit)}).status_code == 200
    assert_refused(post(server, "/v1/chat/completions", {**CHAT, "stop": stops(limit + 1)}), "stop")
    chars = field_limits.DEFAULT_MAX_STOP_STRING_CHARS
    assert post(server, "/v1/completions", {**COMPLETION, "stop": ["x" * chars]}).status_code == 200
    assert_refused(post(server, "/v1/completions", {**COMPLETION, "stop": ["x" * (chars // 2 + 1)] * 2}), "stop",
                   "--max-stop-string-chars")
    entries = field_limits.DEFAULT_MAX_LOGIT_BIAS_ENTRIES
    bias = {str(token_id): 1.0 for token_id in range(entries + 1)}
    assert_refused(post(server, "/v1/completions", {**COMPLETION, "logit_bias": bias}), "logit_bias",
                   f"{entries + 1} entries", "--max-logit-bias-entries")
    many = HI * (field_limits.DEFAULT_MAX_MESSAGES + 1)
    for path, body in [("/v1/chat/completions", CHAT), ("/tokenize", {"model": MODEL})]:
        assert_refused(post(server, path, {**body, "messages": many}), "messages", "--max-messages")
    response = post(server, "/v1/messages", {**MESSAGE, "messages": many})
    assert response.status_code == 400 and "--max-messages" in response.json()["error"]["message"]


def test_each_limit_is_a_flag(flagged_server):
    s = flagged_server
    assert post(s, "/v1/chat/completions", {**CHAT, "stop": ["ab"] * 40}).status_code == 200
    assert_refused(post(s, "/v1/chat/completions", {**CHAT, "stop": ["ab"] * 41}), "stop", "limit of 40")
    assert_refused(post(s, "/v1/completions", {**COMPLETION, "stop": "x" * 101}), "stop", "limit of 100")
    assert post(s, "/v1/chat/completions", {**CHAT, "messages": HI * 8}).status_code == 200
    assert_refused(post(s, "/v1/chat/completions", {**CHAT, "messages": HI * 9}), "messages", "limit of 8")
    assert post(s, "/v1/completions", {**COMPLETION, "logit_bias": {"1": 1, "2": 1, "3": 1}}).status_code == 200
    assert_refused(post(s, "/v1/completions", {**COMPLETION, "logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}),
                   "logit_bias", "limit of 3")


def test_content_parts_do_not_nest(server):
    nested = [{"role": "user", "content": [{"type": "text", "text": [{"type": "text", "text": "hi"}]}]}]
    response = post(server, "/v1/chat/completions", {**CHAT, "messages": nested})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages.0.content")


def test_json_nested_too_deeply_is_a_400_that_says_so(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"[" * 100_000 + b"]" * 100_000,
                          headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == 400 and "nests too deeply" in response.json()["error"]["message"]


@pytest.mark.parametrize("flag", ["--max-stop-strings", "--max-stop-string-chars", "--max-messages",
                                  "--max-logit-bias-entries"])
def test_a_limit_below_one_is_refused_at_start(flag, capsys):
    assert main(["serve", flag, "0"]) == 2
    assert f"{flag} must be at least 1" in capsys.readouterr().err
