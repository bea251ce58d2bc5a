"""vLLM's LoRA gauge, `vllm:lora_requests_info` (with --metrics-prefix's prefix), a stat logger of its own.

    vllm:lora_requests_info{max_lora="2", running_lora_adapters="chat,sql", waiting_lora_adapters=""} 1.7e9

As vLLM defines it: the labels say which adapters have requests running and which have
requests waiting (names joined by commas), and max_lora the server's --max-loras; the
value is the time (Unix seconds) the labels were last set. Here a request waits from the
moment it is sent until its first token arrives, and runs until it finishes.
"""

import time

from prometheus_client import Gauge


class LoRAMetrics:
    def __init__(self, registry, prefix: str, max_loras: int) -> None:
        self.max_loras = max_loras
        self.gauge = Gauge(f"{prefix}:lora_requests_info", "Running stats on lora requests.",
                           ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)
        self.waiting: dict[str, str] = {}  # engine request id -> adapter name
        self.running: dict[str, str] = {}
        self._set()

    def on_request(self, request_id: str, children, params) -> None:
        for child in children:
            if child.lora_request is not None:
                self.waiting[child.request_id] = child.lora_request.lora_name
        self._set()

    def on_outputs(self, outputs, received_time: float | None = None,
                   stop_string_finishes: dict[str, str] | None = None) -> None:
        for output in outputs.outputs:
            request_id = output.request_id
            if request_id in self.waiting and output.new_token_ids:
                self.running[request_id] = self.waiting.pop(request_id)
            if output.finished or request_id in (stop_string_finishes or {}):
                self.waiting.pop(request_id, None)
                self.running.pop(request_id, None)
        self._set()

    def _set(self) -> None:
        self.gauge.labels(max_lora=str(self.max_loras), waiting_lora_adapters=",".join(sorted(set(self.waiting.values()))),
                          running_lora_adapters=",".join(sorted(set(self.running.values())))).set(time.time())


def lora_stat_loggers(ctx, metrics) -> list:
    """The LoRA gauge's logger when the server serves adapters; none otherwise."""
    if ctx.loras is None:
        return []
    return [LoRAMetrics(metrics.registry, metrics.prefix, ctx.engine.engine_args.max_loras)]
