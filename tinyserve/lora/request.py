"""The LoRARequest a prompt runs under, as LLM.generate takes it (`lora_requests_per_prompt`).

`LoRARequest` itself is a request type beside SamplingParams (tinyserve/lora_request.py), since
it crosses the wire and the engine reads it; it is imported here so that a user's
`from tinyserve.lora.request import LoRARequest` is vLLM's own line.
"""

from tinyserve.lora_request import LoRARequest

__all__ = ["LoRARequest", "lora_requests_per_prompt"]


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
