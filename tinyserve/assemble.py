"""The one assembly point: an engine built from its parts and its layers.

    LAYERS                  every capability beside the core, one EngineLayer each (engine/layers.py)
    check_engine_args       EngineArgs' own checks, then each layer's checks of its flags
    build_engine_core       what runs in an engine process (or in the caller's, offline):

        other ranks     a layer's (pipeline parallelism), or tensor parallelism's, started first: they
                        load their shards while this process loads its own
        model           this rank's shard, with the attention backend the device runs
        KV cache        its size (worker/kv_cache_size.py), the manager with a layer's event sink
        runner          ModelRunner (or pooling's), each enabled layer's class around it, built
        scheduler       Scheduler (or pooling's), each enabled layer's class around it, built
        wrapped         the runner the engine steps: stage 0's, or rank 0's of tensor parallelism
        attached        the layers' hooks, in one EngineHooks
        EngineCore      handed all of it; the step is a layer's (the batch queue) or its own

The engine (engine/) and EngineArgs (config.py) import no layer: a new capability is a package
with a `layer.py`, and one line in LAYERS below (docs/design.md, "Adding a layer"). A capability
that reads the answers in the API process instead (the reasoning parser) is one line in
ANSWER_LAYERS: `tinyserve serve` builds those its flags enable (entrypoints/api/answer_layers.py).
"""

import functools

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.distributed.kv_transfer.layer import KVTransferLayer
from tinyserve.distributed.layer import RayLayer
from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.pooling_scheduler import PoolingScheduler
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.engine.engine_core import EngineCore
from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts
from tinyserve.kv_events.layer import KVEventsLayer
from tinyserve.lora.layer import LoRALayer
from tinyserve.multimodal.layer import MultiModalLayer
from tinyserve.pipeline_parallel.layer import PipelineParallelLayer
from tinyserve.prompt_embeds.layer import PromptEmbedsLayer
from tinyserve.reasoning.layer import ReasoningLayer
from tinyserve.spec_decode.layer import SpecDecodeLayer

# In the order their classes wrap the core's: a later layer's class is built around an earlier one's.
LAYERS: list[EngineLayer] = [SpecDecodeLayer(), PipelineParallelLayer(), KVTransferLayer(), LoRALayer(),
                             KVEventsLayer(), RayLayer(), PromptEmbedsLayer(), MultiModalLayer()]
# The layers of the API's answers, in the order they read a choice's text (each one the content the one before left).
ANSWER_LAYERS = [ReasoningLayer]


def check_engine_args(args: EngineArgs) -> EngineArgs:
    """EngineArgs checked whole: its own fields (EngineArgs.validate), then every layer's flags. Returns args."""
    args.validate()
    for layer in LAYERS:
        layer.check_args(args)
    return args


def engine_args(**kwargs) -> EngineArgs:
    """EngineArgs from keyword arguments (LLM's), checked whole (EngineArgs.from_kwargs, then the layers')."""
    return check_engine_args(EngineArgs.from_kwargs(**kwargs))


def build_engine_core(args: EngineArgs, engine_index: int = 0, model_info: ModelInfo | None = None, *,
                      spans_inline: bool = False, wake_loop=None) -> EngineCore:
    """An EngineCore with its layers; every process that runs an engine calls this (engine_core_proc.py's
    `make_engine_core`, the in-process client). wake_loop: wakes an idle engine process's loop."""
    info = model_info or ModelInfo.from_args(args)
    layers = [layer for layer in LAYERS if layer.enabled(args)]
    # Until the engine is whole, a failure must also end the process group: the other
    # ranks would wait for this one for ever, and this process could not form another.
    other_ranks = _start_other_ranks(args, info, engine_index, layers)
    try:
        ctx = AssemblyContext(args, info, engine_index, _attention_backend(args, info), other_ranks,
                              wake_loop or (lambda: None))
        hooks = EngineHooks()
        parts = _build_parts(ctx, layers, hooks)
        return EngineCore(args, engine_index, info, parts, hooks, spans_inline=spans_inline)
    except BaseException:
        if other_ranks is not None:
            other_ranks.shutdown()
        raise


def _start_other_ranks(args: EngineArgs, info: ModelInfo, engine_index: int, layers: list[EngineLayer]):
    """A layer's ranks (pipeline parallelism: every rank of every stage); else tensor parallelism's ranks
    1..N-1 (force_tensor_parallel takes that path with one rank too), started by a layer's launcher (Ray) or
    as processes; else None."""
    for layer in layers:
        ranks = layer.start_ranks(args, info, engine_index)
        if ranks is not None:
            return ranks
    if args.tensor_parallel_size > 1 or args.force_tensor_parallel:
        from tinyserve.engine.worker.tensor_parallel_workers import TensorParallelWorkers

        launcher = next((x for layer in layers if (x := layer.rank_launcher(args, engine_index)) is not None), None)
        return TensorParallelWorkers(args, info, engine_index, launcher=launcher)
    return None


def _attention_backend(args: EngineArgs, info: ModelInfo):
    from tinyserve.kernels.backend import default_attention_backend, get_attention_backend

    device = args.torch_device
    return get_attention_backend(args.attention_backend or default_attention_backend(device), device,
                                 info.max_model_len)


def _build_parts(ctx: AssemblyContext, layers: list[EngineLayer], hooks: EngineHooks) -> EngineParts:
    """The model, the KV cache, the runner and the scheduler, each layer's classes around the core's."""
    from tinyserve.engine.worker.gpu_memory import MemorySnapshot
    from tinyserve.engine.worker.kv_cache_size import num_kv_blocks
    from tinyserve.models.loader import load_model

    args, info, ranks = ctx.args, ctx.model_info, ctx.other_ranks
    device = args.torch_device
    gpu_at_start = MemorySnapshot.take(device) if device.type == "cuda" else None
    model, _ = load_model(info.path, info.torch_dtype, device, ctx.attention_backend,
                          max_model_len=info.max_model_len, tp=getattr(ranks, "tp", None),
                          pp=getattr(ranks, "stage", None))
    # The Triton kernels read every shape from tensors, so a decode step can be recorded
    # once per batch-size bucket and replayed (CUDA graphs); not yet with the collectives
    # of tensor parallelism inside, nor with a layer whose batches change the graph.
    decode_graphs = (ctx.attention_backend.name == "triton" and not args.enforce_eager and ranks is None
                     and all(layer.decode_graphs for layer in layers))
    num_blocks = num_kv_blocks(args, info, model, gpu_at_start, decode_graphs)
    if ranks is not None:
        ranks.start(num_blocks)
    sink = next((s for layer in layers if (s := layer.block_event_sink(ctx)) is not None), None)
    kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching, event_sink=sink)
    model_runner = _build_runner(ctx, layers, model, num_blocks, decode_graphs)
    scheduler_class = PoolingScheduler if args.runner == "pooling" else Scheduler
    for layer in layers:
        scheduler_class = layer.scheduler_class(ctx, scheduler_class, model_runner)
    scheduler = scheduler_class(kv_cache_manager, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_num_seqs=args.max_num_seqs, max_model_len=info.max_model_len,
                                policy=args.scheduling_policy)
    model_runner = _wrap_runner(ctx, layers, model_runner)
    parts = EngineParts(model, kv_cache_manager, scheduler, model_runner, ranks,
                        make_step_fn=lambda engine: next((fn for layer in layers
                                                          if (fn := layer.step_fn(engine)) is not None), None))
    for layer in layers:
        layer.attach(ctx, parts, hooks)
    parts.model_runner.warm_up()
    return parts


def _build_runner(ctx: AssemblyContext, layers: list[EngineLayer], model, num_blocks: int, decode_graphs: bool):
    """--runner: what a step makes of its hidden states. Generate: tokens (ModelRunner). Pooling: a vector per
    request, and the request is done (worker/pooling_runner.py). Then each layer's class around it."""
    from tinyserve.engine.worker.model_runner import ModelRunner
    from tinyserve.engine.worker.pooling_runner import Pooler, PoolingModelRunner

    args, info = ctx.args, ctx.model_info
    runner_class = ModelRunner
    if args.runner == "pooling":
        runner_class = functools.partial(PoolingModelRunner, pooler=Pooler(**args.pooler_config))
    for layer in layers:
        runner_class = layer.runner_class(ctx, runner_class)
    return runner_class(model, num_blocks=num_blocks, block_size=args.block_size, dtype=info.kv_cache_dtype,
                        device=args.torch_device, seed=args.seed, decode_graphs=decode_graphs,
                        max_num_seqs=args.max_num_seqs, max_model_len=info.max_model_len)


def _wrap_runner(ctx: AssemblyContext, layers: list[EngineLayer], model_runner):
    """The runner the engine steps: a layer's around the one built (pipeline stage 0's), or tensor parallelism's
    rank 0 (which sends each step to the other ranks first)."""
    for layer in layers:
        wrapped = layer.wrap_runner(ctx, model_runner)
        if wrapped is not model_runner:
            return wrapped
    if ctx.other_ranks is not None:
        from tinyserve.engine.worker.tensor_parallel_workers import TensorParallelRunner

        return TensorParallelRunner(model_runner, ctx.other_ranks)
    return model_runner
