"""The one interface the front end has to its engine(s), whichever process they run in.

    AsyncLLM ──► EngineClient ──┬─ MPClient           engine processes over ZeroMQ (core_client.py)
                                └─ AsyncInprocClient  an EngineCore in this process, stepped in a thread
    LLMEngine ─► InprocClient                         the same EngineCore, stepped in the caller's thread

vLLM has the same three (AsyncMPClient, InprocClient, SyncMPClient). AsyncLLM holds an
EngineClient and cannot tell which one it has: requests go in as EngineCoreRequests,
outputs come back as EngineCoreOutputs, exactly the messages of `tinyserve.wire`.
The synchronous InprocClient has the same methods without `async`.
"""

from typing import Protocol

from tinyserve.wire.messages import EngineCoreOutputs, EngineCoreRequest


class EngineDeadError(RuntimeError):
    """An engine is gone; the requests it held are lost and no new ones are taken."""


class EngineRankDeadError(EngineDeadError):
    """One data-parallel rank is gone while others still serve: only the requests it held are lost.

    MPClient.get_outputs raises it once per dead rank, after that rank's outputs already
    received, and goes on with the live ranks' outputs on the next call. request_ids are the
    engine request ids the rank held; each of their streams ends with this error. New
    requests go to the live ranks. When the last rank dies, the plain EngineDeadError
    follows, as with a single engine.
    """

    def __init__(self, message: str, engine_index: int, request_ids: list[str]) -> None:
        super().__init__(message)
        self.engine_index = engine_index
        self.request_ids = request_ids


class EngineStartupError(RuntimeError):
    """An engine process failed to load its model or to answer in time."""


class ClientLiveness:
    """What the asynchronous clients share: once an engine died or the client shut down, every call raises."""

    dead_error: EngineDeadError | None = None
    _closed: bool = False

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("the engine client was shut down")


class EngineClient(Protocol):
    in_flight: dict[str, int]  # engine request id -> index of the engine that has it
    # The size of the message the latest add_request sent, for its ipc.send span; None in this
    # process (nothing is encoded: the span then has no size).
    last_sent_bytes: int | None

    async def start(self) -> None:
        """Bring the engine(s) up; returns once each can take requests."""

    async def add_request(self, request: EngineCoreRequest) -> int:
        """Send one (already validated) request; returns the index of the engine that took it."""

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Stop these requests; each answers with a finished output (ids already done are ignored)."""

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next outputs of any engine; raises EngineDeadError once no engine is left (and
        EngineRankDeadError, once, for a data-parallel rank that died while others live)."""

    async def call_utility(self, method: str, *args, engine_index: int = 0):
        """Run one of wire.ipc.UTILITY_METHODS on an engine between two of its steps."""

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_kv_blocks(self) -> list[int]:
        """Per engine, the size of its KV pool in blocks."""

    @property
    def max_model_len(self) -> int: ...

    @property
    def engine_pids(self) -> list[int]: ...

    def shutdown(self) -> None:
        """Stop the engine(s); safe to call twice."""
