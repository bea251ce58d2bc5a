"""`tinyserve serve --headless`: a node that runs engines for another machine's API server.

    head node  (tinyserve serve --data-parallel-size 4 --data-parallel-size-local 2
                --data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345)
        API server, engines 0-1, RemoteEngines on :13345 ◄────────────┐ HELLO, heartbeats
        input-2, input-3, output: TCP sockets on 10.0.0.1  ◄──┐        │ (wire/nodes.py)
                                                              │        │
    this node  (tinyserve serve --headless --data-parallel-start-rank 2 ...same flags)
        run_headless ── starts and watches ──► engines 2-3 ───┘ requests, outputs, READY
        (this process)  ───────────────────────────────────────────────┘

This process serves no HTTP and holds no model. It says hello to the head (which
ranks, which model), gets the addresses of the sockets the head bound for those
ranks, starts one engine process per rank with them (engine_procs.py, exactly as
the head starts its own), and then only keeps watch: heartbeats both ways, and
its engines' exits. It stops its engines and returns when the head says it is
stopping (0), when the head goes silent or an engine dies (1), or on SIGTERM and
Ctrl-C (0). With --trace the engines write their spans into this node's own run
folder; `tinyserve trace merge` joins it with the head's.

With --data-parallel-node-secret (or TINYSERVE_DP_NODE_SECRET) the hello carries it;
a head with another secret, or none, refuses the node (frontend/remote_engines.py
says what the secret protects). What the head sends back is bounded too: a frame
over MAX_HEAD_MESSAGE_BYTES drops the connection, and its text is cut in the log.
"""

import logging
import os
import signal
import time

import msgspec
import zmq

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.engine_procs import EngineProcesses
from tinyserve.lifecycle.tracing import host_name
from tinyserve.models.fingerprint import manifest_fingerprint
from tinyserve.wire.ipc import MessageDecoder
from tinyserve.wire.nodes import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_HEAD_MESSAGE_BYTES,
    MAX_REASON_CHARS,
    NODE_MESSAGE_TYPES,
    EngineExited,
    Heartbeat,
    NodeHello,
    NodeMessageKind,
    peer_text,
)

logger = logging.getLogger(__name__)

WELCOME_TIMEOUT_S = 300.0  # the head may still be starting (loading its own engines' models)


class HeadlessNode:
    def __init__(self, engine_args: EngineArgs, data_parallel_size: int, size_local: int, start_rank: int,
                 address: str, rpc_port: int, node_secret: str | None = None, *, make_engine_core) -> None:
        """make_engine_core: what builds each engine in its process (tinyserve/assemble.py's build_engine_core)."""
        self.engine_args = engine_args
        self.node_secret = node_secret
        self.model_info = ModelInfo.from_args(engine_args)
        self.data_parallel_size = data_parallel_size
        self.ranks = list(range(start_rank, start_rank + size_local))
        self.head = f"tcp://{address}:{rpc_port}"
        self.engines = EngineProcesses(engine_args, self.model_info, size_local, first_index=start_rank,
                                       make_engine_core=make_engine_core)
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 500)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_HEAD_MESSAGE_BYTES)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = MessageDecoder(NodeMessageKind, NODE_MESSAGE_TYPES)
        self._stopping = False

    def run(self) -> int:
        """Join the head, serve until told otherwise; the exit status."""
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_signal)
        try:
            self._socket.connect(self.head)
            welcome = self._join()
            if welcome is None:
                return 1
            self.engines.start(welcome.input_addresses, welcome.output_address)
            logger.info("engines %s started (pids %s), serving the head at %s", self.ranks, self.engines.pids, self.head)
            return self._keep_watch()
        finally:
            self.engines.stop()
            self._socket.close()
            self._context.term()

    def _join(self):
        hello = NodeHello(host_name(), os.getpid(), self.ranks, self.data_parallel_size,
                          manifest_fingerprint(self.model_info.path), self.node_secret)
        self._send(NodeMessageKind.HELLO, hello)
        logger.info("waiting for the head at %s to let ranks %s in", self.head, self.ranks)
        deadline = time.monotonic() + WELCOME_TIMEOUT_S
        while not self._stopping and time.monotonic() < deadline:
            message = self._receive(timeout_s=HEARTBEAT_INTERVAL_S)
            if message is None:
                continue
            kind, body = message
            if kind is NodeMessageKind.WELCOME:
                return body
            if kind is NodeMessageKind.REFUSED:
                logger.error("the head at %s refused this node: %s", self.head, peer_text(body.reason, 1000))
                return None
        if not self._stopping:
            logger.error("no answer from the head at %s within %.0f s", self.head, WELCOME_TIMEOUT_S)
        return None

    def _keep_watch(self) -> int:
        last_heard = last_sent = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            if now - last_sent >= HEARTBEAT_INTERVAL_S:
                self._send(NodeMessageKind.HEARTBEAT, Heartbeat(time.time()))
                last_sent = now
            message = self._receive(timeout_s=HEARTBEAT_INTERVAL_S / 2)
            if message is not None:
                last_heard = time.monotonic()
                if message[0] is NodeMessageKind.SHUTDOWN:
                    logger.info("the head is stopping; so does this node")
                    return 0
            if time.monotonic() - last_heard > HEARTBEAT_TIMEOUT_S:
                logger.error("lost the head at %s: no heartbeat for %.1f s", self.head, time.monotonic() - last_heard)
                return 1
            for position, rank in enumerate(self.ranks):
                if self.engines.has_exited(position):
                    reason = self.engines.exit_reason(position)
                    logger.error("engine %d exited (%s)", rank, reason)
                    self._send(NodeMessageKind.ENGINE_EXITED, EngineExited(rank, reason[:MAX_REASON_CHARS]))
                    return 1
        return 0

    def _send(self, kind: NodeMessageKind, message) -> None:
        self._socket.send_multipart([kind.value, self._encoder.encode(message)])

    def _receive(self, timeout_s: float):
        if not self._socket.poll(int(timeout_s * 1000)):
            return None
        try:
            return self._decoder.decode(self._socket.recv_multipart())
        except ValueError as error:
            logger.warning("dropped a malformed message from the head: %s", error)
            return None

    def _on_signal(self, signum, frame) -> None:
        self._stopping = True
