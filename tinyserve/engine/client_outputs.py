"""Where an engine's outputs go: to the API process that sent each request (stage ⑦).

With `--api-server-count N` every API process is a client of every engine (wire/ipc.py
draws the sockets). A request names its sender in `EngineCoreRequest.client_index`;
the engine remembers it until the request finishes, and one step's EngineCoreOutputs
is cut into one message per client, as vLLM's engine core splits its outputs by
client index:

    step outputs [a0 b1 c0] + stats ──► client 0: [a0 c0] + stats
                                   └──► client 1: [b1]    + stats

Every client gets a message every step, its share of the outputs empty or not, with the
engine's scheduler stats: each front end thus reads every engine's load from the engine
itself, and the least-loaded rule (frontend/dp_client.py) reads the same numbers in
every API process, with no coordinator between them. What one front end cannot see is
the requests another sent since the engine's last report, at most one step's worth.

With one client the message goes through untouched: nothing is remembered or cut.

`ClientSockets` holds the engine's PUSH socket to each client. With several, a send never
blocks the output thread: an API process that died (and whose socket's queue therefore
fills) must not stall the outputs of the others while they drain. What a socket cannot take
now waits in that client's backlog, in order, and is sent before anything newer.
"""

import collections

import zmq

from tinyserve.wire.messages import EngineCoreOutputs, EngineCoreRequest

BACKLOG_RETRY_S = 0.05  # how often the output thread retries a client's backlog while nothing else comes


class ClientOutputs:
    """The engine's table of request id → client index, and the cut of each step's message."""

    def __init__(self, num_clients: int) -> None:
        if num_clients < 1:
            raise ValueError(f"num_clients must be at least 1, got {num_clients}")
        self.num_clients = num_clients
        self.client_of: dict[str, int] = {}

    def knows(self, request: EngineCoreRequest) -> bool:
        """Remember who sent `request`; False when no such client exists (the request is then dropped)."""
        if not 0 <= request.client_index < self.num_clients:
            return False
        if self.num_clients > 1:
            self.client_of[request.request_id] = request.client_index
        return True

    def split(self, message: EngineCoreOutputs) -> list[tuple[int, EngineCoreOutputs]]:
        """(client index, its message) for every client; a finished request is forgotten."""
        if self.num_clients == 1:
            return [(0, message)]
        shares: list[list] = [[] for _ in range(self.num_clients)]
        for output in message.outputs:
            client = self.client_of.pop(output.request_id, 0) if output.finished else \
                self.client_of.get(output.request_id, 0)
            shares[client].append(output)
        return [(client, EngineCoreOutputs(engine_index=message.engine_index, timestamp=message.timestamp,
                                           outputs=outputs, scheduler_stats=message.scheduler_stats))
                for client, outputs in enumerate(shares)]


class ClientSockets:
    """One PUSH socket per client, connected to its output address; sends in order, never blocking on one."""

    def __init__(self, context: zmq.Context, addresses: list[str]) -> None:
        self.sockets = [context.socket(zmq.PUSH) for _ in addresses]
        for socket, address in zip(self.sockets, addresses):
            socket.connect(address)
        self.backlogs = [collections.deque() for _ in addresses]
        self.flags = 0 if len(addresses) == 1 else zmq.NOBLOCK  # one client: wait for it, as ever

    @property
    def backlogged(self) -> bool:
        return any(self.backlogs)

    def send(self, client: int, frames: list[bytes]) -> None:
        self.backlogs[client].append(frames)
        self._flush(client)

    def flush(self) -> None:
        for client in range(len(self.sockets)):
            self._flush(client)

    def _flush(self, client: int) -> None:
        backlog = self.backlogs[client]
        while backlog:
            try:
                self.sockets[client].send_multipart(backlog[0], flags=self.flags)
            except zmq.Again:
                return  # its queue is full: an API process gone, or far behind
            backlog.popleft()

    def close(self, linger_ms: int) -> None:
        for socket in self.sockets:
            socket.close(linger=linger_ms)
