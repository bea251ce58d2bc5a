"""EngineCore: the engine's loop body, `schedule → execute → update`, once per step.

It owns the three pieces of the engine process: the Scheduler (which requests,
how many tokens), the KV cache manager (which blocks), and the ModelRunner (the
forward pass and sampling). It receives them finished: the one assembly point
(tinyserve/assemble.py) loads the model and builds them, with whatever the enabled
layers add (engine/layers.py), and hands over the layers' hooks in one EngineHooks.
Requests come in as EngineCoreRequests; each step returns EngineCoreOutputs with the
new tokens. The in-process client calls `step_fn()` directly; the engine process
(stage ⑤–⑦) calls it from its busy loop.

A step has two public halves, `schedule_step` and `finish_step`, with the model's
forward pass between them; `step` is the three in a row, and pipeline parallelism's
batch queue (vLLM's `step_with_batch_queue`) is built from the same halves.
"""

from tinyserve.config import EngineArgs, ModelInfo, check_kv_fit
from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.layers import EngineHooks, EngineParts
from tinyserve.engine.step_recorder import StepRecord, StepRecorder
from tinyserve.engine.structured_output import StructuredOutputManager
from tinyserve.engine.worker.cpu_threads import ThreadGovernor, engine_cores
from tinyserve.lifecycle.engine_spans import EngineSpanBuilder
from tinyserve.lifecycle.tracing import tracing_enabled
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCore:
    def __init__(self, args: EngineArgs, engine_index: int, model_info: ModelInfo, parts: EngineParts,
                 hooks: EngineHooks | None = None, *, spans_inline: bool = False) -> None:
        """parts: the model, KV cache manager, scheduler and model runner, built (tinyserve/assemble.py).

        spans_inline: build step spans in this thread (the offline LLM, see engine_spans.py).
        """
        self.args = args
        self.engine_index = engine_index
        self.model_info = model_info
        self.hooks = hooks or EngineHooks()
        self.kv_cache_manager = parts.kv_cache_manager
        self.scheduler = parts.scheduler
        self.model_runner = parts.model_runner
        # The engine's other tensor- or pipeline-parallel ranks (worker processes or Ray actors), or None.
        self.other_ranks = parts.other_ranks
        # Grammars for structured outputs, compiled in threads of their own (structured_output.py).
        self.structured_output = StructuredOutputManager(
            args.structured_outputs_backend, self.model_info.path, self.model_info.vocab_size,
            self.model_info.eos_token_ids, compile_timeout=args.structured_outputs_compile_timeout)
        self.recorder = self._make_recorder(spans_inline)
        # The loop's step (vLLM's step_fn): this class's step, or a layer's (the batch queue of pipeline parallelism).
        self.step_fn = parts.make_step_fn(self) or self.step

    def _make_recorder(self, spans_inline: bool) -> StepRecorder:
        """The step's clocks, spans and CPU threads (step_recorder.py)."""
        args = self.args
        # On CPU, the forward pass's thread count: --cpu-threads, or a governor's (worker/cpu_threads.py).
        # With other ranks each keeps the count it started with (its share of the cores).
        governor, fixed = None, None
        if args.torch_device.type == "cpu" and self.other_ranks is None:
            if args.cpu_threads is not None:
                fixed = args.cpu_threads  # set before every execute, as the governor's count
            else:
                governor = ThreadGovernor(engine_cores())
        # Tracing: spans are built from what each step recorded, on the builder's own thread,
        # or in batches in this thread (spans_inline: the offline LLM, see engine_spans.py).
        span_builder = EngineSpanBuilder(self.engine_index, inline=spans_inline,
                                         structured_outputs_backend=args.structured_outputs_backend,
                                         ) if tracing_enabled() else None
        return StepRecorder(self.scheduler, self.model_runner, governor, fixed, span_builder, self.hooks)

    # What the recorder keeps, read by tests, notebooks and benchmarks.
    thread_governor = property(lambda self: self.recorder.threads.governor)
    span_builder = property(lambda self: self.recorder.span_builder)
    last_scheduler_output = property(lambda self: self.recorder.last_scheduler_output)
    last_step_times = property(lambda self: self.recorder.last_step_times)

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    # ---- requests ------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has validated (its input processor checks every field)."""
        self.recorder.on_request(request)
        engine_request = Request.from_engine_core_request(request)
        if request.sampling_params.structured_outputs is not None:
            self.structured_output.add_request(engine_request)
        self.scheduler.add_request(engine_request)

    def check_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError if this request could never be served by this engine.

        The front end has checked the same things; an engine process checks again what
        arrives on its socket, since a bad prompt id would fail a step for every request.
        """
        self.model_info.validate_prompt(request.prompt_token_ids)
        check_kv_fit(
            len(request.prompt_token_ids),
            request.sampling_params.max_tokens,
            self.model_info.max_model_len,
            self.args.block_size,
            self.num_kv_blocks,
        )
        for check in self.hooks.request_checks:  # the layers' own (a LoRA adapter that cannot be read, say)
            check(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort_requests(request_ids)
        self.recorder.on_finished(outputs)
        return outputs

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    @property
    def has_requests(self) -> bool:
        """Whether to step: requests to run, or finished ones the worker must hear of (vLLM's has_requests).

        The ids of requests that finished (or were aborted) reach the worker with the next
        step's SchedulerOutput; with nothing left to run, one more, empty, step delivers
        them, so the worker lets go of their state at once.
        """
        return self.scheduler.has_unfinished_requests or self.scheduler.has_finished_requests

    # ---- one step --------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One iteration of the engine loop: schedule → execute → update."""
        record = self.recorder.begin()  # the step's clock (step_recorder.py)
        scheduler_output = self.schedule_step(record)
        with record.executing():  # CPU threads set, CPU time measured (worker/cpu_threads.py)
            runner_output = self.model_runner.execute_model(scheduler_output)
        return self.finish_step(record, runner_output)

    def schedule_step(self, record: StepRecord) -> SchedulerOutput:
        """The step's first half: requests whose grammar failed, or that a layer failed, end; the scheduler decides;
        the grammar bitmask."""
        record.outputs = self._end_failed_grammars() + self._end_failed_requests()
        scheduler_output = self.scheduler.schedule()
        self.structured_output.grammar_bitmask(scheduler_output, self.scheduler.requests)
        record.scheduled(scheduler_output)
        return scheduler_output

    def finish_step(self, record: StepRecord, runner_output) -> EngineCoreOutputs:
        """The step's second half: the scheduler updated from what ran (None: nothing came back, a batch queue's
        empty step), the post-step hooks, and the step's outputs, which the recorder observes."""
        if runner_output is not None:
            record.outputs += self.scheduler.update_from_output(record.scheduler_output, runner_output)
        record.ended()
        done = {key: value for hook in self.hooks.post_step for key, value in hook(record).items()}
        outputs = EngineCoreOutputs(engine_index=self.engine_index, timestamp=record.end, outputs=record.outputs,
                                    scheduler_stats=self.get_stats())
        self.recorder.observe(record, outputs, done)
        return outputs

    def _end_failed_grammars(self) -> list[EngineCoreOutput]:
        """With nothing to run but requests whose grammar is compiling, wait for one rather than spin.

        Returns the outputs of requests ended because their grammar could not be made in time or at all,
        each carrying the reason as its `error` (the front end answers it as a 400).
        """
        scheduler = self.scheduler
        if not scheduler.running and scheduler.waiting and all(r.waiting_for_grammar for r in scheduler.waiting):
            self.structured_output.wait_for_a_grammar(timeout=0.05)
        failed = self.structured_output.failed_request_ids()
        return self._end_with_errors({request_id: (error, "structured_outputs")
                                      for request_id, error in failed.items()})

    def _end_failed_requests(self) -> list[EngineCoreOutput]:
        """Waiting requests a layer found it cannot serve after all (EngineHooks.failed_requests): each ends alone,
        its output carrying the reason as its `error` (a LoRA adapter unloaded and deleted while it waited)."""
        return self._end_with_errors({request_id: reason for hook in self.hooks.failed_requests
                                      for request_id, reason in hook().items()})

    def _end_with_errors(self, failed: dict[str, tuple[str, str]]) -> list[EngineCoreOutput]:
        """End these requests, each output with its (error, error_param); the front end answers it as a 400."""
        if not failed:
            return []
        outputs = self.abort_requests(list(failed))
        for output in outputs:
            output.error, output.error_param = failed[output.request_id]
        return outputs

    def flush_spans(self) -> None:
        self.recorder.flush()

    def shutdown(self) -> None:
        """Finish building spans (the caller then flushes the tracer); the layers' shutdown hooks; stop the
        other ranks."""
        self.structured_output.shutdown()
        for hook in self.hooks.shutdown:  # a publisher's socket, a connector's side channel
            hook()
        self.hooks.shutdown = []
        self.recorder.close()
        if self.other_ranks is not None:
            self.other_ranks.shutdown()
            self.other_ranks = None

    # ---- utilities -------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        """The scheduler's stats, with what each layer adds (EngineHooks.scheduler_stats)."""
        stats = self.scheduler.make_stats()
        for hook in self.hooks.scheduler_stats:
            hook(stats)
        return stats

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def call_utility(self, method: str, *args):
        """A utility call from the front end (wire/ipc.py's UTILITY_METHODS): this class's, or a layer's."""
        if method in self.hooks.utilities:
            return self.hooks.utilities[method](*args)
        if method in CORE_UTILITIES:
            return getattr(self, method)(*args)
        known = sorted(CORE_UTILITIES | set(self.hooks.utilities))
        raise ValueError(f"this engine has no utility {method!r}; it answers {known}")


CORE_UTILITIES = {"get_stats", "reset_prefix_cache"}
