"""The Anthropic Messages API, Prometheus metrics, and clients that hang up mid-stream."""

import re
import time

import anthropic
import httpx
import pytest

from tests.patience import patient
from tests.server_checks import sse_lines
from tests.shared_server import MODEL

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def metric(server, name: str, **labels) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(f"tinyserve:{name}"):
            continue
        match = re.match(rf"tinyserve:{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def test_anthropic_create(claude):
    message = claude.messages.create(model=MODEL, max_tokens=6, system="Be terse.", extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "Hello"}])
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0


def test_anthropic_stream_has_the_full_event_sequence_and_same_text(claude):
    kwargs = dict(model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    full = claude.messages.create(**kwargs)
    with claude.messages.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    raw = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop")]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in raw
    assert final.content[0].text == full.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8


def test_anthropic_stream_sends_a_ping_before_the_first_delta(server):
    # The SDK drops ping events, so this reads the raw stream.
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    text = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30).text
    events = [line.removeprefix("event: ") for line in text.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequence(claude):
    free = claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Go"}])
    text = free.content[0].text
    stop = text[4:7]
    assert stop.strip()
    stopped = claude.messages.create(model=MODEL, max_tokens=16, extra_body={"temperature": 0}, stop_sequences=[stop],
                                     messages=[{"role": "user", "content": "Go"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop
    assert stopped.content[0].text == text[: text.index(stop)]


def test_anthropic_final_assistant_message_is_continued(server, claude):
    messages = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "The Zen says"}]
    continued = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                                          "continue_final_message": True}).json()["tokens"]
    opened = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    message = claude.messages.create(model=MODEL, max_tokens=4, messages=messages, extra_body={"temperature": 0})
    assert message.usage.input_tokens == len(continued) < len(opened)


def test_anthropic_stop_sequence_on_the_last_allowed_token_is_a_stop_sequence(claude):
    kwargs = dict(model=MODEL, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Go"}])
    one = claude.messages.create(max_tokens=1, **kwargs).content[0].text
    two = claude.messages.create(max_tokens=2, **kwargs).content[0].text
    stop = two[len(one) - 1 :] if len(one) > 0 else two
    assert stop and two.startswith(one)
    # The stop sequence is completed by the second token, the last max_tokens=2 allows.
    stopped = claude.messages.create(max_tokens=2, stop_sequences=[stop], **kwargs)
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert stopped.content[0].text == two[: two.index(stop)]


def test_metrics_count_tokens_and_requests(server):
    counted = ("generation_tokens_total", "time_to_first_token_seconds_count", "request_queue_time_seconds_count",
               "e2e_request_latency_seconds_count")
    before = {name: metric(server, name) for name in counted}
    finished_before = metric(server, "request_success_total", finished_reason="length")
    body = {"model": MODEL, "prompt": "Now is better than never", "max_tokens": 5, "temperature": 0}
    for _ in range(2):
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    added = {name: metric(server, name) - before[name] for name in counted}
    assert added == {"generation_tokens_total": 10, "time_to_first_token_seconds_count": 2,
                     "request_queue_time_seconds_count": 2, "e2e_request_latency_seconds_count": 2}
    assert metric(server, "request_success_total", finished_reason="length") - finished_before == 2
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
                 "prefix_cache_hits", "num_preemptions", "prompt_tokens", "inter_token_latency_seconds",
                 "request_time_per_output_token_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert f"tinyserve:{name}" in text, name
    assert 'model_name="tiny"' in text and 'engine="0"' in text


def test_dropped_streams_abort_their_requests_and_free_the_kv_cache(server):
    aborted_before = metric(server, "request_success_total", finished_reason="abort")
    # Far more tokens than could be generated before the server notices the client has gone.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Talk"}], "max_tokens": 4000,
            "ignore_eos": True, "stream": True}
    for _ in range(20):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                lines = sse_lines(response)
                received = 0
                for line in lines:
                    if line.startswith("data: "):
                        received += 1
                    if received == 2:
                        break
    deadline = time.monotonic() + patient(10)
    while metric(server, "num_requests_running") or metric(server, "kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "requests were not aborted after the clients left"
        time.sleep(0.2)
    assert metric(server, "request_success_total", finished_reason="abort") - aborted_before == 20
