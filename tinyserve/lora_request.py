"""LoRARequest: the adapter a request runs under, as vLLM's `vllm.lora.request.LoRARequest`.

    LoRARequest("sql", 1, "/adapters/sql")      # lora_name, lora_int_id, lora_path

`lora_int_id` identifies the adapter in the engine (its slot, its cached weights, its KV
blocks) and must be at least 1 and unique per adapter; `lora_name` is what the API's
`model` field names. It is a msgspec Struct because it crosses the wire inside the
EngineCoreRequest and the step's NewRequestData, beside the SamplingParams; it imports
nothing else, so the scheduler (no torch) may read it, and the engine reads it without
knowing the LoRA layer (tinyserve/lora/). Users import it as vLLM's users do, from
`tinyserve.lora.request`.
"""

import msgspec


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
