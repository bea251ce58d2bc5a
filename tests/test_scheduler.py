"""The scheduler's policy, checked without a model: tokens are 'sampled' by a fake."""

from tinyserve.engine.worker.model_runner import ModelRunnerOutput
from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256, **kw):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=kw.pop("prefix_caching", True))
    return Scheduler(kv, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                     max_model_len=max_model_len, **kw)


def make_request(request_id, prompt_len=5, priority=0, first_token=1, **params):
    params.setdefault("max_tokens", 4)
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(request_id, prompt, SamplingParams(**params), eos_token_ids=[EOS], arrival_time=0.0, priority=priority)


def step(scheduler, token=7):
    out = scheduler.schedule()
    sampled = {s.request_id: [token] for s in out.scheduled if s.samples_token}
    return out, scheduler.update_from_output(out, ModelRunnerOutput(sampled, {}))


def run_to_completion(scheduler, token=7, max_steps=500):
    finished = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests:
            return finished
        _, outputs = step(scheduler, token)
        finished.update({o.request_id: o for o in outputs if o.finished})
    raise AssertionError("requests did not finish")


def test_waiting_request_gets_its_whole_prompt_when_budget_allows():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=10))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_new_tokens, s.is_prefill, s.samples_token) for s in out.scheduled] == [("a", 10, True, True)]


def test_long_prompt_is_chunked_across_steps_and_samples_only_at_the_end():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    scheduler.add_request(make_request("a", prompt_len=10))
    chunks = []
    for _ in range(3):
        out, outputs = step(scheduler)
        chunks.append((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens, out.scheduled[0].samples_token))
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True)]


def test_running_requests_are_scheduled_before_waiting_ones():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", prompt_len=5))
    step(scheduler)
    scheduler.add_request(make_request("b", prompt_len=20))
    out = scheduler.schedule()
    assert [(s.request_id, s.num_new_tokens, s.is_prefill) for s in out.scheduled] == [("a", 1, False), ("b", 7, True)]


def test_seat_limit_holds_back_extra_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    for i in range(3):
        scheduler.add_request(make_request(str(i)))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["0", "1"]
    assert out.num_waiting == 1


def test_tight_pool_preempts_the_latest_request_and_everything_still_completes():
    # All three prompts fit (2 blocks each), but each grows to 3 blocks (5 prompt + 8 output):
    # 7 blocks cannot hold 9.
    scheduler = make_scheduler(num_blocks=7)
    for i in range(3):
        scheduler.add_request(make_request(str(i), first_token=10 * i + 1, max_tokens=8))
    preempted = []
    finished = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests:
            break
        out, outputs = step(scheduler)
        preempted += out.preempted_request_ids
        finished.update({o.request_id: o for o in outputs if o.finished})
    assert preempted and preempted[0] == "2"
    assert sorted(finished) == ["0", "1", "2"]
    assert all(len(o.times.preemption_times) == (preempted.count(r)) for r, o in finished.items())
    assert scheduler.kv.pool.num_free_blocks == 7
    scheduler.kv.pool.check_integrity()


def test_preempted_request_is_recomputed_with_its_output_tokens():
    scheduler = make_scheduler(num_blocks=7)
    for i in range(3):
        scheduler.add_request(make_request(str(i), first_token=10 * i + 1, max_tokens=8))
    for _ in range(200):
        out, _ = step(scheduler)
        if out.preempted_request_ids:
            victim = scheduler.requests[out.preempted_request_ids[0]]
            break
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    while True:
        out = scheduler.schedule()
        resumed = [s for s in out.scheduled if s.request_id == victim.request_id]
        if resumed:
            break
        scheduler.update_from_output(out, ModelRunnerOutput({s.request_id: [7] for s in out.scheduled if s.samples_token}, {}))
    # It comes back as a prefill of prompt + everything it had generated (its first
    # full block is still in the prefix cache, so that part is not recomputed).
    start, count = resumed[0].num_computed_tokens, resumed[0].num_new_tokens
    assert resumed[0].is_prefill and start == resumed[0].num_cached_tokens == 4
    assert victim.num_output_tokens > 0 and start + count == victim.num_tokens
    assert resumed[0].token_ids == victim.all_token_ids[start : start + count]


def test_a_preempted_request_coming_back_is_not_counted_again_in_prefix_cache_stats():
    scheduler = make_scheduler(num_blocks=7)
    for i in range(3):  # three different prompts: nothing to share
        scheduler.add_request(make_request(str(i), first_token=10 * i + 1, max_tokens=8))
    run_to_completion(scheduler)
    assert scheduler.num_preemptions > 0
    # Each request is counted once, at its first admission; the blocks a resumed one
    # finds are its own, freed by the preemption, and are not hits.
    assert (scheduler.kv.prefix_cache_queries, scheduler.kv.prefix_cache_hits) == (3 * 5, 0)


def test_stop_conditions():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", max_tokens=10))
    scheduler.add_request(make_request("ignore", max_tokens=3, ignore_eos=True))
    scheduler.add_request(make_request("min", max_tokens=10, min_tokens=2))
    finished = run_to_completion(scheduler, token=EOS)
    assert (finished["eos"].finish_reason, len(finished["eos"].new_token_ids)) == ("stop", 1)
    assert finished["eos"].stop_reason is None
    assert finished["ignore"].finish_reason == "length"
    assert finished["min"].finish_reason == "stop"
    assert finished["min"].times.token_times and len(finished["min"].times.token_times) == 2


def test_stop_token_id_is_reported_as_stop_reason():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", max_tokens=10, stop_token_ids=[7]))
    finished = run_to_completion(scheduler, token=7)
    assert (finished["a"].finish_reason, finished["a"].stop_reason) == ("stop", 7)


def test_a_stop_token_that_is_also_the_last_allowed_token_stops_rather_than_caps():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("eos", max_tokens=1))
    finished = run_to_completion(scheduler, token=EOS)
    assert (finished["eos"].finish_reason, finished["eos"].stop_reason) == ("stop", None)
    scheduler.add_request(make_request("stop-id", max_tokens=1, stop_token_ids=[7]))
    finished = run_to_completion(scheduler, token=7)
    assert (finished["stop-id"].finish_reason, finished["stop-id"].stop_reason) == ("stop", 7)


def test_a_further_eos_id_of_the_generation_config_is_named_as_stop_reason():
    scheduler = make_scheduler()
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=4), eos_token_ids=[EOS, 9],
                                  arrival_time=0.0))
    finished = run_to_completion(scheduler, token=9)
    assert (finished["a"].finish_reason, finished["a"].stop_reason) == ("stop", 9)


def test_max_model_len_caps_generation():
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("a", prompt_len=6, max_tokens=100))
    finished = run_to_completion(scheduler)
    assert finished["a"].finish_reason == "length"
    assert len(finished["a"].times.token_times) == 2


def test_abort_frees_blocks_whether_waiting_running_or_mid_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=4, max_num_seqs=2)
    scheduler.add_request(make_request("mid", prompt_len=10))
    scheduler.add_request(make_request("run", prompt_len=2, first_token=50))
    scheduler.add_request(make_request("wait", prompt_len=3, first_token=90))
    step(scheduler)
    outputs = scheduler.abort_requests(["mid", "run", "wait", "unknown"])
    assert sorted(o.request_id for o in outputs) == ["mid", "run", "wait"]
    assert all(o.finish_reason == "abort" for o in outputs)
    assert not scheduler.has_unfinished_requests
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.num_blocks
    scheduler.kv.pool.check_integrity()


def test_priority_policy_admits_lower_priority_value_first():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("late", priority=5))
    scheduler.add_request(make_request("urgent", priority=-1, first_token=40))
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["urgent"]


def test_prefix_cache_hit_is_recorded_on_the_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", prompt_len=10))
    run_to_completion(scheduler)
    scheduler.add_request(make_request("b", prompt_len=10))
    out = scheduler.schedule()
    assert out.scheduled[0].num_cached_tokens == 8
    assert out.scheduled[0].num_new_tokens == 2


def test_scheduler_outputs_alone_rebuild_every_block_table_and_token_list():
    """What the worker learns from SchedulerOutput (new requests in full, running ones as
    deltas, preempted and finished ids) matches the scheduler's own state after every step."""
    scheduler = make_scheduler(num_blocks=7, max_num_batched_tokens=6)
    for i in range(3):
        scheduler.add_request(make_request(str(i), first_token=10 * i + 1, max_tokens=8))
    block_tables, tokens, resumed_in_full = {}, {}, 0
    for token in range(100, 300):
        if not scheduler.has_unfinished_requests:
            break
        out = scheduler.schedule()
        for request_id in out.finished_request_ids:
            del block_tables[request_id], tokens[request_id]
        for request_id in out.preempted_request_ids:
            block_tables[request_id] = []
        for new in out.scheduled_new_requests:
            resumed_in_full += bool(new.output_token_ids)
            block_tables[new.request_id] = list(new.block_ids)
            tokens[new.request_id] = new.prompt_token_ids + new.output_token_ids
        for cached in out.scheduled_cached_requests:
            block_tables[cached.request_id] += cached.new_block_ids
        for request in scheduler.running:
            assert block_tables[request.request_id] == scheduler.kv.get_block_ids(request.request_id)
        sampled = {s.request_id: [token] for s in out.scheduled if s.samples_token}
        for request_id, token_ids in sampled.items():
            tokens[request_id] += token_ids
        scheduler.update_from_output(out, ModelRunnerOutput(sampled, {}))
        for request_id, request in scheduler.requests.items():
            assert tokens.get(request_id, request.all_token_ids) == request.all_token_ids
    assert not scheduler.has_unfinished_requests and resumed_in_full > 0
    out = scheduler.schedule()  # nothing to run: it only lists the requests the last step finished
    assert out.is_empty and sorted(out.finished_request_ids) == sorted(block_tables)
