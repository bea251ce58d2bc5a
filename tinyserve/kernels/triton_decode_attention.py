"""Triton kernels: paged decode attention, one query token per sequence.

In a decode step each sequence brings one new query token, which attends to its
whole context in the paged cache. The work is memory-bound: every KV block is
read once per step, so the kernel is arranged so that it is read exactly once.

    grid = (num_seqs, num_kv_heads, NUM_KV_SPLITS)

    program (s, g, k):   the query heads g*G ... g*G+G-1 of sequence s (G = the
                         query heads sharing KV head g under GQA, padded to
                         BLOCK_H rows), against split k of the context:

        context of s:  | block 0 | block 1 | block 2 | block 3 | block 4 |
        splits:        |<----- split 0 ---->|<----- split 1 ---->|<- 2 ->|
                       each KV block is loaded once, for all G heads at once

A long context gives few programs (num_seqs * num_kv_heads) far too much work
each, so each context is cut into NUM_KV_SPLITS parts (split-K, "flash
decoding"), every sequence into parts of its own length, in whole KV blocks:

    blocks_per_split = cdiv(cdiv(seq_len, BLOCK_SIZE), NUM_KV_SPLITS)

so a short sequence spreads over the splits as a long one does, and the grid and
every constexpr depend only on the engine's configuration (the split count is
fixed when the backend is made, from max_model_len), never on the batch: no
recompilation mid-serving, and one CUDA graph per batch size serves every length.
Each split writes its own normalised partial output and the log of its softmax
denominator (LSE); a second kernel weighs the splits by their share of the
softmax mass:

    out = sum_k exp(lse_k - lse) * out_k,   lse = log(sum_k exp(lse_k))

A split past a sequence's last block (a sequence shorter than NUM_KV_SPLITS
blocks) stores lse = -inf and gets no weight. With one split the partial output
*is* the answer, and the reduction is skipped.

The walk over KV blocks (load through the block table, online softmax) is
shared with the other paged kernel, in triton_paged.py, and so is the choice of
dot (FP32_DOT: fp32 IEEE for an fp32 cache, the cache's half precision with fp32
accumulation otherwise).
"""

import torch
import triton
import triton.language as tl

from tinyserve.kernels.triton_paged import default_fp32_dot, dot, load_kv_block, online_softmax_update

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
    QUERIES_PER_KV: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    # --- The G query heads of this KV head, one row each: q is [BLOCK_H, BLOCK_D].
    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < QUERIES_PER_KV
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)

    # --- This split's range of logical blocks: this sequence's blocks cut into
    # NUM_KV_SPLITS parts (the last ones empty when it has fewer blocks than that).
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(num_blocks, NUM_KV_SPLITS)
    first_block = split * blocks_per_split
    end_block = tl.minimum(first_block + blocks_per_split, num_blocks)

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
            stride_cache_kv, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_SIZE, FP32_DOT,
        )
        # --- Scores of all G heads against the block's tokens: [BLOCK_H, BLOCK_SIZE].
        scores = dot(q, tl.trans(k), FP32_DOT) * scale
        scores = tl.where((positions < seq_len)[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v, FP32_DOT)

    # --- Normalise within the split and store it with its LSE. An empty split
    # (l_i = 0, m_i = -inf) stores zeros and lse = -inf: the reduction gives it no weight.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = m_i + tl.log(l_safe)
    out_ptrs = partial_out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + split * stride_out_split
    tl.store(out_ptrs + dims[None, :], out.to(partial_out_ptr.dtype.element_ty), mask=q_mask)
    num_heads = tl.num_programs(1) * QUERIES_PER_KV
    lse_ptrs = lse_ptr + (seq * num_heads + heads) * NUM_KV_SPLITS + split
    tl.store(lse_ptrs, lse, mask=row_mask)


@triton.jit
def reduce_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32, contiguous
    lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, contiguous
    stride_out_seq,
    stride_out_head,
    head_dim,
    NUM_KV_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (sequence, query head): combine its NUM_KV_SPLITS partials.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head

    splits = tl.arange(0, BLOCK_SPLITS)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < NUM_KV_SPLITS
    dim_mask = dims < head_dim

    # Each split's share of the softmax mass, exp(lse_k - lse). Split 0 is never
    # empty, so the max is finite and padded or empty splits get weight 0.
    lse = tl.load(lse_ptr + row * NUM_KV_SPLITS + splits, mask=split_mask, other=float("-inf"))
    weight = tl.exp(lse - tl.max(lse, axis=0))
    weight = weight / tl.sum(weight, axis=0)

    partial_mask = split_mask[:, None] & dim_mask[None, :]
    partial_ptrs = partial_out_ptr + (row * NUM_KV_SPLITS + splits[:, None]) * head_dim + dims[None, :]
    partial = tl.load(partial_ptrs, mask=partial_mask, other=0.0)
    out = tl.sum(weight[:, None] * partial, axis=0)
    out_ptrs = out_ptr + seq * stride_out_seq + head * stride_out_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def default_num_splits(max_model_len: int) -> int:
    """How many parts to cut every context into (1 = no split-K), fixed for an engine by its max_model_len."""
    return max(1, min(MAX_SPLITS, triton.cdiv(max_model_len, TOKENS_PER_SPLIT)))


def decode_partials(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    fp32_dot: bool,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the split kernel alone: (partial outputs, LSEs) of every split.

    partial outputs are [num_seqs, num_heads, num_splits, head_dim] fp32 (or `out` itself,
    [num_seqs, num_heads, head_dim], when there is one split and it is given); LSEs are
    [num_seqs, num_heads, num_splits], -inf for a split with no KV block.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    queries_per_kv = num_heads // num_kv_heads
    lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=query.device)
    if num_splits == 1 and out is not None:
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
        QUERIES_PER_KV=queries_per_kv,
        NUM_KV_SPLITS=num_splits,
        # tl.dot needs at least 16 rows; the padding rows are masked off.
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP32_DOT=fp32_dot,
    )
    return partial_out, lse


def paged_decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    fp32_dot: bool | None = None,
) -> None:
    """Fill out [num_seqs, num_heads, head_dim] with each sequence's one query attending its context.

    Every context is cut into num_splits parts of its own length (see the module docstring);
    fp32_dot defaults to default_fp32_dot(kv_cache.dtype).
    """
    if fp32_dot is None:
        fp32_dot = default_fp32_dot(kv_cache.dtype)
    # With one split each program already holds the final answer: it writes it to out.
    partial_out, lse = decode_partials(query, kv_cache, block_tables, seq_lens, scale, num_splits, fp32_dot, out)
    if num_splits > 1:
        num_seqs, num_heads, head_dim = query.shape
        reduce_splits_kernel[(num_seqs, num_heads)](
            out,
            partial_out,
            lse,
            out.stride(0),
            out.stride(1),
            head_dim,
            NUM_KV_SPLITS=num_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
