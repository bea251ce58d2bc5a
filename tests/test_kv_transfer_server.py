"""Disaggregated prefill over HTTP: `tinyserve router --prefill URL --decode URL` in front of a kv_producer
and a kv_consumer `tinyserve serve`, on loopback, as vLLM's disaggregated proxy example runs them.

Greedy answers through the router equal a single server's (the prefill server asked directly, without
kv_transfer_params: the plain engine); the decode server's trace has the KV transfer span, in the same
trace as the router's and the prefill's, and its prefill computes the last prompt token only (vLLM
recomputes it too); a prefill server killed while a decode server pulls from it fails that request by
name, and the decode server's KV blocks all come back. Both servers share the secret
(TINYSERVE_KV_TRANSFER_SECRET): a client's forged kv_transfer_params are refused by the decode server,
and strangers' and malformed messages to the prefill server's side channel are dropped, its memory
bounded, while it goes on serving. The servers are shared by the module (started together); the
kill comes last.
"""

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from tests import shared_server
from tests.server_checks import metric, wait_until
from tinyserve.distributed.kv_transfer.trust import SECRET_ENV, SideChannelKeys
from tinyserve.lifecycle import schema
from tinyserve.testing import RouterProcess, ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL
FLAGS = (*shared_server.ENGINE_FLAGS, "--num-kv-blocks", "128")
LONG_PROMPT = " ".join(f"word{i}" for i in range(60))  # several blocks of 16 tokens
SECRET = "the deployment's secret"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(prefill, decode, router), each tracing into a folder of its own."""
    model = shared_server.model_folder()
    roles = {"prefill": {"kv_role": "kv_producer"},
             "decode": {"kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_timeout": 60}}}
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(ServerProcess, model, *FLAGS, "--kv-transfer-config", json.dumps(config), "--trace",
                               "--trace-dir", str(tmp_path_factory.mktemp(name)), env={SECRET_ENV: SECRET})
                   for name, config in roles.items()]
    started = [future.result() for future in futures if future.exception() is None]
    if len(started) < 2:
        for server in started:
            server.stop()
        raise next(future.exception() for future in futures if future.exception() is not None)
    prefill, decode = started
    router = RouterProcess([], "--prefill", prefill.url, "--decode", decode.url, "--trace", "--trace-dir",
                           str(tmp_path_factory.mktemp("router")))
    yield prefill, decode, router
    for process in (router, prefill, decode):
        process.stop()


def client(process) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{process.url}/v1", api_key="unused", max_retries=0)


def run_folder(process) -> Path:
    [line] = [line for line in process.output().splitlines() if "tinyserve: tracing to " in line]
    return Path(line.split("tinyserve: tracing to ")[1].strip())


def spans_in(process) -> list:
    return [span for file in sorted(run_folder(process).glob("*.jsonl")) for span in read_spans(file)]


def test_greedy_answers_through_the_router_equal_a_single_servers(servers):
    prefill, decode, router = servers
    single, via_router = client(prefill), client(router)
    for prompt in ("Once upon a time", LONG_PROMPT):
        completion = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        expected = single.completions.create(**completion).choices[0].text
        assert via_router.completions.create(**completion).choices[0].text == expected
        streamed = via_router.completions.create(**completion, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
        chat = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0)
        expected = single.chat.completions.create(**chat).choices[0].message.content
        assert via_router.chat.completions.create(**chat).choices[0].message.content == expected
        streamed = via_router.chat.completions.create(**chat, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected
    wait_until(lambda: metric(prefill.url, "kv_cache_usage_perc") == 0, 30, "the prefill server freed what it sent")
    assert metric(decode.url, "kv_cache_usage_perc") == 0


def test_one_trace_holds_the_router_the_prefill_and_the_decode_and_its_kv_transfer(servers):
    prefill, decode, router = servers
    trace_id = os.urandom(16).hex()  # the client's own trace: the router's spans and both servers' join it
    answer = client(router).completions.create(model=MODEL, prompt=LONG_PROMPT + " traced", max_tokens=4,
                                               temperature=0,
                                               extra_headers={"traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"})
    num_prompt = answer.usage.prompt_tokens

    def transfer(server) -> list:
        return [s for s in spans_in(server) if s.name == schema.KV_TRANSFER and s.trace_id == trace_id]

    wait_until(lambda: transfer(decode) and transfer(prefill), 30, "both servers wrote their KV transfer span")
    [received], [sent] = transfer(decode), transfer(prefill)
    assert received.attributes[schema.KV_TRANSFER_ROLE] == "consumer" and not received.is_error
    assert sent.attributes[schema.KV_TRANSFER_ROLE] == "producer" and not sent.is_error
    for span in (received, sent):
        assert span.attributes[schema.KV_TRANSFER_NUM_BLOCKS] == -(-num_prompt // 16)
        assert span.attributes[schema.KV_TRANSFER_NUM_BYTES] > 0
        assert span.attributes[schema.KV_TRANSFER_CONNECTOR] in ("MooncakeConnector", "ZmqConnector")

    def routes() -> list:
        return [s for s in spans_in(router) if s.name == schema.ROUTE and s.trace_id == trace_id]

    wait_until(lambda: len(routes()) == 2, 30, "the router wrote a route span for each leg")
    assert sorted(s.attributes[schema.ROUTER_PD_LEG] for s in routes()) == ["decode", "prefill"]

    def decode_prefills() -> list:  # the engine's request spans go out when it exports, after the transfer's
        return [s for s in spans_in(decode) if s.name == schema.PREFILL and s.trace_id == trace_id]

    wait_until(lambda: decode_prefills(), 30, "the decode server wrote the request's prefill span")
    [decode_prefill] = decode_prefills()
    assert decode_prefill.attributes[schema.KV_TRANSFER_NUM_RECEIVED_TOKENS] == num_prompt - 1
    chunks = [event.attributes[schema.CHUNK_TOKENS] for event in decode_prefill.events
              if event.name == schema.EVENT_PREFILL_CHUNK]
    assert chunks == [1]  # the last prompt token, recomputed to sample from, as vLLM does


def prefill_params(prefill, prompt: str) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    return httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]


def test_the_decode_server_refuses_kv_transfer_params_no_prefill_server_signed(servers):
    prefill, decode, router = servers
    params = prefill_params(prefill, LONG_PROMPT + " forged")
    body = {"model": MODEL, "prompt": LONG_PROMPT + " forged", "max_tokens": 4, "temperature": 0}
    for forged in ({**params, "remote_port": decode.port}, {**params, "remote_host": "10.255.255.1"},
                   {k: v for k, v in params.items() if k != "remote_signature"}):
        refused = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": forged}, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "kv_transfer_params"
        assert "remote_signature does not match" in refused.json()["error"]["message"]
    served = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    assert served.status_code == 200  # the genuine ones: pulled, and the prefill server's blocks freed
    wait_until(lambda: metric(prefill.url, "kv_cache_usage_perc") == 0, 30, "the prefill server freed what it sent")


def listener(port: int) -> psutil.Process:
    [pid] = {c.pid for c in psutil.net_connections("tcp") if c.laddr.port == port and c.status == psutil.CONN_LISTEN}
    return psutil.Process(pid)


def until_dropped(socket: zmq.Socket, monitor: zmq.Socket) -> None:
    """Wait for the side channel to drop this connection (or refuse its handshake)."""
    events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    wait_until(lambda: monitor.poll(0) and recv_monitor_message(monitor)["event"] & events, 30,
               "the side channel dropped the connection")


def send_unless_refused(socket: zmq.Socket, *frames) -> None:
    """Send without waiting. Once the side channel has refused this socket's handshake it may have no connection to
    queue on (until it reconnects), and a plain send then blocks for good: there is nothing to send to, which is
    what refusing means. On a busy machine the refusal came before the 64 MiB frame and the test hung."""
    try:
        socket.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
    except zmq.Again:
        pass


def test_the_side_channel_drops_strangers_and_malformed_messages_and_keeps_serving(servers):
    """A stranger (no secret), and a peer sending what no pull is: a two-frame message (it used to end the side
    channel's thread), bytes that are no message, a 64 MiB frame. The prefill engine's memory stays bounded,
    and the decode server then pulls the K/V it keeps and answers as a single server does."""
    prefill, decode, router = servers
    prompt = LONG_PROMPT + " side channel"
    params = prefill_params(prefill, prompt)
    engine = listener(params["remote_port"])
    before, peak, done = engine.memory_info().rss, [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak.append(engine.memory_info().rss)
            done.wait(0.01)

    sampler, context, frame = threading.Thread(target=sample), zmq.Context(), np.zeros(64 << 20, np.uint8)
    sampler.start()
    try:
        stranger, peer = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        SideChannelKeys(SECRET).connect_as_client(peer)
        monitors = {sock: sock.get_monitor_socket() for sock in (stranger, peer)}
        for sock in (stranger, peer):
            sock.connect(f"tcp://127.0.0.1:{params['remote_port']}")
        for message in ([b"two", b"frames"], [b"\xc1 is no msgpack"]):
            send_unless_refused(stranger, *message)
            peer.send_multipart(message)
        send_unless_refused(stranger, memoryview(frame))
        until_dropped(stranger, monitors[stranger])
        wait_until(lambda: "dropped a message of 2 frames" in prefill.output() and
                   "dropped a malformed message" in prefill.output(), 30, "the peer's malformed messages were dropped")
        peer.send(memoryview(frame), copy=False)
        until_dropped(peer, monitors[peer])
    finally:
        done.set()
        sampler.join()
        context.destroy(linger=0)
    assert max(peak) - before < 32 << 20, f"the prefill engine grew by {(max(peak) - before) >> 20} MiB"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    expected = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    pulled = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    assert pulled.status_code == 200 and pulled.json()["choices"][0]["text"] == expected
    wait_until(lambda: metric(prefill.url, "kv_cache_usage_perc") == 0, 30, "the prefill server freed what it sent")


def test_a_prefill_server_killed_mid_transfer_fails_the_pull_by_name_and_frees_every_block(servers):
    prefill, decode, router = servers
    body = {"model": MODEL, "prompt": LONG_PROMPT + " killed", "max_tokens": 1, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()["kv_transfer_params"]
    os.killpg(prefill.pgid, signal.SIGSTOP)  # frozen: the decode server's pull gets no answer
    answers = []
    pulling = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{decode.url}/v1/completions", timeout=120,
        json={**body, "max_tokens": 8, "kv_transfer_params": params})))
    pulling.start()

    def pulling_connected() -> bool:  # the decode server's pull reached the frozen prefill's side channel
        return any(c.raddr and c.raddr.port == params["remote_port"] and c.status == psutil.CONN_ESTABLISHED
                   for c in psutil.net_connections("tcp"))

    wait_until(pulling_connected, 30, "the decode server is pulling")
    os.killpg(prefill.pgid, signal.SIGKILL)
    pulling.join(60)
    [failed] = answers
    assert failed.status_code == 400
    error = failed.json()["error"]
    assert error["param"] == "kv_transfer_params"
    assert f"KV transfer from 127.0.0.1:{params['remote_port']} failed" in error["message"]
    wait_until(lambda: metric(decode.url, "kv_cache_usage_perc") == 0 and
               metric(decode.url, "num_requests_waiting") == 0, 30, "the decode server freed the request's blocks")
    prefill.process.wait(30)
    gone = httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, timeout=60)
    assert gone.status_code == 503 and prefill.url in gone.json()["error"]["message"]
