"""What the engine loop hands the span builder (engine_spans.py): plain records, no OpenTelemetry.

StepTimes is the step's clock, taken by EngineCore.step; StepSpanInput is everything one
step span is built from; TracedRequest is what a request's engine spans need from its
arrival, FinishedRequest what they need once it has finished.
"""

from dataclasses import dataclass, field

from tinyserve.lifecycle import schema


@dataclass(slots=True)
class RankTimes:
    """One tensor-parallel rank's share of a step: its forward pass and the time it waited in all-reduces.

    Under pipeline parallelism, one rank of one stage: `stage` is its stage, and recv_wait_s the part of
    [start, end) it spent waiting for the previous stage's hidden states (the first part)."""

    rank: int
    device: str
    start: float  # time.time()
    end: float
    all_reduce_s: float
    stage: int | None = None
    recv_wait_s: float = 0.0

    def attributes(self, ranks: list["RankTimes"]) -> dict:
        """Its execute span's: tensor parallelism's, and its pipeline stage's where it has one."""
        if self.stage is None:
            return {schema.TP_RANK: self.rank, schema.TP_SIZE: len(ranks), schema.TP_DEVICE: self.device,
                    schema.TP_ALL_REDUCE_TIME: self.all_reduce_s}
        stages = 1 + max(r.stage for r in ranks)
        tp_size = len(ranks) // stages
        return {schema.TP_RANK: self.rank % tp_size, schema.TP_SIZE: tp_size, schema.TP_DEVICE: self.device,
                schema.TP_ALL_REDUCE_TIME: self.all_reduce_s, schema.PP_STAGE: self.stage, schema.PP_SIZE: stages,
                schema.PP_RECV_WAIT_TIME: self.recv_wait_s}


@dataclass(slots=True)
class StepTimes:
    """When one engine step began, finished scheduling, finished executing, and ended (time.time())."""

    start: float
    scheduled: float
    executed: float
    end: float
    ranks: list[RankTimes] | None = None  # under tensor parallelism: every rank's execute, rank 0 first
    # On CPU: the forward pass's thread count in this step, and the process's CPU seconds during execute.
    cpu_threads: int | None = None
    execute_cpu_s: float | None = None
    # A layer's own stages inside execute, (span name, start, end, attributes): the image encoder's encode
    stages: list[tuple] = field(default_factory=list)


@dataclass(slots=True)
class StepSpanInput:
    """What the step span is built from: the step's SchedulerOutput, its clock and the engine's stats after it."""

    scheduler_output: object  # engine.core.scheduler_output.SchedulerOutput
    times: StepTimes
    stats: object  # wire.messages.SchedulerStats
    prefix_cache_hit_tokens: int
    finished_request_ids: list[str]
    released_request_ids: list[str]  # finished or aborted since the previous recorded step
    attributes: dict = field(default_factory=dict)  # from the recorder's step hooks (a layer's own: LoRA's adapters)


@dataclass(slots=True)
class TracedRequest:
    trace_context: dict[str, str]
    num_prompt_tokens: int
    queue_depth_at_arrival: int
    structured_output_kind: str | None = None  # json, regex, ...: the request is constrained
    seed: int | None = None  # the engine request's own seed (with n > 1: the parent's + the child's index)
    attributes: dict = field(default_factory=dict)  # for its queue span, from the recorder's request hooks


@dataclass(slots=True)
class FinishedRequest:
    request_id: str
    trace_context: dict[str, str]
    times: object  # wire.messages.RequestTimes
    finish_reason: str
    num_cached_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    queue_depth_at_arrival: int
    structured_output_kind: str | None = None
    seed: int | None = None
    attributes: dict = field(default_factory=dict)
    decode_attributes: dict = field(default_factory=dict)  # from layers beside the engine, for its decode span
    prefill_attributes: dict = field(default_factory=dict)  # ... and for its prefill span


def block_changes(scheduled: list) -> dict:
    """The step's block-table changes as three flat attributes (see schema.STEP_NEW_BLOCK_IDS)."""
    counts, ids, full = [], [], []
    for request in scheduled:
        new_ids = getattr(request, "block_ids", None)  # NewRequestData: the whole table
        full.append(new_ids is not None)
        new_ids = new_ids if new_ids is not None else request.new_block_ids
        counts.append(len(new_ids))
        ids += new_ids
    return {schema.STEP_NUM_NEW_BLOCK_IDS: counts, schema.STEP_NEW_BLOCK_IDS: ids, schema.STEP_BLOCK_TABLE_IS_FULL: full}
