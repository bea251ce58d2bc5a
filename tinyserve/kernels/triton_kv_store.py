"""Triton kernel: write this step's keys and values into the paged KV cache.

Every new token's K and V go to the slot the scheduler gave it
(slot_mapping[token] = block_id * block_size + offset). One program copies one
(token, KV head) pair, both K and V, one head_dim vector each:

    grid = (num_tokens, num_kv_heads)

        program (t, h):   key[t, h, :]   ->  kv_cache[0, block, offset, h, :]
                          value[t, h, :] ->  kv_cache[1, block, offset, h, :]
                          with block, offset = divmod(slot_mapping[t], block_size)

head_dim need not be a power of two: the vector is padded to BLOCK_D lanes and
the extra lanes are masked off on both the load and the store.

A slot of -1 means "write nothing": the padding rows of a CUDA-graph batch
(engine/worker/cuda_graphs.py) carry it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    block_size,
    head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)

    # Where this token lives in the cache. slot_mapping is int64, so the
    # address arithmetic below cannot overflow on a large cache.
    slot = tl.load(slot_mapping_ptr + token)
    # Slot -1 (a padding row): no lane is stored, and no address is formed from it.
    lanes = tl.where(slot >= 0, head_dim, 0)
    slot = tl.maximum(slot, 0)
    block = slot // block_size
    offset = slot % block_size

    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < lanes
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dims, mask=dim_mask)
    value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + dims, mask=dim_mask)

    # K and V of one slot sit stride_cache_kv apart (axis 0 of the layer's cache).
    dst = kv_cache_ptr + block * stride_cache_block + offset * stride_cache_offset + head * stride_cache_head + dims
    tl.store(dst, key.to(kv_cache_ptr.dtype.element_ty), mask=dim_mask)
    tl.store(dst + stride_cache_kv, value.to(kv_cache_ptr.dtype.element_ty), mask=dim_mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] to their slots in kv_cache.

    kv_cache is one layer's [2, num_blocks, block_size, num_kv_heads, head_dim];
    head_dim must be the contiguous axis of every tensor (strides elsewhere are free,
    so K and V may be views into a fused QKV projection).
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = kv_cache.shape[2]
    store_kv_kernel[(num_tokens, num_kv_heads)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        block_size,
        head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
