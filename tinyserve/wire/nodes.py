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

The port is open to whoever can reach it, so every message is bounded before it is
read: ZeroMQ drops a peer that sends a frame over MAX_NODE_MESSAGE_BYTES (the head's
socket) or MAX_HEAD_MESSAGE_BYTES (the node's) before any of it reaches Python, and
every field below has a cap that decoding checks (a HELLO over one is refused, naming
the field). A HELLO carries the node secret (--data-parallel-node-secret) when one is
set; remote_engines.py says what it protects and what it does not.
"""

import enum
from typing import Annotated

import msgspec

HEARTBEAT_INTERVAL_S = 0.25
HEARTBEAT_TIMEOUT_S = 1.25  # five heartbeats missed: a node lost is noticed well within 2 s

# The caps. A real HELLO is a few hundred bytes (a host name, a 64-hex fingerprint, a
# handful of ranks); the largest one the caps allow (1,024 ranks, every text field
# full of 4-byte characters) is under 9 KiB. 16 KiB leaves room for that and still
# refuses, unread, anything that could keep a thread busy or a log long.
MAX_NODE_MESSAGE_BYTES = 16 * 1024  # node → head, per frame (ZMQ_MAXMSGSIZE on the head's socket)
# A WELCOME holds one address per rank (1,024 x 512 characters at most): 1 MiB bounds it.
MAX_HEAD_MESSAGE_BYTES = 1024 * 1024  # head → node, per frame (ZMQ_MAXMSGSIZE on the node's socket)
MAX_HOST_CHARS = 255  # the longest DNS name
MAX_NODE_RANKS = 1024  # ranks one node may claim
MAX_DATA_PARALLEL_SIZE = 65536
MAX_FINGERPRINT_CHARS = 128  # models/fingerprint.py's are 64 hex digits
MAX_NODE_SECRET_CHARS = 1024
MAX_REASON_CHARS = 4096  # a refusal, or why an engine exited
MAX_ADDRESS_CHARS = 512  # a tcp:// address handed out in a WELCOME
# Text a peer chose (its host name, a decode error quoting it) is cut to this in the
# logs and in replies: one line per message, whatever the peer sent.
PEER_TEXT_CHARS = 200

Host = Annotated[str, msgspec.Meta(max_length=MAX_HOST_CHARS)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_DATA_PARALLEL_SIZE)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)]


class NodeMessageKind(bytes, enum.Enum):
    HELLO = b"H"  # node → head: NodeHello
    WELCOME = b"W"  # head → node: NodeWelcome
    REFUSED = b"X"  # head → node: NodeRefused
    HEARTBEAT = b"B"  # both ways: Heartbeat
    ENGINE_EXITED = b"E"  # node → head: EngineExited
    SHUTDOWN = b"S"  # head → node: Heartbeat (no payload of its own)


class NodeHello(msgspec.Struct, array_like=True):
    host: Host
    pid: Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
    # the data-parallel ranks this node's engines will serve
    ranks: Annotated[list[Rank], msgspec.Meta(min_length=1, max_length=MAX_NODE_RANKS)]
    data_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_DATA_PARALLEL_SIZE)]
    # models/fingerprint.py; None for a model too large to hash
    model_fingerprint: Annotated[str, msgspec.Meta(max_length=MAX_FINGERPRINT_CHARS)] | None
    # --data-parallel-node-secret, in the clear (remote_engines.py); never logged
    node_secret: Annotated[str, msgspec.Meta(max_length=MAX_NODE_SECRET_CHARS)] | None = None

    def __repr__(self) -> str:
        secret = "None" if self.node_secret is None else "'***'"
        return (f"NodeHello(host={self.host[:PEER_TEXT_CHARS]!r}, pid={self.pid}, ranks={self.ranks}, "
                f"data_parallel_size={self.data_parallel_size}, model_fingerprint={self.model_fingerprint!r}, "
                f"node_secret={secret})")


class NodeWelcome(msgspec.Struct, array_like=True):
    # one per rank of the hello, in its order
    input_addresses: Annotated[list[Address], msgspec.Meta(max_length=MAX_NODE_RANKS)]
    output_address: Address


class NodeRefused(msgspec.Struct, array_like=True):
    reason: Reason


class Heartbeat(msgspec.Struct, array_like=True):
    sent_unix: float


class EngineExited(msgspec.Struct, array_like=True):
    rank: Rank
    reason: Reason


NODE_MESSAGE_TYPES: dict[NodeMessageKind, type] = {
    NodeMessageKind.HELLO: NodeHello,
    NodeMessageKind.WELCOME: NodeWelcome,
    NodeMessageKind.REFUSED: NodeRefused,
    NodeMessageKind.HEARTBEAT: Heartbeat,
    NodeMessageKind.ENGINE_EXITED: EngineExited,
    NodeMessageKind.SHUTDOWN: Heartbeat,
}


def peer_text(text: str, limit: int = PEER_TEXT_CHARS) -> str:
    """Text a peer sent, fit for one log line or a reply: cut to `limit` characters (the
    length it had said after), control characters escaped so it cannot forge log lines."""
    cut = text[:limit]
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in cut)
    return shown if len(text) <= limit else f"{shown}... ({len(text)} characters)"
