"""The readable PyTorch attention backend over the paged KV cache.

It is the definition every other backend is tested against (`--attention-backend
torch`). The CPU's default backend (cpu_backend.py) is this one with its decode path
replaced by a kernel that reads the cache in place. A batch mixes two kinds of sequences:

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

Every layer of a step attends over the same sequences, so what the batch looks like
(the groups, their flattened block tables, their masks) is worked out once per step,
by the first layer, as a `StepPlan`; the other layers reuse it.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinyserve.kernels.cpu_bf16 import computes_bf16_in_fp32
from tinyserve.kernels.metadata import AttentionMetadata


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention multiplies in: the model's, or fp32 for bf16 on a CPU without bf16 matmuls (cpu_bf16.py)."""
    return torch.float32 if computes_bf16_in_fp32(query.device, query.dtype) else query.dtype


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
    q_len, dtype = query.shape[0], compute_dtype(query)
    k, v = gather_kv(kv_cache, block_table, seq_len)
    k, v = k.to(dtype), v.to(dtype)  # a --kv-cache-dtype cache is read in the model's dtype
    # [1, heads, tokens, head_dim]: with a batch axis, the CPU picks its flash kernel;
    # without one it falls back to the plain math path, 2-3x slower.
    q, k, v = query.to(dtype).transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q_len == seq_len:  # nothing cached before: the usual square causal mask
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query j sits at position seq_len - q_len + j and sees keys 0..that position
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)


def decode_seqs(metadata: AttentionMetadata) -> list[int]:
    """The batch rows of the sequences with exactly one query: the step's decodes."""
    starts = metadata.query_start_loc_cpu
    return [i for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] == 1]


def prefill_rows(metadata: AttentionMetadata) -> list[tuple[int, int, int]]:
    """(first query row, end query row, batch row) of each sequence with more than one query."""
    starts = metadata.query_start_loc_cpu
    return [(starts[i], starts[i + 1], i) for i in range(metadata.num_seqs) if starts[i + 1] - starts[i] > 1]


def attend_prefills(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                    prefills: list[tuple[int, int, int]], scale: float) -> None:
    """Each prefill's queries, one sequence at a time, into its rows of out."""
    for start, end, row in prefills:
        out[start:end] = prefill_attention(query[start:end], kv_cache, metadata.block_tables[row],
                                           metadata.seq_lens_cpu[row], scale)


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar length, attended to in one call."""

    rows: slice  # where the group's queries sit in the step's decodes, sorted by length (StepPlan.decode_order)
    blocks: torch.Tensor  # [n * num_blocks] int64: their block tables, cut to the group's longest, flattened
    mask: torch.Tensor  # [n, 1, 1, num_blocks * block_size]: 0 where a sequence has a key, -inf past its end


@dataclass(slots=True)
class StepPlan:
    """What every layer of one step needs to know about its batch, worked out once."""

    decode_order: torch.Tensor  # [num_decodes] the decodes' query rows in the flat batch, group after group
    decode_groups: list[DecodeGroup]
    prefills: list[tuple[int, int, int]]  # (first query row, end query row, batch row) of each prefill


def plan_step(metadata: AttentionMetadata, block_size: int, dtype: torch.dtype) -> StepPlan:
    """The step's decodes in length groups, with their block lists and masks, and its prefills.

    The masks are additive, in the dtype attention computes in: handed a boolean mask,
    SDPA turns it into this one on every call (two ops per group and layer, 64 a step at 32
    decodes); made once here, the result is the same, bit for bit.
    """
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    device = metadata.block_tables.device
    groups, order, first = [], [], 0
    for group in length_groups(decode_seqs(metadata), seq_lens):
        rows = torch.tensor(group, device=device)
        num_blocks = -(-max(seq_lens[i] for i in group) // block_size)  # the group's longest, no more
        positions = torch.arange(num_blocks * block_size, device=device)
        past_end = positions[None, :] >= metadata.seq_lens[rows][:, None]
        mask = torch.zeros(past_end.shape, dtype=dtype, device=device).masked_fill_(past_end, float("-inf"))
        groups.append(DecodeGroup(
            rows=slice(first, first + len(group)),
            blocks=metadata.block_tables[rows, :num_blocks].flatten().long(),
            mask=mask[:, None, None, :],
        ))
        order += [starts[i] for i in group]
        first += len(group)
    return StepPlan(torch.tensor(order, dtype=torch.long, device=device), groups, prefill_rows(metadata))


def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, group: DecodeGroup, scale: float) -> torch.Tensor:
    """One query per sequence of the group, all at once: query [n, H, D] -> [n, H, D].

    One copy of the keys and values, the gather: index_select takes each sequence's
    blocks out of the pool, [n * num_blocks, block_size, Hkv, D], which is already
    [n, max_len, Hkv, D]; the attention reads it heads-first as a strided view, in the
    cache's own dtype. Measured with torch 2.13 on a 2-core CPU (32 sequences of 48-288
    tokens, one layer): 0.9 ms in bf16 and 1.4 ms in fp32, against 2.3 and 2.6 ms when
    the gathered blocks were copied once more into contiguous fp32 heads first; the
    flash kernel accumulates in fp32 either way.

    In fp32, the query heads that share a KV head are handed to the kernel as that head's
    rows, [n, Hkv, H / Hkv, D], so it reads each key and value once for all of them instead
    of once per query head: 0.44 against 0.55-0.59 ms (32 sequences, one layer; sums in
    another order, ~3e-7 apart). In bf16 the same layout is slower (0.50 against 0.35-0.38 ms),
    so there the kernel does the sharing itself (enable_gqa).

    Without the gather: `torch.nn.attention.flex_attention`, compiled for the CPU, reads the
    pool in place through a BlockMask made from the block tables (`BlockMask.from_kv_blocks`,
    the last partial block cut by a mask_mod). Measured (torch 2.13, the 2-core AMD EPYC, fp32,
    32 decodes of 48-288 tokens, one layer, three draws): 1.11-1.34 ms against 1.22-1.48 ms
    for these four groups, within 1e-6; but making the step's BlockMask took 2.6 ms, more than
    eight layers save, and torch.compile wants a C++ compiler at run time and ~7 s (dynamic
    shapes, compiled once) before the first step. Here the gather stays: it copies at about the
    machine's memory bandwidth, and what it costs is the extra passes over the keys and values.
    The CPU backend's numba kernel (cpu_decode_attention.py) reads them once, in place.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    k = kv_cache[0].index_select(0, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = kv_cache[1].index_select(0, group.blocks).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    dtype = compute_dtype(query)
    k, v, query = k.to(dtype), v.to(dtype), query.to(dtype)  # a --kv-cache-dtype cache is read in the model's dtype
    # Padding slots hold whatever an earlier request left there (finite values: the
    # pool starts zeroed and only ever holds keys and values); the mask gives them weight 0.
    if dtype == torch.float32:
        rows = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=group.mask, scale=scale)  # [n, Hkv, H / Hkv, D]
    else:
        out = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=group.mask, scale=scale,
                                             enable_gqa=True)  # [n, H, 1, D]
    return out.reshape(num_seqs, num_heads, head_dim)


class TorchAttentionBackend:
    name = "torch"

    def __init__(self) -> None:
        self._plan: StepPlan | None = None
        self._plan_for: AttentionMetadata | None = None  # the step it was made for (held: its id stays its own)

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata) -> None:
        # View the pool as one long array of slots; slot = block_id * block_size + offset.
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        # .to: a --kv-cache-dtype cache rounds them to its own dtype (E4M3 saturates at +-448).
        kv_cache[0].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = key.to(kv_cache.dtype)
        kv_cache[1].view(-1, num_kv_heads, head_dim)[metadata.slot_mapping] = value.to(kv_cache.dtype)

    def attention(self, query, kv_cache, metadata: AttentionMetadata, scale: float):
        if self._plan_for is not metadata:  # the step's first layer
            self._plan, self._plan_for = plan_step(metadata, kv_cache.shape[2], compute_dtype(query)), metadata
        plan = self._plan
        out = torch.empty_like(query)
        if plan.decode_groups:
            # One gather of the decodes' queries, sorted by group, and one scatter of their
            # outputs back: each group's queries are then a slice, not an index of their own.
            queries = query.index_select(0, plan.decode_order)
            outs = [decode_attention(queries[group.rows], kv_cache, group, scale) for group in plan.decode_groups]
            out.index_copy_(0, plan.decode_order, torch.cat(outs).to(query.dtype))
        attend_prefills(out, query, kv_cache, metadata, plan.prefills, scale)
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
