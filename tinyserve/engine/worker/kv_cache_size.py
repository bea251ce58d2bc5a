"""How many KV blocks an engine gets: from --num-kv-blocks, --kv-cache-memory, or the GPU's free memory.

The pool is allocated once, at start-up, by the model runner (model_runner.py); the
scheduler's KV cache manager then hands its blocks out. No point in more blocks than
every seat filled to the full context length.
"""

from tinyserve.config import DEFAULT_KV_CACHE_MEMORY, EngineArgs, ModelInfo
from tinyserve.engine.worker.gpu_memory import MemorySnapshot, kv_cache_budget
from tinyserve.engine.worker.model_runner import ModelRunner
from tinyserve.utils import cdiv


def num_kv_blocks(args: EngineArgs, info: ModelInfo, model, gpu_at_start: MemorySnapshot | None,
                  decode_graphs: bool) -> int:
    """--num-kv-blocks if given; else --kv-cache-memory; else on a GPU what --gpu-memory-utilization leaves; else
    1 GiB. gpu_at_start: the GPU's memory before the model loaded (None on a CPU)."""
    if args.num_kv_blocks:
        return args.num_kv_blocks
    if args.kv_cache_memory is None and gpu_at_start is not None:
        budget = kv_cache_budget(
            model, gpu_at_start, utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=info.max_model_len, block_size=args.block_size, dtype=info.kv_cache_dtype,
            device=args.torch_device, cuda_graphs=decode_graphs,
        )
    else:
        budget = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
    per_block = ModelRunner.kv_bytes_per_block(model, args.block_size, info.kv_cache_dtype)
    blocks_per_seq = cdiv(info.max_model_len, args.block_size)
    return max(1, min(budget // per_block, args.max_num_seqs * blocks_per_seq))
