"""How big the KV cache may be on a GPU: `--gpu-memory-utilization`, as vLLM sizes it.

The engine may use `utilization` of the GPU's total memory. The weights, the peak
activations of the largest step and what the CUDA libraries hold outside PyTorch's
allocator come first; the KV cache gets the rest:

    total memory ─┬─ other processes (must leave `utilization * total` free at start)
                  └─ this engine: utilization * total
                        ├─ weights                      (measured after loading)
                        ├─ peak activations             (measured: one dummy step of
                        │                                max_num_batched_tokens tokens)
                        ├─ non-torch (CUDA context, cuBLAS workspaces)
                        └─ KV cache ◄── what is left, in whole blocks

`kv_cache_bytes` is the arithmetic (tested on any machine); `profile_peak_activations`
runs the dummy step and needs CUDA.
"""

from dataclasses import dataclass

import torch

from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.utils import cdiv

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    free: int  # bytes free on the device (all processes)
    total: int
    allocated: int  # bytes in live PyTorch tensors of this process
    reserved: int  # bytes PyTorch's caching allocator holds

    @classmethod
    def take(cls, device: torch.device) -> "MemorySnapshot":
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


def kv_cache_bytes(*, total: int, free_at_start: int, utilization: float, weights: int, peak_activations: int,
                   non_torch: int) -> int:
    """Bytes left for the KV cache; ValueError with the numbers when there are none."""
    requested = int(total * utilization)
    if free_at_start < requested:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {requested / GiB:.2f} GiB of the GPU's "
            f"{total / GiB:.2f} GiB, but only {free_at_start / GiB:.2f} GiB were free when the engine started "
            "(other processes hold the rest): lower --gpu-memory-utilization or free the GPU"
        )
    available = requested - weights - peak_activations - non_torch
    if available <= 0:
        raise ValueError(
            f"no memory left for the KV cache: of the {requested / GiB:.2f} GiB that gpu_memory_utilization="
            f"{utilization} allows, the weights take {weights / GiB:.2f} GiB, the activations of a "
            f"step up to {peak_activations / GiB:.2f} GiB and CUDA itself {non_torch / GiB:.2f} GiB: "
            "raise --gpu-memory-utilization, or lower --max-num-batched-tokens"
        )
    return available


def kv_cache_budget(model, start: MemorySnapshot, *, utilization: float, max_num_batched_tokens: int,
                    max_num_seqs: int, max_model_len: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> int:
    """The KV cache's bytes on this GPU, measured: call it after loading the weights.

    start is the snapshot taken before the weights were loaded.
    """
    weights = torch.cuda.memory_allocated(device) - start.allocated
    peak = profile_peak_activations(model, num_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, block_size=block_size, dtype=dtype, device=device)
    now = MemorySnapshot.take(device)
    # What the device lost beyond what PyTorch's allocator holds: the CUDA context, library workspaces.
    non_torch = max(0, (start.free - now.free) - (now.reserved - start.reserved))
    return kv_cache_bytes(total=start.total, free_at_start=start.free, utilization=utilization, weights=weights,
                          peak_activations=peak, non_torch=non_torch)


def profile_peak_activations(model, *, num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                             dtype: torch.dtype, device: torch.device) -> int:
    """Peak bytes one step of num_tokens prompt tokens allocates on top of what is already there.

    The dummy step is the largest the scheduler can make: num_tokens prompt tokens in
    sequences of up to max_model_len, then logits for max_num_seqs rows (a decode step
    of a full batch samples that many). Its K/V go to a scratch pool just big enough,
    whose size is not counted.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)

    seq_len = min(num_tokens, max_model_len)
    query_lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = cdiv(seq_len, block_size)
    num_blocks = blocks_per_seq * len(query_lens)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
    scratch = sum(cache.numel() * cache.element_size() for cache in kv_caches)

    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device).view(len(query_lens), blocks_per_seq)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    slot_mapping = torch.cat([i * blocks_per_seq * block_size + torch.arange(n, device=device)
                              for i, n in enumerate(query_lens)])
    metadata = AttentionMetadata.from_lengths(query_lens, query_lens, block_tables, slot_mapping)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    with torch.inference_mode():
        hidden = model(input_ids, positions, kv_caches, metadata)
        rows = torch.arange(max_num_seqs, device=device) % num_tokens
        logits = model.compute_logits(hidden[rows])
        torch.softmax(logits, dim=-1)  # the sampler's largest temporary
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    del kv_caches, hidden, logits
    torch.cuda.empty_cache()
    return max(0, peak)
