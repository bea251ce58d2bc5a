"""SchedulerOutput: the record of everything one engine step decided.

The model runner executes it; the step span shows it. Nothing about a step is
decided anywhere else.
"""

from dataclasses import dataclass, field


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of the step: compute K/V for tokens [num_computed_tokens, +num_new_tokens)."""

    request_id: str
    num_computed_tokens: int
    num_new_tokens: int
    token_ids: list[int]  # the num_new_tokens token ids to feed the model
    block_ids: list[int]  # the request's whole block table
    samples_token: bool  # True when this step reaches the end of the known tokens
    is_prefill: bool  # still inside its prompt (or recomputing after preemption)
    num_cached_tokens: int = 0  # prefix-cache hit when scheduled for the first time this step


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)  # since the previous step
    num_waiting: int = 0
    num_running: int = 0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    token_budget: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled if r.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled if not r.is_prefill)

    @property
    def num_prefill_requests(self) -> int:
        return sum(1 for r in self.scheduled if r.is_prefill)

    @property
    def num_decode_requests(self) -> int:
        return sum(1 for r in self.scheduled if not r.is_prefill)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
