"""The CPU attention backend: decodes through a kernel that reads the paged cache in place.

    write_kv    -> the reference's index_put into the pool            (torch_attention.py)
    attention   -> the step's decodes, all at once: paged_decode_attention  (cpu_decode_attention.py)
                   each prefill:                    prefill_attention       (torch_attention.py)

It is the reference backend with one part replaced: decode attention, where the
reference copies every decode's keys and values out of the pool before SDPA reads them
(cpu_decode_attention.py says what that costs). A prefill has many queries per key, so
there the copy is small beside the attention itself, and SDPA's flash kernel, blocked for
the cache, stays. tests/test_cpu_attention.py holds the two backends to the same numbers.

Handed this backend, the model fuses its elementwise steps too: each residual add with the
RMSNorm after it, and SwiGLU's silu with its product (cpu_elementwise.py, whose kernels the
backend compiles or loads when it is made).

As the reference does, the first layer of a step works out what the batch looks like
(which rows are decodes, their block tables and lengths as the kernel reads them), and
the other layers reuse it.
"""

from dataclasses import dataclass

import numpy as np
import torch

from tinyserve.kernels import cpu_elementwise
from tinyserve.kernels.cpu_decode_attention import paged_decode_attention, set_num_threads
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.kernels.torch_attention import TorchAttentionBackend, attend_prefills, decode_seqs, prefill_rows


@dataclass(slots=True)
class CpuStepPlan:
    """What every layer of one step needs to know about its batch, worked out once."""

    decode_rows: torch.Tensor | None  # the decodes' rows of the flat batch; None: every row is one
    block_tables: np.ndarray  # [num_decodes, max_blocks] int32, the decodes' rows of the step's block tables
    seq_lens: np.ndarray  # [num_decodes] int32
    prefills: list[tuple[int, int, int]]  # (first query row, end query row, batch row) of each prefill


def plan_cpu_step(metadata: AttentionMetadata) -> CpuStepPlan:
    """The step's decodes as the kernel reads them (numpy views of the step's tensors), and its prefills."""
    if metadata.is_decode_only:  # the flat batch is the decodes, one row each
        return CpuStepPlan(None, metadata.block_tables.contiguous().numpy(), metadata.seq_lens.numpy(), [])
    decodes = decode_seqs(metadata)
    index = torch.tensor(decodes, dtype=torch.long)
    return CpuStepPlan(
        decode_rows=torch.tensor([metadata.query_start_loc_cpu[i] for i in decodes], dtype=torch.long),
        block_tables=metadata.block_tables.index_select(0, index).numpy(),
        seq_lens=metadata.seq_lens.index_select(0, index).numpy(),
        prefills=prefill_rows(metadata),
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
            self._plan, self._plan_for = plan_cpu_step(metadata), metadata
            set_num_threads(torch.get_num_threads())  # the kernel's threads follow torch's (cpu_threads.py)
        plan = self._plan
        if plan.decode_rows is None:
            return paged_decode_attention(query, kv_cache, plan.block_tables, plan.seq_lens, scale).to(query.dtype)
        out = torch.empty_like(query)
        if len(plan.seq_lens):
            decodes = paged_decode_attention(query.index_select(0, plan.decode_rows), kv_cache, plan.block_tables,
                                             plan.seq_lens, scale)
            out.index_copy_(0, plan.decode_rows, decodes.to(query.dtype))
        attend_prefills(out, query, kv_cache, metadata, plan.prefills, scale)
        return out
