"""`tinyserve router` in front of two real `tinyserve serve` backends, and their KV cache events, on loopback.

Two --data-parallel-rank servers (ranks 0 and 1 of 2), traced, with vLLM's metric names, a small
KV pool (64 blocks of 16 tokens) and KV cache events on one --kv-events-config (rank 1 publishes
on the port after rank 0's, as vLLM offsets it), shared by every test here; each test starts the
router it needs (a process of a second or two). The clients are the official openai one, httpx,
and a ZeroMQ subscriber written as vLLM's examples/online_serving/kv_events_subscriber.py is.
"""

import contextlib
import hashlib
import json
import random
import re
import select
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import zmq

import httpx
import openai
import psutil
import pytest

from tests import shared_server
from tests.misbehaving_backends import (
    FAKE_TEXT,
    FakeBackend,
    answers_health_only,
    drops_mid_answer,
    reports_load,
    silent,
)
from tests.server_checks import wait_until
from tinyserve.lifecycle import schema
from tinyserve.testing import RouterProcess, ServerProcess, free_port
from tinyserve.trace_reading.otlp_json import read_spans

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL
BLOCK_SIZE = 16  # the engine's default, which the router assumes too
NUM_KV_BLOCKS = 64


def two_free_ports() -> int:
    """A port p with p + 1 free as well: rank 0 publishes on p, rank 1 on p + 1."""
    while True:
        port = free_port()
        with __import__("socket").socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


@pytest.fixture(scope="module")
def events_port() -> int:
    return two_free_ports()


@pytest.fixture(scope="module")
def backends(tmp_path_factory, events_port):
    """The two backend servers, started together, each tracing into a folder of its own."""
    model = shared_server.model_folder()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                         "topic": ""})
    flags = [(*shared_server.ENGINE_FLAGS, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--data-parallel-size", "2",
              "--data-parallel-rank", str(rank), "--metrics-prefix", "vllm", "--kv-events-config", events,
              "--trace", "--trace-dir", str(tmp_path_factory.mktemp(f"backend{rank}")))
             for rank in (0, 1)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, model, *rank_flags) for rank_flags in flags]
    started = [future.result() for future in futures if future.exception() is None]
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:
        for server in started:
            server.stop()
        raise failed[0]
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def traced_router(backends, tmp_path_factory):
    """round_robin over both backends, tracing into a folder of its own."""
    folder = tmp_path_factory.mktemp("router")
    router = RouterProcess([server.url for server in backends], "--trace", "--trace-dir", str(folder))
    yield router
    router.stop()


def run_folder(process) -> Path:
    [line] = [line for line in process.output().splitlines() if "tinyserve: tracing to " in line]
    return Path(line.split("tinyserve: tracing to ")[1].strip())


def spans_in(folder: Path) -> list:
    return [span for file in sorted(folder.glob("*.jsonl")) for span in read_spans(file)]


def test_chat_and_completions_pass_through_streamed_and_whole_as_the_backend_answers(backends, traced_router):
    via_router = openai.OpenAI(base_url=f"{traced_router.url}/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=f"{backends[0].url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about the router."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    expected_chat = direct.chat.completions.create(**chat).choices[0].message.content
    assert via_router.chat.completions.create(**chat).choices[0].message.content == expected_chat
    streamed = via_router.chat.completions.create(**chat, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected_chat
    completion = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    expected_text = direct.completions.create(**completion).choices[0].text
    assert via_router.completions.create(**completion).choices[0].text == expected_text
    chunks = list(via_router.completions.create(**completion, stream=True))
    assert len(chunks) > 2  # passed through chunk by chunk, not gathered into one
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected_text
    assert [m.id for m in via_router.models.list().data] == [MODEL]
    assert httpx.get(f"{traced_router.url}/health", timeout=10).json()["status"] == "ok"


def test_the_backends_request_spans_carry_the_routers_trace_and_merge_into_one_run(backends, traced_router,
                                                                                   tmp_path):
    from tinyserve.trace_reading.merge import merge_runs
    from tinyserve.trace_reading.run import load_run

    via_router = openai.OpenAI(base_url=f"{traced_router.url}/v1", api_key="unused", max_retries=0)
    for i in range(2):  # round robin: one to each backend
        via_router.completions.create(model=MODEL, prompt=f"Trace me {i}", max_tokens=4, temperature=0)
    router_folder = run_folder(traced_router)

    def routes() -> list:
        return [s for s in spans_in(router_folder) if s.name == schema.ROUTE]

    wait_until(lambda: len(routes()) >= 2, 30, "the router wrote its route spans")
    backend_folders = [run_folder(server) for server in backends]
    for route in routes()[-2:]:
        index = route.attributes[schema.ROUTER_BACKEND_INDEX]
        assert route.attributes[schema.ROUTER_POLICY] == "round_robin"
        assert route.attributes[schema.ROUTER_BACKEND] == backends[index].url

        def backend_http_span():
            return [s for s in spans_in(backend_folders[index])
                    if s.trace_id == route.trace_id and s.parent_span_id == route.span_id]

        wait_until(backend_http_span, 30, "the backend wrote the request's HTTP span under the router's")
    merged = merge_runs([router_folder, *backend_folders], tmp_path / "merged")
    assert sorted(p.name for p in merged.glob("*.jsonl")) == ["api-0.jsonl", "api-1.jsonl", "engine-0.jsonl",
                                                             "engine-1.jsonl", "router.jsonl"]
    run = load_run(merged)
    traced = {span.trace_id for span in routes()}
    assert {r.trace_id for r in run.requests} & traced


@contextlib.contextmanager
def unready_router(*flags: str):
    """`tinyserve router FLAGS`, its URL once it listens (RouterProcess would wait for a /health of 200)."""
    process = subprocess.Popen([sys.executable, "-m", "tinyserve.cli.main", "router", *flags, "--port",
                                str(port := free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def listens():
        try:
            return httpx.get(f"{url}/health", timeout=10)
        except httpx.HTTPError:
            return None

    try:
        wait_until(listens, 30, "the router listens")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def complete(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields},
                      timeout=60)


def test_a_backend_that_is_down_is_passed_over_and_none_left_is_a_503_naming_it(backends):
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess([dead, backends[0].url])
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        router.stop()
    with unready_router("--backend", dead) as url:
        refused = complete(url)
        assert refused.status_code == 503
        assert dead in refused.json()["error"]["message"]
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and dead in health.json()["status"]


# ---- backends that misbehave (tests/misbehaving_backends.py) next to a real one --------------------


def test_a_backend_that_takes_requests_and_never_answers_is_a_504_once_then_passed_over(backends):
    hangs = FakeBackend(answers_health_only)
    router = RouterProcess([hangs.url, backends[0].url], "--backend-header-timeout", "2",
                           "--health-check-interval-secs", "600")  # only the request marks it down here
    try:
        timed_out = complete(router.url)  # round_robin: the first request goes to the first backend
        assert timed_out.status_code == 504
        message = timed_out.json()["error"]["message"]
        assert hangs.url in message and "--backend-header-timeout" in message
        for _ in range(4):  # each to the live backend, none to the one that did not answer
            answer = complete(router.url)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] != FAKE_TEXT
        assert len(hangs.posts()) == 1
        health = httpx.get(f"{router.url}/health", timeout=10)
        assert health.status_code == 200
        [state] = [b for b in health.json()["backends"] if b["url"] == hangs.url]
        assert state["up"] is False and "--backend-header-timeout" in state["error"]
    finally:
        router.stop()
        hangs.stop()


def test_a_backend_that_never_answers_at_all_is_taken_out_by_health_checks(backends):
    mute = FakeBackend(silent)
    checks = ("--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "0.5",
              "--health-failure-threshold", "2")
    router = RouterProcess([mute.url, backends[0].url], *checks)
    try:
        def mute_is_down():
            states = httpx.get(f"{router.url}/health", timeout=10).json()["backends"]
            return [b for b in states if b["url"] == mute.url and not b["up"]]

        wait_until(mute_is_down, 30, "the health checks take the mute backend out")
        [state] = mute_is_down()
        assert "--health-check-timeout-secs" in state["error"]
        # 2 (the threshold), or more where a busy machine let another check fail before this read
        assert int(re.search(r"\((\d+) health check\(s\) failed in a row\)", state["error"])[1]) >= 2, state["error"]
        for _ in range(4):
            assert complete(router.url).json()["choices"][0]["text"] != FAKE_TEXT
        assert mute.posts() == []
    finally:
        router.stop()
    with unready_router("--backend", mute.url, *checks) as url:  # no backend left: the router is unhealthy
        wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, 30, "/health says 503")
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert mute.url in health["status"] and "--health-check-timeout-secs" in health["status"]
        refused = complete(url)
        assert refused.status_code == 503 and mute.url in refused.json()["error"]["message"]
    mute.stop()


def test_a_prefill_decode_router_is_healthy_only_while_each_pool_has_a_server_up():
    """With the decode server up and the prefill server mute, every request would be a 503: so is /health."""
    mute, decode = FakeBackend(silent), FakeBackend(answers_health_only)
    checks = ("--health-check-interval-secs", "0.2", "--health-check-timeout-secs", "0.5",
              "--health-failure-threshold", "2")
    try:
        with unready_router("--prefill", mute.url, "--decode", decode.url, *checks) as url:
            wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 503, 30, "/health says 503")
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert health["status"].startswith("no prefill server is up") and mute.url in health["status"]
            assert {b["url"]: b["up"] for b in health["backends"]} == {mute.url: False, decode.url: True}
            refused = complete(url)
            assert refused.status_code == 503 and mute.url in refused.json()["error"]["message"]
    finally:
        mute.stop()
        decode.stop()


def test_orca_loads_that_are_not_finite_numbers_are_ignored_and_logged_and_the_answer_goes_back(backends):
    nan = FakeBackend(reports_load("TEXT named_metrics.num_requests_waiting=NaN, named_metrics.kv_cache_usage_perc=0.9"))
    null = FakeBackend(reports_load('JSON {"named_metrics": {"num_requests_waiting": null, '
                                    '"kv_cache_usage_perc": 0.95}}'))
    router = RouterProcess([nan.url, null.url, backends[0].url], "--policy", "least_load")
    try:
        # All idle: the first listed, then the next; each reports a high KV usage and an invalid queue.
        assert [complete(router.url).json()["choices"][0]["text"] for _ in range(2)] == [FAKE_TEXT, FAKE_TEXT]
        for _ in range(4):  # a NaN queue no longer wins every comparison: the real, least loaded backend does
            assert complete(router.url).json()["choices"][0]["text"] != FAKE_TEXT
        assert (len(nan.posts()), len(null.posts())) == (1, 1)
        log = router.output()
        assert f"backend {nan.url} reported num_requests_waiting='NaN'" in log
        assert f"backend {null.url} reported num_requests_waiting=None" in log
    finally:
        router.stop()
        nan.stop()
        null.stop()


def test_a_backend_dropping_mid_answer_is_an_error_event_and_its_models_answer_is_bounded(backends):
    drops = FakeBackend(drops_mid_answer)
    router = RouterProcess([drops.url, backends[0].url], "--health-check-interval-secs", "600")
    rss = psutil.Process(router.process.pid).memory_info().rss
    try:
        models = httpx.get(f"{router.url}/v1/models", timeout=60)  # 64 MB from the first backend
        assert models.status_code == 502 and str(8 << 20) in models.json()["error"]["message"]
        assert psutil.Process(router.process.pid).memory_info().rss - rss < 32 << 20
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True)
        assert next(stream).choices[0].text == FAKE_TEXT  # the whole event it sent; not the half
        with pytest.raises(openai.APIError) as error:
            next(stream)
        assert drops.url in str(error.value) and "incomplete" in str(error.value)
        for _ in range(3):  # it is down now: every later answer is the live backend's, whole
            chunks = list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, stream=True))
            assert chunks and FAKE_TEXT not in "".join(c.choices[0].text for c in chunks if c.choices)
        assert len(drops.posts()) == 1
    finally:
        router.stop()
    router = RouterProcess([drops.url], "--health-check-interval-secs", "600")
    try:  # a whole answer cut off is cut off for the client too: never a shorter 200 that looks complete
        with pytest.raises(httpx.RemoteProtocolError):
            complete(router.url)
    finally:
        router.stop()
        drops.stop()


def raw_exchange(port: int, head: bytes, chunks=()) -> bytes:
    """Send `head`, then `chunks` until the router answers or closes; its answer (a Content-Length body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        for chunk in chunks:
            if select.select([sock], [], [], 0)[0]:
                break  # it answered (or closed) before taking the whole body
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while not whole_response(answer) and (data := sock.recv(65536)):
                answer += data
        return answer


def whole_response(answer: bytes) -> bool:
    head, blank, body = answer.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(blank) and len(body) >= (lengths[0] if lengths else 0)


def status_and_message(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]["message"]


def assert_large_bodies_refused(router, limit: int, path: str = "/v1/chat/completions") -> None:
    """64 MB bodies, with their length declared and chunked: 413 naming the limit; the router holds none."""
    rss = psutil.Process(router.process.pid).memory_info().rss
    megabyte, size = b"x" * (1 << 20), 64 << 20
    declared = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {size}\r\n\r\n").encode()
    chunked = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               "transfer-encoding: chunked\r\n\r\n").encode()
    for head, chunks in [(declared, [megabyte] * 64), (chunked, [b"100000\r\n" + megabyte + b"\r\n"] * 64)]:
        status, message = status_and_message(raw_exchange(router.port, head, chunks))
        assert status == 413 and str(limit) in message and "--max-request-body-bytes" in message
    assert psutil.Process(router.process.pid).memory_info().rss - rss < 32 << 20


def test_the_router_keeps_the_servers_limits_and_refuses_what_it_cannot_read_by_name(backends):
    limit = 1 << 20
    router = RouterProcess([backends[0].url], "--max-request-body-bytes", str(limit), "--http-header-timeout", "1")
    try:
        assert_large_bodies_refused(router, limit)
        began = time.monotonic()  # headers that never end: 408 and closed once the header timeout passes
        status, message = status_and_message(raw_exchange(router.port, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"))
        assert status == 408 and "--http-header-timeout" in message and 1 <= time.monotonic() - began < 6
        nested = httpx.post(f"{router.url}/v1/completions", content=b"[" * 200_000, timeout=30)
        assert nested.status_code == 400 and "nested too deeply" in nested.json()["error"]["message"]
        for content in (b"[1]", b"{", b"\xff"):
            assert httpx.post(f"{router.url}/v1/completions", content=content, timeout=30).status_code == 400
        smuggled = complete(router.url, kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1"})
        assert smuggled.status_code == 400 and smuggled.json()["error"]["param"] == "kv_transfer_params"
        assert complete(router.url).status_code == 200
    finally:
        router.stop()


def test_the_prefill_decode_router_never_passes_on_a_clients_kv_transfer_params():
    prefill, decode = (FakeBackend(reports_load("TEXT named_metrics.num_requests_waiting=0")) for _ in range(2))
    router = RouterProcess([], "--prefill", prefill.url, "--decode", decode.url)
    try:
        smuggled = complete(router.url, kv_transfer_params={"do_remote_prefill": True, "remote_host": "10.0.0.1",
                                                            "remote_port": 1})
        assert smuggled.status_code == 400 and "kv_transfer_params" in smuggled.json()["error"]["message"]
        assert prefill.posts() == decode.posts() == []
        # The prefill hands nothing over (no kv_transfer_params in its answer): the decode gets none either.
        assert complete(router.url).json()["choices"][0]["text"] == FAKE_TEXT
        [to_prefill], [to_decode] = prefill.posts(), decode.posts()
        assert to_prefill["kv_transfer_params"] == {"do_remote_decode": True}
        assert "kv_transfer_params" not in to_decode
    finally:
        router.stop()
        prefill.stop()
        decode.stop()


@pytest.mark.parametrize(("flags", "message"), [
    ([], "--backend needs at least one URL"),
    (["--backend", "127.0.0.1:8001"], "is not an http(s) URL"),
    (["--backend", "http://a:1", "--policy", "prefix-aware", "--tokenizer", "m"], "needs --kv-events"),
    (["--backend", "http://a:1", "http://b:1", "--policy", "prefix-aware", "--tokenizer", "m",
      "--kv-events", "tcp://a:5557"], "one endpoint per --backend"),
    (["--backend", "http://a:1", "--policy", "prefix-aware", "--kv-events", "tcp://a:5557", "--tokenizer",
      "/nonexistent/model"], "/nonexistent/model"),
    (["--backend", "http://a:1", "--kv-events", "tcp://a:5557"], "is read by --policy prefix-aware only"),
    (["--backend", "http://a:1", "--health-check-interval-secs", "0"], "--health-check-interval-secs must be positive"),
    (["--backend", "http://a:1", "--backend-header-timeout", "nan"], "--backend-header-timeout must be positive"),
    (["--prefill", "http://a:1", "--decode", "http://b:1", "--max-request-body-bytes", "0"],
     "--max-request-body-bytes must be at least 1"),
    (["--backend", "http://a:1", "--health-failure-threshold", "0"], "--health-failure-threshold must be at least 1"),
])
def test_bad_flags_are_refused_naming_them(flags, message, capsys):
    from tinyserve.cli.main import main

    assert main(["router", *flags]) == 2
    assert message in capsys.readouterr().err


# ---- KV cache events, decoded as vLLM's example subscriber decodes them --------------------------
# Types copied from vllm/distributed/kv_events.py, as examples/online_serving/kv_events_subscriber.py has them.


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class Subscriber:
    """A SUB socket on one endpoint, every batch decoded and kept, read on a thread of its own."""

    def __init__(self, endpoint: str) -> None:
        self.batches: list[tuple[bytes, int, KVEventBatch]] = []
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.connect(endpoint)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, "")
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while self._running:
            if self._socket.poll(50):
                topic, seq_bytes, payload = self._socket.recv_multipart()
                self.batches.append((topic, int.from_bytes(seq_bytes, "big"), decoder.decode(payload)))

    def events(self) -> list:
        return [event for _, _, batch in list(self.batches) for event in batch.events]

    def close(self) -> None:
        self._running = False
        self._thread.join()
        self._socket.close(linger=0)


def block_hash_ints(token_ids: list[int]) -> list[int]:
    """The documented hashes: SHA-256 chained over each full block's token ids as little-endian int64s, from
    b"" (engine/core/block_pool.py), sent as the low 64 bits of the digest read big-endian (vLLM's rule)."""
    hashes, parent = [], b""
    for start in range(0, len(token_ids) - BLOCK_SIZE + 1, BLOCK_SIZE):
        block = token_ids[start:start + BLOCK_SIZE]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block)).digest()
        hashes.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return hashes


@pytest.fixture(scope="module")
def subscribers(backends, events_port):
    """One subscriber per backend, on the port vLLM's rule gives its rank; each has seen a batch (it is joined)."""
    subs = [Subscriber(f"tcp://127.0.0.1:{events_port + rank}") for rank in (0, 1)]
    rng = random.Random(7)
    for server, sub in zip(backends, subs):
        def joined():  # a PUB drops what it sends before a subscription reaches it: send until one arrives
            prompt = [rng.randrange(10, 200) for _ in range(BLOCK_SIZE + 1)]
            httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                       timeout=60)
            return sub.batches

        wait_until(joined, 30, "the subscriber receives a batch")
    yield subs
    for sub in subs:
        sub.close()


def test_a_subscriber_sees_blocks_stored_with_their_chain_and_removed_when_the_pool_evicts(backends, subscribers):
    server, sub = backends[0], subscribers[0]
    prompt = [random.Random(11).randrange(10, 200) for _ in range(2 * BLOCK_SIZE + 8)]
    expected = block_hash_ints(prompt)
    httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=60)

    def stored():
        return [e for e in sub.events() if isinstance(e, BlockStored) and e.block_hashes[0] == expected[0]]

    wait_until(stored, 30, "the prompt's blocks are published as stored")
    [event] = stored()
    assert event.block_hashes == expected  # both full blocks, in one event, the second chained from the first
    assert event.parent_block_hash is None and event.token_ids == prompt[:2 * BLOCK_SIZE]
    assert event.block_size == BLOCK_SIZE and event.lora_id is None and event.medium == "CPU"
    # A prompt that needs every block of the pool: every cached block is evicted, ours with them.
    filler = [random.Random(12).randrange(10, 200) for _ in range(NUM_KV_BLOCKS * BLOCK_SIZE - 8)]
    answer = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": filler, "max_tokens": 8},
                        timeout=120)
    assert answer.status_code == 200, answer.text

    def removed() -> set:
        return {h for e in sub.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}

    wait_until(lambda: set(expected) <= removed(), 30, "the evicted blocks are published as removed")
    topics_and_sequences = [(topic, seq) for topic, seq, _ in sub.batches]
    assert {topic for topic, _ in topics_and_sequences} == {b""}
    sequences = [seq for _, seq in topics_and_sequences]
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))  # in order, none lost


def test_the_second_rank_publishes_on_the_next_port(backends, subscribers):
    prompt = [random.Random(13).randrange(10, 200) for _ in range(BLOCK_SIZE + 3)]
    [expected] = block_hash_ints(prompt)
    httpx.post(f"{backends[1].url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
               timeout=60)
    wait_until(lambda: any(isinstance(e, BlockStored) and expected in e.block_hashes for e in subscribers[1].events()),
               30, "rank 1's blocks are published on its own port")
    assert not any(isinstance(e, BlockStored) and expected in e.block_hashes for e in subscribers[0].events())


# ---- prefix-aware routing ------------------------------------------------------------------------


def hits_and_queries(servers) -> tuple[float, float]:
    def total(server, name: str) -> float:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(f"vllm:{name}{{"))

    return (sum(total(s, "prefix_cache_hits_total") for s in servers),
            sum(total(s, "prefix_cache_queries_total") for s in servers))


def shared_prefix_workload(seed: int, num_prefixes: int = 4, per_prefix: int = 5) -> list[list[dict]]:
    """num_prefixes long system prompts, each asked per_prefix different questions; shuffled, so interleaved."""
    rng = random.Random(seed)
    words = ["router", "block", "cache", "prefix", "engine", "token", "batch", "stream", "event", "hash"]
    prefixes = [f"Run {seed}, prefix {p}: " + " ".join(rng.choices(words, k=60)) for p in range(num_prefixes)]
    requests = [[{"role": "system", "content": prefixes[p]}, {"role": "user", "content": f"Question {q} about {p}?"}]
                for p in range(num_prefixes) for q in range(per_prefix)]
    rng.shuffle(requests)
    return requests


def ideal_hit_tokens(server, requests: list[list[dict]]) -> int:
    """Hits if each prefix were computed once: every later request of a prefix finds the full blocks it shares
    with the first, as the backend tokenizes them (/tokenize), at most all but its last token's block."""
    first: dict[str, list[int]] = {}
    ideal = 0
    for messages in requests:
        ids = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=30).json()["tokens"]
        earlier = first.setdefault(messages[0]["content"], ids)
        if earlier is ids:
            continue
        common = next((i for i, (a, b) in enumerate(zip(ids, earlier)) if a != b), min(len(ids), len(earlier)))
        ideal += min(common // BLOCK_SIZE, (len(ids) - 1) // BLOCK_SIZE) * BLOCK_SIZE
    return ideal


def run_workload(router_url: str, requests: list[list[dict]]) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)

    def ask(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)

    with ThreadPoolExecutor(4) as pool:  # four at a time: a prefix's requests overlap before its events arrive
        assert all(answer.choices for answer in pool.map(ask, requests))


def hit_share(backends, router_url: str, seed: int) -> float:
    requests = shared_prefix_workload(seed)
    ideal = ideal_hit_tokens(backends[0], requests)
    before, _ = hits_and_queries(backends)
    run_workload(router_url, requests)
    after, _ = hits_and_queries(backends)
    assert ideal > 0
    return (after - before) / ideal


def test_prefix_aware_routing_reaches_the_ideal_prefix_cache_hits_and_round_robin_does_not(
        backends, subscribers, events_port):
    endpoints = [f"tcp://127.0.0.1:{events_port + rank}" for rank in (0, 1)]
    aware = RouterProcess([s.url for s in backends], "--policy", "prefix-aware", "--kv-events", *endpoints,
                          "--tokenizer", shared_server.model_folder())
    try:
        assert_large_bodies_refused(aware, 4 << 20)  # the default limit: a 64 MB chat is never tokenized
        aware_share = hit_share(backends, aware.url, seed=1)
    finally:
        aware.stop()
    plain = RouterProcess([s.url for s in backends], "--policy", "round_robin")
    try:
        round_robin_share = hit_share(backends, plain.url, seed=2)
    finally:
        plain.stop()
    assert aware_share >= 0.95, (aware_share, round_robin_share)
    assert round_robin_share < 0.95, (aware_share, round_robin_share)
