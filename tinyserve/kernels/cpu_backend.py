"""The CPU attention backend: decodes through a kernel that reads the paged cache in place.

    write_kv    -> the reference's index_put into the pool            (torch_attention.py)
    attention   -> the step's decodes, all at once: paged_decode_attention  (cpu_decode_attention.py)
                   whole prompts of one length:     attend_fresh_run        (here; bf16: one SDPA call)
                   each other prefill:              prefill_attention       (torch_attention.py)

It is the reference backend with one part replaced: decode attention, where the
reference copies every decode's keys and values out of the pool before SDPA reads them
(cpu_decode_attention.py says what that costs). A prefill has many queries per key, so
there the copy is small beside the attention itself, and SDPA's flash kernel, blocked for
the cache, stays; in bf16 a step's whole prompts of one length, side by side, go to it in
one call instead of one each (attend_fresh_run). tests/test_cpu_attention.py holds the two
backends to the same numbers.

Handed this backend, the model fuses its elementwise steps too: each residual add with the
RMSNorm after it, RoPE, and SwiGLU's silu with its product (cpu_elementwise.py, whose kernels
the backend compiles or loads when it is made).

As the reference does, the first layer of a step works out what the batch looks like
(which rows are decodes, their block tables and lengths as the kernel reads them), and
the other layers reuse it.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from tinyserve.kernels import cpu_elementwise
from tinyserve.kernels.cpu_decode_attention import paged_decode_attention, set_num_threads
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.torch_attention import (
    TorchAttentionBackend,
    attend_prefills,
    compute_dtype,
    decode_seqs,
    prefill_rows,
)


@dataclass(slots=True)
class CpuStepPlan:
    """What every layer of one step needs to know about its batch, worked out once."""

    decode_rows: torch.Tensor | None  # the decodes' rows of the flat batch; None: every row is one
    block_tables: np.ndarray  # [num_decodes, max_blocks] int32, the decodes' rows of the step's block tables
    seq_lens: np.ndarray  # [num_decodes] int32
    prefills: list[tuple[int, int, int]]  # (first query row, end query row, batch row) of each prefill
    fresh_runs: list[list[tuple[int, int, int]]]  # of those, prompts of one length with nothing cached, side by side


def fresh_runs(prefills: list[tuple[int, int, int]], seq_lens: list[int]) -> list[list[tuple[int, int, int]]]:
    """Runs of two or more prefills that are whole prompts (nothing cached before them) of one length, each
    starting where the last ended: their queries are then one [n, length] block of the batch."""
    runs: list[list[tuple[int, int, int]]] = []
    for prefill in prefills:
        start, end, row = prefill
        if end - start != seq_lens[row]:
            continue
        last = runs[-1][-1] if runs else None
        if last is not None and last[1] == start and last[1] - last[0] == end - start:
            runs[-1].append(prefill)
        else:
            runs.append([prefill])
    return [run for run in runs if len(run) > 1]


def attend_fresh_run(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata,
                     run: list[tuple[int, int, int]], scale: float) -> None:
    """A run of whole prompts of one length (fresh_runs), in one SDPA call, into their rows of out.

    One sequence at a time, a step of 16 prompts of 128 tokens is 16 small calls a layer; together,
    one gather of their keys and values and one call. The flash kernel computes each sequence as it
    would alone: the reference's numbers, bit for bit. In bf16 on the Xeon with AMX, 16 x 128 tokens:
    2.6 against 3.2 ms a layer. In fp32 it was slower (8.1 against 6.9 ms), so plan_cpu_step keeps
    the runs to bf16.
    """
    (first, _, _), (_, end, _) = run[0], run[-1]
    n, length = len(run), run[0][1] - run[0][0]
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    rows = torch.tensor([row for _, _, row in run])
    blocks = metadata.block_tables.index_select(0, rows)[:, :-(-length // block_size)].flatten().long()
    dtype = compute_dtype(query)
    # [n, Hkv, length, D] each; a --kv-cache-dtype cache is read in the model's dtype, as the reference reads it
    k, v = (kv_cache[i].index_select(0, blocks).view(n, -1, num_kv_heads, head_dim)[:, :length]
            .to(dtype).transpose(1, 2) for i in (0, 1))
    q = query[first:end].view(n, length, num_heads, head_dim).to(dtype).transpose(1, 2)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    out[first:end].view(n, length, num_heads, head_dim).copy_(attended.transpose(1, 2))


def plan_cpu_step(metadata: AttentionMetadata, dtype: torch.dtype) -> CpuStepPlan:
    """The step's decodes as the kernel reads them (numpy views of the step's tensors), and its prefills,
    runs of whole prompts apart where attention computes in bf16 (dtype, compute_dtype's: attend_fresh_run)."""
    if metadata.is_decode_only:  # the flat batch is the decodes, one row each
        return CpuStepPlan(None, metadata.block_tables.contiguous().numpy(), metadata.seq_lens.numpy(), [], [])
    decodes = decode_seqs(metadata)
    index = torch.tensor(decodes, dtype=torch.long)
    prefills = prefill_rows(metadata)
    runs = fresh_runs(prefills, metadata.seq_lens_cpu) if dtype == torch.bfloat16 else []
    in_runs = {prefill for run in runs for prefill in run}
    return CpuStepPlan(
        decode_rows=torch.tensor([metadata.query_start_loc_cpu[i] for i in decodes], dtype=torch.long),
        block_tables=metadata.block_tables.index_select(0, index).numpy(),
        seq_lens=metadata.seq_lens.index_select(0, index).numpy(),
        prefills=[prefill for prefill in prefills if prefill not in in_runs],
        fresh_runs=runs,
    )


class CpuAttentionBackend:
    """The reference's write_kv and prefills; the step's decodes in one call of the kernel."""

    name = "cpu"

    def __init__(self) -> None:
        threads = torch.get_num_threads()
        cpu_elementwise.warm_up()  # the model's fused steps (llama.py takes them with this backend)
        # Their first run launches numba's threading layer, which sets the process's OpenMP thread count
        # to all the cores: torch's own count (a tensor- or pipeline-parallel rank's share) is put back.
        torch.set_num_threads(threads)
        self.reference = TorchAttentionBackend()
        self._plan: CpuStepPlan | None = None
        self._plan_for: AttentionMetadata | None = None  # the step it was made for (held: its id stays its own)

    def write_kv(self, key, value, kv_cache, metadata: AttentionMetadata) -> None:
        self.reference.write_kv(key, value, kv_cache, metadata)

    def attention(self, query, kv_cache, metadata: AttentionMetadata, scale: float):
        if self._plan_for is not metadata:  # the step's first layer
            self._plan, self._plan_for = plan_cpu_step(metadata, compute_dtype(query)), metadata
            set_num_threads(torch.get_num_threads())  # the kernel's threads follow torch's (cpu_threads.py)
        plan = self._plan
        if plan.decode_rows is None:
            return paged_decode_attention(query, kv_cache, plan.block_tables, plan.seq_lens, scale).to(query.dtype)
        out = torch.empty_like(query)
        if len(plan.seq_lens):
            decodes = paged_decode_attention(query.index_select(0, plan.decode_rows), kv_cache, plan.block_tables,
                                             plan.seq_lens, scale)
            out.index_copy_(0, plan.decode_rows, decodes.to(query.dtype))
        for run in plan.fresh_runs:
            attend_fresh_run(out, query, kv_cache, metadata, run, scale)
        attend_prefills(out, query, kv_cache, metadata, plan.prefills, scale)
        return out
