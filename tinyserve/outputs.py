"""What generation hands back: RequestOutput and CompletionOutput, with vLLM's fields; and what
pooling hands back: PoolingRequestOutput (LLM.encode), EmbeddingRequestOutput (LLM.embed)."""

from dataclasses import dataclass

import torch

from tinyserve.wire.messages import RequestTimes


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the sampled token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs, when logprobs are asked for

    def finished(self) -> bool:
        """A method, as vLLM's CompletionOutput.finished() (RequestOutput.finished is a field)."""
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestTimes | None = None  # the engine's timestamps, once finished
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first
    # (nothing predicts it); each holds the prompt token itself plus the top ones.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_request: object = None  # the LoRARequest it ran under (tinyserve/lora_request.py); None: the base model
    # vLLM's: a prefill asked for with kv_transfer_params {"do_remote_decode": true} says here where its
    # K/V wait for the decode instance (distributed/kv_transfer/)
    kv_transfer_params: dict | None = None


@dataclass(slots=True)
class PoolingOutput:
    """A pooling request's result (vLLM's): `data`, the vector as a float32 tensor."""

    data: torch.Tensor


@dataclass(slots=True)
class PoolingRequestOutput:
    """What `LLM.encode` and `AsyncLLM.encode` hand back: one per input, finished at once."""

    request_id: str
    outputs: PoolingOutput | None  # None: aborted before its vector was made
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestTimes | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """An embedding as `LLM.embed` gives it (vLLM's): `embedding`, a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0
    prompt: str | None = None

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(output.request_id, EmbeddingOutput(output.outputs.data.tolist()), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens, output.prompt)
