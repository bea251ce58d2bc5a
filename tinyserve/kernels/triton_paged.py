"""Triton building blocks shared by the paged attention kernels.

Both the decode and the prefill kernel walk a sequence's context one KV block at
a time: look the block up in the sequence's block table, load its keys and
values, score the queries against them, and fold the scores into an online
softmax. These two functions are that walk's body; the kernels differ only in
which queries they hold and which scores they mask.

Two ways to multiply, chosen by the constexpr FP32_DOT:

    FP32_DOT=True    K/V upcast to fp32, dots in IEEE fp32 (not TF32), on the FP32 units:
                     an fp32 cache then equals the reference to 1e-5.
    FP32_DOT=False   operands stay in the cache's dtype (bf16/fp16 tensor cores), the
                     products accumulated in fp32; the softmax weights p are cast down
                     to the cache's dtype for p @ V, as FlashAttention does.

A half-precision cache on a GPU takes the second: the first runs about four times
the instructions per KV block and leaves decode compute-bound. Triton's CPU
interpreter gets bf16 dots wrong, so under it the first is the default for every
dtype (default_fp32_dot); the second's index and mask logic is tested there on
fp32 operands, where the interpreter multiplies exactly.
"""

import os

import torch
import triton
import triton.language as tl


def default_fp32_dot(cache_dtype: torch.dtype) -> bool:
    """Whether the kernels should upcast to fp32 for this cache (see the module docstring).

    An fp8 cache (--kv-cache-dtype fp8) is upcast too: a dot in its dtype would round the
    queries and the softmax weights to its 2-3 mantissa bits, and needs fp8 tensor cores.
    """
    return cache_dtype.itemsize != 2 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, FP32_DOT: tl.constexpr):
    """a @ b accumulated in fp32: both in IEEE fp32, or a cast to b's dtype (the cache's)."""
    if FP32_DOT:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b)


@triton.jit
def load_kv_block(
    kv_cache_ptr,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_table_ptr,  # this sequence's row of the block table
    logical_block,
    seq_len,
    kv_head,
    dims,  # [BLOCK_D] head-dim offsets
    dim_mask,  # [BLOCK_D]
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    FP32_DOT: tl.constexpr,
):
    """Keys and values of one logical block, [BLOCK_SIZE, BLOCK_D] each (in fp32 if FP32_DOT, else in
    the cache's dtype), and its token positions.

    Slots at or past seq_len hold no token of this sequence (the tail of its last
    block: garbage, or another sequence's); they load as zeros, and the caller
    masks their scores with the positions returned.
    """
    physical_block = tl.load(block_table_ptr + logical_block).to(tl.int64)
    offsets = tl.arange(0, BLOCK_SIZE)
    positions = logical_block * BLOCK_SIZE + offsets
    mask = (positions < seq_len)[:, None] & dim_mask[None, :]
    kv_offsets = (
        physical_block * stride_cache_block
        + offsets[:, None] * stride_cache_offset
        + kv_head * stride_cache_head
        + dims[None, :]
    )
    k = tl.load(kv_cache_ptr + kv_offsets, mask=mask, other=0.0)
    v = tl.load(kv_cache_ptr + stride_cache_kv + kv_offsets, mask=mask, other=0.0)
    if FP32_DOT:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v, positions


@triton.jit
def online_softmax_update(m_i, l_i, acc, scores, v, FP32_DOT: tl.constexpr):
    """Fold one block into the running softmax of each query row.

    m_i: running max [ROWS]; l_i: denominator sum_j exp(s_j - m_i) [ROWS]; acc: the
    un-normalised output sum_j exp(s_j - m_i) * v_j [ROWS, BLOCK_D]; scores: this
    block's [ROWS, BLOCK_SIZE] in fp32, -inf where masked; v: its values. What was
    summed under the old max is rescaled to the new one.
    """
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp(m_i - m_new)  # 0 on the first block, where m_i = -inf
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p, v, FP32_DOT)
    return m_new, l_i, acc
