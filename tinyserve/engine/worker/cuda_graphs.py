"""Decode steps replayed as CUDA graphs, one graph per batch-size bucket.

On a GPU, a decode step of a small model is mostly launch overhead: a dozen kernels
per layer, each doing a few microseconds of work, each costing the CPU several
microseconds to launch. A CUDA graph records every launch of one forward pass once;
replaying it is one call. But a graph replays exactly what it recorded — the same
kernels, grids and buffer addresses — so everything that varies must live in
buffers the graph reads:

    static buffers (sized for the largest bucket)     one step of 5 decodes, bucket 8
      input_ids     [B]                                 t t t t t 0 0 0
      positions     [B]                                 p p p p p 0 0 0
      slot_mapping  [B]      where K/V is written       s s s s s -1 -1 -1   (-1: not written)
      seq_lens      [B]                                 n n n n n 1 1 1
      block_tables  [B, max_blocks_per_seq]             the 5 tables, then rows of block 0
      hidden        [B, hidden_size]  the output        rows 0..4 are the answer

A step of n decodes copies its inputs into the first n rows, fills the rest with
padding that harms nothing (a padding row writes no K/V and reads block 0), replays
the graph of the smallest bucket >= n, and reads the first n rows of the output.
The decode kernel's grid must not depend on the step either: its split count is
fixed by max_model_len when the backend is made, and each sequence's context is
cut into that many parts inside the kernel.

Prefill and mixed steps, and decode batches above the largest bucket, run eagerly.
Sampling stays outside the graph: it depends on each request's parameters.

`capture=False` builds everything but records no graph: `run` then executes the
same forward pass on the same static buffers eagerly. That is how the padding is
tested on a machine without a GPU (with Triton's interpreter).
"""

import torch

from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.utils import cdiv


def batch_size_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_num_seqs (and max_num_seqs itself), as vLLM does."""
    buckets = [size for size in (1, 2, 4) if size < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return buckets + [max_num_seqs]


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], *, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = batch_size_buckets(max_num_seqs)
        self.max_model_len = max_model_len
        self.capture_graphs = capture
        largest, max_blocks = self.buckets[-1], cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None  # the memory pool all graphs share (they never run at the same time)

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        """The smallest bucket that holds num_seqs, or None when the batch is too large for any."""
        return next((bucket for bucket in self.buckets if bucket >= num_seqs), None)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """Attention metadata over the first `bucket` rows of the static buffers."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # an upper bound: the kernels read each length from seq_lens
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=[self.max_model_len] * bucket,  # host-side view; the kernels read seq_lens
        )

    def _forward(self, bucket: int) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, self.metadata(bucket))

    def capture_all(self) -> None:
        """Record one graph per bucket, largest first (so the shared pool is sized by it)."""
        self.capture(list(reversed(self.buckets)))

    @torch.inference_mode()
    def capture(self, buckets: list[int]) -> None:
        """Record the graphs of these buckets, in this order (gpu_memory.py measures the largest alone)."""
        if not self.capture_graphs:
            return
        for bucket in buckets:
            self._forward(bucket)  # warm-up outside the graph: Triton compiles, cuBLAS picks its kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bucket] = self._forward(bucket)
            self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden_size] of a decode-only batch of n <= largest sequences."""
        n = input_ids.shape[0]
        bucket = self.bucket_for(n)
        if bucket is None or metadata.max_query_len != 1:
            raise ValueError(f"a CUDA graph runs decode-only batches of at most {self.largest} sequences")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables, non_blocking=True)
        # Padding rows: no K/V written, one token of context read from block 0.
        self.input_ids[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[n:bucket].fill_(1)
        self.block_tables[n:bucket].zero_()
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n]
        return self._forward(bucket)[:n]
