"""The engine client without a second process: an EngineCore stepped in this one.

`InprocClient` is synchronous: the offline LLM (llm_engine.py) calls `get_outputs()`,
which runs one `step()` right there. `AsyncInprocClient` gives AsyncLLM the same
EngineClient interface as MPClient (engine_client.py), for tests and notebooks where
spawning a process per engine is slow or not possible. It has no busy loop:
`get_outputs` runs one step in a worker thread when there is work, and waits for a
request when there is none. A lock keeps requests, aborts and utility calls from
touching the scheduler while a step runs in that thread.

Neither validates a request: the front end's input processor did, once.
"""

import asyncio
import gc
import os
import threading
import weakref

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.assemble import build_engine_core
from tinyserve.frontend.engine_client import ClientLiveness, EngineDeadError
from tinyserve.wire.ipc import UTILITY_METHODS, outputs_message
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


def freeze_while_alive(owner) -> None:
    """What start-up allocated (the model, tokenizer, libraries) out of the garbage collector's sight while
    `owner` lives, as an engine process keeps it (engine_core_proc.py): else every full collection walks those
    objects again, a ~200 ms pause mid-step. Here the heap is the caller's: once the owner is dropped, the
    heap thaws, and the next collection frees the engine (its KV cache lies in reference cycles)."""
    gc.collect()
    gc.freeze()
    weakref.finalize(owner, gc.unfreeze)


class InprocClient:
    def __init__(self, args: EngineArgs, model_info: ModelInfo, *, spans_inline: bool = False) -> None:
        """spans_inline: build step spans in this thread (see engine_spans.py), as the offline LLM wants."""
        self.engine_core = build_engine_core(args, 0, model_info, spans_inline=spans_inline)
        freeze_while_alive(self)
        self.in_flight: dict[str, int] = {}  # request id -> engine index (always 0)
        self._pending: list[EngineCoreOutput] = []  # abort outputs, not yet returned

    def add_request(self, request: EngineCoreRequest) -> int:
        self.engine_core.add_request(request)
        self.in_flight[request.request_id] = 0
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.in_flight.pop(request_id, None)
        self._pending += self.engine_core.abort_requests(request_ids)

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.engine_core.has_requests

    def get_outputs(self) -> EngineCoreOutputs:
        """What aborts produced, if anything, else one engine step."""
        if self._pending:
            outputs, self._pending = self._pending, []
            result = outputs_message(0, outputs, self.engine_core.get_stats())
        else:
            result = self.engine_core.step_fn()
            if result is None:  # a batch sent down the pipeline (pipeline parallelism): no outputs yet
                result = outputs_message(0, [], self.engine_core.get_stats())
        for output in result.outputs:
            if output.finished:
                self.in_flight.pop(output.request_id, None)
        return result

    def call_utility(self, method: str, *args, engine_index: int = 0):
        if method not in UTILITY_METHODS:
            raise ValueError(f"method must be one of {sorted(UTILITY_METHODS)}, got {method!r}")
        if engine_index != 0:
            raise ValueError(f"engine_index must be 0 for the in-process engine, got {engine_index}")
        return self.engine_core.call_utility(method, *args)

    @property
    def num_kv_blocks(self) -> list[int]:
        return [self.engine_core.num_kv_blocks]

    @property
    def max_model_len(self) -> int:
        return self.engine_core.model_info.max_model_len

    @property
    def engine_pids(self) -> list[int]:
        return [os.getpid()]

    def shutdown(self) -> None:
        self.engine_core.shutdown()


class AsyncInprocClient(ClientLiveness):
    last_sent_bytes = None  # the request is handed over, never encoded: its ipc.send span has no size

    def __init__(self, args: EngineArgs, model_info: ModelInfo) -> None:
        self.args = args
        self.model_info = model_info
        self.client: InprocClient | None = None
        self.dead_error: EngineDeadError | None = None
        self._lock = threading.Lock()
        self._wakeup = asyncio.Event()
        self._closed = False

    async def start(self) -> None:
        self.client = await asyncio.to_thread(InprocClient, self.args, self.model_info)

    @property
    def in_flight(self) -> dict[str, int]:
        return self.client.in_flight if self.client is not None else {}

    async def add_request(self, request: EngineCoreRequest) -> int:
        self._check_alive()
        index = await self._locked(self.client.add_request, request)
        self._wakeup.set()
        return index

    async def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        await self._locked(self.client.abort_requests, request_ids)
        self._wakeup.set()

    async def get_outputs(self) -> EngineCoreOutputs:
        while True:
            self._check_alive()
            if self.client.has_unfinished_requests:
                try:
                    return await self._locked(self.client.get_outputs)
                except Exception as error:
                    self.dead_error = EngineDeadError(f"engine step failed: {type(error).__name__}: {error}")
                    raise self.dead_error from error
            self._wakeup.clear()
            await self._wakeup.wait()

    async def call_utility(self, method: str, *args, engine_index: int = 0):
        self._check_alive()
        return await self._locked(self.client.call_utility, method, *args, engine_index=engine_index)

    async def _locked(self, function, *args, **kwargs):
        def call():
            with self._lock:
                return function(*args, **kwargs)

        return await asyncio.to_thread(call)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._closed and self.client is not None

    @property
    def num_kv_blocks(self) -> list[int]:
        return self.client.num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def engine_pids(self) -> list[int]:
        return self.client.engine_pids

    def shutdown(self) -> None:
        self._closed = True
        self._wakeup.set()  # a get_outputs waiting for work raises instead
