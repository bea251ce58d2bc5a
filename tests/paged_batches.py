"""Paged attention batches poisoned with NaN, the reference they are checked against, and the kernel cases
(a helper module, not tests: tests/test_triton_kernels.py and benchmarks/gpu_check.py share them;
it needs no pytest, which a GPU machine may not have).

A batch catches a kernel that reads or writes where it should not: block tables are
shuffled, non-contiguous block ids; block 0 is never allocated (block tables are padded
with it) and, like every cache slot no sequence owns, it holds NaN, so one unmasked
read turns the output into NaN. run_*_kernel fill the output with NaN before the kernel
runs, so every element must be written.
"""

from dataclasses import dataclass

import torch

from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.torch_attention import prefill_attention
from tinyserve.kernels.triton_decode_attention import paged_decode_attention
from tinyserve.kernels.triton_prefill_attention import paged_prefill_attention

TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
}


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata
    scale: float


def make_paged_batch(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    seed: int,
    num_kv_heads: int = 2,
    queries_per_kv: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
) -> PagedBatch:
    """A batch whose sequences' whole contexts (cached prefix and this step's tokens) are in the cache."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 2  # block 0 (the padding id) and two spare blocks
    free_blocks = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)
    slot_mapping = []
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        block_tables[i, : blocks_per_seq[i]] = torch.tensor([free_blocks.pop() for _ in range(blocks_per_seq[i])])
        positions = torch.arange(seq_len)
        seq_slots = block_tables[i, positions // block_size].long() * block_size + positions % block_size
        slots[:, seq_slots] = torch.randn(2, seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slot_mapping.append(seq_slots[seq_len - query_len :])
    num_heads = num_kv_heads * queries_per_kv
    metadata = AttentionMetadata.from_lengths(query_lens, seq_lens, block_tables, torch.cat(slot_mapping))
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(query, kv_cache, metadata, scale=head_dim**-0.5)


def reference_attention(batch: PagedBatch) -> torch.Tensor:
    """The definition, one sequence at a time: it reads nothing past a sequence's length,
    so the NaN poison in unused slots cannot reach it."""
    meta = batch.metadata
    starts = meta.query_start_loc_cpu
    return torch.cat([
        prefill_attention(batch.query[starts[i] : starts[i + 1]], batch.kv_cache, meta.block_tables[i], seq_len,
                          batch.scale)
        for i, seq_len in enumerate(meta.seq_lens_cpu)
    ])


def run_decode_kernel(batch: PagedBatch, num_splits: int = 1, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    meta = batch.metadata
    paged_decode_attention(
        out, batch.query, batch.kv_cache, meta.block_tables, meta.seq_lens, batch.scale, num_splits, **kwargs
    )
    return out


def run_prefill_kernel(batch: PagedBatch, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    meta = batch.metadata
    paged_prefill_attention(
        out,
        batch.query,
        batch.kv_cache,
        meta.block_tables,
        meta.query_start_loc,
        meta.seq_lens,
        batch.scale,
        meta.max_query_len,
        **kwargs,
    )
    return out


def case_id(case: tuple) -> str:
    """gqa2-d128-bs32-bfloat16 for the case (2, 128, 32, torch.bfloat16)."""
    queries_per_kv, head_dim, block_size, dtype = case
    return f"gqa{queries_per_kv}-d{head_dim}-bs{block_size}-{str(dtype).removeprefix('torch.')}"


# Every GQA ratio x head dim x block size in fp32; the half-precision dtypes on a
# spread of them (the interpreter is too slow to pay for the full product twice more).
# (queries_per_kv, head_dim, block_size, dtype) tuples.
KERNEL_CASES = [
    (queries_per_kv, head_dim, block_size, torch.float32)
    for queries_per_kv in (1, 2, 4)
    for head_dim in (48, 64, 128)
    for block_size in (16, 32)
] + [
    (1, 64, 32, torch.bfloat16),
    (2, 128, 32, torch.bfloat16),
    (4, 48, 16, torch.bfloat16),
    (2, 48, 16, torch.float16),
]
