"""LLMEngine: the front end in the caller's thread, for the offline LLM (stages ② ③ ⑧).

    add_request(request_id, prompt, params)
        │ validate + fan out n > 1 (InputProcessor.make_requests)
        │ register with the OutputProcessor
        ▼
    InprocClient ── EngineCoreRequest ──► EngineCore (this process)
        ▲
    step(): one engine step; its outputs detokenized into RequestOutputs

It is AsyncLLM's path without the event loop: the same input processor, the same
output processor, the same messages, an engine client with the same methods. So a
feature added there (a sampling option, structured outputs) works offline too. As in
vLLM, where LLM drives an LLMEngine.
"""

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.frontend.inproc_client import InprocClient
from tinyserve.frontend.input_processor import InputProcessor, ProcessedPrompt
from tinyserve.frontend.output_processor import OutputKind, OutputProcessor
from tinyserve.frontend.pooling_output import PoolingOutputProcessor
from tinyserve.frontend.request_observers import RequestObservers
from tinyserve.outputs import RequestOutput
from tinyserve.sampling_params import SamplingParams
from tinyserve.frontend.request_stream import engine_refusal
from tinyserve.wire.messages import EngineCoreRequest


class LLMEngine:
    def __init__(self, engine_args: EngineArgs, model_info: ModelInfo, tokenizer, *,
                 seed_unseeded: bool = False) -> None:
        """seed_unseeded: a traced LLM's: a sampled request without a seed gets one (InputProcessor.seeded)."""
        self.engine_args = engine_args
        self.model_info = model_info
        self.input_processor = InputProcessor.from_engine_args(model_info, tokenizer, engine_args,
                                                               seed_unseeded=seed_unseeded)
        self.observers = RequestObservers()  # each request's spans, registered by the LLM (tracing on)
        # A pooling engine's outputs are vectors, not tokens: nothing to detokenize (pooling_output.py).
        self.output_processor = PoolingOutputProcessor(self.observers) if engine_args.runner == "pooling" else \
            OutputProcessor(tokenizer, self.observers)
        self.client = InprocClient(engine_args, model_info, spans_inline=True)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams, *, priority: int = 0,
                      lora_request=None) -> list[EngineCoreRequest]:
        """Validate a request and fan it out, without queueing anything (raises ValueError)."""
        return self.input_processor.make_requests(
            request_id, prompt, params, num_kv_blocks=min(self.client.num_kv_blocks), priority=priority,
            trace_context=self.observers.get(request_id).carrier(), lora_request=lora_request,
        )

    def add_request(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                    requests: list[EngineCoreRequest], *, output_kind: OutputKind = OutputKind.FINAL_ONLY) -> None:
        """Register a request made by make_requests and send its engine requests (its spans, if traced, are
        found by its id: self.observers, registered by the caller)."""
        with self.observers.get(request_id).enqueueing(request_id):
            self.output_processor.add_request(request_id, prompt.prompt, prompt.known_token_ids, params,
                                              output_kind, lora_request=requests[0].lora_request)
            for request in requests:
                self.client.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        """Forget these requests and stop their engine requests."""
        self.client.abort_requests(
            [child for request_id in request_ids for child in self.output_processor.abort_request(request_id)]
        )

    @property
    def has_unfinished_requests(self) -> bool:
        return self.client.has_unfinished_requests

    def step(self) -> list[RequestOutput]:
        """One engine step; the RequestOutputs it produced (FINAL_ONLY: the requests it finished).

        Raises the reason (request_stream.engine_refusal) when the engine ended a request itself: its
        constraint could not be compiled (or not within the compile deadline), say; LLM.generate then
        aborts the rest of its call."""
        engine_outputs = self.client.get_outputs()
        for output in engine_outputs.outputs:  # the engine ended a request itself, saying why
            if output.error is not None and output.request_id in self.output_processor.children:
                raise engine_refusal(output)
        processed = self.output_processor.process_outputs(engine_outputs.outputs)
        if processed.reqs_to_abort:  # stop strings found while detokenizing
            self.client.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    @property
    def engine_core(self):
        """The in-process EngineCore, for tests and notebooks that look inside it."""
        return self.client.engine_core

    def flush_spans(self) -> None:
        self.client.engine_core.flush_spans()

    def shutdown(self) -> None:
        self.client.shutdown()
