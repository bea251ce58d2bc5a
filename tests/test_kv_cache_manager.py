"""The KV cache manager: block tables, reference counts, prefix caching, LRU eviction."""

import pytest

from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request
from tinyserve.sampling_params import SamplingParams


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, prompt, SamplingParams(max_tokens=4), eos_token_ids=[], arrival_time=0.0)


def admit(kv: KVCacheManager, request: Request) -> int:
    """Schedule the whole prompt as the scheduler would; returns the prefix-cache hit in tokens."""
    blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_allocation_rounds_up_to_whole_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    request = make_request("a", list(range(9)))
    admit(kv, request)
    assert len(kv.get_block_ids("a")) == 3
    assert kv.pool.num_free_blocks == 7


def test_allocation_fails_when_pool_is_too_small_and_takes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(9)))
    assert not kv.allocate_slots(request, 9)
    assert kv.pool.num_free_blocks == 2
    assert kv.get_block_ids("a") == []


def test_free_returns_every_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    requests = [make_request(str(i), list(range(i, i + 7))) for i in range(3)]
    for request in requests:
        admit(kv, request)
    for request in requests:
        kv.free(request)
    assert kv.pool.num_free_blocks == 8
    kv.pool.check_integrity()


def test_repeated_prompt_hits_prefix_cache_except_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    first = make_request("a", prompt)
    assert admit(kv, first) == 0
    first_blocks = kv.get_block_ids("a")
    kv.free(first)
    second = make_request("b", prompt)
    # The last block is not reused: one token must be recomputed to get logits.
    assert admit(kv, second) == 8
    assert kv.get_block_ids("b")[:2] == first_blocks[:2]
    assert kv.prefix_cache_hits == 8
    assert kv.prefix_cache_queries == 24


def test_a_prefix_equal_only_under_pythons_hash_is_not_a_hit():
    # In CPython hash(0) == hash(2**61 - 1), so chaining blocks by hash() would give these
    # two first blocks the same chain value, and the second request below would take
    # the first one's second block: K/V computed after another prefix.
    assert hash(0) == hash(2**61 - 1)
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("first", [0, 1, 2, 3, 4, 5, 6, 7, 8])
    admit(kv, first)
    own_prefix = make_request("own-prefix", [2**61 - 1, 1, 2, 3, 9])  # caches its first block only
    admit(kv, own_prefix)
    second = make_request("second", [2**61 - 1, 1, 2, 3, 4, 5, 6, 7, 8])
    assert admit(kv, second) == 4  # its own first block, not first's second block
    assert kv.get_block_ids("second")[1] != kv.get_block_ids("first")[1]


def test_shared_prefix_blocks_are_shared_with_reference_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    b = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43])
    admit(kv, a)
    assert admit(kv, b) == 8
    shared = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in shared)
    kv.free(a)
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in shared)
    kv.free(b)
    kv.pool.check_integrity()
    assert kv.pool.num_free_blocks == 16


def test_different_prefix_before_equal_block_is_not_a_hit():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert admit(kv, make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_least_recently_freed_cached_block_is_evicted_first():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    old = make_request("old", [1, 1, 1, 1, 1])
    new = make_request("new", [2, 2, 2, 2, 2])
    admit(kv, old)
    kv.free(old)
    admit(kv, new)
    kv.free(new)
    # Two fresh blocks needed: the two blocks freed longest ago go first,
    # and among them old's cached block is the oldest.
    filler = make_request("filler", [9] * 8)
    admit(kv, filler)
    kv.free(filler)
    assert admit(kv, make_request("new2", [2, 2, 2, 2, 2])) == 4
    assert admit(kv, make_request("old2", [1, 1, 1, 1, 1])) == 0


def test_cache_disabled_never_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    prompt = list(range(12))
    first = make_request("a", prompt)
    admit(kv, first)
    kv.free(first)
    assert admit(kv, make_request("b", prompt)) == 0


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(9)))
    admit(kv, request)
    assert not kv.reset_prefix_cache()
    kv.free(request)
    assert kv.reset_prefix_cache()
    assert kv.pool.cached_blocks == {}
    assert admit(kv, make_request("b", list(range(9)))) == 0


def test_invalid_pool_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        KVCacheManager(num_blocks=0, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
