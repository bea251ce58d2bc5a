"""The engine's step under pipeline parallelism: vLLM's batch queue (`EngineCore.step_with_batch_queue`).

With N stages, a batch spends 1/N of its forward pass on each: stepping as the plain engine
does (schedule, execute, wait, update) would leave N-1 stages idle at any moment. So the
engine keeps up to N batches in flight, and each step does one of two things:

    queue not full, and the scheduler finds work      schedule a batch, submit it (stage 0 runs
                                                      its layers now), return None (no outputs)
    otherwise, if a batch is in flight                wait for the oldest, update the scheduler
                                                      from it, return its outputs

    time ─►   stage 0 │ B1 │ B2 │ B1'│ B2'│            B1' is B1's requests' next token: the
              stage 1 │    │ B1 │ B2 │ B1'│ B2'        scheduler does not schedule a request
                                                       again while its batch is in flight

It is built from EngineCore's two public halves, as vLLM's `step_with_batch_queue` is from its
engine's: `schedule_step` (grammars, the scheduler, the bitmask) before a batch is submitted, and
`finish_step` (the scheduler updated, the step's outputs) once it is back. A step is recorded from
its batch's scheduling to its return, so the step spans of batches in flight together overlap:
that overlap is the pipeline. EngineCore.step is untouched; this step is the engine's `step_fn`
(layer.py), as vLLM picks its step function.
"""

from collections import deque

from tinyserve.engine.step_recorder import StepRecord
from tinyserve.wire.messages import EngineCoreOutputs


class BatchQueue:
    def __init__(self, engine, size: int) -> None:
        self.engine = engine  # EngineCore: its step's halves, its model runner (a PipelineParallelRunner), recorder
        self.size = size  # batches in flight at most: the number of stages
        self.queue: deque[StepRecord] = deque()  # in flight, oldest first

    def step(self) -> EngineCoreOutputs | None:
        """Submit a new batch if there is room and work (None: no outputs yet, as vLLM's); else retire the
        oldest batch in flight and return its outputs."""
        if len(self.queue) < self.size:
            record = self._schedule_and_submit()
            if not record.scheduler_output.is_empty:
                self.queue.append(record)
                return None
            # An empty step, as the plain engine's: it told the stages of finished requests.
            ended = self.engine.finish_step(record, None)
            if not self.queue:
                return ended
            retired = self._retire()
            retired.outputs[:0] = ended.outputs  # requests it ended itself (a grammar not made in time)
            return retired
        return self._retire()

    def _schedule_and_submit(self) -> StepRecord:
        engine = self.engine
        record = engine.recorder.begin()
        scheduler_output = engine.schedule_step(record)
        with record.executing():  # stage 0's layers; the later stages run on while the engine goes on
            engine.model_runner.submit(scheduler_output)
        return record

    def _retire(self) -> EngineCoreOutputs:
        record = self.queue.popleft()
        runner_output = self.engine.model_runner.result(record.scheduler_output)  # waits for the last stage
        record.executed()
        return self.engine.finish_step(record, runner_output)
