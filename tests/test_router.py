"""`tinyserve router` in front of two real `tinyserve serve` backends, and their KV cache events, on loopback.

Two --data-parallel-rank servers (ranks 0 and 1 of 2), traced, with vLLM's metric names, a small
KV pool (64 blocks of 16 tokens) and KV cache events on one --kv-events-config (rank 1 publishes
on the port after rank 0's, as vLLM offsets it), shared by every test here; each test starts the
router it needs (a process of a second or two). The clients are the official openai one, httpx,
and a ZeroMQ subscriber written as vLLM's examples/online_serving/kv_events_subscriber.py is.
"""

import hashlib
import json
import random
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import zmq

import httpx
import openai
import pytest

from tests import shared_server
from tests.server_checks import wait_until
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.otlp_json import read_spans
from tinyserve.testing import RouterProcess, ServerProcess, free_port

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
    from tinyserve.lifecycle.merge import merge_runs
    from tinyserve.lifecycle.run import load_run

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


def test_a_backend_that_is_down_is_passed_over_and_none_left_is_a_503_naming_it(backends):
    dead = f"http://127.0.0.1:{free_port()}"
    router = RouterProcess([dead, backends[0].url])
    try:
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        for _ in range(3):
            assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None
    finally:
        router.stop()
    nothing = subprocess.Popen([sys.executable, "-m", "tinyserve.cli.main", "router", "--backend", dead, "--port",
                                str(port := free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def answer():
            try:
                return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"model": MODEL, "prompt": "Hi"},
                                  timeout=10)
            except httpx.HTTPError:
                return None

        wait_until(answer, 30, "the router listens")
        refused = answer()
        assert refused.status_code == 503
        assert dead in refused.json()["error"]["message"]
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
    finally:
        nothing.terminate()
        nothing.wait(30)


@pytest.mark.parametrize(("flags", "message"), [
    ([], "--backend needs at least one URL"),
    (["--backend", "127.0.0.1:8001"], "is not an http(s) URL"),
    (["--backend", "http://a:1", "--policy", "prefix-aware", "--tokenizer", "m"], "needs --kv-events"),
    (["--backend", "http://a:1", "http://b:1", "--policy", "prefix-aware", "--tokenizer", "m",
      "--kv-events", "tcp://a:5557"], "one endpoint per --backend"),
    (["--backend", "http://a:1", "--policy", "prefix-aware", "--kv-events", "tcp://a:5557", "--tokenizer",
      "/nonexistent/model"], "/nonexistent/model"),
    (["--backend", "http://a:1", "--kv-events", "tcp://a:5557"], "is read by --policy prefix-aware only"),
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
