"""Preemption under the "priority" policy, checked without a model: tokens are 'sampled' by a fake.

When the KV pool cannot grow a running request, the scheduler preempts the
lowest-priority running request (the largest priority value), and among equals the
latest admitted; a victim that already got tokens earlier in the same step gives
them back, and one that is the request being grown leaves the others their tokens.
"""

from tinyserve.engine.worker.model_runner import ModelRunnerOutput
from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(num_blocks: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=False)
    return Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, policy="priority")


def make_request(request_id: str, prompt_len: int, priority: int, first_token: int) -> Request:
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(request_id, prompt, SamplingParams(max_tokens=8), eos_token_ids=[0], arrival_time=0.0,
                   priority=priority)


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    scheduler.update_from_output(out, ModelRunnerOutput({s.request_id: [7] for s in out.scheduled if s.samples_token}, {}))
    return out


def test_the_victim_is_the_lowest_priority_request_even_when_it_came_first_and_already_has_its_token():
    # "low" runs alone first (2 blocks, room to grow); then "high" (1 full block) and
    # "next" (1 block, room for one more token) join, and the pool of 4 is full. Next step
    # "low" decodes into its own block; then "high" needs a new block that is not there,
    # and "low", the largest priority value, is preempted although it came first, and gives
    # back the token it was given: with a budget of 2 tokens a step, "next", after "high"
    # in the list, still gets one.
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("low", prompt_len=5, priority=5, first_token=10))
    step(scheduler)
    scheduler.add_request(make_request("high", prompt_len=4, priority=0, first_token=40))
    scheduler.add_request(make_request("next", prompt_len=3, priority=0, first_token=70))
    step(scheduler)
    scheduler.max_num_batched_tokens = 2  # from this step on
    assert [r.request_id for r in scheduler.running] == ["low", "high", "next"]
    assert scheduler.kv.pool.num_free_blocks == 0

    out = scheduler.schedule()

    assert out.preempted_request_ids == ["low"]
    assert [(s.request_id, s.num_new_tokens) for s in out.scheduled] == [("high", 1), ("next", 1)]
    low = scheduler.requests["low"]
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert scheduler.waiting == [low] and scheduler.kv.get_block_ids("low") == []
    scheduler.kv.pool.check_integrity()


def test_among_equal_priorities_the_victim_is_the_latest_admitted():
    # Three requests of one block each fill the pool; "high" then needs a second block.
    # "early" and "late" share the lowest priority: the later one goes.
    scheduler = make_scheduler(num_blocks=3)
    scheduler.add_request(make_request("early", prompt_len=3, priority=5, first_token=10))
    scheduler.add_request(make_request("high", prompt_len=4, priority=0, first_token=40))
    scheduler.add_request(make_request("late", prompt_len=3, priority=5, first_token=70))
    step(scheduler)
    assert scheduler.kv.pool.num_free_blocks == 0

    out = scheduler.schedule()

    assert out.preempted_request_ids == ["late"]
    assert sorted((s.request_id, s.num_new_tokens) for s in out.scheduled) == [("early", 1), ("high", 1)]
    assert scheduler.requests["late"].status == RequestStatus.PREEMPTED
    scheduler.kv.pool.check_integrity()


def test_a_lowest_priority_request_that_cannot_grow_preempts_itself_and_those_after_it_still_run():
    # "low" runs alone first, then "high" joins; each holds 2 blocks, the pool of 4 is
    # full, and both reach a block edge in the same step. "low" is first in the running
    # list and itself the least important: it goes, and "high" still gets this step's token.
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("low", prompt_len=4, priority=5, first_token=10))
    step(scheduler)
    scheduler.add_request(make_request("high", prompt_len=5, priority=0, first_token=40))
    for _ in range(10):
        out = step(scheduler)
        if out.preempted_request_ids:
            break
    assert out.preempted_request_ids == ["low"]
    assert [(s.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled] == [("high", 8, 1)]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED


def test_a_preempted_low_priority_request_comes_back_and_finishes_after_the_high_priority_one():
    scheduler = make_scheduler(num_blocks=3)
    scheduler.add_request(make_request("low", prompt_len=5, priority=5, first_token=10))
    scheduler.add_request(make_request("high", prompt_len=4, priority=0, first_token=40))
    finished_order = []
    for _ in range(100):
        if not scheduler.has_unfinished_requests:
            break
        out = scheduler.schedule()
        outputs = scheduler.update_from_output(out, ModelRunnerOutput({s.request_id: [7] for s in out.scheduled if s.samples_token}, {}))
        finished_order += [o.request_id for o in outputs if o.finished]
    assert finished_order == ["high", "low"]
    assert scheduler.num_preemptions == 1
    assert scheduler.kv.pool.num_free_blocks == 3
