"""AsyncLLM: the engine as the API process sees it (stages ② ③ and ⑧).

    generate(prompt, params, request_id)            one async iterator per request
        │ render + tokenize + validate (InputProcessor)
        │ register with the OutputProcessor; n > 1 fans out into n engine requests
        ▼
    engine client ── EngineCoreRequest ──► engine process(es)
        ▲
        │ one background task pulls EngineCoreOutputs, detokenizes them and puts
        │ each RequestOutput on its request's queue; stop strings found here
        │ abort the request in the engine
    generate() yields from that queue until the request is finished

If the caller stops iterating (a client disconnected), the request is aborted
in the engine so its KV blocks are freed at once.
"""

import asyncio
import logging
import time

import msgspec
from collections.abc import AsyncIterator

from tinyserve.config import EngineArgs, ModelInfo, check_kv_fit
from tinyserve.engine.core_client import EngineDeadError, MPClient
from tinyserve.engine.inproc_client import InprocClient
from tinyserve.engine.input_processor import InputProcessor, ProcessedPrompt
from tinyserve.engine.messages import SchedulerStats
from tinyserve.engine.output_processor import OutputKind, OutputProcessor
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.request_spans import NO_SPANS
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import SamplingParams


logger = logging.getLogger("tinyserve.requests")
_LOG_PROMPT_CHARS = 200
_LOG_PROMPT_TOKENS = 40


def log_inputs(request_id: str, prompt: ProcessedPrompt, params: SamplingParams) -> None:
    """One line per request with what it asked for (prompt and ids truncated), as vLLM logs."""
    text = None if prompt.prompt is None else prompt.prompt[:_LOG_PROMPT_CHARS]
    logger.info(
        "Received request %s: prompt: %r, params: %s, prompt_token_ids: %s (%d tokens)",
        request_id, text, params, prompt.prompt_token_ids[:_LOG_PROMPT_TOKENS], len(prompt.prompt_token_ids),
    )


class AsyncLLM:
    def __init__(
        self, engine_args: EngineArgs, *, data_parallel_size: int = 1, in_process: bool = False, log_requests: bool = False
    ) -> None:
        self.engine_args = engine_args
        self.log_requests = log_requests
        self.model_info = ModelInfo.from_args(engine_args)
        self.tokenizer = load_tokenizer(self.model_info.path)
        self.input_processor = InputProcessor(self.model_info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        if in_process:
            self.client = InprocClient(engine_args, self.model_info)
        else:
            self.client = MPClient(engine_args, self.model_info, data_parallel_size=data_parallel_size)
        self.queues: dict[str, asyncio.Queue] = {}
        self.engine_stats: dict[int, SchedulerStats] = {}
        # Objects with on_request(EngineCoreRequest) and on_outputs(EngineCoreOutputs, received_time),
        # e.g. the server's Prometheus metrics.
        self.stat_loggers: list = []
        self._output_task: asyncio.Task | None = None
        self._dead: BaseException | None = None

    @classmethod
    async def create(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        llm = cls(engine_args, **kwargs)
        await llm.start()
        return llm

    async def start(self) -> None:
        await self.client.start()
        self._output_task = asyncio.create_task(self._pull_outputs(), name="tinyserve-output-handler")

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.client.is_healthy

    @property
    def num_kv_blocks(self) -> int:
        return min(self.client.num_kv_blocks)

    def process_prompt(self, prompt) -> ProcessedPrompt:
        return prompt if isinstance(prompt, ProcessedPrompt) else self.input_processor.tokenize_prompt(prompt)

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        output_kind: OutputKind = OutputKind.DELTA,
        priority: int = 0,
        spans=NO_SPANS,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs (deltas by default) until the request finishes."""
        if self._dead is not None:
            raise EngineDeadError("the engine is dead; no new requests are accepted") from self._dead
        prompt = self.process_prompt(prompt)
        child_requests = []
        for index in range(sampling_params.n):
            child_params = sampling_params.clone(
                n=1, seed=None if sampling_params.seed is None else sampling_params.seed + index
            )
            # Ids are assigned by the output processor below; validate first so nothing leaks.
            request = self.input_processor.make_request(
                request_id, prompt, child_params, priority=priority, trace_context=spans.carrier()
            )
            check_kv_fit(
                len(prompt.prompt_token_ids), child_params.max_tokens, self.model_info.max_model_len,
                self.engine_args.block_size, self.num_kv_blocks,
            )
            child_requests.append(request)
        if self.log_requests:
            log_inputs(request_id, prompt, sampling_params)
        queue: asyncio.Queue = asyncio.Queue()
        finished = False
        try:
            with spans.stage(schema.ENQUEUE, {schema.REQUEST_ID: request_id}) as enqueue_span:
                child_ids = self.output_processor.add_request(
                    request_id, prompt.prompt, prompt.prompt_token_ids, sampling_params, output_kind, spans
                )
                self.queues[request_id] = queue
                for child_id, request in zip(child_ids, child_requests):
                    request.request_id = child_id
                    with spans.stage(schema.IPC_SEND, {schema.REQUEST_ID: child_id}) as send_span:
                        engine_index = await self.client.add_request(request)
                        if send_span is not None:
                            send_span.set_attributes({schema.ENGINE_INDEX: engine_index,
                                                      schema.IPC_BYTES: len(msgspec.msgpack.encode(request))})
                    for logger in self.stat_loggers:
                        logger.on_request(request)
                if enqueue_span is not None:
                    enqueue_span.set_attribute(schema.ENGINE_INDEX, engine_index)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        except Exception as error:  # a disconnect (cancellation) ends the spans through the abort below
            spans.fail(error)
            raise
        finally:
            self.queues.pop(request_id, None)
            if not finished:
                await self._abort_quietly(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request; its iterator (if any) ends without a final output."""
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self._dead is None:
            await self.client.abort_requests(child_ids)

    async def get_stats(self) -> list[SchedulerStats]:
        """Fresh scheduler stats from every engine (a utility call to each)."""
        return [await self.client.call_utility("get_stats", engine_index=i) for i in range(len(self.client.num_kv_blocks))]

    async def reset_prefix_cache(self) -> list[bool]:
        return [await self.client.call_utility("reset_prefix_cache", engine_index=i) for i in range(len(self.client.num_kv_blocks))]

    async def shutdown(self) -> None:
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except (asyncio.CancelledError, Exception):
                pass
        self.client.shutdown()

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await asyncio.shield(self.abort(request_id))
        except (EngineDeadError, asyncio.CancelledError):
            pass

    async def _pull_outputs(self) -> None:
        """The single background task that routes engine outputs to request queues."""
        try:
            while True:
                engine_outputs = await self.client.get_outputs()
                received_time = time.time()
                if engine_outputs.scheduler_stats is not None:
                    self.engine_stats[engine_outputs.engine_index] = engine_outputs.scheduler_stats
                for logger in self.stat_loggers:
                    logger.on_outputs(engine_outputs, received_time)
                request_outputs, to_abort = self.output_processor.process_outputs(engine_outputs.outputs)
                for request_output in request_outputs:
                    queue = self.queues.get(request_output.request_id)
                    if queue is not None:
                        queue.put_nowait(request_output)
                if to_abort:
                    await self.client.abort_requests(to_abort)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the engine died (or the client broke): fail everyone, hang no one
            self._dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
            for request_id, queue in list(self.queues.items()):
                self.output_processor.abort_request(request_id)
                queue.put_nowait(self._dead)
