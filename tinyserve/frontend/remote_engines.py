"""The head's side of multi-node data parallel: the engines that run on other machines.

MPClient (core_client.py) starts the head's own engines as processes and watches
their sentinels. The other ranks belong to headless nodes (engine/headless.py),
which connect to the head's --data-parallel-rpc-port; the exchange is drawn in
wire/nodes.py. This class answers them: it checks each hello (ranks in range and
not taken, the same model), hands out the addresses of the sockets MPClient bound
for those ranks, and from then on counts a node as alive only while its
heartbeats arrive. A node that goes silent, or reports an engine dead, is handed
to `on_dead` once per rank, and MPClient fails those requests as it does for a
local engine that exits.

To the load balancer a remote engine is just an engine: it reports its
SchedulerStats over the same output socket, so "fewest waiting, then running"
counts it like the others.
"""

import asyncio
import logging
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
    NODE_MESSAGE_TYPES,
    EngineExited,
    Heartbeat,
    NodeHello,
    NodeMessageKind,
    NodeRefused,
    NodeWelcome,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class MultiNode:
    """Where this head's engines are: ranks [0, size_local) here, the rest on headless nodes."""

    size_local: int
    address: str  # the head's address as the other nodes reach it (--data-parallel-address)
    rpc_port: int  # the handshake and heartbeat port (--data-parallel-rpc-port)


@dataclass(slots=True)
class Node:
    identity: bytes
    host: str
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
        """input_addresses: every rank's, local ones included (only the remote ones are handed out)."""
        self.multi_node = multi_node
        self.data_parallel_size = data_parallel_size
        self.model_fingerprint = model_fingerprint
        self.input_addresses = input_addresses
        self.output_address = output_address
        self.on_dead = on_dead
        self.nodes: dict[bytes, Node] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = MessageDecoder(NodeMessageKind, NODE_MESSAGE_TYPES)
        self._socket = context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        endpoint = f"tcp://{multi_node.address}:{multi_node.rpc_port}"
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as error:
            self._socket.close()
            raise ValueError(f"cannot listen for headless nodes on {endpoint} (--data-parallel-address, "
                             f"--data-parallel-rpc-port): {error}") from None
        self.endpoint = endpoint
        # The same socket seen as a plain one, for sends: a ROUTER never blocks (it drops what
        # it cannot route), so a send needs no future and works after the event loop is gone.
        self._sender = zmq.Socket.shadow(self._socket.underlying)
        self._tasks: list[asyncio.Task] = []

    @property
    def remote_ranks(self) -> range:
        return range(self.multi_node.size_local, self.data_parallel_size)

    @property
    def missing_ranks(self) -> list[int]:
        """Remote ranks no node has claimed yet."""
        taken = {rank for node in self.nodes.values() for rank in node.ranks}
        return [rank for rank in self.remote_ranks if rank not in taken]

    def node_of(self, rank: int) -> Node | None:
        return next((node for node in self.nodes.values() if rank in node.ranks), None)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._receive(), name="headless-nodes"),
                       asyncio.create_task(self._watch(), name="headless-heartbeats")]

    # ---- what the nodes say -----------------------------------------------------------

    async def _receive(self) -> None:
        while True:
            identity, *frames = await self._socket.recv_multipart()
            try:
                kind, message = self._decoder.decode(frames)
            except ValueError as error:
                logger.warning("dropped a malformed message from a headless node: %s", error)
                continue
            node = self.nodes.get(identity)
            if kind is NodeMessageKind.HELLO:
                self._on_hello(identity, message)
            elif node is None:
                continue  # a node that was refused, or one already counted dead
            elif kind is NodeMessageKind.HEARTBEAT:
                node.last_heard = time.monotonic()
                self._send(identity, NodeMessageKind.HEARTBEAT, Heartbeat(time.time()))
            elif kind is NodeMessageKind.ENGINE_EXITED:
                self._lose(node, f"engine {message.rank} on headless node {node.name} exited ({message.reason})")

    def _on_hello(self, identity: bytes, hello: NodeHello) -> None:
        problem = self._check_hello(hello)
        if problem is not None:
            logger.error("refused headless node %s (pid %d): %s", hello.host, hello.pid, problem)
            self._send(identity, NodeMessageKind.REFUSED, NodeRefused(problem))
            return
        self.nodes[identity] = Node(identity, hello.host, hello.pid, list(hello.ranks))
        logger.info("headless node %s (pid %d) joined with ranks %s", hello.host, hello.pid, hello.ranks)
        welcome = NodeWelcome([self.input_addresses[rank] for rank in hello.ranks], self.output_address)
        self._send(identity, NodeMessageKind.WELCOME, welcome)

    def _check_hello(self, hello: NodeHello) -> str | None:
        here = f"the head (--data-parallel-size {self.data_parallel_size})"
        if hello.data_parallel_size != self.data_parallel_size:
            return (f"headless node {hello.host} says --data-parallel-size {hello.data_parallel_size}, "
                    f"{here} says {self.data_parallel_size}")
        for rank in hello.ranks:
            if rank not in self.remote_ranks:
                return (f"rank {rank} of headless node {hello.host} is not a remote rank of {here}: "
                        f"the head serves ranks 0-{self.multi_node.size_local - 1} itself and waits for "
                        f"{self.remote_ranks.start}-{self.remote_ranks.stop - 1}")
            owner = self.node_of(rank)
            if owner is not None:
                return f"rank {rank} is served twice: by headless node {owner.name} and by {hello.host} (pid {hello.pid})"
        if hello.model_fingerprint != self.model_fingerprint:
            return (f"headless node {hello.host} serves a different model: fingerprint "
                    f"{_short(hello.model_fingerprint)} there, {_short(self.model_fingerprint)} on the head")
        return None

    # ---- liveness ----------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S / 2)
            now = time.monotonic()
            for node in list(self.nodes.values()):
                silent = now - node.last_heard
                if silent > HEARTBEAT_TIMEOUT_S:
                    self._lose(node, f"headless node {node.name} missed its heartbeats ({silent:.1f} s silent)")

    def _lose(self, node: Node, reason: str) -> None:
        self.nodes.pop(node.identity, None)
        for rank in node.ranks:
            self.on_dead(rank, reason)

    def _send(self, identity: bytes, kind: NodeMessageKind, message) -> None:
        try:
            self._sender.send_multipart([identity, kind.value, self._encoder.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:
            logger.warning("could not reach a headless node: %s", error)

    def shutdown(self) -> None:
        """Tell every node the head is stopping (each stops its engines), then close the port."""
        for task in self._tasks:
            task.cancel()
        for identity in list(self.nodes):
            self._send(identity, NodeMessageKind.SHUTDOWN, Heartbeat(time.time()))
        self.nodes.clear()
        self._socket.close(linger=500)  # the SHUTDOWNs still go out


def _short(fingerprint: str | None) -> str:
    return "none (a model too large to hash)" if fingerprint is None else fingerprint[:12]
