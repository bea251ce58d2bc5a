"""The readable PyTorch attention backend over the paged KV cache.

It is the definition every other backend is tested against, and the one the CPU
uses. A batch mixes two kinds of sequences:

- prefill (several query tokens): one sequence at a time, gather its keys and
  values out of the paged cache through its block table, then plain causal
  attention of its queries against them;
- decode (exactly one query token): all of them at once. Their block tables are
  gathered together into one padded [num_seqs, max_len] batch of keys, and
  positions past each sequence's length are masked out:

      block_tables[i] = [7, 2, 9]       ─► keys of seq i: cache[7] ++ cache[2] ++ cache[9]
      seq_lens[i]     = 37  (bs = 16)   ─► positions 37..47 are padding: masked with -inf

Batching decodes turns one small attention call per sequence into one call per
layer; that is most of the step time saved at large batch sizes on a CPU.
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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, may_attend: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q·kᵀ·scale) · v over the allowed positions, with grouped-query heads.

    q is [..., Hkv, R, D]: for each KV head, the rows of every query head that shares it
    (G heads × Lq queries, head-major), so one matmul against that head's k [..., Hkv, Lk, D]
    serves the whole group and k, v are never copied G times. may_attend broadcasts to
    [..., Hkv, R, Lk]. It computes in float32 whatever the dtype: scores rounded to
    bfloat16 would be off by ~0.05 at typical magnitudes. (Written out rather than through
    scaled_dot_product_attention: with a mask on a CPU that takes a path several times
    slower, ten times in bfloat16.)
    """
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~may_attend, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).to(dtype)


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                      scale: float) -> torch.Tensor:
    """One sequence's q_len queries, at positions seq_len - q_len .. seq_len - 1, causally."""
    q_len, num_heads, head_dim = query.shape
    k, v = gather_kv(kv_cache, block_table, seq_len)  # [seq_len, Hkv, D]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # [q_len, H, D] -> [Hkv, G * q_len, D]: row g * q_len + j is query j of head g of the group.
    q = query.transpose(0, 1).reshape(num_kv_heads, group * q_len, head_dim)
    # Query j sits at position seq_len - q_len + j and sees keys 0..that position.
    q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
    may_attend = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]  # [q_len, seq_len]
    out = attend(q, k.transpose(0, 1), v.transpose(0, 1), may_attend.repeat(group, 1), scale)
    return out.reshape(num_heads, q_len, head_dim).transpose(0, 1)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, all sequences at once: query [S, H, D] -> [S, H, D]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    blocks = block_tables.long()
    # [S, max_blocks, block_size, Hkv, D] -> [S, Hkv, max_len, D]
    k = kv_cache[0][blocks].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = kv_cache[1][blocks].view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    # Padding slots hold whatever an earlier request left there (finite values: the
    # pool starts zeroed and only ever holds keys and values); the mask gives them weight 0.
    valid = torch.arange(k.shape[2], device=query.device)[None, :] < seq_lens[:, None]  # [S, max_len]
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [S, Hkv, G, D]
    out = attend(q, k, v, valid[:, None, None, :], scale)  # [S, Hkv, G, D]
    return out.reshape(num_seqs, num_heads, head_dim)


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata) -> None:
        # View the pool as one long array of slots; slot = block_id * block_size + offset.
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = key
        kv_cache[1].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = value

    def attention(self, query, kv_cache, metadata: AttentionMetadata, scale: float):
        if metadata.is_decode_only:
            return decode_attention(query, kv_cache, metadata.block_tables, metadata.seq_lens, scale)
        out = torch.empty_like(query)
        starts = metadata.query_start_loc_cpu
        decode_rows = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        if decode_rows:
            rows = torch.tensor(decode_rows, device=query.device)
            tokens = torch.tensor([starts[i] for i in decode_rows], device=query.device)
            out[tokens] = decode_attention(query[tokens], kv_cache, metadata.block_tables[rows],
                                           metadata.seq_lens[rows], scale)
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            if starts[i + 1] - starts[i] > 1:
                out[starts[i] : starts[i + 1]] = prefill_attention(
                    query[starts[i] : starts[i + 1]], kv_cache, metadata.block_tables[i], seq_len, scale
                )
        return out
