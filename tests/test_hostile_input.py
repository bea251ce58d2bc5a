"""Hostile input: every malformed request gets a 4xx in its endpoint's own error format, never a 5xx.

One server (with --api-key, a 128-token context and a 1 MiB body limit) takes
wrong types, missing fields, unknown roles, non-text content, out-of-range
numbers, token ids outside the vocabulary, prompts beyond the context, invalid
UTF-8, lone surrogates, deep nesting, oversized and non-JSON bodies, and
garbage on its IPC socket; afterwards it still serves and holds no request.
"""

import json
import os
import re
import stat
import time

import httpx
import psutil
import pytest
import zmq

from tests.patience import patient
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

MODEL = "tiny"
KEY = "sk-hostile-test"
BODY_LIMIT = 1 << 20
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
MESSAGE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """This module's own server (not conftest's shared one): an API key, a 128-token context, a 1 MiB body limit."""
    tmpdir = tmp_path_factory.mktemp("server-tmp")
    proc = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL, "--api-key", KEY,
                         "--num-kv-blocks", "64", "--max-model-len", "128",
                         "--max-request-body-bytes", str(BODY_LIMIT), "--log-requests", env={"TMPDIR": str(tmpdir)})
    proc.tmpdir = tmpdir
    yield proc
    proc.stop()


def post(server, path, body=None, *, content=None, headers=None):
    headers = {**AUTH, **(headers or {})}
    if content is not None:
        headers.setdefault("Content-Type", "application/json")
        return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def assert_openai_error(response, status, param=None, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def assert_anthropic_error(response, status, error_type, *words):
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    for word in words:
        assert word in body["error"]["message"], body


def user(content):
    return {"messages": [{"role": "user", "content": content}]}


@pytest.mark.parametrize("change, param", [
    ({"model": 5}, "model"),
    ({"messages": None}, "messages"),
    (user(None), "messages.0"),
    ({"messages": [{"role": "user"}]}, "messages.0"),
    ({"messages": [{"content": "no role"}]}, "messages.0.role"),
    ({"messages": [{"role": "", "content": "x"}]}, "messages.0.role"),  # any other role goes to the template
    (user([{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]), "messages.0.content.0.type"),
    (user([{"type": "image_url", "image_url": {"url": "http://example.com/cat.png", "detail": "high"}}]),
     "messages.0.content.0.image_url.detail"),
    (user([{"type": "text"}]), "messages.0.content.0.text"),
    (user({"text": "not a list"}), "messages.0.content"),
    (user(12), "messages.0.content"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "2"}, "n"),
    ({"n": 1.5}, "n"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**63 + 1}, "top_k"),  # once sent on, it overflowed the sampler and killed the engine
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"),
    ({"priority": 2**70}, "priority"),
    ({"stop": 5}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    (user("x " * 400), "prompt"),
])
def test_bad_chat_fields_are_400_naming_the_parameter(server, change, param):
    assert_openai_error(post(server, "/v1/chat/completions", {**CHAT, **change}), 400, param, param.split(".")[0])


@pytest.mark.parametrize("change, words", [
    ({"stop": [""]}, ["stop"]),
    ({"min_tokens": 10}, ["min_tokens"]),
])
def test_sampling_params_that_contradict_are_400(server, change, words):
    assert_openai_error(post(server, "/v1/chat/completions", {**CHAT, **change}), 400, None, *words)


@pytest.mark.parametrize("prompt, words", [
    ([1, 2, 10**6], ["vocabulary"]),
    ([-1], ["vocabulary"]),
    ([2**70], ["vocabulary"]),
    ([[5, 6], [7, 10**9]], ["vocabulary"]),
    ([1.5, 2], []),
    ([True, False], []),
    ([[[1]]], []),
    ("", ["empty"]),
    ([], ["empty"]),
    ([[]], ["empty"]),
    ([5] * 200, ["max_model_len"]),
    ("word " * 300, ["max_model_len"]),
])
def test_bad_completion_prompts_are_400(server, prompt, words):
    assert_openai_error(post(server, "/v1/completions", {**COMPLETION, "prompt": prompt}), 400, None, *words)


def test_unknown_model_is_404_even_with_a_name_json_can_barely_carry(server):
    response = post(server, "/v1/completions", {**COMPLETION, "model": "模型\u0000\"}"})
    assert_openai_error(response, 404, "model", "模型\u0000\"}")


@pytest.mark.parametrize("change, words", [
    ({"max_tokens": 0}, ["max_tokens"]),
    ({"max_tokens": None}, ["max_tokens"]),
    ({"model": None}, ["model"]),
    ({"temperature": 1.5}, ["temperature"]),
    ({"top_k": -1}, ["top_k"]),
    ({"top_k": 2**63 + 1}, ["top_k"]),
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "system", "content": "x"}]}, ["messages.0.role"]),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "base64"}}]}]},
     ["messages.0.content.0", "'document'"]),  # a block type other than text, image, tool_use, tool_result
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     ["messages.0.content.0.image.source.base64.media_type"]),
    ({"system": 7}, ["system"]),
    ({"stop_sequences": "END"}, ["stop_sequences"]),
    ({"stop_sequences": [""]}, ["stop"]),
    ({"metadata": {"user_id": 5}}, ["metadata.user_id"]),
    ({"max_tokens": 1000}, ["128"]),
])
def test_bad_anthropic_fields_are_400_in_anthropic_format(server, change, words):
    response = post(server, "/v1/messages", {**MESSAGE, **change}, headers={"Authorization": "", "x-api-key": KEY})
    assert_anthropic_error(response, 400, "invalid_request_error", *words)


RAW_BODIES = {
    "invalid JSON": b"{not json",
    "invalid UTF-8": b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe"}], "max_tokens": 4}',
    "lone surrogate": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 4}',
    "NaN": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": NaN}',
    "Infinity": b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": Infinity}',
    "nested 100k deep": b"[" * 100_000 + b"]" * 100_000,
    "nested 500 deep in a field": b'{"model": "tiny", "max_tokens": 4, "messages": ' + b"[" * 500 + b"]" * 500 + b"}",
    "huge number": b'{"model": "tiny", "messages": [], "max_tokens": 1' + b"0" * 5000 + b"}",
    "a list": b"[1, 2, 3]",
    "a string": b'"hello"',
    "null": b"null",
    "empty": b"",
}


@pytest.mark.parametrize("name", list(RAW_BODIES))
def test_unparseable_or_malformed_bodies_are_400_in_each_format(server, name):
    assert_openai_error(post(server, "/v1/chat/completions", content=RAW_BODIES[name]), 400)
    response = post(server, "/v1/messages", content=RAW_BODIES[name])
    assert_anthropic_error(response, 400, "invalid_request_error")


def test_lone_surrogates_are_refused_in_every_string_field(server):
    for path, body in [("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}),
                       ("/v1/completions", {**COMPLETION, "stop": ["\udfff"]}),
                       ("/v1/chat/completions", {**CHAT, "model": "\ud800"}),
                       ("/tokenize", {"prompt": "\ud800"})]:
        content = json.dumps(body).encode()  # json.dumps escapes the surrogate as \ud800
        assert_openai_error(post(server, path, content=content), 400, None, "Unicode")


def test_bodies_over_the_limit_are_413_whether_or_not_their_length_is_declared(server):
    big = b'{"prompt": "' + b"x" * (2 * BODY_LIMIT) + b'"}'

    def chunked():  # no Content-Length: the limit must hold while reading
        for start in range(0, len(big), 64 * 1024):
            yield big[start:start + 64 * 1024]

    for content in (big, chunked()):
        assert_openai_error(post(server, "/v1/completions", content=content), 413, None, str(BODY_LIMIT))
    assert_anthropic_error(post(server, "/v1/messages", content=big), 413, "request_too_large")
    just_under = json.dumps({**COMPLETION, "user": "u" * (BODY_LIMIT - 200)}).encode()
    assert len(just_under) <= BODY_LIMIT
    assert post(server, "/v1/completions", content=just_under).status_code == 200


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_non_json_bodies_are_415(server, path, content_type):
    response = post(server, path, content=json.dumps(CHAT).encode(), headers={"Content-Type": content_type})
    assert response.status_code == 415, response.text
    if path == "/v1/messages":
        assert_anthropic_error(response, 415, "invalid_request_error", "application/json")
    else:
        assert_openai_error(response, 415, None, "application/json")


def test_json_with_a_charset_or_a_json_suffix_is_accepted(server):
    for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
        response = post(server, "/v1/completions", content=json.dumps(COMPLETION).encode(),
                        headers={"Content-Type": content_type})
        assert response.status_code == 200, response.text


def test_unknown_routes_and_methods_have_error_bodies(server):
    assert_openai_error(httpx.get(f"{server.url}/v2/everything", headers=AUTH), 404)
    assert_openai_error(httpx.get(f"{server.url}/v1/completions", headers=AUTH), 405)
    assert_anthropic_error(httpx.get(f"{server.url}/v1/messages", headers=AUTH), 405, "invalid_request_error")


def test_every_v1_route_wants_the_key_and_health_and_metrics_do_not(server):
    routes = [("GET", "/v1/models", None), ("POST", "/v1/chat/completions", CHAT),
              ("POST", "/v1/completions", COMPLETION), ("POST", "/v1/messages", MESSAGE)]
    for method, path, body in routes:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY}, {"x-api-key": "sk-wrong"},
                        {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Basic {KEY}"}):
            response = httpx.request(method, f"{server.url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (path, headers)
        right = httpx.request(method, f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
        assert right.status_code == 200, (path, right.text)
    anthropic_key = httpx.post(f"{server.url}/v1/messages", json=MESSAGE, headers={"x-api-key": KEY}, timeout=60)
    assert anthropic_key.status_code == 200
    openai_with_x_api_key = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers={"x-api-key": KEY})
    assert openai_with_x_api_key.status_code == 200  # either spelling, on every route
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_the_server_listens_on_loopback_only_by_default(server):
    listening = [c.laddr for c in psutil.Process(server.process.pid).net_connections("inet") if c.status == "LISTEN"]
    assert listening and all(address.ip == "127.0.0.1" for address in listening), listening


def ipc_dir(server):
    [folder] = [p for p in server.tmpdir.iterdir() if p.name.startswith("tinyserve-ipc-")]
    return folder


def test_ipc_sockets_live_in_a_directory_only_the_server_user_can_enter(server):
    folder = ipc_dir(server)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    sockets = {p.name for p in folder.iterdir() if stat.S_ISSOCK(p.stat().st_mode)}
    assert sockets == {"input-0", "output"}


def test_garbage_on_the_ipc_socket_is_dropped_and_logged_and_the_server_serves_on(server):
    context = zmq.Context()
    intruder = context.socket(zmq.PUSH)
    intruder.connect(f"ipc://{ipc_dir(server) / 'output'}")
    try:
        intruder.send_multipart([b"O", b"\xff\x00 not msgpack"])  # claims to be outputs
        intruder.send_multipart([b"?", b""])  # unknown kind
        intruder.send(b"one frame")
        intruder.send_multipart([b"O", b"\x93\x01\x02\x03"])  # msgpack, but not EngineCoreOutputs
    finally:
        intruder.close(linger=2000)
        context.term()
    deadline = time.monotonic() + patient(10)
    while server.output().count("dropped a malformed message") < 4:
        assert time.monotonic() < deadline, server.output()[-2000:]
        time.sleep(0.1)
    assert post(server, "/v1/completions", COMPLETION).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^tinyserve:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE))


def test_after_hostile_bodies_the_server_is_healthy_idle_and_never_answered_5xx(server):
    # A volley of its own, so that this holds run alone too; after the whole module the log covers all of it.
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages"):
        for content in [*RAW_BODIES.values(), b'{"prompt": "' + b"x" * (2 * BODY_LIMIT) + b'"}']:
            assert 400 <= post(server, path, content=content).status_code < 500, (path, content[:40])
    response = post(server, "/v1/chat/completions", CHAT)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert metric(server, "num_requests_running") == 0 and metric(server, "kv_cache_usage_perc") == 0
    log = server.output()
    assert not re.search(r'" 5\d\d ', log), "a request was answered with a 5xx"
    assert "Traceback" not in log
    assert os.path.isdir(ipc_dir(server))
