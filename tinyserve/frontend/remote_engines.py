"""The head's side of multi-node data parallel: the engines that run on other machines.

MPClient (core_client.py) starts the head's own engines as processes and watches
their sentinels. The other ranks belong to headless nodes (engine/headless.py),
which connect to the head's --data-parallel-rpc-port; the exchange is drawn in
wire/nodes.py. This class answers them: it checks each hello (the node secret,
ranks in range and not taken, the same model), hands out the addresses of the
sockets MPClient bound for those ranks, and from then on counts a node as alive
only while its heartbeats arrive. A node that goes silent, or reports an engine
dead, is handed to `on_dead` once per rank, and MPClient fails those requests as
it does for a local engine that exits.

The port is served by a thread of its own, not by the API's event loop: hellos are
answered, heartbeats read and answered, and deadlines judged there, so a loop kept
busy (a slow request, a stall) cannot make a live node look dead, nor the node hear
nothing and stop. Only the verdict, `on_dead`, runs on the loop.

Who may join. Like vLLM's own data-parallel ports the node port is plain TCP, and
vLLM's advice holds: put the nodes on a network of their own. With
--data-parallel-node-secret (or TINYSERVE_DP_NODE_SECRET, which stays out of `ps`)
on the head and on every node, a HELLO must carry the same secret, compared in
constant time; any other is refused and logged, and learns nothing of the
deployment. Without one the head says so loudly when --data-parallel-address is not
a loopback address: any host that reaches the port could claim a free rank and be
sent that rank's prompts. The secret keeps strangers from joining. It does not
encrypt anything: it crosses the wire in the clear in the HELLO, so whoever can read
that traffic learns it; prompts and outputs travel unencrypted over the engines'
own TCP sockets, which take no secret (a host that reaches their ports can connect
to them directly); and a peer holding the secret is trusted.

Whatever a peer sends is bounded before it is read: ZMQ_MAXMSGSIZE drops a peer with
a frame over MAX_NODE_MESSAGE_BYTES, every field has a cap checked as it is decoded,
and text the peer chose is cut to PEER_TEXT_CHARS in logs and replies. Warnings about
strangers are rate-limited, so a flood of bad hellos costs a few log lines a second.

To the load balancer a remote engine is just an engine: it reports its
SchedulerStats over the same output socket, so "fewest waiting, then running"
counts it like the others.

The module is over 300 lines because the port's whole exchange (the hello's checks, the
secret, the caps, heartbeats and deadlines on their own thread) is one story, read best in
one place.
"""

import asyncio
import hmac
import ipaddress
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from tinyserve.wire.ipc import MessageDecoder
from tinyserve.wire.nodes import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    MAX_NODE_MESSAGE_BYTES,
    MAX_REASON_CHARS,
    NODE_MESSAGE_TYPES,
    EngineExited,
    Heartbeat,
    NodeHello,
    NodeMessageKind,
    NodeRefused,
    NodeWelcome,
    peer_text,
)

logger = logging.getLogger(__name__)


# At most this many warnings about strangers (malformed messages, refused hellos) per
# window; the rest are counted and summed up in one line when the window ends.
WARNINGS_PER_WINDOW = 20
WARNING_WINDOW_S = 10.0


@dataclass(slots=True)
class MultiNode:
    """Where this head's engines are: ranks [0, size_local) here, the rest on headless nodes."""

    size_local: int
    address: str  # the head's address as the other nodes reach it (--data-parallel-address)
    rpc_port: int  # the handshake and heartbeat port (--data-parallel-rpc-port)
    node_secret: str | None = field(default=None, repr=False)  # --data-parallel-node-secret

    def check(self, data_parallel_size: int, start_index: int) -> None:
        if start_index != 0:
            raise ValueError(f"a head with headless nodes starts at engine 0, got start_index={start_index}")
        if not 1 <= self.size_local <= data_parallel_size:
            raise ValueError(f"data_parallel_size_local must be in [1, {data_parallel_size}], got {self.size_local}")


@dataclass(slots=True)
class Node:
    identity: bytes
    host: str  # as the node said it, cut to PEER_TEXT_CHARS
    pid: int
    ranks: list[int]
    last_heard: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return f"{self.host} (pid {self.pid})"


class RemoteEngines:
    def __init__(self, context: zmq.asyncio.Context, multi_node: MultiNode, data_parallel_size: int,
                 model_fingerprint: str | None, input_addresses: list[str], output_address: str,
                 on_dead: Callable[[int, str], None]) -> None:
        """input_addresses: every rank's, local ones included (only the remote ones are handed out).
        on_dead(rank, reason) is called on the event loop start() runs on."""
        self.multi_node = multi_node
        self.data_parallel_size = data_parallel_size
        self.model_fingerprint = model_fingerprint
        self.input_addresses = input_addresses
        self.output_address = output_address
        self.on_dead = on_dead
        self.nodes: dict[bytes, Node] = {}  # changed by the port's thread only, under _lock
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = MessageDecoder(NodeMessageKind, NODE_MESSAGE_TYPES)
        # A plain (blocking) socket on the client's context: the port's thread owns it.
        self._socket = zmq.Context.shadow(context.underlying).socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # A peer sending a larger frame is disconnected by ZeroMQ before Python sees a byte of it.
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_NODE_MESSAGE_BYTES)
        endpoint = f"tcp://{multi_node.address}:{multi_node.rpc_port}"
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as error:
            self._socket.close()
            raise ValueError(f"cannot listen for headless nodes on {endpoint} (--data-parallel-address, "
                             f"--data-parallel-rpc-port): {error}") from None
        self.endpoint = endpoint
        if multi_node.node_secret is None and not is_loopback(multi_node.address):
            logger.warning("NO NODE SECRET: any host that can reach %s can join as a headless node and be sent "
                           "the prompts of the ranks it claims; set --data-parallel-node-secret (or "
                           "TINYSERVE_DP_NODE_SECRET) on the head and every node, and keep the nodes on a "
                           "network of their own", endpoint)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._warnings = _WarningBudget()

    @property
    def remote_ranks(self) -> range:
        return range(self.multi_node.size_local, self.data_parallel_size)

    @property
    def missing_ranks(self) -> list[int]:
        """Remote ranks no node has claimed yet."""
        with self._lock:
            taken = {rank for node in self.nodes.values() for rank in node.ranks}
        return [rank for rank in self.remote_ranks if rank not in taken]

    def node_of(self, rank: int) -> Node | None:
        with self._lock:
            return next((node for node in self.nodes.values() if rank in node.ranks), None)

    def start(self) -> None:
        """Serve the port on a thread; `on_dead` will be called on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="headless-nodes", daemon=True)
        self._thread.start()

    # ---- the port's thread -------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._socket.poll(int(HEARTBEAT_INTERVAL_S / 2 * 1000)):
                    for _ in range(256):  # then judge the deadlines, however many more are queued
                        message = self._receive()
                        if message is None:
                            break
                        self._on_message(*message)
                self._watch()
                self._warnings.roll()
            except zmq.ZMQError:
                if self._stopping.is_set():
                    return
                logger.exception("error on the headless-node port")
            except Exception:  # a bug here must not silence every node's heartbeats
                logger.exception("error on the headless-node port")

    def _receive(self) -> tuple[bytes, list[bytes], str] | None:
        """One message: the peer's id, its frames (3 at most kept: a real one has 2) and its address."""
        try:
            first = self._socket.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            address = first.get("Peer-Address")
        except zmq.ZMQError:
            address = "?"
        frames = []
        while self._socket.getsockopt(zmq.RCVMORE):  # a message arrives whole: these never wait
            frame = self._socket.recv()
            if len(frames) < 3:
                frames.append(frame)
        return first.bytes, frames, address

    def _on_message(self, identity: bytes, frames: list[bytes], address: str) -> None:
        try:
            kind, message = self._decoder.decode(frames)
        except ValueError as error:
            problem = _named_fields(str(error))
            self._warn("dropped a malformed message from %s on the headless-node port: %s",
                       _peer(identity, address), peer_text(problem))
            if frames and frames[0] == NodeMessageKind.HELLO.value:
                self._send(identity, NodeMessageKind.REFUSED, NodeRefused(peer_text(problem)))
            return
        node = self.nodes.get(identity)
        if kind is NodeMessageKind.HELLO:
            self._on_hello(identity, address, message)
        elif node is None:
            return  # a node that was refused, or one already counted dead
        elif kind is NodeMessageKind.HEARTBEAT:
            node.last_heard = time.monotonic()
            self._send(identity, NodeMessageKind.HEARTBEAT, Heartbeat(time.time()))
        elif kind is NodeMessageKind.ENGINE_EXITED:
            self._lose(node, f"engine {message.rank} on headless node {node.name} exited "
                             f"({peer_text(message.reason, MAX_REASON_CHARS // 4)})")

    def _on_hello(self, identity: bytes, address: str, hello: NodeHello) -> None:
        host = peer_text(hello.host)
        if not self._secret_matches(hello):
            self._warn("refused a headless node from %s (says %s, pid %d): %s", _peer(identity, address), host,
                       hello.pid, "no node secret" if hello.node_secret is None else "a wrong node secret")
            self._send(identity, NodeMessageKind.REFUSED, NodeRefused(SECRET_REFUSAL))
            return
        problem = self._check_hello(hello, host)
        if problem is not None:
            self._warn("refused headless node %s (pid %d) from %s: %s", host, hello.pid, _peer(identity, address),
                       problem, level=logging.ERROR)
            self._send(identity, NodeMessageKind.REFUSED, NodeRefused(problem[:MAX_REASON_CHARS]))
            return
        with self._lock:
            self.nodes[identity] = Node(identity, host, hello.pid, list(hello.ranks))
        logger.info("headless node %s (pid %d) from %s joined with ranks %s", host, hello.pid, peer_text(address),
                    hello.ranks)
        welcome = NodeWelcome([self.input_addresses[rank] for rank in hello.ranks], self.output_address)
        self._send(identity, NodeMessageKind.WELCOME, welcome)

    def _secret_matches(self, hello: NodeHello) -> bool:
        """The same secret on both sides, or none on either (a secret on the node only is a head
        that forgot its own: refused, so that the gap shows). Compared in constant time."""
        expected = self.multi_node.node_secret
        if expected is None or hello.node_secret is None:
            return expected is None and hello.node_secret is None
        return hmac.compare_digest(hello.node_secret.encode(), expected.encode())

    def _check_hello(self, hello: NodeHello, host: str) -> str | None:
        here = f"the head (--data-parallel-size {self.data_parallel_size})"
        if hello.data_parallel_size != self.data_parallel_size:
            return (f"headless node {host} says --data-parallel-size {hello.data_parallel_size}, "
                    f"{here} says {self.data_parallel_size}")
        if len(set(hello.ranks)) != len(hello.ranks):
            return f"headless node {host} names a rank twice: {hello.ranks}"
        for rank in hello.ranks:
            if rank not in self.remote_ranks:
                return (f"rank {rank} of headless node {host} is not a remote rank of {here}: "
                        f"the head serves ranks 0-{self.multi_node.size_local - 1} itself and waits for "
                        f"{self.remote_ranks.start}-{self.remote_ranks.stop - 1}")
            owner = self.node_of(rank)
            if owner is not None:
                return f"rank {rank} is served twice: by headless node {owner.name} and by {host} (pid {hello.pid})"
        if hello.model_fingerprint != self.model_fingerprint:
            return (f"headless node {host} serves a different model: fingerprint "
                    f"{_short(hello.model_fingerprint)} there, {_short(self.model_fingerprint)} on the head")
        return None

    def _watch(self) -> None:
        now = time.monotonic()
        for node in list(self.nodes.values()):
            silent = now - node.last_heard
            if silent > HEARTBEAT_TIMEOUT_S:
                self._lose(node, f"headless node {node.name} missed its heartbeats ({silent:.1f} s silent)")

    def _lose(self, node: Node, reason: str) -> None:
        """Forget the node here, at once; its ranks die on the event loop, when it gets to them."""
        with self._lock:
            self.nodes.pop(node.identity, None)
        for rank in node.ranks:
            try:
                self._loop.call_soon_threadsafe(self.on_dead, rank, reason)
            except RuntimeError:
                return  # the loop is closed: the head is stopping anyway

    def _warn(self, message: str, *args, level: int = logging.WARNING) -> None:
        if self._warnings.take():
            logger.log(level, message, *args)

    def _send(self, identity: bytes, kind: NodeMessageKind, message) -> None:
        try:
            self._socket.send_multipart([identity, kind.value, self._encoder.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:
            logger.warning("could not reach a headless node: %s", error)

    def shutdown(self) -> None:
        """Stop the port's thread, tell every node the head is stopping (each stops its engines),
        then close the port. Called from the event loop's thread, or after the loop is gone."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)  # it polls in steps of HEARTBEAT_INTERVAL_S / 2
        for identity in list(self.nodes):
            self._send(identity, NodeMessageKind.SHUTDOWN, Heartbeat(time.time()))
        with self._lock:
            self.nodes.clear()
        self._socket.close(linger=500)  # the SHUTDOWNs still go out


SECRET_REFUSAL = ("this node's --data-parallel-node-secret (TINYSERVE_DP_NODE_SECRET) is not the head's: "
                  "set the same one on the head and on every node")


class _WarningBudget:
    """WARNINGS_PER_WINDOW warnings per WARNING_WINDOW_S; the ones over it are counted, then summed up."""

    def __init__(self) -> None:
        self.window_start = time.monotonic()
        self.used = 0
        self.suppressed = 0

    def take(self) -> bool:
        if self.used < WARNINGS_PER_WINDOW:
            self.used += 1
            return True
        self.suppressed += 1
        return False

    def roll(self) -> None:
        if time.monotonic() - self.window_start < WARNING_WINDOW_S:
            return
        if self.suppressed:
            logger.warning("%d more malformed or refused messages on the headless-node port in the last %.0f s "
                           "(not logged one by one)", self.suppressed, WARNING_WINDOW_S)
        self.window_start, self.used, self.suppressed = time.monotonic(), 0, 0


def is_loopback(address: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name (or an interface name): it may well be reachable from elsewhere


def _peer(identity: bytes, address: str) -> str:
    """Who sent a message, for a log line: the address ZeroMQ saw and the peer's id (which the peer may choose)."""
    return f"{peer_text(address, 64)} (id {identity[:16].hex()}{'...' if len(identity) > 16 else ''})"


def _named_fields(error: str) -> str:
    """msgspec's error for a HELLO names a field by its position (`$[0]`); name it as NodeHello does."""
    if "malformed HELLO" not in error:
        return error
    fields = NodeHello.__struct_fields__

    def name(match: re.Match) -> str:
        position = int(match.group(1))
        return f"`{fields[position]}" if position < len(fields) else match.group(0)

    return re.sub(r"`\$\[(\d+)\]", name, error)


def _short(fingerprint: str | None) -> str:
    return "none (a model too large to hash)" if fingerprint is None else fingerprint[:12]
