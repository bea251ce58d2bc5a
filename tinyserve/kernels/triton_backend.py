"""The Triton attention backend: the same interface and numbers as the PyTorch reference.

    write_kv    -> store_kv                 (triton_kv_store.py)
    attention   -> decode-only batch:  paged_decode_attention   (triton_decode_attention.py)
                   anything else:      paged_prefill_attention  (triton_prefill_attention.py)

The prefill kernel is correct for one-token queries too, so mixed batches of
prefills and decodes go through it whole. Pure decode batches get their own
kernel because their shape is different: one query row per sequence, where
the prefill kernel would spend a BLOCK_M-row tile per query head on it. The
decode kernel instead packs the query heads of one KV head into the rows of a
tile (each KV block is read once, not once per query head) and can split long
contexts across programs.

The kernels run on CUDA, or on the CPU through Triton's interpreter when
TRITON_INTERPRET=1. Triton reads that variable when a kernel is defined, i.e.
when these modules are first imported, so it must be set before that.
"""

import os

import torch

from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.triton_decode_attention import default_num_splits, paged_decode_attention
from tinyserve.kernels.triton_kv_store import store_kv
from tinyserve.kernels.triton_prefill_attention import paged_prefill_attention


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, device: torch.device | str, max_model_len: int):
        # Fixed for the engine's life: the decode kernel's grid and constexprs never follow the batch.
        self.num_kv_splits = default_num_splits(max_model_len)
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' needs a CUDA GPU, or TRITON_INTERPRET=1 to run "
                "the kernels through Triton's interpreter on the CPU"
            )

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata) -> None:
        store_kv(key, value, kv_cache, metadata.slot_mapping)

    def attention(self, query, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size = kv_cache.shape[2]
        # One KV block is one tile of the kernels: tl.arange wants a power of two,
        # and tl.dot at least 16 along each axis.
        if block_size < 16 or block_size & (block_size - 1):
            raise ValueError(
                f"block_size must be a power of two >= 16 for attention_backend='triton', got {block_size}"
            )
        out = torch.empty_like(query)
        if metadata.is_decode_only:
            paged_decode_attention(
                out, query, kv_cache, metadata.block_tables, metadata.seq_lens, scale, self.num_kv_splits
            )
        else:
            paged_prefill_attention(
                out,
                query,
                kv_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.seq_lens,
                scale,
                metadata.max_query_len,
            )
        return out
