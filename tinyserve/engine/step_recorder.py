"""The step recorder: what watches EngineCore.step, besides schedule → execute → update.

    record = self.recorder.begin()                clock: start
    ... schedule ... record.scheduled(output)     clock: scheduled
    with record.executing():                      CPU threads set, CPU time measured (cpu_threads.py)
        ... execute_model ...                     clock: executed
    ... update_from_output ... record.ended()     clock: end
    self.recorder.observe(record, outputs, ...)   the step's times kept; its span recorded

The engine builds the step's outputs itself; the recorder only watches: the clocks of
`StepTimes`, the spans built from each step by lifecycle/engine_spans.py, and the CPU
thread governor all sit here. The latest step's record stays readable
(`last_step_times`, `last_scheduler_output`) for a notebook or a benchmark. The layers'
span attributes come from the named hook lists of EngineHooks (engine/layers.py), read
only when tracing.
"""

import contextlib
import time
from dataclasses import dataclass, field

from tinyserve.engine.layers import EngineHooks
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
    end: float = 0.0
    scheduler_output: object = None  # engine.core.scheduler_output.SchedulerOutput
    threads: object = None  # cpu_threads.ThreadsUsed
    outputs: list[EngineCoreOutput] = field(default_factory=list)

    def scheduled(self, scheduler_output) -> None:
        self.scheduled_at, self.scheduler_output = time.time(), scheduler_output

    @contextlib.contextmanager
    def executing(self):
        with self.recorder.threads.running() as self.threads:
            yield
        self.executed()

    def executed(self) -> None:
        """Clock: the forward pass is over (a batch queue's batch: when it is back from the last stage)."""
        self.executed_at = time.time()

    def ended(self) -> None:
        self.end = time.time()


class StepRecorder:
    """An engine's clocks, spans and CPU threads, step after step."""

    def __init__(self, scheduler, model_runner, governor: ThreadGovernor | None, fixed_threads: int | None,
                 span_builder: EngineSpanBuilder | None, hooks: EngineHooks) -> None:
        self.scheduler = scheduler
        self.model_runner = model_runner
        self.threads = ExecuteThreads(governor, fixed_threads)
        self.span_builder = span_builder  # None: tracing is off
        self.hooks = hooks  # the layers' span attributes: request_, step_, finish_ and prefill_attributes
        self.last_scheduler_output = None
        self.last_step_times: StepTimes | None = None

    # A step is begun when it is scheduled and observed when its outputs are made: for the plain step
    # at once, for a batch queue's step (pipeline_parallel/batch_queue.py) when its batch is back.
    def begin(self) -> StepRecord:
        return StepRecord(self, start=time.time())

    def observe(self, record: StepRecord, outputs: EngineCoreOutputs, done: dict) -> None:
        """The step is over: keep its times, and record its span (`done`: what the post-step hooks did)."""
        ranks = getattr(self.model_runner, "last_rank_times", None)  # tensor parallelism: every rank's execute
        threads = record.threads
        self.last_scheduler_output = record.scheduler_output
        self.last_step_times = StepTimes(record.start, record.scheduled_at, record.executed_at, record.end, ranks,
                                         threads.threads, threads.cpu_s)
        if self.span_builder is not None:
            attributes = {k: v for hook in self.hooks.step_attributes
                          for k, v in hook(record.scheduler_output).items()} | done
            self.last_step_times.stages = [stage for hook in self.hooks.step_spans
                                           for stage in hook(record.scheduler_output)]
            self.span_builder.record_step(record.scheduler_output, self.last_step_times, outputs.scheduler_stats,
                                          record.outputs, attributes, self._finished_attributes(record.outputs),
                                          self._finished_attributes(record.outputs, self.hooks.prefill_attributes))

    # ---- hooks outside the step --------------------------------------------------

    def on_request(self, request: EngineCoreRequest) -> None:
        """A request was queued: its spans will need its trace context and the queue it joined."""
        if self.span_builder is not None:
            constraint = request.sampling_params.structured_outputs
            self.span_builder.on_request(request.request_id, request.trace_context, len(request.prompt_token_ids),
                                         len(self.scheduler.waiting), constraint.kind if constraint else None,
                                         request.sampling_params.seed,
                                         {k: v for hook in self.hooks.request_attributes
                                          for k, v in hook(request).items()})

    def on_finished(self, outputs: list[EngineCoreOutput]) -> None:
        """Requests that finished outside a step (aborted): their spans end."""
        if self.span_builder is not None and outputs:
            self.span_builder.record_finished(outputs, self._finished_attributes(outputs),
                                              self._finished_attributes(outputs, self.hooks.prefill_attributes))

    def _finished_attributes(self, outputs: list[EngineCoreOutput], hooks: list | None = None) -> dict[str, dict]:
        """request id -> the hooks' attributes (finish_attributes unless given), for each request that finished."""
        hooks = self.hooks.finish_attributes if hooks is None else hooks
        if not hooks:
            return {}
        return {output.request_id: {k: v for hook in hooks for k, v in hook(output.request_id).items()}
                for output in outputs if output.finished}

    def flush(self) -> None:
        if self.span_builder is not None:
            self.span_builder.flush()

    def close(self) -> None:
        if self.span_builder is not None:
            self.span_builder.close()
            self.span_builder = None
