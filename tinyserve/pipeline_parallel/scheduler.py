"""The scheduler under pipeline parallelism: a request in flight is not scheduled again until its batch is back.

With N stages the engine keeps up to N batches in flight (batch_queue.py). A request in
one of them has had its tokens counted as computed, but its next token is not sampled
yet: scheduling it again would feed a token nobody knows. vLLM's scheduler passes over
such a request (its num_new_tokens is 0, and it `continue`s); here the first loop's
candidates leave it out (`_running_candidates`, the seam in scheduler.py). Everything else
is the plain scheduler, with two consequences worth knowing:

- `max_num_seqs` counts running requests, in flight or not, as vLLM's does: with N batches
  in flight, each holds about max_num_seqs / N of them. A pipeline wants max_num_seqs
  (and enough requests) N times the batch one stage should see.
- A request preempted while its batch is in flight gets nothing from that batch: its
  token is dropped when the batch returns, and it is recomputed as any preempted request.

Each cached request also carries the tokens it feeds (`CachedRequestData.new_token_ids`,
vLLM's): only the last stage samples, so the others learn the tokens from here.
"""

from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.engine.core.scheduler_output import CachedRequestData, SchedulerOutput


class PipelineScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: dict[str, int] = {}  # request id -> step_id of the batch that holds it
        self.num_batches_in_flight = 0

    def _running_candidates(self) -> list[Request]:
        return [request for request in self.running if request.request_id not in self.in_flight]

    def schedule(self) -> SchedulerOutput:
        output = super().schedule()
        if not output.is_empty:  # the batch queue sends every batch that has work (batch_queue.py)
            self.num_batches_in_flight += 1
            for scheduled in output.scheduled:
                self.in_flight[scheduled.request_id] = output.step_id
        return output

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output):
        self.num_batches_in_flight -= 1
        return super().update_from_output(scheduler_output, model_runner_output)

    def _served(self, scheduler_output: SchedulerOutput, now: float):
        """As the plain scheduler's, less requests that left this batch while it was in flight (preempted,
        aborted), whose results it drops."""
        for scheduled, request in super()._served(scheduler_output, now):
            if self.in_flight.get(request.request_id) == scheduler_output.step_id:
                del self.in_flight[request.request_id]
                yield scheduled, request

    def _schedule_cached(self, request: Request, num_new_tokens: int, num_blocks_held: int) -> CachedRequestData:
        data = super()._schedule_cached(request, num_new_tokens, num_blocks_held)
        start = data.num_computed_tokens
        data.new_token_ids = request.all_token_ids[start:start + num_new_tokens]
        return data

    def _preempt(self, request: Request) -> None:
        self.in_flight.pop(request.request_id, None)  # its batch's token, when it comes, is dropped
        super()._preempt(request)

    def abort_requests(self, request_ids: list[str]):
        for request_id in request_ids:
            self.in_flight.pop(request_id, None)
        return super().abort_requests(request_ids)

    @property
    def has_unfinished_requests(self) -> bool:
        """Also while a batch is in flight: the engine steps until it is back, even if all its requests left."""
        return super().has_unfinished_requests or self.num_batches_in_flight > 0
