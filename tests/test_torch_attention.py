"""The PyTorch backend: its batched decode path equals the one-sequence-at-a-time definition."""

import pytest
import torch

from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.torch_attention import TorchAttentionBackend, length_groups, prefill_attention


def paged_batch(query_lens, seq_lens, *, num_heads=4, num_kv_heads=2, head_dim=24, block_size=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    # Stale finite values everywhere, as a used pool holds: padding must get weight 0.
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = torch.tensor([order.pop() for _ in range(count)])
    metadata = AttentionMetadata.from_lengths(query_lens, seq_lens, block_tables,
                                              torch.zeros(sum(query_lens), dtype=torch.int64))
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return query, kv_cache, metadata


def one_at_a_time(query, kv_cache, metadata, scale):
    starts = metadata.query_start_loc_cpu
    return torch.cat([
        prefill_attention(query[starts[i] : starts[i + 1]], kv_cache, metadata.block_tables[i], n, scale)
        for i, n in enumerate(metadata.seq_lens_cpu)
    ])


@pytest.mark.parametrize("num_kv_heads", [1, 2, 4])
def test_batched_decode_equals_the_definition(num_kv_heads):
    query, kv_cache, metadata = paged_batch([1] * 5, [1, 16, 17, 40, 63], num_kv_heads=num_kv_heads)
    assert metadata.is_decode_only
    out = TorchAttentionBackend().attention(query, kv_cache, metadata, 0.2)
    torch.testing.assert_close(out, one_at_a_time(query, kv_cache, metadata, 0.2), rtol=1e-5, atol=1e-5)


def test_mixed_batch_of_prefill_chunks_and_decodes_equals_the_definition():
    query, kv_cache, metadata = paged_batch([7, 1, 12, 1], [7, 30, 40, 5])
    out = TorchAttentionBackend().attention(query, kv_cache, metadata, 0.2)
    torch.testing.assert_close(out, one_at_a_time(query, kv_cache, metadata, 0.2), rtol=1e-5, atol=1e-5)


def test_prefill_after_a_cached_prefix_is_causal():
    # Queries 3..5 of a 6-token sequence: query j must not see keys after position 3 + j.
    query, kv_cache, metadata = paged_batch([3], [6])
    out = prefill_attention(query, kv_cache, metadata.block_tables[0], 6, 0.2)
    for j in range(3):
        changed = kv_cache.clone()
        changed[:, metadata.block_tables[0, 0].long(), 4 + j :] += 100.0  # alter only the future
        again = prefill_attention(query, changed, metadata.block_tables[0], 6, 0.2)
        torch.testing.assert_close(again[j], out[j])


def test_a_large_decode_batch_in_length_groups_equals_the_definition():
    # 37 sequences of scattered lengths: four length groups, the last one shorter.
    seq_lens = torch.randint(1, 300, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    query, kv_cache, metadata = paged_batch([1] * 37, seq_lens)
    out = TorchAttentionBackend().attention(query, kv_cache, metadata, 0.2)
    torch.testing.assert_close(out, one_at_a_time(query, kv_cache, metadata, 0.2), rtol=1e-5, atol=1e-5)


def test_many_decodes_between_prefill_chunks_equal_the_definition():
    query_lens = [1] * 10 + [9] + [1] * 10 + [20, 1]
    seq_lens = [5 + 13 * i for i in range(10)] + [9] + [200 - 7 * i for i in range(10)] + [50, 2]
    query, kv_cache, metadata = paged_batch(query_lens, seq_lens)
    out = TorchAttentionBackend().attention(query, kv_cache, metadata, 0.2)
    torch.testing.assert_close(out, one_at_a_time(query, kv_cache, metadata, 0.2), rtol=1e-5, atol=1e-5)


def test_bfloat16_decode_stays_close_to_the_float32_definition():
    seq_lens = torch.randint(1, 200, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    query, kv_cache, metadata = paged_batch([1] * 20, seq_lens)
    query, kv_cache = query.bfloat16(), kv_cache.bfloat16()
    out = TorchAttentionBackend().attention(query, kv_cache, metadata, 0.2)
    assert out.dtype == torch.bfloat16
    wants = one_at_a_time(query.float(), kv_cache.float(), metadata, 0.2)
    torch.testing.assert_close(out.float(), wants, rtol=1e-2, atol=1e-2)


def test_length_groups_cover_every_row_once_and_cut_the_padding():
    seq_lens = [300, 20, 150, 90] * 8 + [5, 7, 11]
    rows = [i for i in range(len(seq_lens)) if i != 4]  # any subset of the batch
    groups = length_groups(rows, seq_lens)
    assert sorted(row for group in groups for row in group) == rows
    assert 1 < len(groups) <= 4 and all(len(group) >= 8 for group in groups)
    longest = [max(seq_lens[i] for i in group) for group in groups]
    assert longest == sorted(longest)  # shortest group first, no overlap in length
    padded = sum(len(group) * top for group, top in zip(groups, longest))
    assert padded < 0.8 * len(rows) * max(seq_lens)
    assert length_groups([3, 1], seq_lens) == [[1, 3]]  # too few to split: one group
    assert length_groups([], seq_lens) == []


def test_one_backend_over_successive_steps_plans_each_step_once_and_anew():
    # The first layer of a step works out the step's plan; the others reuse it; the next
    # step (a new metadata, other lengths) gets its own.
    backend = TorchAttentionBackend()
    first = paged_batch([1] * 12, list(range(5, 125, 10)), seed=3)
    second = paged_batch([1] * 9 + [4], [3 + 20 * i for i in range(10)], seed=4)
    for query, kv_cache, metadata in (first, second, first):
        for _layer in range(2):
            out = backend.attention(query, kv_cache, metadata, 0.2)
            torch.testing.assert_close(out, one_at_a_time(query, kv_cache, metadata, 0.2), rtol=1e-5, atol=1e-5)
        plan = backend._plan
        backend.attention(query, kv_cache, metadata, 0.2)
        assert backend._plan is plan  # not rebuilt within the step
