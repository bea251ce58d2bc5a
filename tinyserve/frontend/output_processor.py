"""Stage ⑧, detokenize: turn the engine's new token ids into RequestOutputs.

`process_outputs` takes each engine output through four named steps:

    detokenize    the incremental detokenizer's new text (clocked by the request's spans)
    stop strings  a hit finishes the request here, and the engine is asked to abort it
    fold          the child's tokens, logprobs and finish into its parent (n > 1: n children)
    shape         the RequestOutput its OutputKind asks for

and returns vLLM's OutputProcessorOutput: the RequestOutputs, the engine requests to abort,
and the finishes the stop strings decided (the engine's own message is left as it came, but for
tokens after a stop string, cut from it: with speculative decoding one output may bring several).

How much each RequestOutput carries depends on its OutputKind, as in vLLM:
CUMULATIVE (everything so far), DELTA (only what is new: streaming) or
FINAL_ONLY (one output when the request is done: offline generate).
"""

import enum
from dataclasses import dataclass, field

from tinyserve.errors import InvalidInputError
from tinyserve.frontend.detokenizer import IncrementalDetokenizer
from tinyserve.frontend.input_processor import child_request_id
from tinyserve.frontend.request_observers import RequestObservers
from tinyserve.wire.messages import EngineCoreOutput, RequestTimes, TokenLogprobs
from tinyserve.lifecycle.request_spans import NO_SPANS
from tinyserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tinyserve.sampling_params import SamplingParams


class OutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(eq=False)
class ParentRequest:
    """One user request; its n children are separate engine requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    n: int
    output_kind: OutputKind
    latest: dict[int, CompletionOutput] = field(default_factory=dict)
    num_finished: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None
    metrics: RequestTimes | None = None
    spans: object = NO_SPANS  # lifecycle.request_spans: they clock the detokenizer, end when it finishes
    final: dict[int, CompletionOutput] = field(default_factory=dict)  # cumulative, per finished child
    lora_request: object = None  # the adapter it runs under, handed back on each RequestOutput as vLLM's
    kv_transfer_params: dict | None = None  # a disaggregated prefill's, from its engine (distributed/kv_transfer/)

    @property
    def finished(self) -> bool:
        return self.num_finished == self.n


@dataclass(eq=False)
class ChildState:
    parent: ParentRequest
    index: int
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sampled tokens, when logprobs are asked for


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)  # engine requests a stop string finished early
    # Engine request id -> "stop", for each request a stop string finished: the finish the client is
    # told and the metrics count, whatever the engine's output says (not finished yet, or max_tokens).
    stop_string_finishes: dict[str, str] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer, observers: RequestObservers | None = None) -> None:
        """observers: where a request's spans are found by its id (AsyncLLM's, LLMEngine's)."""
        self.tokenizer = tokenizer
        self.observers = observers if observers is not None else RequestObservers()
        self.parents: dict[str, ParentRequest] = {}
        self.children: dict[str, ChildState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_kind: OutputKind = OutputKind.CUMULATIVE,
        lora_request=None,
    ) -> list[str]:
        """Register a request; returns the engine request ids of its children.

        Request ids and the engine ids of n > 1 samples ("0_x", "1_x" for "x") share one
        namespace while they run: an id that clashes with a running one either way is
        refused, so no engine output can ever reach the wrong request.
        """
        child_ids = [child_request_id(request_id, index, params.n) for index in range(params.n)]
        clashes = sorted(i for i in {request_id, *child_ids} if i in self.parents or i in self.children)
        if clashes:
            raise InvalidInputError(f"request_id {request_id!r} is already in use" if request_id in clashes else
                                    f"request_id {request_id!r} (n={params.n}) clashes with running request ids "
                                    f"{clashes}", "request_id")
        parent = ParentRequest(request_id, prompt, prompt_token_ids, params.n, output_kind,
                               spans=self.observers.get(request_id), lora_request=lora_request)
        self.parents[request_id] = parent
        for index, child_id in enumerate(child_ids):
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop or [],
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            self.children[child_id] = ChildState(parent, index, detokenizer, params.logprobs is not None)
        return child_ids

    @property
    def num_unfinished(self) -> int:
        return len(self.parents)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        """detokenize → stop strings → fold the children → shape, for each engine output."""
        processed = OutputProcessorOutput()
        for output in outputs:
            child = self.children.get(output.request_id)
            if child is None:  # finished here already (a stop string), the engine had one more step
                continue
            delta_text = self._detokenize(child, output)
            finish_reason, stop_reason = self._stop_strings(child, output, processed)
            completion = self._fold(child, output, delta_text, finish_reason, stop_reason)
            request_output = self._request_output(child.parent, completion)
            if request_output is not None:
                processed.request_outputs.append(request_output)
        return processed

    @staticmethod
    def _detokenize(child: ChildState, output: EngineCoreOutput) -> str:
        """The new text. On the last update the detokenizer releases what it held back (a possible
        stop-string prefix, an unfinished character)."""
        with child.parent.spans.detokenizing:
            return child.detokenizer.update(output.new_token_ids, finished=output.finish_reason is not None,
                                            stop_terminated=output.finish_reason == "stop")

    @staticmethod
    def _stop_strings(child: ChildState, output: EngineCoreOutput, processed: OutputProcessorOutput):
        """(finish_reason, stop_reason): the engine's, unless the detokenizer found a stop string. That
        ends the request even when the engine ended it in the same step (max_tokens, or a stop token
        after the string): the text was cut there."""
        stop_string = child.detokenizer.stop_reason
        if stop_string is None:
            return output.finish_reason, output.stop_reason
        if output.finish_reason is None:
            processed.reqs_to_abort.append(output.request_id)
        processed.stop_string_finishes[output.request_id] = "stop"
        # Several new tokens in one output (speculative decoding): none after the one that completed the string.
        num_kept = child.detokenizer.num_output_tokens - len(child.token_ids)
        if num_kept < len(output.new_token_ids):
            output.new_token_ids = output.new_token_ids[:num_kept]
            output.new_logprobs = output.new_logprobs[:num_kept] if output.new_logprobs else output.new_logprobs
        return "stop", stop_string

    def _fold(self, child: ChildState, output: EngineCoreOutput, delta_text: str, finish_reason, stop_reason):
        """The child's new tokens and logprobs into its state, its finish into its parent; its completion."""
        parent = child.parent
        child.token_ids += output.new_token_ids
        if output.prompt_logprobs is not None and parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None] + [self._convert_logprobs(lp) for lp in output.prompt_logprobs]
        new_logprobs = [self._convert_logprobs(lp) for lp in output.new_logprobs or ()]
        child.logprobs += new_logprobs
        child.cumulative_logprob += sum(lp.logprobs[0] for lp in output.new_logprobs or ())  # sampled: first
        parent.num_cached_tokens = max(parent.num_cached_tokens, output.num_cached_tokens)
        parent.kv_transfer_params = output.kv_transfer_params or parent.kv_transfer_params
        if finish_reason is not None:
            del self.children[output.request_id]
            parent.num_finished += 1
            parent.metrics = output.times or parent.metrics
            parent.final[child.index] = self._cumulative(child, finish_reason, stop_reason)
            if parent.finished:
                del self.parents[parent.request_id]
                parent.spans.finish(list(parent.final.values()))
        delta = parent.output_kind == OutputKind.DELTA
        completion = CompletionOutput(
            index=child.index,
            text=delta_text if delta else child.detokenizer.output_text,
            token_ids=list(output.new_token_ids) if delta else list(child.token_ids),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=(new_logprobs if delta else list(child.logprobs)) if child.want_logprobs else None,
            cumulative_logprob=child.cumulative_logprob if child.want_logprobs else None,
        )
        parent.latest[child.index] = completion
        return completion

    def abort_request(self, request_id: str, error: BaseException | None = None) -> list[str]:
        """Forget a request (and its children); returns the engine ids to abort. `error`: why the server
        ends it (on its span), when it is not the client's abort."""
        parent = self.parents.pop(request_id, None)
        if parent is None:
            return []
        aborted = []
        for index in range(parent.n):
            child_id = child_request_id(request_id, index, parent.n)
            child = self.children.pop(child_id, None)
            if child is not None:
                aborted.append(child_id)
                parent.final[index] = self._cumulative(child, "abort", None)
        parent.spans.finish(list(parent.final.values()), error)
        return aborted

    @staticmethod
    def _cumulative(child: ChildState, finish_reason: str, stop_reason) -> CompletionOutput:
        return CompletionOutput(child.index, child.detokenizer.output_text, list(child.token_ids), finish_reason, stop_reason)

    def _request_output(self, parent: ParentRequest, completion: CompletionOutput) -> RequestOutput | None:
        """Shape: what the parent's OutputKind hands out now (FINAL_ONLY: nothing until every child is done)."""
        if parent.output_kind == OutputKind.FINAL_ONLY and not parent.finished:
            return None
        if parent.output_kind == OutputKind.DELTA:
            outputs = [completion]
        else:
            outputs = [parent.latest[i] for i in sorted(parent.latest)]
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=outputs,
            finished=parent.finished,
            num_cached_tokens=parent.num_cached_tokens,
            metrics=parent.metrics if parent.finished else None,
            prompt_logprobs=parent.prompt_logprobs,
            lora_request=parent.lora_request,
            kv_transfer_params=parent.kv_transfer_params,
        )

    def _convert_logprobs(self, token_logprobs: TokenLogprobs) -> PositionLogprobs:
        return {
            token_id: Logprob(logprob, rank, self.tokenizer.decode([token_id]))
            for token_id, logprob, rank in zip(token_logprobs.token_ids, token_logprobs.logprobs, token_logprobs.ranks)
        }
