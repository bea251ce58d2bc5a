"""Triton kernel: causal prefill attention over the paged KV cache (varlen).

The batch is flat: sequence s owns the query rows query_start_loc[s] ...
query_start_loc[s+1] - 1, and those queries are its *last* query_len positions.
The context before them (an earlier chunk of a chunked prefill, or a prefix-
cache hit) is already in the cache, and so is this step's own K/V (written by
store_kv first), so every key is read through the block table.

    grid = (num_seqs, num_heads, cdiv(max_query_len, BLOCK_M))

    program (s, h, t):   query tile t (BLOCK_M query rows) of sequence s, head h,
                         flash-attention style: walk the KV blocks one at a time
                         with an online softmax, never materialising the scores.

        positions:   0 ............ context_len ........................ seq_len
        keys:        |  cached context  |   this step's tokens (queries)    |
        query tile t:                       |<-- BLOCK_M rows -->|
        keys read:   |<------------- blocks up to the tile's last row ->|

Query row i sits at position context_len + i and sees keys 0 .. that position
(causal). The query heads sharing a KV head under GQA are separate programs;
each rereads the KV block, which then comes from L2. A one-token query (decode)
is just a tile with one valid row, so mixed batches of prefills and decodes run
through this one kernel.

The walk over KV blocks (load through the block table, online softmax) is
shared with the other paged kernel, in triton_paged.py, and so is the choice of
dot (FP32_DOT: fp32 IEEE for an fp32 cache, the cache's half precision with fp32
accumulation otherwise). A program runs on 8 warps: at head_dim 128 a 64-row tile
of fp32 scores and accumulator does not fit 4 warps' registers and spills.
"""

import torch
import triton
import triton.language as tl

from tinyserve.kernels.triton_paged import default_fp32_dot, dot, load_kv_block, online_softmax_update


@triton.jit
def paged_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    scale,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_block_table,
    head_dim,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    kv_head = head // QUERIES_PER_KV

    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    # The grid is sized for the longest query; shorter ones have no tile t.
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # --- This tile's query rows: q is [BLOCK_M, BLOCK_D], rows past query_len masked.
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < query_len
    dim_mask = dims < head_dim
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q_offsets = (query_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)
    if FP32_DOT:
        q = q.to(tl.float32)
    q_positions = context_len + rows

    # Online softmax state per query row: running max m_i, denominator l_i, and
    # the un-normalised output acc = sum_j exp(s_j - m_i) * v_j.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Causality: no row of this tile sees past its last row's position.
    kv_end = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    block_table_ptr = block_tables_ptr + seq * stride_block_table
    for logical_block in range(0, tl.cdiv(kv_end, BLOCK_SIZE)):
        k, v, k_positions = load_kv_block(
            kv_cache_ptr, block_table_ptr, logical_block, seq_len, kv_head, dims, dim_mask,
            stride_cache_kv, stride_cache_block, stride_cache_offset, stride_cache_head, BLOCK_SIZE, FP32_DOT,
        )
        # --- Scores [BLOCK_M, BLOCK_SIZE], with the causal mask. Key 0 is visible to
        # every row, so after the first block each row's max is finite and a row
        # whose keys are all masked in a later block just gets p = 0 there.
        scores = dot(q, tl.trans(k), FP32_DOT) * scale
        visible = (k_positions[None, :] <= q_positions[:, None]) & (k_positions < seq_len)[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_update(m_i, l_i, acc, scores, v, FP32_DOT)

    out = acc / l_i[:, None]
    out_offsets = (query_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    block_m: int = 64,
    fp32_dot: bool | None = None,
    num_warps: int = 8,
) -> None:
    """Fill out [num_tokens, num_heads, head_dim] with causal attention of each sequence's queries.

    block_m is the number of query rows per program (a power of two, >= 16); fp32_dot
    defaults to default_fp32_dot(kv_cache.dtype).
    """
    if fp32_dot is None:
        fp32_dot = default_fp32_dot(kv_cache.dtype)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = seq_lens.shape[0]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    paged_prefill_kernel[grid](
        out,
        query,
        kv_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_tables.stride(0),
        head_dim,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        BLOCK_M=block_m,
        BLOCK_SIZE=block_size,
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP32_DOT=fp32_dot,
        num_warps=num_warps,
    )
