"""Plug the LoRA layer into an engine's scheduler and model runner, at their seams.

    model          each adaptable Linear wrapped in a LoRALinear (layers.py)
    recorder       the adapters on the request and step spans (attach_lora_recorder)
    model runner   an input hook: the batch's adapters made resident, its rows grouped (manager.py)
    scheduler      an admission gate: at most max_loras adapters running (scheduling.py)
    engine         a request check: a request's adapter is read as it arrives, or the request refused

The step itself does not change: EngineCore calls this once, while it builds the engine.
"""

from tinyserve.lora.manager import LoRAManager
from tinyserve.lora.scheduling import LoRAAdmissionGate, running_and_waiting_adapters


def attach_lora(args, model, scheduler, model_runner, request_checks: list) -> LoRAManager:
    manager = LoRAManager(model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          max_cpu_loras=args.max_cpu_loras)
    request_checks.append(manager.check_request)  # EngineCore.check_request: the adapter read before queueing
    model_runner.input_hooks.append(manager.prepare_batch)
    scheduler.admission_gates.append(LoRAAdmissionGate(args.max_loras))
    return manager


def attach_lora_recorder(recorder, manager: LoRAManager, scheduler) -> None:
    """The adapters on the spans: a request's on its queue span, a step's batch (and the adapters of the
    running and waiting requests after it) on the step span (lifecycle/schema.py's LORA_* and STEP_*LORA*)."""
    from tinyserve.lifecycle import schema

    def request_attributes(request) -> dict:
        return {schema.LORA_NAME: request.lora_request.lora_name} if request.lora_request is not None else {}

    def step_attributes(scheduler_output) -> dict:
        running, waiting = running_and_waiting_adapters(scheduler)
        return {schema.STEP_LORA_ADAPTERS: [] if scheduler_output.is_empty else list(manager.batch_adapters),
                schema.STEP_RUNNING_LORA_ADAPTERS: running, schema.STEP_WAITING_LORA_ADAPTERS: waiting}

    recorder.request_hooks.append(request_attributes)
    recorder.step_hooks.append(step_attributes)
