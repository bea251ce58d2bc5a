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
"""

from tinyserve.wire.messages import EngineCoreOutputs, EngineCoreRequest


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
