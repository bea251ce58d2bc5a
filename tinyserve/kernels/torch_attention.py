"""The readable PyTorch reference for paged attention.

This is the definition every other backend is tested against. It walks the
batch one sequence at a time: gather the sequence's keys and values out of the
paged cache through its block table, then run plain causal attention of its
queries against them.
"""

import torch

from tinyserve.kernels.metadata import AttentionMetadata


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """Keys and values of one sequence, contiguous: two [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    # kv_cache[:, blocks] is [2, num_blocks, block_size, H, D]; flatten the blocks
    # back into one token axis and cut off the unused tail of the last block.
    kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len]
    return kv[0], kv[1]


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata) -> None:
        # View the pool as one long array of slots; slot = block_id * block_size + offset.
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = key
        kv_cache[1].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = value

    def attention(self, query, kv_cache, metadata: AttentionMetadata, scale: float):
        out = torch.empty_like(query)
        num_heads, num_kv_heads = query.shape[1], kv_cache.shape[-2]
        group = num_heads // num_kv_heads  # query heads sharing one KV head (GQA)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            q = query[starts[i] : starts[i + 1]]  # [q_len, H, D]
            q_len = q.shape[0]
            k, v = gather_kv(kv_cache, metadata.block_tables[i], seq_len)
            if group > 1:
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
            # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
            )
            out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
        return out
