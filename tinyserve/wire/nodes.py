"""The wire between the head node and a headless node (multi-node data parallel).

With `--data-parallel-size 4 --data-parallel-size-local 2`, the head runs the API
server and engines 0–1; another machine runs `tinyserve serve --headless
--data-parallel-start-rank 2 ...`: engines 2–3 and no API. The two talk over one
TCP connection to the head's --data-parallel-rpc-port, a ZeroMQ ROUTER (head) and
DEALER (node):

    node ── HELLO(ranks, model fingerprint, host) ──► head   checks: ranks free and in range,
    node ◄── WELCOME(input addresses, output address) ─ head   same model (or REFUSED(why))
    node: starts its engines; each connects its input and the output socket to the
          head, like a local engine, loads its model and sends READY (KV blocks) there
    node ── HEARTBEAT ──► head ── HEARTBEAT ──► node        every HEARTBEAT_INTERVAL_S, both ways
    node ── ENGINE_EXITED(rank, why) ──► head              one of its engines died
    head ── SHUTDOWN ──► node                              the head is stopping

Requests and outputs do not pass here: they go over the engines' own sockets
(ipc.py), TCP in this case. This channel only says who is there. A side that hears
nothing from the other for HEARTBEAT_TIMEOUT_S takes it as gone: the head fails the
node's requests as if its engines had died, the node stops its engines.

Frames are `[kind, msgpack payload]` as in ipc.py (the ROUTER adds the peer's id in front).
"""

import enum

import msgspec

HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 1.25  # five heartbeats missed: a node lost is noticed well within 2 s


class NodeMessageKind(bytes, enum.Enum):
    HELLO = b"H"  # node → head: NodeHello
    WELCOME = b"W"  # head → node: NodeWelcome
    REFUSED = b"X"  # head → node: NodeRefused
    HEARTBEAT = b"B"  # both ways: Heartbeat
    ENGINE_EXITED = b"E"  # node → head: EngineExited
    SHUTDOWN = b"S"  # head → node: Heartbeat (no payload of its own)


class NodeHello(msgspec.Struct, array_like=True):
    host: str
    pid: int
    ranks: list[int]  # the data-parallel ranks this node's engines will serve
    data_parallel_size: int
    model_fingerprint: str | None  # models/fingerprint.py; None for a model too large to hash


class NodeWelcome(msgspec.Struct, array_like=True):
    input_addresses: list[str]  # one per rank of the hello, in its order
    output_address: str


class NodeRefused(msgspec.Struct, array_like=True):
    reason: str


class Heartbeat(msgspec.Struct, array_like=True):
    sent_unix: float


class EngineExited(msgspec.Struct, array_like=True):
    rank: int
    reason: str


NODE_MESSAGE_TYPES: dict[NodeMessageKind, type] = {
    NodeMessageKind.HELLO: NodeHello,
    NodeMessageKind.WELCOME: NodeWelcome,
    NodeMessageKind.REFUSED: NodeRefused,
    NodeMessageKind.HEARTBEAT: Heartbeat,
    NodeMessageKind.ENGINE_EXITED: EngineExited,
    NodeMessageKind.SHUTDOWN: Heartbeat,
}
