"""Plug the LoRA layer into an engine's scheduler and model runner, at their seams.

    model          each adaptable Linear wrapped in a LoRALinear (layers.py)
    model runner   an input hook: the batch's adapters made resident, its rows grouped (manager.py)
    scheduler      an admission gate: at most max_loras adapters running (scheduling.py)

The step itself does not change: EngineCore calls this once, while it builds the engine.
"""

from tinyserve.lora.manager import LoRAManager
from tinyserve.lora.scheduling import LoRAAdmissionGate


def attach_lora(args, model, scheduler, model_runner) -> LoRAManager:
    manager = LoRAManager(model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          max_cpu_loras=args.max_cpu_loras)
    model_runner.input_hooks.append(manager.prepare_batch)
    scheduler.admission_gates.append(LoRAAdmissionGate(args.max_loras))
    return manager
