"""Stage ⑧ for a pooling engine (`--runner pooling`): the engine's vector becomes a PoolingRequestOutput.

There is nothing to detokenize: a pooling request's one engine output carries its vector
(`EngineCoreOutput.pooling_output`) and finishes it. This class stands where the
OutputProcessor (output_processor.py) stands for a generating engine, with the same
methods, so AsyncLLM and LLMEngine drive either the same way:

    add_request      register the request (one engine request: its own id)
    process_outputs  each finished output → PoolingRequestOutput (outputs None if it was aborted)
    abort_request    forget it
"""

from dataclasses import dataclass

import torch

from tinyserve.errors import InvalidInputError
from tinyserve.frontend.output_processor import OutputProcessorOutput
from tinyserve.frontend.request_observers import RequestObservers
from tinyserve.lifecycle.request_spans import NO_SPANS
from tinyserve.outputs import CompletionOutput, PoolingOutput, PoolingRequestOutput
from tinyserve.wire.messages import EngineCoreOutput


@dataclass(eq=False)
class PoolingRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    spans: object = NO_SPANS

    @property
    def parent(self) -> "PoolingRequest":
        """Its own parent: a pooling request is never fanned out (AsyncLLM reads child.parent)."""
        return self


class PoolingOutputProcessor:
    def __init__(self, observers: RequestObservers | None = None) -> None:
        """observers: where a request's spans are found by its id (AsyncLLM's, LLMEngine's)."""
        self.observers = observers if observers is not None else RequestObservers()
        self.parents: dict[str, PoolingRequest] = {}
        self.children = self.parents  # one engine request per request, under the same id

    @property
    def num_unfinished(self) -> int:
        return len(self.parents)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params,
                    output_kind=None, lora_request=None) -> list[str]:
        if request_id in self.parents:
            raise InvalidInputError(f"request_id {request_id!r} is already in use", "request_id")
        self.parents[request_id] = PoolingRequest(request_id, prompt, prompt_token_ids,
                                                  self.observers.get(request_id))
        return [request_id]

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        processed = OutputProcessorOutput()
        for output in outputs:
            request = self.parents.get(output.request_id)
            if request is None or output.finish_reason is None:
                continue
            del self.parents[output.request_id]
            vector = output.pooling_output  # None: aborted in the engine (the server draining, say)
            if vector is not None:
                request.spans.pooled(len(vector))
            request.spans.finish([CompletionOutput(0, "", [], output.finish_reason)])
            processed.request_outputs.append(PoolingRequestOutput(
                request_id=request.request_id,
                outputs=None if vector is None else PoolingOutput(torch.tensor(vector, dtype=torch.float32)),
                prompt_token_ids=request.prompt_token_ids,
                finished=True, num_cached_tokens=output.num_cached_tokens, prompt=request.prompt, metrics=output.times,
            ))
        return processed

    def abort_request(self, request_id: str, error: BaseException | None = None) -> list[str]:
        request = self.parents.pop(request_id, None)
        if request is None:
            return []
        request.spans.finish([CompletionOutput(0, "", [], "abort")], error)
        return [request_id]
