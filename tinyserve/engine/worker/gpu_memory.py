"""How big the KV cache may be on a GPU: `--gpu-memory-utilization`, as vLLM sizes it.

The engine may use `utilization` of the GPU's total memory. The weights, the peak
activations of the largest step and what the CUDA libraries hold outside PyTorch's
allocator come first; the KV cache gets the rest:

    total memory ─┬─ other processes (must leave `utilization * total` free at start)
                  └─ this engine: utilization * total
                        ├─ weights                      (measured after loading)
                        ├─ peak activations             (measured: one dummy step of
                        │                                max_num_batched_tokens tokens,
                        │                                with the costliest sampling)
                        ├─ CUDA graphs' memory pool     (measured: the largest bucket
                        │                                recorded once, then freed)
                        ├─ non-torch (CUDA context, cuBLAS workspaces)
                        └─ KV cache ◄── what is left, in whole blocks

The dummy step is the largest the scheduler can make, and its sampling the most
memory-hungry a request may ask for, since they are what the KV cache must leave
room for: a full batch of max_num_seqs rows sampled with temperature, min-p, top-k,
top-p and logprobs (the sort of the whole vocabulary, its int64 indices, the softmax,
its cumulative sum and the scatter back: several times the logits themselves), and
prompt logprobs over every token of the step (log_softmax of their logits). vLLM
runs a dummy sampler pass in its profile too, and measures its graphs' memory.

`kv_cache_bytes` is the arithmetic (tested on any machine); `dummy_step` runs on any
device; `profile_peak_activations` and `graph_pool_bytes` measure on CUDA.
"""

from dataclasses import dataclass

import torch

from tinyserve.engine.worker.cuda_graphs import DecodeGraphs
from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.sampler import Sampler
from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.sampling_params import SamplingParams
from tinyserve.utils import cdiv

# The costliest sampling a request can ask for: every step of the sampler runs.
PROFILE_SAMPLING = SamplingParams(temperature=1.0, min_p=0.01, top_k=50, top_p=0.9, logprobs=20, prompt_logprobs=20)

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
                   non_torch: int, cuda_graphs: int = 0) -> int:
    """Bytes left for the KV cache; ValueError with the numbers when there are none."""
    requested = int(total * utilization)
    if free_at_start < requested:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {requested / GiB:.2f} GiB of the GPU's "
            f"{total / GiB:.2f} GiB, but only {free_at_start / GiB:.2f} GiB were free when the engine started "
            "(other processes hold the rest): lower --gpu-memory-utilization or free the GPU"
        )
    available = requested - weights - peak_activations - non_torch - cuda_graphs
    if available <= 0:
        raise ValueError(
            f"no memory left for the KV cache: of the {requested / GiB:.2f} GiB that gpu_memory_utilization="
            f"{utilization} allows, the weights take {weights / GiB:.2f} GiB, the activations of a "
            f"step up to {peak_activations / GiB:.2f} GiB, the CUDA graphs {cuda_graphs / GiB:.2f} GiB and CUDA "
            f"itself {non_torch / GiB:.2f} GiB: raise --gpu-memory-utilization, or lower --max-num-batched-tokens "
            "(or --max-num-seqs, or --enforce-eager)"
        )
    return available


def kv_cache_budget(model, start: MemorySnapshot, *, utilization: float, max_num_batched_tokens: int,
                    max_num_seqs: int, max_model_len: int, block_size: int, dtype: torch.dtype,
                    device: torch.device, cuda_graphs: bool) -> int:
    """The KV cache's bytes on this GPU, measured: call it after loading the weights.

    start is the snapshot taken before the weights were loaded; cuda_graphs whether
    decode steps will be recorded (their memory pool is measured then).
    """
    weights = torch.cuda.memory_allocated(device) - start.allocated
    shape = dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size, dtype=dtype,
                 device=device)
    peak = profile_peak_activations(model, num_tokens=max_num_batched_tokens, **shape)
    graphs = graph_pool_bytes(model, **shape) if cuda_graphs else 0
    now = MemorySnapshot.take(device)
    # What the device lost beyond what PyTorch's allocator holds: the CUDA context, library workspaces.
    non_torch = max(0, (start.free - now.free) - (now.reserved - start.reserved))
    return kv_cache_bytes(total=start.total, free_at_start=start.free, utilization=utilization, weights=weights,
                          peak_activations=peak, non_torch=non_torch, cuda_graphs=graphs)


def scratch_kv_caches(model, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]


@torch.inference_mode()
def dummy_step(model, kv_caches: list[torch.Tensor], *, num_tokens: int, max_num_seqs: int, max_model_len: int,
               block_size: int, device: torch.device) -> tuple[int, int]:
    """The largest step, sampled the costliest way: (rows sampled, rows of prompt logprobs).

    num_tokens prompt tokens in sequences of up to max_model_len (kv_caches must hold
    them); then max_num_seqs rows sampled with PROFILE_SAMPLING, and prompt logprobs
    for every token, as ModelRunner computes them.
    """
    seq_len = min(num_tokens, max_model_len)
    query_lens = [seq_len] * (num_tokens // seq_len) + ([num_tokens % seq_len] if num_tokens % seq_len else [])
    blocks_per_seq = cdiv(seq_len, block_size)
    block_tables = torch.arange(len(query_lens) * blocks_per_seq, dtype=torch.int32, device=device)
    block_tables = block_tables.view(len(query_lens), blocks_per_seq)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    slot_mapping = torch.cat([i * blocks_per_seq * block_size + torch.arange(n, device=device)
                              for i, n in enumerate(query_lens)])
    metadata = AttentionMetadata.from_lengths(query_lens, query_lens, block_tables, slot_mapping)
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=device), positions, kv_caches, metadata)

    rows = torch.arange(max_num_seqs, device=device) % num_tokens
    requests = [CachedRequestState(f"profile-{i}", [0], PROFILE_SAMPLING, []) for i in range(max_num_seqs)]
    Sampler(device).sample(model.compute_logits(hidden[rows]), requests)
    prompt_logprobs = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
    prompt_logprobs.topk(PROFILE_SAMPLING.prompt_logprobs, dim=-1)
    return len(requests), prompt_logprobs.shape[0]


def profile_peak_activations(model, *, num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                             dtype: torch.dtype, device: torch.device) -> int:
    """Peak bytes the dummy step allocates on top of what is already there (its scratch KV pool not counted)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    num_blocks = cdiv(num_tokens, min(num_tokens, max_model_len)) * cdiv(min(num_tokens, max_model_len), block_size)
    kv_caches = scratch_kv_caches(model, num_blocks, block_size, dtype, device)
    scratch = sum(cache.numel() * cache.element_size() for cache in kv_caches)
    dummy_step(model, kv_caches, num_tokens=num_tokens, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
               block_size=block_size, device=device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before - scratch
    del kv_caches
    torch.cuda.empty_cache()
    return max(0, peak)


def graph_pool_bytes(model, *, max_num_seqs: int, max_model_len: int, block_size: int, dtype: torch.dtype,
                     device: torch.device) -> int:
    """Device memory the decode CUDA graphs hold while they live: the largest bucket recorded once, then freed.

    All buckets share one pool, recorded largest first, so the largest sizes it. The
    graphs read only block 0 of their padding rows, so a one-block scratch pool will do.
    """
    kv_caches = scratch_kv_caches(model, 1, block_size, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    graphs = DecodeGraphs(model, kv_caches, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                          block_size=block_size, device=device)
    graphs.capture([graphs.largest])
    torch.cuda.empty_cache()  # what the warm-up cached outside the pool goes back
    pool = free_before - torch.cuda.mem_get_info(device)[0]
    del graphs, kv_caches
    torch.cuda.empty_cache()
    return max(0, pool)
