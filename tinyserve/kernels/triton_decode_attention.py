"""Triton kernels: paged decode attention, one query token per sequence.

In a decode step each sequence brings one new query token, which attends to its
whole context in the paged cache. The work is memory-bound: every KV block is
read once per step, so the kernel is arranged so that it is read exactly once.

    grid = (num_seqs, num_kv_heads, num_splits)

    program (s, g, k):   the query heads g*G ... g*G+G-1 of sequence s (G = the
                         query heads sharing KV head g under GQA, padded to
                         BLOCK_H rows), against split k of the context:

        context of s:  | block 0 | block 1 | block 2 | block 3 | block 4 |
        splits:        |<----- split 0 ---->|<----- split 1 ---->|<- 2 ->|
                       each KV block is loaded once, for all G heads at once

A long context gives few programs (num_seqs * num_kv_heads) far too much work
each, so the context can be cut into num_splits parts (split-K, "flash
decoding"). Each split writes its own normalised partial output and the log of
its softmax denominator (LSE); a second kernel weighs the splits by their
share of the softmax mass:

    out = sum_k exp(lse_k - lse) * out_k,   lse = log(sum_k exp(lse_k))

With one split the partial output *is* the answer, and the reduction is skipped.

The walk over KV blocks (load through the block table, online softmax) is
shared with the other paged kernel, in triton_paged.py. All arithmetic is fp32
whatever the cache dtype, at the price of half-precision tensor cores.
"""

import torch
import triton
import triton.language as tl

from tinyserve.kernels.triton_paged import load_kv_block, online_softmax_update

# A split is worth its extra pass once a program would otherwise walk more than
# this many tokens; past MAX_SPLITS the extra parallelism no longer pays.
TOKENS_PER_SPLIT = 512
MAX_SPLITS = 16


@triton.jit
def paged_decode_kernel(
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim]
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, contiguous
    query_ptr,  # [num_seqs, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [num_seqs]
    scale,
    stride_q_seq,
    stride_q_head,
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_table,
    head_dim,
    blocks_per_split,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # --- The G query heads of this KV head, one row each: q is [BLOCK_H, BLOCK_D].
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < QUERIES_PER_KV
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float32)

    # --- This split's range of logical blocks (may be empty for a short sequence).
    first_block = split * blocks_per_split
    end_block = tl.minimum(first_block + blocks_per_split, tl.cdiv(seq_len, BLOCK_SIZE))

    # Online softmax state per query head: running max m_i, denominator l_i, and the
    # un-normalised output acc = sum_j exp(s_j - m_i) * v_j.
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    block_table_ptr = block_tables_ptr + seq * stride_block_table
    for logical_block in range(first_block, end_block):
        # --- One KV block through the block table, loaded once for all G heads.
        k, v, positions = load_kv_block(
            kv_cache_ptr, block_table_ptr, logical_block, seq_len, kv_head, dims, dim_mask,
            stride_cache_kv, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_SIZE,
        )
        # --- Scores of all G heads against the block's tokens: [BLOCK_H, BLOCK_SIZE].
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        scores = tl.where((positions < seq_len)[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v)

    # --- Normalise within the split and store it with its LSE. An empty split
    # (l_i = 0, m_i = -inf) stores zeros and lse = -inf: the reduction gives it no weight.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = m_i + tl.log(l_safe)
    out_ptrs = partial_out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + split * stride_out_split
    tl.store(out_ptrs + dims[None, :], out.to(partial_out_ptr.dtype.element_ty), mask=q_mask)
    num_heads = tl.num_programs(1) * QUERIES_PER_KV
    lse_ptrs = lse_ptr + (seq * num_heads + heads) * num_splits + split
    tl.store(lse_ptrs, lse, mask=row_mask)


@triton.jit
def reduce_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, contiguous
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, contiguous
    stride_out_seq,
    stride_out_head,
    head_dim,
    num_splits,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head): combine its num_splits partials.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head

    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    dim_mask = dims < head_dim

    # Each split's share of the softmax mass, exp(lse_k - lse). Split 0 is never
    # empty, so the max is finite and padded or empty splits get weight 0.
    lse = tl.load(lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))
    weight = weight / tl.sum(weight, axis=0)

    partial_mask = split_mask[:, None] & dim_mask[None, :]
    partial_ptrs = partial_out_ptr + (row * num_splits + splits[:, None]) * head_dim + dims[None, :]
    partial = tl.load(partial_ptrs, mask=partial_mask, other=0.0)
    out = tl.sum(weight[:, None] * partial, axis=0)
    out_ptrs = out_ptr + seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def default_num_splits(max_seq_len: int) -> int:
    """How many parts to cut the longest context into (1 = no split-K)."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_seq_len, TOKENS_PER_SPLIT)))


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
) -> None:
    """Fill out [num_seqs, num_heads, head_dim] with each sequence's one query attending its context.

    num_splits defaults to default_num_splits(max_seq_len); the same split length
    (a whole number of KV blocks) is used for every sequence in the batch.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    num_splits = num_splits or default_num_splits(max_seq_len)
    blocks_per_split = triton.cdiv(triton.cdiv(max_seq_len, block_size), num_splits)
    block_d = triton.next_power_of_2(head_dim)

    # With one split each program already holds the final answer: write it to out.
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    if num_splits == 1:
        partial_out, stride_out_split = out, 0
    else:
        partial_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device)
        stride_out_split = partial_out.stride(2)

    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_out,
        lse,
        query,
        kv_cache,
        block_tables,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        stride_out_split,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        head_dim,
        blocks_per_split,
        QUERIES_PER_KV=queries_per_kv,
        # tl.dot needs at least 16 rows; the padding rows are masked off.
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size,
        BLOCK_D=block_d,
    )
    if num_splits > 1:
        reduce_splits_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            lse,
            out.stride(0),
            out.stride(1),
            head_dim,
            num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
