"""Stage 0's model runner in the engine process: a batch goes in now, its result comes back later.

`submit` sends the SchedulerOutput to every other rank, then runs stage 0's layers here
and sends the hidden states on (stage_runner.py): it returns as soon as stage 0 is done,
while the later stages work. `result` waits for the last stage's ModelRunnerOutput of
that batch. The batch queue (batch_queue.py) calls one and, up to N batches later, the
other; `execute_model` is both at once, for a caller that wants the plain interface.
"""

import time

from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.worker.model_runner import ModelRunnerOutput
from tinyserve.lifecycle.engine_records import RankTimes
from tinyserve.pipeline_parallel.workers import PipelineParallelWorkers


class PipelineParallelRunner:
    def __init__(self, runner, workers: PipelineParallelWorkers) -> None:
        self.runner = runner  # PipelineStageRunner over stage 0's layers
        self.workers = workers
        self.last_rank_times: list[RankTimes] | None = None  # the latest returned batch's, every rank's clock
        self._own_times: dict[int, RankTimes] = {}  # step_id -> this rank's clock, until the batch returns

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send the batch down the pipeline: every rank hears of it, then stage 0 runs its layers."""
        workers, link = self.workers, self.workers.link
        workers.send(scheduler_output)
        started, waited = time.time(), link.recv_wait_s
        all_reduced = workers.tp.timer.seconds if workers.tp is not None else 0.0
        try:
            self.runner.execute_model(scheduler_output)  # stage 0 samples nothing: its output is empty
        except Exception as error:
            if workers.watchdog is not None and workers.watchdog.fired:  # stage 0's peers were killed: say why
                raise RuntimeError(workers.watchdog.fired) from error
            raise
        self.last_rank_times = None
        if workers.traced and not scheduler_output.is_empty:
            self._own_times[scheduler_output.step_id] = workers.placement.clock(started, workers.tp, all_reduced,
                                                                                link, waited)

    def result(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The batch's sampled tokens, from the last stage, once it has them."""
        output, times = self.workers.receive(scheduler_output.step_id)
        own = self._own_times.pop(scheduler_output.step_id, None)
        self.last_rank_times = sorted([own, *times], key=lambda t: t.rank) if own is not None else None
        return output

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return ModelRunnerOutput({}, {}) if scheduler_output.is_empty else self.result(scheduler_output)

    def warm_up(self) -> None:
        self.runner.warm_up()  # every rank runs the same dummy batch: the sends and receives pair up
        self.workers.watch()

    def __getattr__(self, name):  # requests, kv_caches, ...: stage 0's
        return getattr(self.runner, name)
