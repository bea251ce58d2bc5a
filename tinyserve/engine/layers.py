"""The seam between the engine and its layers: what a layer may add, and where it goes.

A capability beside the core (speculative decoding, pipeline parallelism, LoRA, a KV
connector, KV cache events, Ray) is a layer: a package of its own with one `EngineLayer`
in its `layer.py`. The engine never imports a layer. The one assembly point
(tinyserve/assemble.py) lists the layers, asks each enabled one for its contribution while
it builds an engine, and hands EngineCore the finished parts and one `EngineHooks`:

    check_args        its own flags, checked with the rest of EngineArgs (every layer, on or off)
    start_ranks       the engine's other ranks, before the model loads (pipeline parallelism)
    rank_launcher     what starts tensor-parallel ranks (Ray actors instead of processes)
    block_event_sink  the block pool's listener (KV cache events)
    runner_class      the model runner's class, given the one so far (wrap it with functools.partial)
    scheduler_class   the scheduler's class, given the one so far and the model runner built
    wrap_runner       the runner the engine steps, around the one built (pipeline stage 0)
    attach            hooks into the named lists of EngineHooks, and hook lists the scheduler and
                      model runner own (admission_gates, input_hooks, embeds_hooks), once both are built
    step_fn           the engine loop's step, if not EngineCore.step (the batch queue)

Every method's default adds nothing, so a layer writes only what it changes. A layer never
assigns to another object's attributes: what it hands over goes in through a constructor
argument (the classes, the sink) or a named hook list.
"""

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class AssemblyContext:
    """What a layer may read while an engine is assembled."""

    args: object  # EngineArgs
    model_info: object  # ModelInfo
    engine_index: int
    attention_backend: object  # kernels.backend.AttentionBackend
    other_ranks: object = None  # TensorParallelWorkers, a layer's ranks (start_ranks), or None
    wake_loop: Callable[[], None] = lambda: None  # wakes an idle engine process's loop (work ended outside a step)


@dataclass
class EngineHooks:
    """The named lists where layers put what they add to an engine; EngineCore and its recorder run them."""

    # request_checks(EngineCoreRequest): raise ValueError to refuse a request as it arrives (EngineCore.check_request)
    request_checks: list[Callable] = field(default_factory=list)
    # failed_requests() -> {request_id: (error, error_param)}: waiting requests a layer found it cannot serve after
    # all (a LoRA adapter that cannot be read again), ended at the next step with the error on their output
    failed_requests: list[Callable] = field(default_factory=list)
    # post_step(StepRecord) -> dict: after every step, traced or not (KV events drained and published);
    # what it returns goes on the step span
    post_step: list[Callable] = field(default_factory=list)
    # scheduler_stats(SchedulerStats): a layer's counters added to the stats of every step and of get_stats (the
    # image encoder cache's queries and hits, which live in the runner, not the scheduler)
    scheduler_stats: list[Callable] = field(default_factory=list)
    # shutdown(): as the engine shuts down (a publisher's socket, a connector's side channel)
    shutdown: list[Callable] = field(default_factory=list)
    # utilities: name -> method, answered as EngineCore's own utility calls (wire/ipc.py's UTILITY_METHODS)
    utilities: dict[str, Callable] = field(default_factory=dict)
    # Span attributes, read only when tracing (step_recorder.py): request_attributes(EngineCoreRequest) for its
    # queue span, step_attributes(SchedulerOutput) for the step span, finish_attributes(request_id) for a
    # finished request's decode span, prefill_attributes(request_id) for its prefill span
    request_attributes: list[Callable] = field(default_factory=list)
    step_attributes: list[Callable] = field(default_factory=list)
    # step_spans(SchedulerOutput) -> [(name, start, end, attributes)]: a layer's own stages of the step (times on
    # time.time()'s clock), each a span inside the step's tinyserve.execute (the image encoder's tinyserve.encode)
    step_spans: list[Callable] = field(default_factory=list)
    finish_attributes: list[Callable] = field(default_factory=list)
    prefill_attributes: list[Callable] = field(default_factory=list)
    # What each layer built, by layer name, for tests, notebooks and benchmarks to read (LoRA's manager)
    parts: dict[str, object] = field(default_factory=dict)


class EngineLayer:
    """One capability's contribution to an engine; a layer overrides what it adds."""

    name = ""
    decode_graphs = True  # False: its batches change what a recorded CUDA graph would replay (LoRA's groups)

    def check_args(self, args) -> None:
        """Raise ValueError naming the flag: this layer's arguments, and what it does not combine with."""

    def enabled(self, args) -> bool:
        return False

    def start_ranks(self, args, model_info, engine_index: int):
        return None

    def rank_launcher(self, args, engine_index: int):
        return None

    def block_event_sink(self, ctx: AssemblyContext):
        return None

    def runner_class(self, ctx: AssemblyContext, runner_class):
        return runner_class

    def scheduler_class(self, ctx: AssemblyContext, scheduler_class, model_runner):
        return scheduler_class

    def wrap_runner(self, ctx: AssemblyContext, model_runner):
        return model_runner

    def attach(self, ctx: AssemblyContext, engine_parts: "EngineParts", hooks: EngineHooks) -> None:
        pass

    def step_fn(self, engine):
        return None


@dataclass
class EngineParts:
    """An engine's finished parts, as the assembly hands them to EngineCore."""

    model: object
    kv_cache_manager: object  # core.kv_cache_manager.KVCacheManager
    scheduler: object  # core.scheduler.Scheduler, or a layer's subclass
    model_runner: object  # worker.model_runner.ModelRunner, a layer's subclass, or a wrapper of one
    other_ranks: object = None  # the engine's other tensor- or pipeline-parallel ranks, or None
    make_step_fn: Callable = lambda engine: None  # engine -> the loop's step (a layer's step_fn); None: EngineCore.step
