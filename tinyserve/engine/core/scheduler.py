"""The scheduler: which requests run this step, and how many tokens each.

One step has a token budget (`max_num_batched_tokens`) and a seat limit
(`max_num_seqs`). The policy is two loops, as in vLLM v1:

1. Running requests first, in admission order. A decoding request needs one token;
   one still in its prompt gets the next chunk that fits the budget (chunked
   prefill). If the KV pool cannot hold the new tokens, the lowest-priority,
   latest-admitted running request is preempted: its blocks are freed and it goes
   back to the waiting queue, to be recomputed from scratch later.
2. Then waiting requests, in order (FCFS, or by priority), while the budget, the
   seats and the KV pool allow. A request's leading full blocks may already be in
   the prefix cache, and then only the rest is computed. No new request is
   admitted in a step that had to preempt: the pool is already too tight.

The result is a SchedulerOutput: a request from the first loop goes to the worker as
a delta (the worker holds it already), one from the second in full. After the model
ran, `update_from_output` appends the sampled tokens and decides which requests are
finished.

The module is over 300 lines because the policy and its bookkeeping (preemption, stops,
aborts, the output each request gets) read best side by side.
"""

import bisect
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from tinyserve.wire.messages import EngineCoreOutput, SchedulerStats

if TYPE_CHECKING:  # the worker's; the scheduler reads its fields only
    from tinyserve.engine.worker.model_runner import ModelRunnerOutput

SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class StepDraft:
    """The step as schedule() builds it: the budget left, and who got what so far."""

    token_budget: int
    cached: dict[str, CachedRequestData] = field(default_factory=dict)  # running requests: deltas, by id
    new: list[NewRequestData] = field(default_factory=list)  # admitted from the waiting queue: in full
    preempted: list[str] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.kv = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _queue_key
        self.running: list[Request] = []  # in admission order
        self._admission_order = itertools.count()
        self._queue_order: dict[str, int] = {}
        self._finished_since_last_step: list[str] = []
        self.step_id = 0
        self.num_preemptions = 0
        # Layers that limit which waiting requests may start (LoRA: lora/scheduling.py), each
        # gate(request, scheduler) -> bool; a request one refuses keeps its place and is passed over.
        self.admission_gates: list = []
        # Layers that limit how many tokens a request computes this step (images: multimodal/scheduling.py, the
        # encoder budget), each limit(request, start, num_new_tokens, scheduler) -> at most num_new_tokens;
        # a request limited to none gets nothing this step (a waiting one, and those after it, wait).
        self.token_limits: list = []

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self._queue_order[request.request_id] = next(self._admission_order)
        self._enqueue(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Finish the given requests now (unknown or already finished ids are ignored)."""
        outputs = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            outputs.append(self._output(request, []))
        return outputs

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def has_finished_requests(self) -> bool:
        """Requests finished since the last step, whose ids the worker has not been told yet."""
        return bool(self._finished_since_last_step)

    # ---- one step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """This step's requests and token counts: running requests first, then waiting ones."""
        self.step_id += 1
        step = StepDraft(token_budget=self.max_num_batched_tokens)
        self._schedule_running(step)
        if not step.preempted:  # a step that had to preempt has no blocks to spare for newcomers
            self._schedule_waiting(step)
        output = SchedulerOutput(
            step_id=self.step_id,
            scheduled_cached_requests=list(step.cached.values()),
            scheduled_new_requests=step.new,
            preempted_request_ids=step.preempted,
            finished_request_ids=self._finished_since_last_step,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_kv_blocks_used=self.kv.pool.num_used_blocks,
            num_kv_blocks_total=self.kv.num_blocks,
            token_budget=self.max_num_batched_tokens,
        )
        self._finished_since_last_step = []
        return output

    def _schedule_running(self, step: "StepDraft") -> None:
        """1. Running requests, in order: the next token (decode) or the next prompt chunk."""
        for request in self._running_candidates():
            if step.token_budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            # num_tokens_with_spec: the known tokens and any speculative drafts to verify (spec_decode/)
            num_new_tokens = self._limited(request, request.num_computed_tokens, min(
                request.num_tokens_with_spec - request.num_computed_tokens, step.token_budget))
            if num_new_tokens <= 0:
                continue
            num_blocks_held = len(self.kv.get_block_ids(request.request_id))  # the worker's block table
            if self._preempt_for(request, num_new_tokens, step):
                step.cached[request.request_id] = self._schedule_cached(request, num_new_tokens, num_blocks_held)
                step.token_budget -= num_new_tokens

    def _limited(self, request: Request, start: int, num_new_tokens: int) -> int:
        """The tokens from `start` the request may compute this step: what the budget leaves, then each layer's
        token_limits (none: all of them)."""
        for limit in self.token_limits:
            num_new_tokens = min(num_new_tokens, limit(request, start, num_new_tokens, self))
        return num_new_tokens

    def _running_candidates(self) -> list[Request]:
        """The running requests the first loop may schedule: all of them, except under pipeline parallelism
        those whose previous batch is still in flight (pipeline_parallel/scheduler.py)."""
        return list(self.running)

    def _preempt_for(self, request: Request, num_new_tokens: int, step: "StepDraft") -> bool:
        """Slots for the request's new tokens, preempting the least important running request until
        they fit. False if that was the request itself: it gets nothing this step.

        vLLM stops scheduling running requests when the request preempts itself; here the
        loop goes on, so those after it (more important, under the priority policy) still
        get this step's tokens.
        """
        while not self.kv.allocate_slots(request, num_new_tokens):
            victim = max(self.running, key=self._queue_key)
            self.running.remove(victim)
            if victim.request_id in step.cached:  # it already got tokens this step: take them back
                undone = step.cached.pop(victim.request_id)
                step.token_budget += undone.num_new_tokens
                # Back to what was computed before this step: freeing the blocks below reads it, and
                # takes out of the prefix cache a block this step registered but will not write.
                victim.num_computed_tokens = undone.num_computed_tokens
            self._preempt(victim)
            step.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _schedule_waiting(self, step: "StepDraft") -> None:
        """2. Waiting requests, while budget, seats and KV blocks allow; those whose grammar is still
        being compiled (structured outputs), or that an admission gate refuses, keep their place and wait."""
        position = 0
        while position < len(self.waiting) and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[position]
            if request.waiting_for_grammar or not all(gate(request, self) for gate in self.admission_gates):
                position += 1
                continue
            cached_blocks, num_cached = self._computed_blocks(request)
            num_new_tokens = self._limited(request, num_cached, min(request.num_tokens - num_cached, step.token_budget))
            if num_new_tokens <= 0 or not self.kv.allocate_slots(request, num_new_tokens, cached_blocks):
                break
            self.waiting.pop(position)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            if request.times.first_scheduled_time is None:
                request.times.first_scheduled_time = time.time()
            self.running.append(request)
            step.new.append(self._schedule_new(request, num_new_tokens))
            step.token_budget -= num_new_tokens

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: "ModelRunnerOutput") -> list[EngineCoreOutput]:
        """Append each request's new tokens, check stop conditions, and report what changed."""
        sampled_token_ids = model_runner_output.sampled_token_ids
        logprobs, prompt_logprobs = model_runner_output.logprobs, model_runner_output.prompt_logprobs
        now = time.time()
        outputs = []
        for scheduled, request in self._served(scheduler_output, now):
            if prompt_logprobs and request.request_id in prompt_logprobs:
                request.prompt_logprobs += prompt_logprobs[request.request_id]
            if not scheduled.samples_token:
                continue
            # One token; or, verifying speculative drafts, the accepted drafts and one more. A stop
            # (token, max_tokens, max_model_len) may come before the last of them: nothing after it is kept.
            new_token_ids = []
            for token_id in sampled_token_ids[request.request_id]:
                request.append_output_token(token_id, now)
                new_token_ids.append(token_id)
                status = self._check_stop(request)
                if status is not None:
                    self.running.remove(request)
                    self._finish(request, status)
                    break
            new_logprobs = logprobs[request.request_id][: len(new_token_ids)] \
                if logprobs and request.request_id in logprobs else None
            output = self._output(request, new_token_ids, new_logprobs)
            if request.sampling_params.prompt_logprobs is not None and request.num_output_tokens == 1:
                output.prompt_logprobs = request.prompt_logprobs  # complete once the first token is sampled
            outputs.append(output)
        return outputs

    def _served(self, scheduler_output: SchedulerOutput, now: float):
        """(scheduled, request) for each request the step served that is still live (one aborted while the step
        ran is not), its prefill chunk's time recorded."""
        for scheduled in scheduler_output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.is_finished:
                continue
            if scheduled.is_prefill:
                request.times.prefill_chunks.append((now, scheduled.num_new_tokens))
            yield scheduled, request

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_kv_blocks_used=self.kv.pool.num_used_blocks,
            num_kv_blocks_total=self.kv.num_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            step_id=self.step_id,
            num_waiting_deferred_reqs=sum(1 for request in self.waiting if request.waiting_for_grammar),
        )

    # ---- helpers -------------------------------------------------------------

    def _queue_key(self, request: Request) -> tuple[int, int]:
        """Smaller runs first: priority (if that policy is on), then admission order."""
        priority = request.priority if self.policy == "priority" else 0
        return priority, self._queue_order[request.request_id]

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self._queue_key)

    def _schedule_cached(self, request: Request, num_new_tokens: int, num_blocks_held: int) -> CachedRequestData:
        """A delta: the worker holds the request and its first num_blocks_held blocks already."""
        start, samples_token, is_prefill = self._advance(request, num_new_tokens)
        return CachedRequestData(
            request.request_id, start, num_new_tokens, samples_token, is_prefill,
            new_block_ids=self.kv.get_block_ids(request.request_id)[num_blocks_held:],
        )

    def _schedule_new(self, request: Request, num_new_tokens: int) -> NewRequestData:
        """In full: new to the worker, or resumed after a preemption (the block table it had is gone)."""
        start, samples_token, is_prefill = self._advance(request, num_new_tokens)
        return NewRequestData(
            request.request_id, start, num_new_tokens, samples_token, is_prefill,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_ids=request.eos_token_ids,
            block_ids=self.kv.get_block_ids(request.request_id),
            output_token_ids=list(request.output_token_ids),
            pooling_params=request.pooling_params,
            lora_request=request.lora_request,
            prompt_embeds=request.prompt_embeds, mm_features=request.mm_features,
        )

    @staticmethod
    def _advance(request: Request, num_new_tokens: int) -> tuple[int, bool, bool]:
        """Count this step's tokens as computed: (where they start, samples_token, is_prefill)."""
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new_tokens
        samples_token = request.num_computed_tokens == request.num_tokens
        # Decode = computing only the newest sampled token; anything else is (re)filling.
        is_decode = num_new_tokens == 1 and request.num_output_tokens > 0 and start == request.num_tokens - 1
        return start, samples_token, not is_decode

    def _computed_blocks(self, request: Request) -> tuple[list, int]:
        """What a waiting request starts with: its prefix-cache hits (blocks not yet in its table) and the
        tokens computed. A KV connector's scheduler adds the K/V that arrived from another engine."""
        return self.kv.get_computed_blocks(request)

    def _free_blocks(self, request: Request) -> None:
        """A finished request's blocks go back to the pool (a KV connector's may keep them while they are sent)."""
        self.kv.free(request)

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.times.preemption_times.append(time.time())
        self.num_preemptions += 1
        self._enqueue(request)

    def _check_stop(self, request: Request) -> RequestStatus | None:
        """As vLLM's check_stop: a stop token first (even the last one max_tokens allows), then length."""
        params = request.sampling_params
        last_token = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and last_token in request.stop_token_ids:
            # The model's EOS gives no stop_reason; any other stop token (from stop_token_ids,
            # or a further EOS id of generation_config.json) is named, as vLLM does.
            if params.ignore_eos or request.eos_token_ids[:1] != [last_token]:
                request.stop_reason = last_token
            return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len
        if request.num_tokens >= self.max_model_len or request.num_output_tokens >= max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.times.finished_time = time.time()
        self._free_blocks(request)
        del self.requests[request.request_id]
        del self._queue_order[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def _output(self, request: Request, new_token_ids: list[int], new_logprobs=None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            times=request.times if request.is_finished else None,
        )
