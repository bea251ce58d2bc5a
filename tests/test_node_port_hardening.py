"""The head's node port (--data-parallel-rpc-port) against what a stranger can send it.

Whoever reaches the port may send anything: a 50 MB HELLO, frames that decode to
nothing, fields past their caps, a HELLO without the node secret. The head answers
each with a short refusal or by dropping the peer, and keeps serving: its headless
node stays joined, requests complete, the log stays short. The heartbeats are judged
on a thread of their own, so a busy event loop cannot make a live node look dead.

One deployment (a head and a node on loopback) is started; the rest runs in-process.
"""

import asyncio
import logging
import threading
import time

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from tests.test_multi_node import ENGINE_FLAGS, HeadlessProcess, burst, dp_flags, served_by_engine
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.cli.data_parallel_flags import NODE_SECRET_ENV
from tinyserve.frontend.remote_engines import SECRET_REFUSAL, MultiNode, RemoteEngines
from tinyserve.models.fingerprint import manifest_fingerprint
from tinyserve.testing import ServerProcess, free_port
from tinyserve.wire.ipc import MessageDecoder
from tinyserve.wire.nodes import (
    HEARTBEAT_TIMEOUT_S,
    MAX_HOST_CHARS,
    NODE_MESSAGE_TYPES,
    Heartbeat,
    NodeMessageKind,
)

SECRET = "correct horse battery staple"
encoder = msgspec.msgpack.Encoder()
decoder = MessageDecoder(NodeMessageKind, NODE_MESSAGE_TYPES)


def hello_frames(host="attacker", pid=1, ranks=(1,), size=2, fingerprint=None, secret=None) -> list[bytes]:
    """A HELLO as a peer would send it, with no cap checked on the way out."""
    return [NodeMessageKind.HELLO.value, encoder.encode([host, pid, list(ranks), size, fingerprint, secret])]


def answer(dealer: zmq.Socket, timeout_s: float = 5.0):
    """The head's reply to this DEALER, decoded; None if none came."""
    if not dealer.poll(int(timeout_s * 1000)):
        return None
    return decoder.decode(dealer.recv_multipart())


# ---- in-process: the caps, the warning, a busy loop ---------------------------------------


@pytest.mark.parametrize("fields, where", [
    (["h" * (MAX_HOST_CHARS + 1), 1, [1], 2, None], "$[0]"),
    (["h", 1, [], 2, None], "$[2]"),  # a HELLO that claims no rank is no node
    (["h", 1, list(range(2000)), 2, None], "$[2]"),
    (["h", 1, [-1], 2, None], "$[2][0]"),
    (["h", -5, [1], 2, None], "$[1]"),
    (["h", 1, [1], 2, "f" * 129], "$[4]"),
    (["h", 1, [1], 2, None, "s" * 1025], "$[5]"),
])
def test_a_hello_field_over_its_cap_does_not_decode(fields, where):
    with pytest.raises(ValueError, match="malformed HELLO") as error:
        decoder.decode([NodeMessageKind.HELLO.value, encoder.encode(fields)])
    assert where in str(error.value) and len(str(error.value)) < 120


def test_a_node_secret_over_its_cap_exits_2_before_loading_the_model(tmp_path, capsys, monkeypatch):
    from tinyserve.cli.main import main

    flags = ["--data-parallel-size", "2", "--data-parallel-size-local", "1"]
    assert main(["serve", str(tmp_path / "no-such-model"), *flags, "--data-parallel-node-secret", "s" * 1025]) == 2
    assert capsys.readouterr().err == ("error: --data-parallel-node-secret (or TINYSERVE_DP_NODE_SECRET) may be "
                                       "1024 characters at most\n")
    monkeypatch.setenv(NODE_SECRET_ENV, "s" * 1025)
    assert main(["serve", str(tmp_path / "no-such-model"), *flags]) == 2
    assert "may be 1024 characters at most" in capsys.readouterr().err


def test_without_a_secret_a_head_listening_beyond_loopback_warns_that_anyone_can_join(caplog):
    context = zmq.asyncio.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="tinyserve.frontend.remote_engines"):
            quiet = RemoteEngines(context, MultiNode(1, "127.0.0.1", free_port()), 2, None, ["a", "b"], "o", print)
            quiet.shutdown()
            assert "NO NODE SECRET" not in caplog.text
            loud = RemoteEngines(context, MultiNode(1, "0.0.0.0", free_port()), 2, None, ["a", "b"], "o", print)
            loud.shutdown()
            assert "NO NODE SECRET: any host that can reach" in caplog.text
            with_secret = RemoteEngines(context, MultiNode(1, "0.0.0.0", free_port(), node_secret=SECRET), 2, None,
                                        ["a", "b"], "o", print)
            with_secret.shutdown()
        assert caplog.text.count("NO NODE SECRET") == 1
    finally:
        context.term()


def test_a_busy_event_loop_does_not_make_a_live_node_look_dead():
    """The loop is held for 3 s (more than twice HEARTBEAT_TIMEOUT_S) while a node keeps sending heartbeats:
    the head's thread answers them all the while, and declares nothing. Silence then is noticed."""
    port = free_port()
    dead: list[tuple[int, str]] = []
    replies: list[float] = []
    stop = threading.Event()

    def node() -> None:
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart(hello_frames(host="node-a", fingerprint="fp", secret=SECRET))
        kind, _ = answer(dealer)
        assert kind is NodeMessageKind.WELCOME
        while not stop.is_set():
            dealer.send_multipart([NodeMessageKind.HEARTBEAT.value, encoder.encode(Heartbeat(time.time()))])
            while dealer.poll(250):
                if decoder.decode(dealer.recv_multipart())[0] is NodeMessageKind.HEARTBEAT:
                    replies.append(time.monotonic())
        dealer.close(linger=0)
        context.term()

    async def main() -> None:
        context = zmq.asyncio.Context()
        remote = RemoteEngines(context, MultiNode(1, "127.0.0.1", port, node_secret=SECRET), 2, "fp",
                               ["in-0", "in-1"], "out", lambda rank, reason: dead.append((rank, reason)))
        remote.start()
        thread = threading.Thread(target=node)
        thread.start()
        try:
            while remote.node_of(1) is None:
                await asyncio.sleep(0.05)
            busy_from = time.monotonic()
            while time.monotonic() - busy_from < 3.0:  # the loop runs nothing else, and holds the GIL when it can
                pass
            busy_until = time.monotonic()
            await asyncio.sleep(0.2)
            assert dead == []
            heard = [t for t in replies if busy_from <= t <= busy_until]
            gaps = [b - a for a, b in zip([busy_from, *heard], [*heard, busy_until])]
            assert len(heard) >= 6 and max(gaps) < HEARTBEAT_TIMEOUT_S / 2, gaps
            stop.set()
            thread.join(timeout=5)
            silent_from = time.monotonic()
            while not dead and time.monotonic() - silent_from < 5:
                await asyncio.sleep(0.05)
            assert len(dead) == 1 and dead[0][0] == 1 and "missed its heartbeats" in dead[0][1], dead
            assert time.monotonic() - replies[-1] > HEARTBEAT_TIMEOUT_S  # not before its time
            assert time.monotonic() - silent_from < HEARTBEAT_TIMEOUT_S + 1.0
        finally:
            stop.set()
            thread.join(timeout=5)
            remote.shutdown()
            context.term()

    asyncio.run(main())


# ---- one deployment: a head and a node with the secret, and strangers ----------------------


@pytest.mark.server
def test_strangers_on_the_node_port_are_refused_or_dropped_and_the_deployment_keeps_serving(monkeypatch):
    model = tiny_model_with_tokenizer("llama")
    port = free_port()
    flags = (*dp_flags("127.0.0.1", port), "--data-parallel-start-rank", "1")
    monkeypatch.setenv(NODE_SECRET_ENV, SECRET)  # head and node take it from the environment, out of `ps`
    node = HeadlessProcess(model, *flags)
    head = ServerProcess(str(model), *ENGINE_FLAGS, *dp_flags("127.0.0.1", port))
    context = zmq.Context()
    try:
        # Real nodes: a wrong secret (the flag beats the variable), and none at all.
        wrong = HeadlessProcess(model, *flags, "--data-parallel-node-secret", "not it")
        monkeypatch.delenv(NODE_SECRET_ENV)
        missing = HeadlessProcess(model, *flags)

        endpoint = f"tcp://127.0.0.1:{port}"
        huge = context.socket(zmq.DEALER)
        huge.connect(endpoint)
        huge.send_multipart(hello_frames(host="x" * 50_000_000, secret=SECRET))  # dropped by ZeroMQ, unread
        assert answer(huge, timeout_s=2) is None

        dealer = context.socket(zmq.DEALER)
        dealer.connect(endpoint)
        fingerprint = manifest_fingerprint(str(model))
        # Frames that decode to nothing: dropped, no answer (a would-be HELLO is told why, briefly).
        for frames in ([b"Z", b"\x90"], [b"B", b"\xff\xff"], [b"E", b"\x92\x01"], [b"B"] * 1000):
            dealer.send_multipart(frames)
        assert answer(dealer, timeout_s=1) is None
        for frames in ([b"H"], [b"H", b"", b"", b""], [b"H", b"\xc1" * 1000]):
            dealer.send_multipart(frames)
            kind, refused = answer(dealer)
            assert kind is NodeMessageKind.REFUSED and len(refused.reason) < 200, refused
        # A HELLO that does not decode: refused, naming the field, in a line.
        dealer.send_multipart(hello_frames(host="y" * 10_000, fingerprint=fingerprint, secret=SECRET))
        kind, refused = answer(dealer)
        assert kind is NodeMessageKind.REFUSED
        assert "`host`" in refused.reason and "yyy" not in refused.reason and len(refused.reason) < 200
        dealer.send_multipart(hello_frames(ranks=[], fingerprint=fingerprint, secret=SECRET))
        kind, refused = answer(dealer)
        assert kind is NodeMessageKind.REFUSED and "`ranks`" in refused.reason
        # The rogue of the report (the public fingerprint, no ranks or a free-looking one) without the secret.
        for secret in (None, "guess", SECRET[:-1]):
            dealer.send_multipart(hello_frames(host="rogue\nINFO forged line", ranks=[1], fingerprint=fingerprint,
                                               secret=secret))
            kind, refused = answer(dealer)
            assert kind is NodeMessageKind.REFUSED and refused.reason == SECRET_REFUSAL
        # A flood of them: the log does not grow with it.
        for _ in range(500):
            dealer.send_multipart(hello_frames(host="z" * 5000, fingerprint=fingerprint))
        for _ in range(500):
            assert answer(dealer)[0] is NodeMessageKind.REFUSED

        assert wrong.wait(timeout=60) == 1 and missing.wait(timeout=60) == 1
        for refused_node in (wrong, missing):
            assert "not the head's" in refused_node.output(), refused_node.output()

        # The deployment is whole: the node still joined, both engines serve, /health is ok.
        assert node.process.poll() is None, node.output()
        burst(head.url, count=8)
        counts = served_by_engine(head.url)
        assert counts.get("0", 0) > 0 and counts.get("1", 0) > 0, counts
        assert httpx.get(f"{head.url}/health").status_code == 200
        log = head.output()
        assert "missed its heartbeats" not in log and "\nINFO forged line" not in log
        assert "rogue\\nINFO forged line" in log  # the peer's text, escaped: one line
        assert "x" * 300 not in log and "z" * 300 not in log and "y" * 300 not in log
        assert len(log) < 40_000, len(log)
        assert "not logged one by one" in log or log.count("refused a headless node") <= 25
        assert SECRET not in log and SECRET not in node.output()
        assert len(node.output()) < 20_000
    finally:
        context.destroy(linger=0)
        head.stop()
        node.kill()
