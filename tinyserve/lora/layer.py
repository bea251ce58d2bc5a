"""LoRA adapters as a layer of the engine (`--enable-lora`), at its seams.

    check_args     the adapter limits, and tensor parallelism refused (not yet)
    decode_graphs  off: a batch's adapter groups change with every batch
    attach         model: each adaptable Linear wrapped in a LoRALinear (layers.py, by the manager);
                   the model runner's input hooks: the batch's adapters made resident, its rows grouped
                   (manager.py); the scheduler's admission gates: at most max_loras adapters running
                   (scheduling.py), and a second: its adapter's weights in memory, read again if they
                   were let go (max_cpu_loras), or the request failed alone (failed_requests); a request
                   check: a request's adapter is read as it arrives, or the request refused; the
                   `remove_lora` utility; span attributes: the adapters on the
                   request's queue span and on the step span (lifecycle/schema.py's LORA_* and STEP_*LORA*)

The assembly (tinyserve/assemble.py) attaches it while it builds the engine; the step itself does not change.
"""

from tinyserve.engine.layers import AssemblyContext, EngineHooks, EngineLayer, EngineParts


class LoRALayer(EngineLayer):
    name = "lora"
    decode_graphs = False

    def check_args(self, args) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(args, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(args, name)}")
        if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
            raise ValueError(f"max_cpu_loras ({args.max_cpu_loras}) must be at least max_loras ({args.max_loras})")
        if args.enable_lora and (args.tensor_parallel_size > 1 or args.force_tensor_parallel):
            raise ValueError("enable_lora is not supported with tensor parallelism (tensor_parallel_size > 1) yet")

    def enabled(self, args) -> bool:
        return args.enable_lora

    def attach(self, ctx: AssemblyContext, engine_parts: EngineParts, hooks: EngineHooks) -> None:
        from tinyserve.lifecycle import schema
        from tinyserve.lora.manager import LoRAManager
        from tinyserve.lora.scheduling import LoRAAdmissionGate, running_and_waiting_adapters

        args, scheduler = ctx.args, engine_parts.scheduler

        def running_adapters() -> set[int]:  # what the manager must keep in memory
            return {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}

        manager = LoRAManager(engine_parts.model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                              max_cpu_loras=args.max_cpu_loras, running_adapters=running_adapters)
        engine_parts.model_runner.input_hooks.append(manager.prepare_batch)
        scheduler.admission_gates.append(LoRAAdmissionGate(args.max_loras))
        scheduler.admission_gates.append(manager.admit)  # its weights in memory (read again if let go), or it fails
        hooks.failed_requests.append(manager.failed_requests)  # ... alone, named, at the next step
        hooks.request_checks.append(manager.check_request)  # the adapter read before queueing
        hooks.utilities["remove_lora"] = manager.remove_lora  # an adapter unloaded at run time (vLLM's)
        hooks.parts[self.name] = manager

        def request_attributes(request) -> dict:
            return {schema.LORA_NAME: request.lora_request.lora_name} if request.lora_request is not None else {}

        def step_attributes(scheduler_output) -> dict:
            running, waiting = running_and_waiting_adapters(scheduler)
            return {schema.STEP_LORA_ADAPTERS: [] if scheduler_output.is_empty else list(manager.batch_adapters),
                    schema.STEP_RUNNING_LORA_ADAPTERS: running, schema.STEP_WAITING_LORA_ADAPTERS: waiting}

        hooks.request_attributes.append(request_attributes)
        hooks.step_attributes.append(step_attributes)
