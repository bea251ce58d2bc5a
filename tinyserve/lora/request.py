"""LoRARequest: the adapter a request runs under, as vLLM's `vllm.lora.request.LoRARequest`.

    LoRARequest("sql", 1, "/adapters/sql")      # lora_name, lora_int_id, lora_path

`lora_int_id` identifies the adapter in the engine (its slot, its cached weights, its KV
blocks) and must be at least 1 and unique per adapter; `lora_name` is what the API's
`model` field names. It is a msgspec Struct because it crosses the wire inside the
EngineCoreRequest and the step's NewRequestData; it imports nothing else, so the
scheduler (no torch) may read it.
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


def block_hash_root(lora_request: LoRARequest | None) -> bytes:
    """What the prefix cache chains a request's first block from: b"" for the base model.

    An adapter changes every K and V, so the same prompt under two adapters (or under one
    and the base model) is different KV: its blocks must never be shared. The adapter's
    id, name and path all go into the root, so a name loaded again from elsewhere gets
    its own blocks too.
    """
    if lora_request is None:
        return b""
    return f"lora\x00{lora_request.lora_int_id}\x00{lora_request.lora_name}\x00{lora_request.lora_path}".encode()


def lora_requests_per_prompt(lora_request, count: int) -> list[LoRARequest | None]:
    """LLM.generate's lora_request, one per prompt: one LoRARequest (or None) for all, or a list of `count`.

    A dict is taken as LoRARequest's fields, as a trace logs them (replay hands them over so).
    """
    if lora_request is None or isinstance(lora_request, (LoRARequest, dict)):
        return [_as_lora_request(lora_request)] * count
    if isinstance(lora_request, (list, tuple)) and len(lora_request) == count:
        return [_as_lora_request(item) for item in lora_request]
    raise ValueError(f"lora_request must be one LoRARequest (or None) or a list of {count} (one per prompt)")


def _as_lora_request(item) -> LoRARequest | None:
    if item is None or isinstance(item, LoRARequest):
        return item
    if isinstance(item, dict):
        try:
            return LoRARequest(**item)
        except TypeError as error:
            raise ValueError(f"lora_request: {error}") from None
    raise ValueError(f"lora_request entries must be LoRARequests (or their fields as a dict) or None, "
                     f"got {type(item).__name__}")
