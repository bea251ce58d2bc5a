"""EngineCore: the engine's loop body, `schedule → execute → update`, once per step.

It owns the three pieces of the engine process: the Scheduler (which requests,
how many tokens), the KV cache manager (which blocks), and the ModelRunner (the
forward pass and sampling). Requests come in as EngineCoreRequests; each step
returns EngineCoreOutputs with the new tokens. The in-process client calls
`step()` directly; the engine process (stage ⑤–⑦) calls it from its busy loop.
"""

import atexit
import functools
import gc

from tinyserve.config import DEFAULT_KV_CACHE_MEMORY, EngineArgs, ModelInfo, check_kv_fit
from tinyserve.distributed.kv_transfer.attach import attach_kv_transfer, kv_transfer_classes
from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.pooling_scheduler import PoolingScheduler
from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler import Scheduler
from tinyserve.engine.step_recorder import StepRecorder
from tinyserve.engine.structured_output import StructuredOutputManager
from tinyserve.engine.worker.cpu_threads import ThreadGovernor, engine_cores
from tinyserve.engine.worker.gpu_memory import MemorySnapshot, kv_cache_budget
from tinyserve.engine.worker.model_runner import ModelRunner
from tinyserve.engine.worker.pooling_runner import Pooler, PoolingModelRunner
from tinyserve.engine.worker.tensor_parallel_workers import TensorParallelRunner, TensorParallelWorkers
from tinyserve.kernels.backend import default_attention_backend, get_attention_backend
from tinyserve.lifecycle.engine_spans import EngineSpanBuilder
from tinyserve.lifecycle.tracing import tracing_enabled
from tinyserve.kv_events.attach import attach_kv_events
from tinyserve.lora.attach import attach_lora, attach_lora_recorder
from tinyserve.pipeline_parallel.attach import attach_pipeline, pipeline_classes, start_workers
from tinyserve.spec_decode.attach import attach_spec_decode, speculative_classes
from tinyserve.utils import cdiv
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCore:
    def __init__(self, args: EngineArgs, engine_index: int = 0, model_info: ModelInfo | None = None, *,
                 spans_inline: bool = False) -> None:
        self.args = args
        self.engine_index = engine_index
        self.model_info = model_info or ModelInfo.from_args(args)
        # Checks a layer adds to check_request (attach_lora's): each raises ValueError to refuse a request.
        self.request_checks: list = []
        # Set by the engine process: wakes its idle loop when work ends outside a step (a KV transfer that a
        # step must free or admit: distributed/kv_transfer/attach.py). Stepped directly, nothing to wake.
        self.wake_loop = lambda: None
        # Tensor parallelism: ranks 1..N-1 start now and load their shards while this one
        # loads rank 0's (worker/tensor_parallel_workers.py); force_tensor_parallel takes
        # that path with one rank too.
        # Pipeline parallelism: every other rank, of every stage, starts now (tinyserve/pipeline_parallel/).
        self.tp_workers = None
        if args.pipeline_parallel_size > 1:
            self.tp_workers = start_workers(args, self.model_info, engine_index)
        elif args.tensor_parallel_size > 1 or args.force_tensor_parallel:
            self.tp_workers = TensorParallelWorkers(args, self.model_info, engine_index)
        # The loop's step (vLLM's step_fn): this class's step, or the batch queue's under pipeline parallelism.
        self.step_fn = self.step
        # Until the engine is whole, a failure must also end the process group: the other
        # ranks would wait for this one for ever, and this process could not form another.
        try:
            self._build_scheduler_and_runner()
        except BaseException:
            if self.tp_workers is not None:
                self.tp_workers.shutdown()
            raise
        # Grammars for structured outputs, compiled in threads of their own (structured_output.py).
        self.structured_output = StructuredOutputManager(
            args.structured_outputs_backend, self.model_info.path, self.model_info.vocab_size,
            self.model_info.eos_token_ids, compile_timeout=args.structured_outputs_compile_timeout)
        self.recorder = self._make_recorder(spans_inline)
        if self.lora_manager is not None:  # the adapters on the request's and the step's spans
            attach_lora_recorder(self.recorder, self.lora_manager, self.scheduler)
        if args.speculative_config is not None:  # its request check and step span attributes
            attach_spec_decode(self)
        if args.kv_events_config is not None:  # the block pool's event sink, published after each step
            attach_kv_events(self)
        if args.kv_transfer_config is not None:  # its request check, side channel and prefill span attribute
            attach_kv_transfer(self)
        # Everything allocated so far (model, tokenizer, libraries) lives as long as the
        # engine: move it out of the garbage collector's sight, as vLLM does after start-up.
        # Otherwise every full collection walks those millions of objects again: a
        # ~200 ms pause in the middle of a step, whenever enough small objects were made.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let the interpreter's last collection free them at exit

    def _build_scheduler_and_runner(self) -> None:
        """The model (this rank's shard), the KV cache's size, the scheduler and the model runner."""
        from tinyserve.models.loader import load_model

        args, info, device = self.args, self.model_info, self.args.torch_device
        backend = get_attention_backend(args.attention_backend or default_attention_backend(device), device,
                                        info.max_model_len)
        gpu_at_start = MemorySnapshot.take(device) if device.type == "cuda" else None
        pipeline = args.pipeline_parallel_size > 1
        model, _ = load_model(info.path, info.torch_dtype, device, backend, max_model_len=info.max_model_len,
                              tp=self.tp_workers.tp if self.tp_workers else None,
                              pp=self.tp_workers.stage if pipeline else None)
        # The Triton kernels read every shape from tensors, so a decode step can be
        # recorded once per batch-size bucket and replayed (CUDA graphs); not yet with
        # the collectives of tensor parallelism inside.
        decode_graphs = (backend.name == "triton" and not args.enforce_eager and self.tp_workers is None
                         and not args.enable_lora)  # LoRA's groups change with every batch
        num_blocks = args.num_kv_blocks or self._blocks_from_memory(model, gpu_at_start, decode_graphs)
        if self.tp_workers is not None:
            self.tp_workers.start(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        # --runner: what a step makes of its hidden states. Generate: tokens. Pooling: a vector per
        # request, and the request is done (pooling_scheduler.py, worker/pooling_runner.py).
        scheduler_class, runner_class = Scheduler, ModelRunner
        if args.runner == "pooling":
            scheduler_class = PoolingScheduler
            runner_class = functools.partial(PoolingModelRunner, pooler=Pooler(**args.pooler_config))
        # --speculative-config: drafts proposed, verified in one pass, rolled back (tinyserve/spec_decode/).
        if args.speculative_config is not None:
            scheduler_class, runner_class = speculative_classes(args, info, backend)
        if pipeline:  # the scheduler skips requests in flight; each stage runs its layers (pipeline_parallel/)
            scheduler_class, runner_class = pipeline_classes(self.tp_workers)
        # --kv-transfer-config: prompts' K/V sent to, or received from, other engines (tinyserve/distributed/).
        if args.kv_transfer_config is not None:
            scheduler_class, runner_class = kv_transfer_classes(args)
        self.scheduler = scheduler_class(self.kv_cache_manager, max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_num_seqs=args.max_num_seqs, max_model_len=info.max_model_len,
                                   policy=args.scheduling_policy)
        self.model_runner = runner_class(model, num_blocks=num_blocks, block_size=args.block_size,
                                        dtype=info.kv_cache_dtype, device=device, seed=args.seed,
                                        decode_graphs=decode_graphs, max_num_seqs=args.max_num_seqs,
                                        max_model_len=info.max_model_len)
        if pipeline:  # stage 0 submits batches; the engine steps through the batch queue
            attach_pipeline(self)
        elif self.tp_workers is not None:
            self.model_runner = TensorParallelRunner(self.model_runner, self.tp_workers)
        self.lora_manager = attach_lora(args, model, self.scheduler, self.model_runner,
                                        self.request_checks) if args.enable_lora else None
        self.model_runner.warm_up()

    def _make_recorder(self, spans_inline: bool) -> StepRecorder:
        """The step's clocks, stats, spans and CPU threads (step_recorder.py)."""
        args = self.args
        # On CPU, the forward pass's thread count: --cpu-threads, or a governor's (worker/cpu_threads.py).
        # Under tensor parallelism each rank keeps the count it started with (its share of the cores).
        governor, fixed = None, None
        if args.torch_device.type == "cpu" and self.tp_workers is None:
            if args.cpu_threads is not None:
                fixed = args.cpu_threads  # set before every execute, as the governor's count
            else:
                governor = ThreadGovernor(engine_cores())
        # Tracing: spans are built from what each step recorded, on the builder's own thread,
        # or in batches in this thread (spans_inline: the offline LLM, see engine_spans.py).
        span_builder = EngineSpanBuilder(self.engine_index, inline=spans_inline,
                                         structured_outputs_backend=args.structured_outputs_backend,
                                         ) if tracing_enabled() else None
        return StepRecorder(self.engine_index, self.scheduler, self.model_runner, governor, fixed, span_builder)

    # What the recorder keeps, read by tests, notebooks and benchmarks.
    thread_governor = property(lambda self: self.recorder.threads.governor)
    span_builder = property(lambda self: self.recorder.span_builder)
    last_scheduler_output = property(lambda self: self.recorder.last_scheduler_output)
    last_step_times = property(lambda self: self.recorder.last_step_times)

    def _blocks_from_memory(self, model, gpu_at_start: MemorySnapshot | None, decode_graphs: bool) -> int:
        """--kv-cache-memory if given; else on a GPU what --gpu-memory-utilization leaves; else 1 GiB."""
        args, info = self.args, self.model_info
        if args.kv_cache_memory is None and gpu_at_start is not None:
            budget = kv_cache_budget(
                model, gpu_at_start, utilization=args.gpu_memory_utilization,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_model_len=info.max_model_len, block_size=args.block_size, dtype=info.kv_cache_dtype,
                device=args.torch_device, cuda_graphs=decode_graphs,
            )
        else:
            budget = args.kv_cache_memory or DEFAULT_KV_CACHE_MEMORY
        per_block = ModelRunner.kv_bytes_per_block(model, self.args.block_size, self.model_info.kv_cache_dtype)
        # No point in more blocks than every seat filled to the full context length.
        blocks_per_seq = cdiv(self.model_info.max_model_len, self.args.block_size)
        return max(1, min(budget // per_block, self.args.max_num_seqs * blocks_per_seq))

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache_manager.num_blocks

    # ---- requests ------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request the front end has validated (its input processor checks every field)."""
        self.recorder.on_request(request)
        engine_request = Request.from_engine_core_request(request)
        if request.sampling_params.structured_outputs is not None:
            self.structured_output.add_request(engine_request)
        self.scheduler.add_request(engine_request)

    def check_request(self, request: EngineCoreRequest) -> None:
        """Raise ValueError if this request could never be served by this engine.

        The front end has checked the same things; an engine process checks again what
        arrives on its socket, since a bad prompt id would fail a step for every request.
        """
        self.model_info.validate_prompt(request.prompt_token_ids)
        check_kv_fit(
            len(request.prompt_token_ids),
            request.sampling_params.max_tokens,
            self.model_info.max_model_len,
            self.args.block_size,
            self.num_kv_blocks,
        )
        for check in self.request_checks:  # the layers' own (a LoRA adapter that cannot be read, say)
            check(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = self.scheduler.abort_requests(request_ids)
        self.recorder.on_finished(outputs)
        return outputs

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests

    @property
    def has_requests(self) -> bool:
        """Whether to step: requests to run, or finished ones the worker must hear of (vLLM's has_requests).

        The ids of requests that finished (or were aborted) reach the worker with the next
        step's SchedulerOutput; with nothing left to run, one more, empty, step delivers
        them, so the worker lets go of their state at once.
        """
        return self.scheduler.has_unfinished_requests or self.scheduler.has_finished_requests

    # ---- one step --------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One iteration of the engine loop: schedule → execute → update."""
        with self.recorder.step() as step:  # clocks, stats, spans, CPU threads: step_recorder.py
            failed = self._wait_for_grammars()
            scheduler_output = self.scheduler.schedule()
            self.structured_output.grammar_bitmask(scheduler_output, self.scheduler.requests)
            step.scheduled(scheduler_output)
            with step.executing():
                runner_output = self.model_runner.execute_model(scheduler_output)
            step.outputs = failed + self.scheduler.update_from_output(scheduler_output, runner_output)
        return step.engine_core_outputs

    def _wait_for_grammars(self) -> list[EngineCoreOutput]:
        """With nothing to run but requests whose grammar is compiling, wait for one rather than spin.

        Returns the outputs of requests ended because their grammar could not be made in time or at all,
        each carrying the reason as its `error` (the front end answers it as a 400).
        """
        scheduler = self.scheduler
        if not scheduler.running and scheduler.waiting and all(r.waiting_for_grammar for r in scheduler.waiting):
            self.structured_output.wait_for_a_grammar(timeout=0.05)
        failed = self.structured_output.failed_request_ids()
        if not failed:
            return []
        outputs = self.abort_requests(list(failed))
        for output in outputs:
            output.error, output.error_param = failed[output.request_id], "structured_outputs"
        return outputs

    def flush_spans(self) -> None:
        self.recorder.flush()

    def shutdown(self) -> None:
        """Finish building spans (the caller then flushes the tracer); stop the other TP ranks."""
        self.structured_output.shutdown()
        self.recorder.close()
        if self.tp_workers is not None:
            self.tp_workers.shutdown()
            self.tp_workers = None

    # ---- utilities -------------------------------------------------------------

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def remove_lora(self, lora_id: int) -> bool:
        """Forget a LoRA adapter unloaded at run time (vLLM's remove_lora); False if this engine did not hold it."""
        return self.lora_manager is not None and self.lora_manager.remove_lora(lora_id)
