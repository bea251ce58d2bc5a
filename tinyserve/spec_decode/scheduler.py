"""The scheduler of a speculative engine: the base policy, with each decoding request's drafts counted.

The two loops are the base Scheduler's (engine/core/scheduler.py), unchanged: a running
request asks for `num_tokens_with_spec - num_computed_tokens` tokens, which is its newest
token plus its drafts, and the budget and KV slots are taken for all of them (the budget
may cut drafts off). Three helpers change:

    _schedule_cached    the drafts that fit go to the worker in scheduled_spec_decode_tokens
    update_from_output  rejected drafts are taken back before the new tokens are appended:
                        num_computed_tokens rolls back, the blocks only they reached are freed (named in last_freed),
                        the counters (SpecDecodingStats) count; the worker's new drafts are kept
    _preempt            a preempted request's drafts are dropped (it is recomputed first)

    step s:   x d1 d2 d3 scheduled (4 tokens, 4 slots)   computed 10 → 14
    verified: d1 d2 accepted, d3 rejected, t emitted      computed 14 → 13, tokens += d1 d2 t
"""

from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.engine.core.scheduler_output import CachedRequestData, SchedulerOutput
from tinyserve.wire.messages import EngineCoreOutput, SchedulerStats, SpecDecodingStats


class SpecDecodeScheduler(Scheduler):
    def __init__(self, *args, num_speculative_tokens: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.spec_stats = SpecDecodingStats(num_spec_tokens=num_speculative_tokens,
                                            num_accepted_tokens_per_pos=[0] * num_speculative_tokens)
        self._step_drafts: dict[str, list[int]] = {}
        # request id -> [proposed, accepted] in the last step (the step span's, spec_decode/layer.py)
        self.last_verified: dict[str, tuple[int, int]] = {}
        # request id -> the KV blocks its rollback freed in the last step (only rejected drafts reached them),
        # for each request in last_verified: what the step span records so block tables can be rebuilt
        self.last_freed: dict[str, list[int]] = {}
        # request id -> [proposed, accepted] over its life; moved to finished_totals as it finishes, where
        # the decode span's hook reads it (kept until the next update or abort)
        self.request_totals: dict[str, list[int]] = {}
        self.finished_totals: dict[str, list[int]] = {}

    def schedule(self) -> SchedulerOutput:
        self._step_drafts = {}
        output = super().schedule()
        output.scheduled_spec_decode_tokens = {
            cached.request_id: self._step_drafts[cached.request_id]
            for cached in output.scheduled_cached_requests if cached.request_id in self._step_drafts
        }
        return output

    def _schedule_cached(self, request: Request, num_new_tokens: int, num_blocks_held: int) -> CachedRequestData:
        """The base delta for the known tokens, then the drafts that fit the tokens given."""
        num_spec = max(0, request.num_computed_tokens + num_new_tokens - request.num_tokens)
        scheduled = super()._schedule_cached(request, num_new_tokens - num_spec, num_blocks_held)
        if num_spec:
            scheduled.num_new_tokens += num_spec
            request.num_computed_tokens += num_spec
            self._step_drafts[request.request_id] = request.spec_token_ids[:num_spec]
        return scheduled

    def _preempt(self, request: Request) -> None:
        request.spec_token_ids = []
        super()._preempt(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        self.finished_totals = {}
        return super().abort_requests(request_ids)

    def _finish(self, request: Request, status) -> None:
        self.finished_totals[request.request_id] = self.request_totals.pop(request.request_id, [0, 0])
        super()._finish(request, status)

    def update_from_output(self, scheduler_output: SchedulerOutput, model_runner_output) -> list[EngineCoreOutput]:
        self.last_verified, self.last_freed, self.finished_totals = {}, {}, {}
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.is_finished:  # aborted while the step ran
                continue
            num_accepted = len(model_runner_output.sampled_token_ids[request_id]) - 1
            request.num_computed_tokens -= len(drafts) - num_accepted
            self.last_freed[request_id] = self.kv.free_tail(request)
            self._count(len(drafts), num_accepted)
            totals = self.request_totals.setdefault(request_id, [0, 0])
            totals[0] += len(drafts)
            totals[1] += num_accepted
            self.last_verified[request_id] = (len(drafts), num_accepted)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is not None and not request.is_finished and scheduled.samples_token:
                request.spec_token_ids = model_runner_output.spec_token_ids.get(scheduled.request_id, [])
        return outputs

    def _count(self, num_drafts: int, num_accepted: int) -> None:
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            stats.num_accepted_tokens_per_pos[position] += 1

    def make_stats(self) -> SchedulerStats:
        stats = super().make_stats()
        spec = self.spec_stats
        stats.spec_decoding_stats = SpecDecodingStats(spec.num_spec_tokens, spec.num_drafts, spec.num_draft_tokens,
                                                      spec.num_accepted_tokens, list(spec.num_accepted_tokens_per_pos))
        return stats
