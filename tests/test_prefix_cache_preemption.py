"""A block registered in the prefix cache for a step that never ran must not be hit later.

Under the priority policy the scheduler can give a running request its token for this
step, register the block that token fills, and then, further down the running list,
preempt that same request to make room for a more important one: its tokens are taken
back before the model runs, so the block's K/V is never written.

With today's running loop the unwritten block is always the victim's last, and so the
first taken again (blocks are freed tail first) by the request that needed room: the
second test below passes even without the fix. A victim scheduled earlier in the same
step must have left budget for the requests after it, so it took either one decode
token or the last chunk of its prompt; and in the step of that last chunk the requests
after it are new, and new requests never preempt. The first test guards the mechanism
itself, which must not rest on that ordering.
"""

from tinyserve.engine.worker.model_runner import ModelRunnerOutput
from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.sampling_params import SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, prompt: list[int], priority: int = 0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return Request(request_id, prompt, params, eos_token_ids=[], arrival_time=0.0, priority=priority)


def test_taking_back_a_steps_tokens_takes_its_blocks_out_of_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5, 6, 7])
    assert kv.allocate_slots(request, 7)  # the whole prompt: block 0 full, block 1 with 3 tokens
    request.num_computed_tokens = 7
    request.append_output_token(8, now=0.0)  # fills block 1 once the next step computes it
    assert kv.allocate_slots(request, 1)  # that step's allocation registers block 1 ...
    block_0, block_1 = kv.req_to_blocks["a"]
    assert block_1.block_hash is not None
    kv.free(request)  # ... but the step is taken back (num_computed_tokens still 7): preempted
    assert block_1.block_hash is None and block_0.block_hash is not None
    again = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(again)[1] == BLOCK_SIZE  # only the block whose K/V was written


def test_a_request_scheduled_then_preempted_in_the_same_step_leaves_no_unwritten_block_cached():
    kv = KVCacheManager(num_blocks=3, block_size=BLOCK_SIZE)
    scheduler = Scheduler(kv, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=64, policy="priority")
    low = make_request("low", [11, 12, 13, 14, 15, 16], priority=5)
    scheduler.add_request(low)
    first = scheduler.schedule()  # low's prompt: blocks 0 (full) and 1 (two tokens)
    scheduler.update_from_output(first, ModelRunnerOutput({"low": [17]}, {}))
    high = make_request("high", [21, 22, 23, 24], priority=0)
    scheduler.add_request(high)
    second = scheduler.schedule()  # low decodes position 6; high is admitted into the last free block
    scheduler.update_from_output(second, ModelRunnerOutput({"low": [18], "high": [25]}, {}))

    # Running in admission order: low gets position 7, which fills its block 1 (registered),
    # then high needs a new block, none is free, and the victim is low, already scheduled.
    third = scheduler.schedule()
    assert third.preempted_request_ids == ["low"] and [s.request_id for s in third.scheduled] == ["high"]
    assert low.status == RequestStatus.PREEMPTED
    lookalike = make_request("lookalike", [11, 12, 13, 14, 15, 16, 17, 18, 99])
    assert kv.get_computed_blocks(lookalike)[1] == BLOCK_SIZE  # block 0 only: block 1 was never written
    kv.pool.check_integrity()
