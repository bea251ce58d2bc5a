"""Replay: re-run logged requests and check that the engine produces the same tokens.

A trace logs everything a request needs to run again: its prompt token ids, its
sampling params (seed included) and its LoRA adapter in the render span, and every
completion's output token ids in the request span. Replay submits each logged request to an
engine its caller hands over (this module imports nothing of the engine) and
compares the outputs token by token:

    llm = LLM(run.manifest["model"], num_kv_blocks=...)
    for result in replay_run(run, llm):
        print(result.describe())        chatcmpl-1 match
                                        chatcmpl-2 MISMATCH at completion 0 position 5: expected 318, got 4711
                                        chatcmpl-3 skipped: sampled (temperature=0.7) without a seed

A request that cannot be reproduced is skipped, never counted as a match:
sampling without a seed, redacted inputs, or no logged outputs. Hand it an
untraced LLM: a traced one would add the replayed requests to its own run.
"""

from dataclasses import dataclass

from tinyserve.lifecycle.run import Run
from tinyserve.lifecycle.timeline import RequestTimeline

GREEDY_BELOW = 1e-5  # a temperature under this is greedy (SamplingParams' rule, as vLLM's)


@dataclass(slots=True)
class Divergence:
    completion_index: int
    position: int  # the first output position whose token differs
    expected: int | None  # the logged token (None: the logged completion ended here)
    got: int | None  # the replayed token (None: the replay ended here)


@dataclass(slots=True)
class ReplayResult:
    request_id: str
    matched: bool
    first_divergence: Divergence | None = None
    skipped_reason: str | None = None

    @property
    def skipped(self) -> bool:
        return self.skipped_reason is not None

    def describe(self) -> str:
        if self.skipped:
            return f"{self.request_id} skipped: {self.skipped_reason}"
        if self.matched:
            return f"{self.request_id} match"
        d = self.first_divergence
        return (f"{self.request_id} MISMATCH at completion {d.completion_index} position {d.position}: "
                f"expected {_token(d.expected)}, got {_token(d.got)}")


def _token(token: int | None) -> str:
    return "the end of the output" if token is None else str(token)


def why_not_reproducible(request: RequestTimeline) -> str | None:
    """The reason this logged request cannot be replayed exactly, or None if it can."""
    inputs = request.inputs
    if inputs.redacted:
        return "inputs redacted (the server ran without logging prompts)"
    if inputs.prompt_token_ids is None:
        return "no prompt token ids logged"
    if inputs.pooling_params is not None:
        return "a pooling request: its vector is not logged, so there are no tokens to compare"
    params = inputs.sampling_params
    if params is None:
        return "no sampling params logged"
    temperature = params.get("temperature", 1.0)  # SamplingParams' default, omitted when logged
    if temperature >= GREEDY_BELOW and params.get("seed") is None:
        return f"sampled (temperature={temperature}) without a seed"
    if any(c.finish_reason in (None, "abort") for c in request.completions):
        return "the request was aborted before it finished"
    if request.error is not None:
        return f"the request failed: {request.error}"
    if not request.completions:
        return "no output logged"
    return None


def _local(params: dict) -> dict:
    """A request's sampling params to run here: without kv_transfer_params (disaggregated prefill), whose K/V
    came from another engine; computed here instead, they give the same tokens."""
    extra_args = {k: v for k, v in (params.get("extra_args") or {}).items() if k != "kv_transfer_params"}
    local = {k: v for k, v in params.items() if k != "extra_args"}
    return {**local, "extra_args": extra_args} if extra_args else local


def first_divergence(expected: list[list[int]], got: list[list[int]]) -> Divergence | None:
    """Where two sets of completions (token ids, by completion index) first differ, or None."""
    for index in range(max(len(expected), len(got))):
        want = expected[index] if index < len(expected) else []
        have = got[index] if index < len(got) else []
        for position in range(max(len(want), len(have))):
            a = want[position] if position < len(want) else None
            b = have[position] if position < len(have) else None
            if a != b:
                return Divergence(index, position, a, b)
    return None


def replay_request(request: RequestTimeline, llm) -> ReplayResult:
    """Run one logged request again on `llm` (a tinyserve.LLM) and compare its completions."""
    reason = why_not_reproducible(request)
    if reason is not None:
        return ReplayResult(request.request_id, matched=False, skipped_reason=reason)
    try:
        [output] = llm.generate([_prompt(request)], _local(request.inputs.sampling_params), use_tqdm=False,
                                lora_request=[request.inputs.lora_request])
    except ValueError as error:  # this engine cannot serve it: another model, a smaller context
        return ReplayResult(request.request_id, matched=False, skipped_reason=f"the engine rejected it: {error}")
    return _compare(request, output)


def replay_run(run: Run, llm, request_ids: list[str] | None = None) -> list[ReplayResult]:
    """Replay every request of the run (or those named), in arrival order, and compare each.

    They run as one batch, as a server would have run them: a greedy or seeded request's
    tokens do not depend on what else shares its steps. If the engine refuses one of
    them, they run one at a time instead, so the result can say which.
    """
    requests = run.requests if request_ids is None else [run.request(request_id) for request_id in request_ids]
    runnable = [request for request in requests if why_not_reproducible(request) is None]
    try:
        outputs = llm.generate([_prompt(r) for r in runnable], [_local(r.inputs.sampling_params) for r in runnable],
                               use_tqdm=False, lora_request=[r.inputs.lora_request for r in runnable]) if runnable else []
    except ValueError:
        return [replay_request(request, llm) for request in requests]
    replayed = {request.request_id: _compare(request, output) for request, output in zip(runnable, outputs)}
    return [replayed.get(request.request_id) or replay_request(request, llm) for request in requests]


def _prompt(request: RequestTimeline) -> dict:
    return {"prompt_token_ids": request.inputs.prompt_token_ids}


def _compare(request: RequestTimeline, output) -> ReplayResult:
    logged = sorted(request.completions, key=lambda c: c.index)
    replayed = sorted(output.outputs, key=lambda c: c.index)
    divergence = first_divergence([c.token_ids for c in logged], [list(c.token_ids) for c in replayed])
    return ReplayResult(request.request_id, matched=divergence is None, first_divergence=divergence)
