"""The wire between the API process and its engine processes (stages ④ and ⑦).

Each engine has one input socket (client PUSH, bound → engine PULL, connected) and
all engines share one output socket (engines PUSH, connected → client PULL, bound):

    client ── PUSH input-0 ─────► engine 0 ──┐
    client ── PUSH input-1 ─────► engine 1 ──┤ PUSH
    client ◄── PULL output ◄──────────────────┘

The client binds every socket, so it owns the addresses: `ipc://` paths in a
private directory (mode 0700) by default, or `tcp://127.0.0.1:<port>` (on the
head's --data-parallel-address when engines run on other nodes, wire/nodes.py).

With several API processes (`--api-server-count N`, cli/api_servers.py) every one of them
is a client of every engine: each binds its own input socket per engine and its own
output socket (`client_socket_name`), and an engine's one PULL connects to all N
inputs, its N PUSH sockets one to each client's output:

    api 0 ── PUSH api-0-input-0 ──┐                 ┌── PUSH ──► api-0-output (PULL, api 0)
    api 1 ── PUSH api-1-input-0 ──┴──► engine 0 ────┴── PUSH ──► api-1-output (PULL, api 1)

A request carries its `client_index`; the engine sends its outputs, and the answer to
a UtilityCall, to that client only, and its stats, READY, FAILED and HEARTBEAT to every
client (engine/client_outputs.py).

Every message is two frames, `[kind, msgpack payload]`. The kind byte picks the
one msgspec type the payload is decoded into; nothing is pickled, and bytes that
do not decode into that type are dropped and logged by the receiver.
"""

import enum
import os
import tempfile
import time
from typing import Any

import msgspec
import zmq

from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats

# A request the engine refused finishes at once with this reason; stop_reason
# carries the error message. The front end validates first, so this is a fallback.
FINISH_REASON_ERROR = "error"


class EngineInputKind(bytes, enum.Enum):
    """Client → engine."""

    ADD = b"A"  # payload: EngineCoreRequest
    ABORT = b"B"  # payload: EngineCoreAbort
    UTILITY = b"U"  # payload: UtilityCall


class EngineOutputKind(bytes, enum.Enum):
    """Engine → client."""

    OUTPUTS = b"O"  # payload: EngineCoreOutputs
    READY = b"R"  # payload: EngineReady
    FAILED = b"F"  # payload: EngineFailed
    UTILITY_RESULT = b"U"  # payload: UtilityResult
    HEARTBEAT = b"H"  # payload: EngineHeartbeat


class EngineCoreAbort(msgspec.Struct, array_like=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0  # the API process that asked, which the answer goes back to


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: msgspec.Raw = msgspec.Raw(b"\xc0")  # msgpack of the method's return type (nil by default)
    error: str | None = None


class EngineReady(msgspec.Struct, array_like=True):
    """The handshake: the engine has loaded its model and is listening."""

    engine_index: int
    pid: int
    num_kv_blocks: int
    max_model_len: int


class EngineFailed(msgspec.Struct, array_like=True):
    """Sent just before an engine exits with an error (start-up or a failed step)."""

    engine_index: int
    error: str


class EngineHeartbeat(msgspec.Struct, array_like=True):
    """The engine's loop turns: sent while it has requests and has sent nothing else for ENGINE_HEARTBEAT_S
    (a grammar compiling, a KV transfer awaited), so that its silence means a step that never ends
    (frontend/engine_watchdog.py)."""

    engine_index: int


ENGINE_HEARTBEAT_S = 1.0


# The engine methods a client may call, and the type each one returns. Anything
# else is refused: a utility call is not a way to run arbitrary code remotely.
UTILITY_METHODS: dict[str, type] = {
    "get_stats": SchedulerStats,
    "reset_prefix_cache": bool,
    "remove_lora": bool,
}

INPUT_TYPES: dict[EngineInputKind, type] = {
    EngineInputKind.ADD: EngineCoreRequest,
    EngineInputKind.ABORT: EngineCoreAbort,
    EngineInputKind.UTILITY: UtilityCall,
}
OUTPUT_TYPES: dict[EngineOutputKind, type] = {
    EngineOutputKind.OUTPUTS: EngineCoreOutputs,
    EngineOutputKind.READY: EngineReady,
    EngineOutputKind.FAILED: EngineFailed,
    EngineOutputKind.UTILITY_RESULT: UtilityResult,
    EngineOutputKind.HEARTBEAT: EngineHeartbeat,
}


class MessageDecoder:
    """Decodes `[kind, payload]` frames into the typed message for that kind."""

    def __init__(self, kinds: type[enum.Enum], types: dict) -> None:
        self.kinds = kinds
        self.decoders = {kind: msgspec.msgpack.Decoder(struct) for kind, struct in types.items()}

    def decode(self, frames: list[bytes]):
        """Return (kind, message); raise ValueError for anything that is not a valid message."""
        if len(frames) != 2:
            raise ValueError(f"expected 2 frames [kind, payload], got {len(frames)}")
        try:
            kind = self.kinds(bytes(frames[0]))
        except ValueError:
            raise ValueError(f"unknown message kind {bytes(frames[0])[:8]!r}") from None
        try:
            return kind, self.decoders[kind].decode(frames[1])
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError too
            raise ValueError(f"malformed {kind.name} message: {error}") from None


def error_output(request_id: str, error: str, param: str | None = None) -> EngineCoreOutput:
    """A finished output for a request the engine refused to queue; the front end raises `error` on its stream."""
    return EngineCoreOutput(request_id, new_token_ids=[], finish_reason=FINISH_REASON_ERROR, stop_reason=error,
                            error=error, error_param=param)


def outputs_message(engine_index: int, outputs: list[EngineCoreOutput], stats: SchedulerStats) -> EngineCoreOutputs:
    return EngineCoreOutputs(engine_index=engine_index, timestamp=time.time(), outputs=outputs, scheduler_stats=stats)


def make_ipc_dir(parent: str | None = None) -> str:
    """A fresh private directory for the ipc:// sockets (mkdtemp creates it with mode 0700)."""
    return tempfile.mkdtemp(prefix="tinyserve-ipc-", dir=parent)


def bind_address(transport: str, ipc_dir: str | None, name: str, host: str | None = None) -> str:
    """Where the client binds socket `name`; a TCP port is chosen at bind time, on host (default loopback)."""
    if transport == "ipc":
        return f"ipc://{os.path.join(ipc_dir, name)}"
    return f"tcp://{host or '127.0.0.1'}:*"


def client_socket_name(name: str, client_index: int | None) -> str:
    """The name of API process `client_index`'s socket `name` in the shared ipc directory (None: the only client)."""
    return name if client_index is None else f"api-{client_index}-{name}"


def bound_endpoint(socket: zmq.Socket) -> str:
    """The address a bound socket really listens on (the port a wildcard resolved to)."""
    return socket.getsockopt(zmq.LAST_ENDPOINT).decode()
