"""What one attention call needs to know about the flattened batch.

The model runner packs every scheduled sequence into one flat list of tokens
(no padding). Attention needs to find, for each sequence, its queries in that
flat list and its keys/values in the paged KV cache:

    flat tokens:       | seq0: 5 prefill | seq1: 1 decode | seq2: 3 prefill |
    query_start_loc:   0                 5                6                 9
    seq_lens:          5                 37               3+16 (16 cached)

    kv_cache[layer]:   [2, num_blocks, block_size, num_kv_heads, head_dim]
                        ^ 0 = keys, 1 = values
    block_tables[i]:   the block ids holding sequence i's context, in order;
                       token t of sequence i lives in block block_tables[i][t // block_size]
                       at offset t % block_size.
    slot_mapping[j]:   where flat token j's new K/V is written:
                       block_id * block_size + offset.

The queries of sequence i are its *last* query_len tokens: positions
seq_lens[i] - query_len ... seq_lens[i] - 1. Everything before them was written
to the cache by earlier steps (or found in the prefix cache).
"""

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host copies, so a Python loop over sequences never syncs with the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @classmethod
    def from_lengths(cls, query_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor,
                     slot_mapping: torch.Tensor) -> "AttentionMetadata":
        """Build it from per-sequence lengths; tensors go to the device of block_tables."""
        query_start_loc = [0]
        for query_len in query_lens:
            query_start_loc.append(query_start_loc[-1] + query_len)
        device = block_tables.device
        return cls(
            slot_mapping=slot_mapping.to(device, non_blocking=True),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=list(seq_lens),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
