"""The scheduler of a pooling engine (`--runner pooling`): a request is a prefill that finishes at once.

Which requests run, and how many tokens each, is decided exactly as for generation
(scheduler.py's two loops): a pooling request waits for a seat and the token budget,
takes blocks for its prompt, may be chunked over several steps, may be preempted. What
differs is the end. Where a generating request, once its prompt is computed, gets a
sampled token and goes on decoding, a pooling request gets its vector from the runner
(pooling_runner.py) and is finished on the spot, "stop", its blocks freed:

    WAITING ──schedule──► RUNNING ── prompt computed, vector pooled ──► FINISHED_STOPPED
                          (one or more prefill steps; never a decode step)

This class overrides `update_from_output` only.
"""

import time

from tinyserve.engine.core.request import RequestStatus
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.wire.messages import EngineCoreOutput


class PoolingScheduler(Scheduler):
    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        """Finish each request whose prompt this step completed, with the vector the runner pooled."""
        outputs = []
        for scheduled, request in self._served(scheduler_output, time.time()):  # every one a prefill
            if not scheduled.samples_token:  # a chunk of a longer prompt: more to come
                continue
            self.running.remove(request)
            self._finish(request, RequestStatus.FINISHED_STOPPED)
            output = self._output(request, [])
            output.pooling_output = model_runner_output.pooler_output[request.request_id]
            outputs.append(output)
        return outputs
