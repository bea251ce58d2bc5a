"""AsyncLLM: the engine as the API process sees it (stages ② ③ and ⑧).

    generate(prompt, params, request_id)            one async iterator per request
        │ admission: refuse when the waiting queue is full or the server drains
        │ render + tokenize (in a thread: RenderThreads) + validate (InputProcessor)
        │ register with the OutputProcessor; n > 1 fans out into n engine requests
        ▼
    engine client ── EngineCoreRequest ──► engine process(es)
        ▲
        │ one background task pulls EngineCoreOutputs, detokenizes them and puts
        │ each RequestOutput on its request's queue; stop strings found here
        │ abort the request in the engine; generate() yields until the request finishes

If the caller stops iterating (a client disconnected), the request is aborted in the
engine, freeing its KV blocks at once. `add_request` (the part before the loop) returns
the `RequestStream`: the server calls it before answering, so a refusal is a 503, not an
error inside a 200 stream.

Admission is counted here, from what the front end knows: every engine request sent
and not seen to finish is unfinished; the engines' latest stats (with every step) say
how many of those run; the rest wait. Beyond `max_waiting_requests` waiting, new ones
are refused with RequestRejectedError (the server's 503), so a burst cannot grow memory
without bound. On shutdown, `start_draining` refuses new requests and `abort_all` ends
the ones left with finish_reason "abort", through the engines as any abort.

A data-parallel rank that dies fails the requests it held and no others: their streams
end with its EngineRankDeadError (a 503, or a stream's error event), a request of n > 1
with one child there fails whole (its children elsewhere are aborted), and the rank's
last stats stop counting. Every other request runs on. `errored` turns true only once
no engine is left; `dead_engines` says which died meanwhile.

The module is over 300 lines because a request's whole way through the front end
(admission, send, abort, the output loop that ends it) reads best in one place.
"""

import asyncio
import time
from collections.abc import AsyncIterator

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.errors import InvalidInputError, QueueFullError, RequestRejectedError
from tinyserve.frontend.core_client import MPClient
from tinyserve.frontend.dp_client import data_parallel_engine_indices
from tinyserve.frontend.remote_engines import MultiNode
from tinyserve.frontend.engine_client import EngineClient, EngineDeadError, EngineRankDeadError
from tinyserve.frontend.inproc_client import AsyncInprocClient
from tinyserve.frontend.input_processor import InputProcessor, ProcessedPrompt, log_inputs
from tinyserve.frontend.output_processor import OutputKind, OutputProcessor
from tinyserve.frontend.pooling_output import PoolingOutputProcessor
from tinyserve.frontend.render_threads import RenderThreads
from tinyserve.frontend.request_observers import RequestObservers
from tinyserve.frontend.request_stream import RequestStream, end_now, engine_refusal
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.outputs import PoolingRequestOutput, RequestOutput
from tinyserve.pooling_params import PoolingParams
from tinyserve.sampling_params import SamplingParams
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats


class AsyncLLM:
    def __init__(
        self,
        engine_args: EngineArgs,
        *,
        data_parallel_size: int = 1,
        data_parallel_rank: int | None = None,  # run that engine alone, behind an external load balancer
        in_process: bool = False,
        log_requests: bool = False,
        max_waiting_requests: int | None = None,
        multi_node: MultiNode | None = None,
        client: MPClient | None = None,
        seed_unseeded: bool = False,
    ) -> None:
        """max_waiting_requests: most engine requests waiting for a seat before new ones are refused (None: no bound).

        multi_node: some of the data_parallel_size engines run on headless nodes (remote_engines.py).
        client: the MPClient.for_engines of the same arguments, made already (`tinyserve serve`
        launches its engines before it imports this module, so that they load meanwhile).
        seed_unseeded: a traced server's: a sampled request without a seed gets one (InputProcessor.seeded).
        """
        self.engine_indices = data_parallel_engine_indices(data_parallel_size, data_parallel_rank, in_process)
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be at least 1, got {max_waiting_requests}")
        self.engine_args = engine_args
        self.max_waiting_requests = max_waiting_requests
        self.log_requests = log_requests
        self.model_info = ModelInfo.from_args(engine_args)
        self.tokenizer = load_tokenizer(self.model_info.path)
        self.input_processor = InputProcessor.from_engine_args(self.model_info, self.tokenizer, engine_args,
                                                               seed_unseeded=seed_unseeded)
        self.render_threads = RenderThreads(self.input_processor)  # templates and tokenizing, off the event loop
        self.observers = RequestObservers()  # each request's spans, registered by the caller (tracing on)
        # A pooling engine's outputs are vectors, not tokens: nothing to detokenize (pooling_output.py).
        self.output_processor = PoolingOutputProcessor(self.observers) if engine_args.runner == "pooling" else \
            OutputProcessor(self.tokenizer, self.observers)
        if client is None:
            client = AsyncInprocClient(engine_args, self.model_info) if in_process else MPClient.for_engines(
                engine_args, self.model_info, data_parallel_size, data_parallel_rank, multi_node)
        self.client: EngineClient = client
        self.queues: dict[str, asyncio.Queue] = {}
        self.engine_stats: dict[int, SchedulerStats] = {}
        self.dead_engines: dict[int, str] = {}  # engine index -> how it died and what was lost (others live)
        # Objects with on_request(request_id, child EngineCoreRequests, SamplingParams) and on_outputs(...),
        # e.g. the server's Prometheus metrics.
        self.stat_loggers: list = []
        self._output_task: asyncio.Task | None = None
        self._start: asyncio.Future | None = None
        self._dead: BaseException | None = None
        self._draining = False

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        """As in vLLM. The engines start with the first request (or an explicit `await start()`)."""
        return cls(engine_args, **kwargs)

    @classmethod
    async def create(cls, engine_args: EngineArgs, **kwargs) -> "AsyncLLM":
        """An AsyncLLM whose engines are up and ready."""
        llm = cls(engine_args, **kwargs)
        await llm.start()
        return llm

    async def start(self) -> None:
        """Start the engines and the output task; concurrent and repeated calls start them once."""
        if self._start is None:
            self._start = asyncio.ensure_future(self._start_engines())
        await asyncio.shield(self._start)

    async def _start_engines(self) -> None:
        await self.client.start()
        self._output_task = asyncio.create_task(self._pull_outputs(), name="tinyserve-output-handler")

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self.client.is_healthy

    @property
    def errored(self) -> bool:
        """An engine died and every request it held has been failed (vLLM's name); nothing new is taken."""
        return self._dead is not None

    @property
    def dead_reason(self) -> str | None:
        """Which engine died and how (its process's exit, a headless node's silence); None while all live."""
        return None if self._dead is None else str(self._dead)

    @property
    def live_engine_indices(self) -> list[int]:
        """The engines that still serve (all of engine_indices until a data-parallel rank dies)."""
        return [] if self._dead is not None else [i for i in self.engine_indices if i not in self.dead_engines]

    @property
    def num_kv_blocks(self) -> int:
        return min(self.client.num_kv_blocks)

    @property
    def num_unfinished_requests(self) -> int:
        """Engine requests sent and not yet seen to finish (each of n > 1 counts)."""
        return len(self.output_processor.children)

    @property
    def num_waiting_requests(self) -> int:
        """Unfinished requests beyond those the engines last reported running."""
        running = sum(stats.num_running_reqs for stats in self.engine_stats.values())
        return max(0, self.num_unfinished_requests - running)

    def check_admission(self, num_requests: int = 1) -> None:
        """Raise unless `num_requests` more engine requests may be sent now."""
        if self._dead is not None:
            raise EngineDeadError("the engine is dead; no new requests are accepted") from self._dead
        if self._draining:
            raise RequestRejectedError("the server is shutting down and accepts no new requests")
        if (limit := self.max_waiting_requests) is None:
            return
        if num_requests > limit:
            raise InvalidInputError(f"the request needs {num_requests} sequences (prompts × n) but at most "
                                    f"max_waiting_requests={limit} can ever wait", "n")
        waiting = self.num_waiting_requests
        if waiting + num_requests > limit:
            raise QueueFullError(f"the server is overloaded: {waiting} requests are waiting "
                                       f"(max_waiting_requests={limit}); retry later")

    async def process_prompt(self, prompt) -> ProcessedPrompt:
        return prompt if isinstance(prompt, ProcessedPrompt) else await self.render_threads.tokenize_prompt(prompt)

    async def generate(
        self,
        prompt,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        output_kind: OutputKind = OutputKind.DELTA,
        priority: int = 0,
        lora_request=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs (deltas by default) until the request finishes."""
        stream = await self.add_request(prompt, sampling_params, request_id, output_kind=output_kind,
                                        priority=priority, lora_request=lora_request)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.close()

    async def encode(
        self,
        prompt,
        pooling_params: PoolingParams,
        request_id: str,
        *,
        priority: int = 0,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """Yield the one PoolingRequestOutput of a pooling request (a pooling engine: --runner pooling)."""
        async for output in self.generate(prompt, pooling_params, request_id, output_kind=OutputKind.FINAL_ONLY,
                                          priority=priority):
            yield output

    async def add_request(self, prompt, sampling_params: SamplingParams | PoolingParams, request_id: str, *,
                          output_kind: OutputKind = OutputKind.DELTA, priority: int = 0,
                          lora_request=None, reasoning_end=None) -> RequestStream:
        """Admit, validate and send a request; its outputs arrive on the returned stream (the caller must
        `close()` it: that aborts it if unfinished). lora_request: a LoRARequest; reasoning_end: a ReasoningEnd
        (wire/messages.py). Its spans, if traced, are found by its id (self.observers, registered by the caller)."""
        if self._output_task is None:
            await self.start()
        observer = self.observers.get(request_id)
        try:
            child_requests, prompt = await self._make_requests(prompt, sampling_params, request_id, priority,
                                                               lora_request, reasoning_end)
            with observer.enqueueing(request_id) as enqueued:
                stream = self._register(prompt, sampling_params, request_id, output_kind, lora_request,
                                        child_requests)
                enqueued.engine_index = await self._send(request_id, child_requests, stream)
        except Exception as error:
            observer.fail(error)
            raise
        return stream

    async def _make_requests(self, prompt, sampling_params, request_id, priority: int, lora_request, reasoning_end):
        """Admission, the prompt tokenized (if it is not yet) and the engine requests validated and made; arrival is
        before all of it (vLLM's), and a constraint is checked off the loop, within its deadline (render_threads.py)."""
        arrival_time = time.time()
        self.check_admission(sampling_params.n)
        prompt = await self.process_prompt(prompt)
        await self.render_threads.check_constraint(sampling_params, arrival_time, self.engine_args)
        child_requests = self.input_processor.make_requests(  # the constraint passed: make_requests remembers it
            request_id, prompt, sampling_params, num_kv_blocks=self.num_kv_blocks, priority=priority,
            trace_context=self.observers.get(request_id).carrier(), lora_request=lora_request,
            arrival_time=arrival_time, reasoning_end=reasoning_end)
        if self.log_requests:
            log_inputs(request_id, prompt, sampling_params)
        return child_requests, prompt

    def _register(self, prompt: ProcessedPrompt, sampling_params, request_id: str, output_kind: OutputKind,
                  lora_request, child_requests: list[EngineCoreRequest]) -> RequestStream:
        """The request known to the output processor, its stream and the stat loggers, before the first send
        (an output may follow it at once)."""
        self.output_processor.add_request(request_id, prompt.prompt, prompt.known_token_ids, sampling_params,
                                          output_kind, lora_request=lora_request)
        stream = RequestStream(self, request_id)
        self.queues[request_id] = stream.queue
        for logger in self.stat_loggers:
            logger.on_request(request_id, child_requests, sampling_params)
        return stream

    async def _send(self, request_id: str, child_requests: list[EngineCoreRequest], stream: RequestStream) -> int:
        """Send each engine request (n > 1: each child); the engine the last went to. The request is
        registered: if a send fails, closing its stream aborts what was sent."""
        observer = self.observers.get(request_id)
        try:
            for request in child_requests:
                with observer.sending(request.request_id) as sent:
                    sent.engine_index = await self.client.add_request(request)
                    sent.num_bytes = self.client.last_sent_bytes  # None: an engine in this process
        except BaseException:
            await stream.close()
            raise
        return sent.engine_index

    async def abort(self, request_id: str) -> None:
        """Stop a request; its iterator (if any) ends without a final output. Unknown or finished ids are ignored."""
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            end_now(queue)
        child_ids = self.output_processor.abort_request(request_id)
        if child_ids and self._dead is None:
            await self.client.abort_requests(child_ids)

    async def get_stats(self) -> list[SchedulerStats]:
        """Fresh scheduler stats from every live engine (a utility call to each)."""
        return [await self.client.call_utility("get_stats", engine_index=i) for i in self.live_engine_indices]

    async def reset_prefix_cache(self) -> list[bool]:
        """Each live engine's answer (a rank that died has no cache left to reset)."""
        return [await self.client.call_utility("reset_prefix_cache", engine_index=i)
                for i in self.live_engine_indices]

    def start_draining(self) -> None:
        """Refuse every new request from now on; those in flight go on."""
        self._draining = True

    async def abort_all(self) -> int:
        """Abort every unfinished request in the engines; each stream then ends with finish_reason "abort".

        The engines answer an abort with a finished output, which reaches the
        streams by the usual path. Returns how many engine requests were aborted.
        """
        child_ids = list(self.output_processor.children)
        if child_ids and self._dead is None:
            await self.client.abort_requests(child_ids)
        return len(child_ids)

    def shutdown(self) -> None:
        """Stop the output task and the engines (as vLLM's, a plain call), a start under way too; safe to call twice."""
        if self._start is not None:
            self._start.cancel()  # nothing once started; else MPClient.start stops what it started
        if self._output_task is not None:
            self._output_task.cancel()
        self.render_threads.shutdown()
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
                try:
                    engine_outputs = await self.client.get_outputs()
                except EngineRankDeadError as lost:
                    await self._fail_lost_requests(lost)
                    continue
                received_time = time.time()
                refused = [output for output in engine_outputs.outputs if output.error is not None]
                if refused:
                    await self._fail_refused_requests(refused)
                if engine_outputs.scheduler_stats is not None:
                    self.engine_stats[engine_outputs.engine_index] = engine_outputs.scheduler_stats
                processed = self.output_processor.process_outputs(engine_outputs.outputs)
                for logger in self.stat_loggers:  # after: a stop string found there is the finish they count
                    logger.on_outputs(engine_outputs, received_time, processed.stop_string_finishes)
                for request_output in processed.request_outputs:
                    # Popped once finished: a stream nobody reads any more leaves nothing behind.
                    get = self.queues.pop if request_output.finished else self.queues.get
                    queue = get(request_output.request_id, None)
                    if queue is not None:
                        queue.put_nowait(request_output)
                if processed.reqs_to_abort:
                    await self.client.abort_requests(processed.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # the engine died (or the client broke): fail everyone, hang no one
            self._dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
            for request_id, queue in list(self.queues.items()):
                self.output_processor.abort_request(request_id)
                queue.put_nowait(self._dead)

    async def _fail_refused_requests(self, outputs: list[EngineCoreOutput]) -> None:
        """Requests the engine ended itself, saying why (a grammar not compiled, or not in time; an adapter it
        cannot read; a request its own checks refuse): each request's stream raises that reason
        (request_stream.engine_refusal: a 400 at the API, naming the field), and its other
        children (n > 1) are aborted. The outputs then find no request left to update."""
        to_abort = []
        for output in outputs:
            child = self.output_processor.children.get(output.request_id)
            if child is None:
                continue
            to_abort += [c for c in self._fail_request(child.parent.request_id, engine_refusal(output))
                         if c != output.request_id]
        if to_abort:
            await self.client.abort_requests(to_abort)

    async def _fail_lost_requests(self, lost: EngineRankDeadError) -> None:
        """One data-parallel rank died, others live: end the requests it held with its error, and only those.

        A request of n > 1 whose child was there fails whole, as a dead engine fails a request
        today; its children on live engines are aborted so that their KV blocks are freed.
        """
        self.dead_engines[lost.engine_index] = str(lost)
        self.engine_stats.pop(lost.engine_index, None)  # its last report no longer runs anything
        lost_ids = set(lost.request_ids)
        parents = {child.parent.request_id for child_id in lost.request_ids
                   if (child := self.output_processor.children.get(child_id)) is not None}
        to_abort = []
        for request_id in parents:
            to_abort += [c for c in self._fail_request(request_id, lost) if c not in lost_ids]
        if to_abort:
            await self.client.abort_requests(to_abort)

    def _fail_request(self, request_id: str, error: BaseException) -> list[str]:
        """End a request with `error` (on its span, and raised by its stream); returns its children's engine ids."""
        children = self.output_processor.abort_request(request_id, error)
        queue = self.queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)
        return children
