"""The model runner of a speculative engine: verify this step's drafts, then propose the next ones.

The forward pass is the base runner's (engine/worker/model_runner.py), unchanged: a
request's drafts are fed after its newest token (CachedRequestState.token_ids reads them),
so one pass computes K/V and hidden states for all of them. What changes is `_outputs`:

    hidden rows of a request:  x   d1  d2  d3
    logits at each:            p0  p1  p2  p3      (the base runner takes p3's row only)
    verify (rejection_sampler.py)   ─► emitted: accepted drafts + one token
    roll back                       ─► the worker's block table drops blocks only rejected drafts reached
    propose (ngram_proposer.py / draft_model_proposer.py) ─► next step's drafts, in ModelRunnerOutput

The scheduler (spec_decode/scheduler.py) appends the emitted tokens, rolls back its own
count and blocks the same way, and schedules the drafts next step.
"""

import time

import torch

from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.engine.worker.model_runner import ModelInputs, ModelRunner, ModelRunnerOutput
from tinyserve.spec_decode.rejection_sampler import RejectionSampler
from tinyserve.utils import cdiv


class SpecDecodeModelRunner(ModelRunner):
    def __init__(self, model, *, make_proposer, num_speculative_tokens: int, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = kwargs.get("max_model_len", 2048)
        self.proposer = make_proposer(self)  # after the target's KV pool: the draft's is sized from it
        self.rejection_sampler = RejectionSampler(self.sampler)
        # The latest step's time verifying and proposing (the step span's); None for a step that ran no
        # forward pass (nothing scheduled: a step that only releases blocks), so no earlier step's time is told
        self.last_propose_s: float | None = None
        self.last_verify_s: float | None = None

    def warm_up(self) -> None:
        super().warm_up()
        self.proposer.warm_up()

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        self.last_propose_s = self.last_verify_s = None  # every step starts here, empty ones too
        super().update_states(scheduler_output)
        drafts = scheduler_output.scheduled_spec_decode_tokens
        for scheduled in scheduler_output.scheduled:
            self.requests[scheduled.request_id].spec_token_ids = list(drafts.get(scheduled.request_id, ()))
        self.proposer.update_states(scheduler_output)

    def _outputs(self, hidden: torch.Tensor, inputs: ModelInputs,
                 scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        started = time.perf_counter()
        sampled, logprobs = {}, {}
        request_ids = inputs.sampling_request_ids
        if request_ids:
            states = [self.requests[request_id] for request_id in request_ids]
            drafts = [state.spec_token_ids for state in states]
            # Each request's rows: after its newest token and after each draft (the last row is the base's).
            last_rows = inputs.logits_indices.tolist()
            rows = [row for last, d in zip(last_rows, drafts) for row in range(last - len(d), last + 1)]
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])
            emitted, token_logprobs = self.rejection_sampler(logits, states, drafts)
            scheduled = {s.request_id: s for s in scheduler_output.scheduled}
            for state, tokens, request_drafts, lps in zip(states, emitted, drafts, token_logprobs):
                state.output_token_ids += tokens  # the scheduler appends the same tokens (up to a stop)
                state.spec_token_ids = []
                step = scheduled[state.request_id]
                num_computed = step.num_computed_tokens + step.num_new_tokens - (len(request_drafts) - len(tokens) + 1)
                del state.block_ids[cdiv(num_computed, self.block_size):]  # as KVCacheManager.free_tail
                sampled[state.request_id] = tokens
                if lps is not None:
                    logprobs[state.request_id] = lps
        verified = time.perf_counter()
        spec_token_ids = self._propose(request_ids)
        self.last_verify_s, self.last_propose_s = verified - started, time.perf_counter() - verified
        prompt_logprobs = self._prompt_logprobs(hidden, scheduler_output)
        return ModelRunnerOutput(sampled, logprobs, prompt_logprobs, spec_token_ids=spec_token_ids)

    def _propose(self, request_ids: list[str]) -> dict[str, list[int]]:
        """Drafts for each request that sampled, no more than its max_tokens and max_model_len leave room for
        (a step emits its drafts and one more token)."""
        states = [self.requests[request_id] for request_id in request_ids]
        room = {}
        for state in states:
            max_tokens = state.sampling_params.max_tokens
            left = self.max_model_len - len(state.prompt_token_ids) - state.num_output_tokens - 1
            if max_tokens is not None:
                left = min(left, max_tokens - state.num_output_tokens - 1)
            room[state.request_id] = min(self.num_speculative_tokens, left)
        return self.proposer.propose(states, room) if states else {}
