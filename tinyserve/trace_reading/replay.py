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

Four kinds of request are replayed with what the run holds of them:
- aborted (a client left, or the engine serving it died): replayed up to where it stopped,
  max_tokens the tokens it had produced (at least 1), and compared on that prefix;
- under a LoRA adapter: the adapter is the run's own copy, <run>/adapters/<lora_name>/
  (scripts/record_traces.py puts it there), else the logged lora_path;
- pooling (an embedding): its vector is not logged, only its length, so the replay
  computes the vector and compares its length (and says so);
- with images: the render span logs each image's content hash, and the run keeps its pixels,
  <run>/images/<hash>.<format> (multimodal/processor.py's keep_images); the replay sends the logged
  token ids, placeholders expanded, with those images.
"""

from dataclasses import dataclass
from pathlib import Path

from tinyserve.lifecycle import schema
from tinyserve.trace_reading.run import Run
from tinyserve.trace_reading.timeline import RequestTimeline

GREEDY_BELOW = 1e-5  # a temperature under this is greedy (SamplingParams' rule, as vLLM's)
ADAPTERS_FOLDER = "adapters"  # <run>/adapters/<lora_name>/: the run's copy of each LoRA adapter it served


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
    # what was compared, when it was less than every token: "aborted after 6 tokens: compared up to
    # there", "pooling: the vector's length (256), the vector itself is not logged"
    note: str | None = None

    @property
    def skipped(self) -> bool:
        return self.skipped_reason is not None

    def describe(self) -> str:
        if self.skipped:
            return f"{self.request_id} skipped: {self.skipped_reason}"
        if self.matched:
            return f"{self.request_id} match" + (f" ({self.note})" if self.note else "")
        d = self.first_divergence
        if d is None:
            return f"{self.request_id} MISMATCH: {self.note}"
        return (f"{self.request_id} MISMATCH at completion {d.completion_index} position {d.position}: "
                f"expected {_token(d.expected)}, got {_token(d.got)}"
                + (f" ({self.note})" if self.note else ""))


def _token(token: int | None) -> str:
    return "the end of the output" if token is None else str(token)


def why_not_reproducible(request: RequestTimeline, run: Run | None = None) -> str | None:
    """The reason this logged request cannot be replayed exactly, or None if it can (a prompt's images read from
    `run`'s folder)."""
    inputs = request.inputs
    if inputs.redacted:
        return "inputs redacted (the server ran without logging prompts)"
    if inputs.prompt_token_ids is None:
        return "no prompt token ids logged"
    if inputs.mm_hashes is None and any(schema.MM_HASHES in sequence.stages[schema.QUEUE].attributes
                                        for sequence in request.sequences if schema.QUEUE in sequence.stages):
        return "a prompt with images whose render span logged no hashes (a run from before images were kept)"
    missing = [h for h in inputs.mm_hashes or () if run is None or _image_path(run, h) is None]
    if missing:
        return (f"a prompt with images whose pixels are not in the run's {schema.RUN_IMAGES_DIR}/ folder "
                f"({len(missing)} of {len(inputs.mm_hashes)})")
    if inputs.pooling_params is not None:
        if schema.POOLING_DIMENSIONS not in request.request_span.attributes:
            return "a pooling request without its vector's length logged: nothing to compare"
        return None
    params = inputs.sampling_params
    if params is None:
        return "no sampling params logged"
    temperature = params.get("temperature", 1.0)  # SamplingParams' default, omitted when logged
    if temperature >= GREEDY_BELOW and params.get("seed") is None:
        return f"sampled (temperature={temperature}) without a seed"
    if not request.completions:
        return "no output logged" if request.error is None else f"the request failed: {request.error}"
    if request.error is not None and not aborted(request):
        return f"the request failed: {request.error}"
    return None


def aborted(request: RequestTimeline) -> bool:
    """Whether a completion stopped before it finished: its client left, or the engine serving it died.
    Such a request is replayed up to where it stopped."""
    return any(c.finish_reason in (None, "abort") for c in request.completions)


def _stopped_at(request: RequestTimeline) -> int:
    """How many tokens an aborted request's longest completion had produced: the replay's max_tokens."""
    return max(len(c.token_ids) for c in request.completions)


def _local(request: RequestTimeline) -> dict:
    """A request's sampling params to run here: without kv_transfer_params (disaggregated prefill), whose K/V
    came from another engine; computed here instead, they give the same tokens. An aborted request stops
    where it stopped: max_tokens is what it had produced (at least one token: an engine step's worth)."""
    params = request.inputs.sampling_params
    extra_args = {k: v for k, v in (params.get("extra_args") or {}).items() if k != "kv_transfer_params"}
    local = {k: v for k, v in params.items() if k != "extra_args"}
    if aborted(request):
        local["max_tokens"] = max(1, _stopped_at(request))
        if local.get("min_tokens", 0) > local["max_tokens"]:
            local["min_tokens"] = local["max_tokens"]
    return {**local, "extra_args": extra_args} if extra_args else local


def _lora_request(request: RequestTimeline, run: Run | None) -> dict | None:
    """The request's adapter, read from the run's own copy (<run>/adapters/<lora_name>/) when it has one:
    the logged lora_path is where the adapter was on the machine that served it."""
    logged = request.inputs.lora_request
    if not logged or run is None:
        return logged
    copy = Path(run.path) / ADAPTERS_FOLDER / str(logged.get("lora_name"))
    return {**logged, "lora_path": str(copy)} if copy.is_dir() else logged


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


def replay_request(request: RequestTimeline, llm, run: Run | None = None) -> ReplayResult:
    """Run one logged request again on `llm` (a tinyserve.LLM) and compare its completions (its adapter read
    from `run`'s folder when the run holds a copy)."""
    reason = why_not_reproducible(request, run)
    if reason is not None:
        return ReplayResult(request.request_id, matched=False, skipped_reason=reason)
    try:
        [output] = _submit([request], llm, run)
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
    runnable = [request for request in requests if why_not_reproducible(request, run) is None]
    try:
        outputs = _submit(runnable, llm, run)
    except ValueError:
        return [replay_request(request, llm, run) for request in requests]
    replayed = {request.request_id: _compare(request, output) for request, output in zip(runnable, outputs)}
    return [replayed.get(request.request_id) or replay_request(request, llm, run) for request in requests]


def _submit(requests: list[RequestTimeline], llm, run: Run | None) -> list:
    """The engine's outputs for the requests, in their order: generated ones in one batch, pooled ones in another."""
    pooled = [r for r in requests if r.inputs.pooling_params is not None]
    generated = [r for r in requests if r.inputs.pooling_params is None]
    outputs = {}
    if generated:
        outputs.update(zip((r.request_id for r in generated), llm.generate(
            [_prompt(r, run) for r in generated], [_local(r) for r in generated], use_tqdm=False,
            lora_request=[_lora_request(r, run) for r in generated])))
    for request in pooled:  # one at a time: each its own params (normalize may differ), a dict as logged
        [outputs[request.request_id]] = llm.encode([_prompt(request, run)], request.inputs.pooling_params or None,
                                                   use_tqdm=False)
    return [outputs[r.request_id] for r in requests]


def _prompt(request: RequestTimeline, run: Run | None = None) -> dict:
    """The logged prompt: its token ids (an image's placeholders expanded), and its images, read back from the run's
    folder by their content hashes."""
    prompt = {"prompt_token_ids": request.inputs.prompt_token_ids}
    if request.inputs.mm_hashes:
        from PIL import Image

        images = []
        for digest in request.inputs.mm_hashes:
            with Image.open(_image_path(run, digest)) as image:
                images.append(image.copy())  # read whole before the file closes
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def _image_path(run: Run, digest: str) -> Path | None:
    """The run's file of the image with this content hash (<hash>.png, .jpeg, .bmp, ...), or None."""
    return next((run.path / schema.RUN_IMAGES_DIR).glob(f"{digest}.*"), None)


def _compare(request: RequestTimeline, output) -> ReplayResult:
    if request.inputs.pooling_params is not None:
        return _compare_pooled(request, output)
    logged = sorted(request.completions, key=lambda c: c.index)
    replayed = [list(c.token_ids) for c in sorted(output.outputs, key=lambda c: c.index)]
    note = None
    if aborted(request):  # a completion that stopped early is compared up to where it stopped
        replayed = [tokens[:len(c.token_ids)] if c.finish_reason in (None, "abort") else tokens
                    for c, tokens in zip(logged, replayed)] + replayed[len(logged):]
        stopped = _stopped_at(request)
        note = (f"aborted after {stopped} token{'s' * (stopped != 1)}: replayed and compared up to there" if stopped
                else "aborted before its first token: replayed for one token, none to compare")
    divergence = first_divergence([c.token_ids for c in logged], replayed)
    return ReplayResult(request.request_id, matched=divergence is None, first_divergence=divergence, note=note)


def _compare_pooled(request: RequestTimeline, output) -> ReplayResult:
    """A pooling request: its vector is not logged, its length is: the replayed vector must have that length."""
    logged = int(request.request_span.attributes[schema.POOLING_DIMENSIONS])
    got = 0 if output.outputs is None else len(output.outputs.data)
    if got == logged:
        return ReplayResult(request.request_id, matched=True,
                            note=f"pooling: a vector of {got} values, as logged; the values themselves are not logged")
    return ReplayResult(request.request_id, matched=False,
                        note=f"pooling: a vector of {got} values, the run logged {logged}")
