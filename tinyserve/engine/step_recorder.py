"""The step recorder: what EngineCore.step does besides schedule → execute → update.

    with self.recorder.step() as step:            clock: start
        ... schedule ...
        step.scheduled(scheduler_output)          clock: scheduled
        with step.executing():                    CPU threads set, CPU time measured (cpu_threads.py)
            ... execute_model ...                 clock: executed
        step.outputs = ... update_from_output ...
    return step.engine_core_outputs               clock: end; stats; the step's span recorded

So the lifecycle reads as three lines, and everything that watches it (the clocks of
`StepTimes`, the `SchedulerStats` every output carries, the spans built from each step by
lifecycle/engine_spans.py, and the CPU thread governor) sits here, behind one `with`. The
latest step's record stays readable (`last_step_times`, `last_scheduler_output`) for a
notebook or a benchmark. A new stage that wants the step's clock adds a hook here, not a
line to the step.
"""

import contextlib
import time
from dataclasses import dataclass, field

from tinyserve.engine.worker.cpu_threads import ExecuteThreads, ThreadGovernor
from tinyserve.lifecycle.engine_records import StepTimes
from tinyserve.lifecycle.engine_spans import EngineSpanBuilder
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


@dataclass(slots=True)
class StepRecord:
    """One step as it happens: its clock so far, and the outputs the step hands back."""

    recorder: "StepRecorder"
    start: float
    scheduled_at: float = 0.0
    executed_at: float = 0.0
    scheduler_output: object = None  # engine.core.scheduler_output.SchedulerOutput
    threads: object = None  # cpu_threads.ThreadsUsed
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    engine_core_outputs: EngineCoreOutputs | None = None

    def scheduled(self, scheduler_output) -> None:
        self.scheduled_at, self.scheduler_output = time.time(), scheduler_output

    @contextlib.contextmanager
    def executing(self):
        with self.recorder.threads.running() as self.threads:
            yield
        self.executed_at = time.time()


class StepRecorder:
    """An engine's clocks, stats, spans and CPU threads, step after step."""

    def __init__(self, engine_index: int, scheduler, model_runner, governor: ThreadGovernor | None,
                 fixed_threads: int | None, span_builder: EngineSpanBuilder | None) -> None:
        self.engine_index = engine_index
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.threads = ExecuteThreads(governor, fixed_threads)
        self.span_builder = span_builder  # None: tracing is off
        self.last_scheduler_output = None
        self.last_step_times: StepTimes | None = None
        # Layers beside the engine that put attributes of their own on the spans (LoRA: lora/attach.py):
        # request_hooks(EngineCoreRequest) -> dict for its queue span; step_hooks(SchedulerOutput) -> dict
        # for the step span.
        self.request_hooks: list = []
        self.step_hooks: list = []
        # finish_hooks(request_id) -> dict for the decode span of a request that finished (speculative
        # decoding: spec_decode/attach.py)
        self.finish_hooks: list = []
        # end_hooks(StepRecord) -> dict for the step span: run after every step, traced or not, once the
        # step is over (KV cache events drain and publish here: kv_events/attach.py); close_hooks() at close.
        self.end_hooks: list = []
        self.close_hooks: list = []
        # prefill_hooks(request_id) -> dict for the prefill span of a request that finished (disaggregated
        # prefill: the tokens whose K/V arrived from another engine, distributed/kv_transfer/attach.py)
        self.prefill_hooks: list = []

    @contextlib.contextmanager
    def step(self):
        record = self.begin()
        yield record
        self.finish(record)

    # A step in two halves, for a step whose batch returns later (the batch queue of pipeline parallelism,
    # pipeline_parallel/batch_queue.py): begun when it is scheduled, finished when its batch is back.
    def begin(self) -> StepRecord:
        return StepRecord(self, start=time.time())

    def finish(self, record: StepRecord) -> EngineCoreOutputs:
        end = time.time()
        ended = {k: v for hook in self.end_hooks for k, v in hook(record).items()}
        stats = self.scheduler.make_stats()
        ranks = getattr(self.model_runner, "last_rank_times", None)  # tensor parallelism: every rank's execute
        threads = record.threads
        self.last_scheduler_output = record.scheduler_output
        self.last_step_times = StepTimes(record.start, record.scheduled_at, record.executed_at, end, ranks,
                                         threads.threads, threads.cpu_s)
        if self.span_builder is not None:
            attributes = {k: v for hook in self.step_hooks for k, v in hook(record.scheduler_output).items()} | ended
            self.span_builder.record_step(record.scheduler_output, self.last_step_times, stats, record.outputs,
                                          attributes, self._finished_attributes(record.outputs),
                                          self._finished_attributes(record.outputs, self.prefill_hooks))
        record.engine_core_outputs = EngineCoreOutputs(engine_index=self.engine_index, timestamp=end,
                                                       outputs=record.outputs, scheduler_stats=stats)
        return record.engine_core_outputs

    # ---- hooks outside the step --------------------------------------------------

    def on_request(self, request: EngineCoreRequest) -> None:
        """A request was queued: its spans will need its trace context and the queue it joined."""
        if self.span_builder is not None:
            constraint = request.sampling_params.structured_outputs
            self.span_builder.on_request(request.request_id, request.trace_context, len(request.prompt_token_ids),
                                         len(self.scheduler.waiting), constraint.kind if constraint else None,
                                         request.sampling_params.seed,
                                         {k: v for hook in self.request_hooks for k, v in hook(request).items()})

    def on_finished(self, outputs: list[EngineCoreOutput]) -> None:
        """Requests that finished outside a step (aborted): their spans end."""
        if self.span_builder is not None and outputs:
            self.span_builder.record_finished(outputs, self._finished_attributes(outputs),
                                              self._finished_attributes(outputs, self.prefill_hooks))

    def _finished_attributes(self, outputs: list[EngineCoreOutput], hooks: list | None = None) -> dict[str, dict]:
        """request id -> the hooks' attributes (finish_hooks unless given), for each request that finished."""
        hooks = self.finish_hooks if hooks is None else hooks
        if not hooks:
            return {}
        return {output.request_id: {k: v for hook in hooks for k, v in hook(output.request_id).items()}
                for output in outputs if output.finished}

    def flush(self) -> None:
        if self.span_builder is not None:
            self.span_builder.flush()

    def close(self) -> None:
        for hook in self.close_hooks:
            hook()
        self.close_hooks = []
        if self.span_builder is not None:
            self.span_builder.close()
            self.span_builder = None
