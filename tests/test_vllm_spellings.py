"""vLLM's spellings of what tinyserve does, as vLLM's users send them.

Unknown request fields named (a warning, the X-Ignored-Fields header), --otlp-traces-endpoint,
stream_options.continuous_usage_stats, request_id and X-Request-Id as the answer's id,
/v1/models' root as a /tokenize model, /ping, /invocations and chat's reasoning_effort.
Through the openai client and httpx, on the shared server (one test starts its own).
"""

import concurrent.futures
import json
import time
import uuid

import httpx
import openai
import pytest

from tests.shared_server import MODEL
from tinyserve.cli.main import build_parser

MESSAGES = [{"role": "user", "content": "Errors should never pass silently."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "Unless explicitly silenced", "max_tokens": 4, "temperature": 0}
WARNING = "The following fields were present in the request but ignored: "


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def logged_warning(server, marker: str, timeout: float = 10.0) -> str:
    """The server's one warning line naming the field `marker` (waiting for it to reach the log)."""
    deadline = time.monotonic() + timeout
    while True:
        lines = [line for line in server.output().splitlines() if WARNING in line and marker in line]
        if lines or time.monotonic() > deadline:
            assert len(lines) == 1, lines
            return lines[0]
        time.sleep(0.1)


# ---- unknown fields: a warning and a header -------------------------------------------------


@pytest.mark.server
def test_a_misspelled_field_is_named_in_the_log_and_the_header(server, client):
    marker = f"unknown_{uuid.uuid4().hex[:8]}"
    raw = client.chat.completions.with_raw_response.create(
        **CHAT, extra_body={"max_token": 5, marker: True})
    assert raw.http_response.status_code == 200
    assert json.loads(raw.headers["x-ignored-fields"]) == ["max_token", marker]
    assert raw.parse().usage.completion_tokens == 4  # max_tokens, not the misspelled max_token
    assert logged_warning(server, marker).endswith(f"{WARNING}['max_token', '{marker}']")


@pytest.mark.server
def test_known_fields_are_not_named_even_those_refused_or_without_effect(server, client):
    raw = client.chat.completions.with_raw_response.create(
        **CHAT, user="u-1", store=False, reasoning_effort="low", extra_body={"best_of": 1, "ignore_eos": True})
    assert raw.http_response.status_code == 200 and "x-ignored-fields" not in raw.headers
    raw = client.completions.with_raw_response.create(**COMPLETION, extra_body={"request_id": "known"})
    assert "x-ignored-fields" not in raw.headers


@pytest.mark.server
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_a_streamed_answer_names_them_in_its_header_too(server, path, body):
    marker = f"streamed_{uuid.uuid4().hex[:8]}"
    response = httpx.post(f"{server.url}{path}", json={**body, "stream": True, marker: 1}, timeout=60)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert json.loads(response.headers["x-ignored-fields"]) == [marker]
    assert events(response)  # the stream itself is as ever
    logged_warning(server, marker)


@pytest.mark.server
def test_tokenize_and_detokenize_name_them_too(server):
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": "Now is better", "prompt_typo": 1})
    assert tokenized.status_code == 200 and json.loads(tokenized.headers["x-ignored-fields"]) == ["prompt_typo"]
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": tokenized.json()["tokens"], "token": []})
    assert detokenized.status_code == 200 and json.loads(detokenized.headers["x-ignored-fields"]) == ["token"]


@pytest.mark.server
def test_a_hostile_field_name_stays_one_ascii_header_and_one_log_line(server):
    marker = f"evil_{uuid.uuid4().hex[:8]}"
    name = f"{marker}\r\nSet-Cookie: x=1 \u00e9"
    response = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, name: 1}, timeout=60)
    assert response.status_code == 200 and "set-cookie" not in response.headers
    assert json.loads(response.headers["x-ignored-fields"]) == [name]
    logged_warning(server, marker)


# ---- --otlp-traces-endpoint -------------------------------------------------------------------


def test_otlp_traces_endpoint_is_vllms_name_for_otlp_endpoint():
    for flag in ("--otlp-traces-endpoint", "--otlp-endpoint"):
        assert build_parser().parse_args(["serve", flag, "http://collector:4318"]).otlp_endpoint \
            == "http://collector:4318"


# ---- stream_options.continuous_usage_stats ----------------------------------------------------


@pytest.mark.server
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chat_chunk(client):
    chunks = list(client.chat.completions.create(
        **{**CHAT, "max_tokens": 6}, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(chunk.usage is not None for chunk in chunks)
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {prompt_tokens}
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 6  # the role chunk, then growing
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6  # include_usage's last chunk


@pytest.mark.server
def test_continuous_usage_stats_counts_each_completion_choice_with_its_own_prompt(client):
    prompts = ["Simple", "Complex is better than complicated"]
    lengths = [len(httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                              json={"prompt": p}).json()["tokens"]) for p in prompts]
    chunks = list(client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=3, temperature=0, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    seen = {0: [], 1: []}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        assert chunk.usage.prompt_tokens == lengths[choice.index]
        seen[choice.index].append(chunk.usage.completion_tokens)
    assert all(counts == sorted(counts) and counts[-1] == 3 for counts in seen.values())
    assert chunks[-1].usage.prompt_tokens == sum(lengths) and chunks[-1].usage.completion_tokens == 6


@pytest.mark.server
def test_continuous_usage_stats_without_include_usage_adds_nothing_as_in_vllm(client):
    chunks = list(client.chat.completions.create(**CHAT, stream=True,
                                                 stream_options={"continuous_usage_stats": True}))
    assert chunks and all(chunk.usage is None for chunk in chunks)


# ---- request_id and X-Request-Id ------------------------------------------------------------


@pytest.mark.server
def test_the_bodys_request_id_is_the_answers_id(client):
    chat = client.chat.completions.create(**CHAT, extra_body={"request_id": "batch-7"})
    completion = client.completions.create(**COMPLETION, extra_body={"request_id": "batch-7"})
    assert (chat.id, completion.id) == ("chatcmpl-batch-7", "cmpl-batch-7")
    stream = client.chat.completions.create(**CHAT, stream=True, extra_body={"request_id": "batch-8"})
    assert {chunk.id for chunk in stream} == {"chatcmpl-batch-8"}


@pytest.mark.server
def test_the_x_request_id_header_wins_over_the_body_as_in_vllm(client):
    raw = client.completions.with_raw_response.create(**COMPLETION, extra_headers={"X-Request-Id": "from-proxy"},
                                                      extra_body={"request_id": "from-body"})
    assert raw.parse().id == "cmpl-from-proxy" and raw.headers["x-request-id"] == "from-proxy"
    chat = client.chat.completions.create(**CHAT, extra_headers={"X-Request-Id": "from-proxy"})
    assert chat.id == "chatcmpl-from-proxy"


@pytest.mark.server
def test_without_either_the_id_is_a_fresh_one(client):
    ids = {client.chat.completions.create(**CHAT).id for _ in range(2)}
    assert len(ids) == 2 and all(i.startswith("chatcmpl-") and len(i) > len("chatcmpl-") for i in ids)


@pytest.mark.server
def test_requests_named_alike_run_together(server):
    """Two clients (or a retry) may give the same id: the engine keeps them apart."""
    body = {**CHAT, "max_tokens": 32, "ignore_eos": True, "request_id": "same"}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60),
                                range(4)))
    assert [(a.status_code, a.json()["id"]) for a in answers] == [(200, "chatcmpl-same")] * 4


@pytest.mark.server
def test_a_request_id_over_the_limit_is_a_400_naming_it(server):
    response = httpx.post(f"{server.url}/v1/completions", json={**COMPLETION, "request_id": "x" * 300})
    assert response.status_code == 400 and response.json()["error"]["param"] == "request_id"


# ---- /tokenize and /detokenize take the root of /v1/models ------------------------------------


@pytest.mark.server
def test_tokenize_and_detokenize_accept_the_root_that_v1_models_gives(server):
    root = httpx.get(f"{server.url}/v1/models").json()["data"][0]["root"]
    by_root = httpx.post(f"{server.url}/tokenize", json={"model": root, "prompt": "Readability counts"})
    by_name = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "Readability counts"})
    assert by_root.status_code == 200 and by_root.json() == by_name.json()
    detokenized = httpx.post(f"{server.url}/detokenize", json={"model": root, "tokens": by_root.json()["tokens"]})
    assert detokenized.status_code == 200 and "Readability counts" in detokenized.json()["prompt"]
    other = httpx.post(f"{server.url}/tokenize", json={"model": root + "-other", "prompt": "x"})
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"


# ---- /ping and /invocations -------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_as_health(server, method):
    response = httpx.request(method, f"{server.url}/ping")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


@pytest.mark.server
def test_invocations_answers_a_chat_body_as_chat_and_a_prompt_body_as_completions(server):
    chat = httpx.post(f"{server.url}/invocations", json=CHAT, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, timeout=60).json()
    assert chat.json()["choices"][0]["message"] == direct["choices"][0]["message"]
    completion = httpx.post(f"{server.url}/invocations", json=COMPLETION, timeout=60)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    streamed = httpx.post(f"{server.url}/invocations", json={**CHAT, "stream": True, "max_token": 1}, timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert {chunk["object"] for chunk in events(streamed)} == {"chat.completion.chunk"}
    assert json.loads(streamed.headers["x-ignored-fields"]) == ["max_token"]


@pytest.mark.server
def test_invocations_refuses_a_body_of_neither_shape_and_names_the_field_of_a_bad_one(server):
    neither = httpx.post(f"{server.url}/invocations", json={"model": MODEL, "input": "Hello"})
    assert neither.status_code == 400
    assert neither.json()["error"]["message"].startswith("Cannot find suitable handler for request")
    bad_chat = httpx.post(f"{server.url}/invocations", json={**CHAT, "temperature": 5})
    assert bad_chat.status_code == 400 and bad_chat.json()["error"]["param"] == "temperature"
    not_json = httpx.post(f"{server.url}/invocations", content=b"{", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]


# ---- chat's reasoning_effort ------------------------------------------------------------------


@pytest.mark.server
def test_reasoning_effort_is_accepted_and_changes_nothing_for_a_model_that_does_not_reason(client):
    plain = client.chat.completions.create(**CHAT)
    for effort in ("low", "high"):
        given = client.chat.completions.create(**CHAT, reasoning_effort=effort)
        assert given.choices[0].message.content == plain.choices[0].message.content
