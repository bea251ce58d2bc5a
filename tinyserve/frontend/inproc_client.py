"""The engine client without a second process: an EngineCore stepped in this one.

Same async interface as `MPClient` (core_client.py), so AsyncLLM runs the same
way in a test or a notebook, where spawning a process per engine is slow or not
possible. There is no busy loop: `get_outputs` runs one `step()` in a worker
thread when there is work, and waits for a request when there is none. A lock
keeps requests, aborts and utility calls from touching the scheduler while a
step runs in that thread.
"""

import asyncio
import os
import threading

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.engine_core import EngineCore
from tinyserve.frontend.core_client import EngineDeadError
from tinyserve.wire.ipc import UTILITY_METHODS, error_output, outputs_message
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, args: EngineArgs, model_info: ModelInfo) -> None:
        self.args = args
        self.model_info = model_info
        self.engine_core: EngineCore | None = None
        self.in_flight: dict[str, int] = {}  # request id -> engine index (always 0)
        self.dead_error: EngineDeadError | None = None
        self._lock = threading.Lock()
        self._pending: list[EngineCoreOutput] = []  # abort and rejection outputs, not yet returned
        self._wakeup = asyncio.Event()
        self._closed = False

    async def start(self) -> None:
        self.engine_core = await asyncio.to_thread(EngineCore, self.args, 0, self.model_info)

    async def add_request(self, request: EngineCoreRequest) -> int:
        self._check_alive()
        try:
            await self._locked(self.engine_core.add_request, request)
            self.in_flight[request.request_id] = 0
        except ValueError as error:
            self._pending.append(error_output(request.request_id, str(error)))
        self._wakeup.set()
        return 0

    async def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        for request_id in request_ids:
            self.in_flight.pop(request_id, None)
        self._pending += await self._locked(self.engine_core.abort_requests, request_ids)
        self._wakeup.set()

    async def get_outputs(self) -> EngineCoreOutputs:
        while True:
            self._check_alive()
            if self._pending:
                outputs, self._pending = self._pending, []
                return self._finish(outputs_message(0, outputs, self.engine_core.get_stats()))
            if self.engine_core.has_unfinished_requests:
                try:
                    return self._finish(await self._locked(self.engine_core.step))
                except Exception as error:
                    self.dead_error = EngineDeadError(f"engine step failed: {type(error).__name__}: {error}")
                    raise self.dead_error from error
            self._wakeup.clear()
            await self._wakeup.wait()

    async def call_utility(self, method: str, *args, engine_index: int = 0):
        if method not in UTILITY_METHODS:
            raise ValueError(f"method must be one of {sorted(UTILITY_METHODS)}, got {method!r}")
        if engine_index != 0:
            raise ValueError(f"engine_index must be 0 for the in-process engine, got {engine_index}")
        self._check_alive()
        return await self._locked(getattr(self.engine_core, method), *args)

    def _finish(self, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        for output in outputs.outputs:
            if output.finished:
                self.in_flight.pop(output.request_id, None)
        return outputs

    async def _locked(self, function, *args):
        def call():
            with self._lock:
                return function(*args)

        return await asyncio.to_thread(call)

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._closed:
            raise EngineDeadError("the engine client was shut down")

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._closed and self.engine_core is not None

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
        self._closed = True
        self._wakeup.set()  # a get_outputs waiting for work raises instead
