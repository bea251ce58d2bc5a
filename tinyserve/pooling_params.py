"""PoolingParams: what a pooling request asks for, with vLLM's names (`vllm.PoolingParams`).

A pooling request computes a vector from its prompt instead of generating tokens:
one pass over the prompt (in chunks if it is long) and done. What the vector is
(which positions are pooled, whether it is L2-normalised) is the server's
`--pooler-config`; a request may only turn normalisation off or on.

    normalize    None: the server's (L2-normalised by default, as vLLM's embed task);
                 True / False: this request's choice
    dimensions   a shorter vector (Matryoshka models only): refused, no model here is one
"""

import msgspec

from tinyserve.errors import InvalidInputError
from tinyserve.sampling_params import SamplingParams

POOLING_TASKS = ("embed",)


class PoolingParams(msgspec.Struct, omit_defaults=True):
    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidInputError(f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}", "task")
        if self.dimensions is not None:
            # vLLM's answer for a model without Matryoshka training: no shorter vectors.
            raise InvalidInputError(
                f"dimensions={self.dimensions}: this model does not support Matryoshka representation, "
                "so its embeddings cannot be shortened; leave dimensions out", "dimensions")

    @property
    def n(self) -> int:
        """One vector per request (a request with SamplingParams may ask for n samples)."""
        return 1

    def clone(self, **changes) -> "PoolingParams":
        return msgspec.structs.replace(self, **changes)


# Every engine request carries SamplingParams; a pooling request's are these. Nothing samples with
# them: the engine's checks read max_tokens only (its KV must fit the prompt and one more token).
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)
