"""One engine step, as its `tinyserve.step` span recorded it: the batch and the KV cache."""

from dataclasses import dataclass, field

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.otlp_json import Span
from tinyserve.trace_reading.timeline import engine_index_of

@dataclass(slots=True, eq=False)
class StepRecord:
    engine_index: int | None
    step_id: int | None
    start_ns: int
    end_ns: int
    request_ids: list[str]
    num_tokens_per_request: list[int]  # aligned with request_ids
    num_prefill_requests: int
    num_decode_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_tokens: int
    token_budget: int | None
    kv_blocks_used: int | None
    kv_blocks_free: int | None
    kv_blocks_total: int | None
    kv_usage: float | None  # fraction of the KV blocks in use, 0..1
    prefix_cache_hit_tokens: int | None
    num_waiting: int | None
    num_running: int | None
    preempted_request_ids: list[str]
    finished_request_ids: list[str]
    # The KV blocks each request gained (aligned with request_ids), and whether they are its
    # whole table; requests whose blocks were released before this step. Run.block_table reads them.
    new_block_ids: list[list[int]]
    block_table_is_full: list[bool]
    released_request_ids: list[str]
    schedule_s: float | None
    execute_s: float | None  # rank 0's, under tensor parallelism
    update_s: float | None
    span: Span = field(repr=False)
    # Speculative decoding: request id -> (drafts proposed, accepted) for the requests whose drafts this
    # step verified; and request id -> the KV blocks its rollback freed after the step (None: the run
    # did not record them, it was recorded before steps logged them)
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)
    rollback_freed_block_ids: dict[str, list[int]] | None = None
    # Under tensor parallelism, per rank: {"rank", "device", "execute_s", "all_reduce_s"}, by rank; under
    # pipeline parallelism also "stage", "start_ns", "end_ns" and "recv_wait_s", by stage then rank.
    ranks: list[dict] = field(default_factory=list)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    def to_record(self) -> dict:
        """A flat row (for a DataFrame): the per-request dicts of speculative decoding become the step's totals."""
        record = {name: getattr(self, name) for name in self.__dataclass_fields__
                  if name not in ("span", "drafts", "rollback_freed_block_ids")}
        record.update(duration_s=self.duration_s, num_requests=self.num_requests,
                      num_draft_tokens=sum(proposed for proposed, _ in self.drafts.values()),
                      num_accepted_tokens=sum(accepted for _, accepted in self.drafts.values()),
                      num_rollback_freed_blocks=None if self.rollback_freed_block_ids is None else
                      sum(map(len, self.rollback_freed_block_ids.values())))
        return record


def _stage_of(execute: Span) -> dict:
    """Under pipeline parallelism, a rank's stage, its clock and its wait for the previous stage."""
    a = execute.attributes
    if schema.PP_STAGE not in a:
        return {}
    return {"stage": a[schema.PP_STAGE], "start_ns": execute.start_ns, "end_ns": execute.end_ns,
            "recv_wait_s": a.get(schema.PP_RECV_WAIT_TIME, 0.0)}


def step_record_from_span(span: Span, children: list[Span]) -> StepRecord:
    a = span.attributes
    tokens = [int(t) for t in a.get(schema.STEP_TOKENS_PER_REQUEST, [])]
    spec_ids = [str(r) for r in a.get(schema.STEP_SPEC_REQUEST_IDS, [])]
    ranks = sorted(({"rank": c.attributes[schema.TP_RANK], "device": c.attributes.get(schema.TP_DEVICE),
                     "execute_s": c.duration_s, "all_reduce_s": c.attributes.get(schema.TP_ALL_REDUCE_TIME),
                     **_stage_of(c)}
                    for c in children if c.name == schema.EXECUTE and schema.TP_RANK in c.attributes),
                   key=lambda r: (r.get("stage", 0), r["rank"]))
    phases = {child.name: child.duration_s for child in children
              if child.attributes.get(schema.TP_RANK, 0) == 0 and child.attributes.get(schema.PP_STAGE, 0) == 0}
    return StepRecord(
        engine_index=engine_index_of(span),
        step_id=a.get(schema.STEP_ID),
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        request_ids=[str(r) for r in a.get(schema.STEP_REQUEST_IDS, [])],
        num_tokens_per_request=tokens,
        num_prefill_requests=a.get(schema.STEP_NUM_PREFILL_REQUESTS, 0),
        num_decode_requests=a.get(schema.STEP_NUM_DECODE_REQUESTS, 0),
        num_prefill_tokens=a.get(schema.STEP_NUM_PREFILL_TOKENS, 0),
        num_decode_tokens=a.get(schema.STEP_NUM_DECODE_TOKENS, 0),
        num_scheduled_tokens=a.get(schema.STEP_NUM_SCHEDULED_TOKENS, sum(tokens)),
        token_budget=a.get(schema.STEP_TOKEN_BUDGET),
        kv_blocks_used=a.get(schema.KV_BLOCKS_USED),
        kv_blocks_free=a.get(schema.KV_BLOCKS_FREE),
        kv_blocks_total=a.get(schema.KV_BLOCKS_TOTAL),
        kv_usage=a.get(schema.KV_USAGE),
        prefix_cache_hit_tokens=a.get(schema.PREFIX_CACHE_HIT_TOKENS),
        num_waiting=a.get(schema.NUM_WAITING),
        num_running=a.get(schema.NUM_RUNNING),
        preempted_request_ids=[str(r) for r in a.get(schema.STEP_PREEMPTED_REQUEST_IDS, [])],
        finished_request_ids=[str(r) for r in a.get(schema.STEP_FINISHED_REQUEST_IDS, [])],
        new_block_ids=_split(a.get(schema.STEP_NEW_BLOCK_IDS, []), a.get(schema.STEP_NUM_NEW_BLOCK_IDS, [])),
        block_table_is_full=[bool(f) for f in a.get(schema.STEP_BLOCK_TABLE_IS_FULL, [])],
        released_request_ids=[str(r) for r in a.get(schema.STEP_RELEASED_REQUEST_IDS, [])],
        schedule_s=phases.get(schema.SCHEDULE),
        execute_s=phases.get(schema.EXECUTE),
        update_s=phases.get(schema.UPDATE),
        ranks=ranks,
        span=span,
        drafts=dict(zip(spec_ids, zip((int(n) for n in a.get(schema.STEP_SPEC_NUM_PROPOSED, [])),
                                      (int(n) for n in a.get(schema.STEP_SPEC_NUM_ACCEPTED, [])))))
        if spec_ids else {},
        rollback_freed_block_ids=dict(zip(spec_ids, _split(a[schema.STEP_SPEC_FREED_BLOCK_IDS],
                                                           a[schema.STEP_SPEC_NUM_FREED_BLOCK_IDS])))
        if schema.STEP_SPEC_NUM_FREED_BLOCK_IDS in a else None,
    )


def _split(flat: list, counts: list) -> list[list[int]]:
    """[4, 9, 31], [2, 0, 1] → [[4, 9], [], [31]]."""
    result, start = [], 0
    for count in counts:
        result.append([int(i) for i in flat[start : start + int(count)]])
        start += int(count)
    return result
