"""The router's policies without a process: what each chooses, given the backends' state.

The loads come as the server writes them (entrypoints/api/load_reports.py's ORCA header);
the KV index is filled with events as a backend publishes them (kv_events/events.py).
"""

import asyncio

from tinyserve.entrypoints.api.load_reports import orca_header
from tinyserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tinyserve.lifecycle import schema
from tinyserve.router.backends import Backend
from tinyserve.router.kv_index import KVIndex
from tinyserve.router.policies import LeastLoad, RoundRobin, RoutedRequest
from tinyserve.router.prefix_aware import PrefixAware


class TokenIdsHasher:
    """A completion's prompt of token ids, hashed in blocks of 4 (the real hasher's block_hashes)."""

    def __init__(self) -> None:
        from tinyserve.router.prefix_hashes import PromptHasher

        self.block_size = 4
        self.block_hashes = lambda ids: PromptHasher.block_hashes(self, ids)

    def token_ids(self, path: str, body: dict) -> list[int]:
        return body["prompt"]


def choose(policy, backends, prompt=(1,)):
    request = RoutedRequest("/v1/completions", {"prompt": list(prompt)})
    choice = asyncio.run(policy.choose(request, backends))
    policy.forwarded(request, choice)
    return choice


def test_round_robin_takes_turns_and_least_load_reads_the_orca_report_and_its_own_in_flight():
    backends = [Backend("http://a", 0), Backend("http://b", 1)]
    policy = RoundRobin()
    assert [choose(policy, backends).backend.index for _ in range(4)] == [0, 1, 0, 1]
    backends[0].read_orca(orca_header("text", [("kv_cache_usage_perc", 0.5), ("num_requests_waiting", 3.0)]))
    backends[1].read_orca(orca_header("json", [("kv_cache_usage_perc", 0.1), ("num_requests_waiting", 1.0)]))
    assert (backends[0].num_requests_waiting, backends[1].kv_cache_usage_perc) == (3.0, 0.1)
    assert choose(LeastLoad(), backends).backend.index == 1
    backends[1].in_flight = 5  # the router's own requests there outweigh the other's queue
    assert choose(LeastLoad(), backends).backend.index == 0


def test_prefix_aware_follows_the_events_and_remembers_what_it_sent_until_they_arrive():
    backends = [Backend("http://a", 0), Backend("http://b", 1)]
    index = KVIndex(["tcp://a", "tcp://b"])
    policy = PrefixAware(backends, index, TokenIdsHasher())
    shared = list(range(100, 112))  # three blocks of 4
    hashes = policy.hasher.block_hashes(shared)
    first = choose(policy, backends, shared + [1])
    assert first.attributes[schema.ROUTER_CACHED_BLOCKS] == 0
    first.backend.routed += 1  # as the router counts it: an idle pair would otherwise take turns
    # Before its events arrive, the prefix's next request follows the first: pending.
    again = choose(policy, backends, shared + [2])
    assert again.backend is first.backend and again.attributes[schema.ROUTER_PENDING_BLOCKS] == 3
    other = 1 - first.backend.index
    # The events say the other backend holds two of the blocks now and the first one none (evicted).
    index.apply(other, KVEventBatch(0.0, [BlockStored(hashes[:2], None, shared[:8], 4, None, "CPU")]))
    index.apply(first.backend.index, KVEventBatch(0.0, [BlockStored(hashes, None, shared, 4, None, "CPU"),
                                                        BlockRemoved(hashes, "CPU")]))
    moved = choose(policy, backends, shared + [3])
    assert moved.backend.index == other and moved.attributes[schema.ROUTER_CACHED_BLOCKS] == 2
    # A match of under half the prompt (a header every prompt shares) is not followed: the least loaded takes it.
    backends[other].in_flight = 3
    header_only = choose(policy, backends, shared[:4] + list(range(500, 508)))
    assert header_only.backend.index == 1 - other and header_only.attributes[schema.ROUTER_CACHED_BLOCKS] == 0
    index.apply(other, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert not index.held[other]


def test_the_block_size_is_read_from_a_servers_metrics_as_it_writes_them():
    from tinyserve.config import EngineArgs
    from tinyserve.entrypoints.api.metrics import ServerMetrics
    from tinyserve.router.prefix_aware import block_size_in_metrics

    for prefix in ("vllm", "tinyserve"):
        metrics = ServerMetrics("tiny", [0], 4096, prefix=prefix)
        assert block_size_in_metrics(metrics.render().decode()) is None  # before the engines reported their pools
        metrics.record_cache_config(EngineArgs(block_size=32), [100])
        assert block_size_in_metrics(metrics.render().decode()) == 32


def test_the_kv_index_holds_at_most_its_bound_per_backend_dropping_the_oldest_stored():
    """A publisher that stores and never removes (20 M hashes took 1.6 GB unbounded): the index keeps the
    newest max_blocks, and a hash stored again counts as new."""
    index = KVIndex(["tcp://a"], max_blocks=1000)
    for start in range(0, 5000, 500):
        hashes = list(range(start, start + 500))
        index.apply(0, KVEventBatch(0.0, [BlockStored(hashes, None, [], 4, None, "CPU")]))
        if start == 4000:  # the oldest held, stored again: it outlives those stored after it once
            index.apply(0, KVEventBatch(0.0, [BlockStored([3500], None, [], 4, None, "CPU")]))
    assert len(index.held[0]) == 1000 and index.dropped[0] == 4000
    assert list(index.held[0]) == [*range(4001, 4500), 3500, *range(4500, 5000)]


def test_orca_values_that_are_not_finite_numbers_of_zero_or_more_leave_the_last_valid_load():
    backend = Backend("http://a", 0)
    backend.read_orca(orca_header("text", [("kv_cache_usage_perc", 0.5), ("num_requests_waiting", 3.0)]))
    for header in ("TEXT named_metrics.num_requests_waiting=-1, named_metrics.kv_cache_usage_perc=inf",
                   'JSON {"named_metrics": {"num_requests_waiting": "NaN", "kv_cache_usage_perc": true}}',
                   'JSON {"named_metrics": [1]}', "JSON " + "[" * 100_000, "TEXT named_metrics.num_requests_waiting=x"):
        backend.read_orca(header)
        assert (backend.num_requests_waiting, backend.kv_cache_usage_perc) == (3.0, 0.5), header
