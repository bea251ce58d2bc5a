"""The scheduler's LoRA gate: no more than max_loras adapters among the running requests.

The worker has max_loras slots, and a batch may hold any running request, so the set of
adapters the running requests use must fit them. A waiting request whose adapter is
neither running already nor has a free slot to take keeps its place in the queue and is
passed over, as vLLM's scheduler does; those behind it may still start. Plain Python:
the scheduler imports no torch.
"""


class LoRAAdmissionGate:
    """An admission gate of the Scheduler (`Scheduler.admission_gates`): may `request` start now?"""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras

    def __call__(self, request, scheduler) -> bool:
        if request.lora_request is None:
            return True
        running = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}
        return request.lora_request.lora_int_id in running or len(running) < self.max_loras


def running_and_waiting_adapters(scheduler) -> tuple[list[str], list[str]]:
    """The names of the adapters of the running requests and of the waiting ones (step spans, metrics)."""
    def names(requests) -> list[str]:
        return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
    return names(scheduler.running), names(scheduler.waiting)
