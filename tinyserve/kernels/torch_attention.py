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

Batching decodes turns one small attention call per sequence into a few calls per
layer; that is most of the step time saved at large batch sizes on a CPU. "A few":
decodes are sorted by length and batched in up to four groups (`length_groups`),
so a 20-token sequence is not padded to the 300 tokens of the longest one.
"""

import torch
import torch.nn.functional as F

from tinyserve.kernels.metadata import AttentionMetadata


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int):
    """Keys and values of one sequence, contiguous: two [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    # kv_cache[:, blocks] is [2, num_blocks, block_size, H, D]; flatten the blocks
    # back into one token axis and cut off the unused tail of the last block.
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len]
    return kv[0], kv[1]


def prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
                      scale: float) -> torch.Tensor:
    """One sequence's q_len queries, at positions seq_len - q_len .. seq_len - 1, causally."""
    q_len = query.shape[0]
    k, v = gather_kv(kv_cache, block_table, seq_len)
    k, v = k.to(query.dtype), v.to(query.dtype)  # a --kv-cache-dtype cache is read in the model's dtype
    # [1, heads, tokens, head_dim]: with a batch axis, the CPU picks its flash kernel;
    # without one it falls back to the plain math path, 2-3x slower.
    q, k, v = query.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == seq_len:  # nothing cached before: the usual square causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query j sits at position seq_len - q_len + j and sees keys 0..that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence, all sequences at once: query [S, H, D] -> [S, H, D]."""
    num_seqs, _, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    blocks = block_tables.flatten().long()
    # Gather each sequence's blocks, [S * max_blocks, block_size, Hkv, D] (index_select:
    # several times faster than kv_cache[0][block_tables] on a CPU), then copy them once
    # more into [S, Hkv, max_len, D] float32, contiguous. Both copies pay for themselves:
    # the attention kernel runs several times faster over one contiguous [max_len, D]
    # matrix per head than over keys strided by Hkv * D, and in float32 than in bfloat16
    # when there is a single query row (the bf16 kernel is built for long query blocks).
    # The output is rounded back to the query's dtype.
    k = _heads_first_fp32(kv_cache[0].index_select(0, blocks), num_seqs, num_kv_heads, head_dim)
    v = _heads_first_fp32(kv_cache[1].index_select(0, blocks), num_seqs, num_kv_heads, head_dim)
    valid = torch.arange(k.shape[2], device=query.device)[None, :] < seq_lens[:, None]  # [S, max_len]
    # Padding slots hold whatever an earlier request left there (finite values: the
    # pool starts zeroed and only ever holds keys and values); the mask gives them weight 0.
    out = F.scaled_dot_product_attention(
        query[:, :, None, :].float(), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
    )  # [S, H, 1, D]
    return out[:, :, 0, :].to(query.dtype)


def _heads_first_fp32(gathered: torch.Tensor, num_seqs: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """[S * max_blocks, block_size, Hkv, D] -> [S, Hkv, max_len, D] float32, contiguous."""
    tokens_last = gathered.view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    out = torch.empty(tokens_last.shape, dtype=torch.float32, device=gathered.device)
    return out.copy_(tokens_last)  # transpose and cast in one pass


class TorchAttentionBackend:
    name = "torch"

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata) -> None:
        # View the pool as one long array of slots; slot = block_id * block_size + offset.
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        # .to: a --kv-cache-dtype cache rounds them to its own dtype (E4M3 saturates at +-448).
        kv_cache[0].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = key.to(kv_cache.dtype)
        kv_cache[1].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = value.to(kv_cache.dtype)

    def attention(self, query, kv_cache, metadata: AttentionMetadata, scale: float):
        out = torch.empty_like(query)
        starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        block_size = kv_cache.shape[2]
        decode_rows = [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]
        for group in length_groups(decode_rows, seq_lens):
            rows = torch.tensor(group, device=query.device)
            tokens = torch.tensor([starts[i] for i in group], device=query.device)
            num_blocks = -(-max(seq_lens[i] for i in group) // block_size)  # the group's longest, no more
            out[tokens] = decode_attention(query[tokens], kv_cache, metadata.block_tables[rows, :num_blocks],
                                           metadata.seq_lens[rows], scale)
        for i, seq_len in enumerate(seq_lens):
            if starts[i + 1] - starts[i] > 1:
                out[starts[i] : starts[i + 1]] = prefill_attention(
                    query[starts[i] : starts[i + 1]], kv_cache, metadata.block_tables[i], seq_len, scale
                )
        return out


MIN_DECODE_GROUP = 8  # the fewest sequences worth a padded batch of their own
MAX_DECODE_GROUPS = 4


def length_groups(rows: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Decode rows sorted by length and cut into up to four groups of similar length.

    One padded batch pads every sequence to the longest of all: with lengths spread
    evenly from 20 to 300 tokens, 45 % of what it gathers and attends to is padding.
    Each group is padded only to its own longest, which cuts the padding to ~10 %
    for three more (cheap) attention calls. A group has at least 8 sequences.
    """
    if not rows:
        return []
    rows = sorted(rows, key=seq_lens.__getitem__)
    num_groups = max(1, min(MAX_DECODE_GROUPS, len(rows) // MIN_DECODE_GROUP))
    cuts = [len(rows) * g // num_groups for g in range(num_groups + 1)]  # sizes differ by at most one
    return [rows[cuts[g] : cuts[g + 1]] for g in range(num_groups)]
