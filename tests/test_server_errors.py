"""Every bad request gets the right status and an error body in the API's own format."""

import signal
import time

import anthropic
import httpx
import openai
import pytest

from tests.patience import patient
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

MODEL = "tiny"
KEY = "sk-test-key"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    """This module's own server (not conftest's shared one): it wants an API key, and has a 128-token context."""
    folder = str(tiny_model_with_tokenizer("llama"))
    proc = ServerProcess(folder, "--served-model-name", MODEL, "--api-key", KEY, "--num-kv-blocks", "64",
                         "--max-model-len", "128")
    yield proc
    proc.stop()


def post(server, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=30, **kwargs)


def assert_openai_error(response, status, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for word in words:
        assert word in error["message"]


INVALID_CHAT_FIELDS = [  # (change to CHAT, words the error message must hold)
    ({"temperature": -1}, ["temperature"]),
    ({"temperature": "hot"}, ["temperature"]),
    ({"top_p": 0}, ["top_p"]),
    ({"n": 0}, ["n"]),
    ({"max_tokens": 0}, ["max_tokens"]),
    ({"top_logprobs": 21, "logprobs": True}, ["top_logprobs", "--max-logprobs 20"]),
    ({"top_logprobs": -2, "logprobs": True}, ["top_logprobs"]),
    ({"presence_penalty": 5}, ["presence_penalty"]),
    ({"top_k": -5}, ["top_k"]),
    ({"messages": []}, ["messages"]),
    ({"messages": [{"role": "", "content": "x"}]}, ["role"]),  # any other role goes to the template
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, ["content"]),
    ({"messages": "hello"}, ["messages"]),
    ({"top_logprobs": 2}, ["top_logprobs", "logprobs"]),
    ({"stream_options": {"include_usage": True}}, ["stream_options", "stream"]),
    ({"continue_final_message": True}, ["continue_final_message", "add_generation_prompt"]),
    ({"logit_bias": {"five": 10}}, ["logit_bias", "token ids"]),
    ({"logit_bias": {"5": 500}}, ["logit_bias"]),
    ({"logit_bias": {"99999": 5}}, ["logit_bias", "outside the vocabulary"]),
]


@pytest.mark.parametrize("change, words", INVALID_CHAT_FIELDS)
def test_invalid_chat_fields_are_400_not_422(server, change, words):
    assert_openai_error(post(server, "/v1/chat/completions", {**CHAT, **change}), 400, *words)


@pytest.mark.parametrize(
    "change, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_chat_fields_asking_for_what_is_not_implemented_are_400_naming_them(server, change, param):
    response = post(server, "/v1/chat/completions", {**CHAT, **change})
    assert_openai_error(response, 400, param, "not supported")
    assert response.json()["error"]["param"] == param


def test_auto_tool_choice_without_a_tool_call_parser_is_400_naming_the_flags(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    for body in ({"tools": tools}, {"tools": tools, "tool_choice": "auto"}):  # "auto" is the default with tools
        response = post(server, "/v1/chat/completions", {**CHAT, **body})
        assert_openai_error(response, 400, "tool_choice", "--enable-auto-tool-choice")


def test_completion_suffix_is_400_naming_it(server):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "suffix": "end"})
    assert_openai_error(response, 400, "suffix", "not supported")


def test_fields_that_ask_for_nothing_unusual_are_accepted(server):
    nothing = {"logit_bias": {}, "response_format": {"type": "text"}, "best_of": 1, "tool_choice": "none"}
    response = post(server, "/v1/chat/completions", {**CHAT, **nothing})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4


def test_missing_messages_is_400(server):
    assert_openai_error(post(server, "/v1/chat/completions", {"model": MODEL}), 400, "messages")


def test_invalid_json_is_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert_openai_error(response, 400)


def test_token_ids_outside_the_vocabulary_are_400(server):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**6], "max_tokens": 2})
    assert_openai_error(response, 400, "vocabulary")


def test_prompt_plus_max_tokens_beyond_max_model_len_says_by_how_much(server):
    response = post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 100, "max_tokens": 40})
    assert_openai_error(response, 400, "128", "12 too many")


def test_unknown_model_is_404(server):
    assert_openai_error(post(server, "/v1/chat/completions", {**CHAT, "model": "gpt-9"}), 404, "gpt-9")


def test_missing_or_wrong_api_key_is_401(server):
    assert_openai_error(post(server, "/v1/chat/completions", CHAT, key=None), 401)
    assert_openai_error(post(server, "/v1/chat/completions", CHAT, key="sk-wrong"), 401)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_health_and_metrics_stay_open_without_a_key(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_anthropic_errors_use_the_anthropic_format(server):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": []}, headers={"x-api-key": KEY})
    assert response.status_code == 400
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    client = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("change, words", [
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well, "}]},
     "trailing whitespace"),
    # tool_choice "auto" is the default with tools, and this server has no tool-call parser for it
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "--enable-auto-tool-choice"),
])
def test_anthropic_refuses_a_prefill_ending_in_whitespace_and_auto_tools_without_a_parser(server, change, words):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match=words):
        client.messages.create(**{"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                                  **change})


def test_a_run_of_bad_requests_leaves_the_server_serving(server):
    for change, _ in INVALID_CHAT_FIELDS:
        assert post(server, "/v1/chat/completions", {**CHAT, **change}).status_code == 400, change
    assert post(server, "/v1/completions", {"model": MODEL, "prompt": [5] * 200, "max_tokens": 4}).status_code == 400
    assert post(server, "/v1/chat/completions", CHAT, key="sk-wrong").status_code == 401
    response = post(server, "/v1/chat/completions", CHAT)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    assert "Traceback" not in server.output()


def test_dead_engine_makes_health_503_and_requests_fail_with_503():
    import psutil

    folder = str(tiny_model_with_tokenizer("llama"))
    proc = ServerProcess(folder, "--served-model-name", MODEL, "--num-kv-blocks", "64", "--keep-alive-on-engine-death")
    try:
        engines = [p for p in psutil.Process(proc.process.pid).children(recursive=True) if "tinyserve-engine" in " ".join(p.cmdline()) or "tinyserve-engine" in p.name()]
        assert engines, "the engine process should be a child of the server"
        for engine in engines:
            engine.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + patient(5)
        while httpx.get(f"{proc.url}/health").status_code != 503:
            assert time.monotonic() < deadline, "/health did not turn 503"
            time.sleep(0.1)
        response = httpx.post(f"{proc.url}/v1/chat/completions", json=CHAT, timeout=10)
        assert_openai_error(response, 503)
    finally:
        proc.stop()
