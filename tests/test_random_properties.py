"""Randomized properties of LLM under stress settings, each case drawn from one seed.

A case (tests/random_workloads.py) is a set of engine settings from stress ranges and a
workload of requests with every sampling option, late arrivals and random aborts.
For each case:

1. Batch invariance: every greedy or seeded request that is not aborted gives, in the
   batch, what it gives alone on the same engine settings: the same token ids, text,
   finish and stop reasons, logprobs (to float tolerance).
2. Nothing leaks: after every run, every KV block is free (`pool.check_integrity()`),
   the scheduler and the KV cache manager hold no request, the output processor no
   parent or child, the client nothing in flight.

By default a fixed list of seeds runs (about a minute on two busy cores). More:

    TINYSERVE_PROPERTY_CASES=200 pytest tests/test_random_properties.py   # seeds 0 .. 199
    TINYSERVE_PROPERTY_SEEDS=17,42 pytest tests/test_random_properties.py  # exactly these

A failing case's report ends with its seed, its engine settings and every request; the
seed replays it exactly.
"""

import contextlib
import math
import os

import pytest
import torch

from tests.random_workloads import Case, PlannedRequest, draw_case
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.outputs import CompletionOutput, RequestOutput

DEFAULT_NUM_CASES = 20
MAX_STEPS = 20_000  # far more than any case needs: more means the engine stopped making progress
LOGPROB_TOLERANCE = 1e-4


def case_seeds() -> list[int]:
    if os.environ.get("TINYSERVE_PROPERTY_SEEDS"):
        return [int(s) for s in os.environ["TINYSERVE_PROPERTY_SEEDS"].split(",")]
    return list(range(int(os.environ.get("TINYSERVE_PROPERTY_CASES", DEFAULT_NUM_CASES))))


SEEDS = case_seeds()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """A tiny model's step is too little work to share: on busy cores, more threads only wait for each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model_with_tokenizer("llama"))


@pytest.fixture(scope="module")
def probe(model) -> LLM:
    """A roomy engine that runs each workload once, to pick stop strings from real output."""
    return LLM(model, num_kv_blocks=256)


@contextlib.contextmanager
def replayable(case: Case):
    """Any failure inside names the case, so it can be replayed."""
    try:
        yield
    except Exception as error:
        error.add_note(case.describe())
        raise


# ---- checks -------------------------------------------------------------------------


def assert_engine_core_idle(core, where: str) -> None:
    pool = core.kv_cache_manager.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks, f"{where}: {pool.num_used_blocks} KV blocks still held"
    scheduler, kv = core.scheduler, core.kv_cache_manager
    assert not (scheduler.requests or scheduler.waiting or scheduler.running), f"{where}: the scheduler holds requests"
    assert not (kv.req_to_blocks or kv.req_to_hashes or kv.req_num_cached_blocks), \
        f"{where}: the KV cache manager remembers requests {sorted({*kv.req_to_blocks, *kv.req_to_hashes})}"


def assert_output_processor_empty(output_processor, where: str) -> None:
    assert not output_processor.parents and not output_processor.children, \
        f"{where}: the output processor holds {sorted(output_processor.parents)} / {sorted(output_processor.children)}"


def assert_llm_idle(llm: LLM, where: str) -> None:
    assert not llm.llm_engine.has_unfinished_requests, f"{where}: unfinished requests"
    assert not llm.llm_engine.client.in_flight, f"{where}: in flight {sorted(llm.llm_engine.client.in_flight)}"
    assert_output_processor_empty(llm.llm_engine.output_processor, where)
    assert_engine_core_idle(llm.engine_core, where)
    # Per-request sampler state goes with the next step's list of finished requests; an idle step sends it.
    llm.engine_core.step()
    assert not llm.engine_core.model_runner.sampler.request_generators, f"{where}: seeded generators left behind"


def assert_logprobs_close(got, want, what: str) -> None:
    assert (got is None) == (want is None), what
    if want is None:
        return
    assert len(got) == len(want), what
    for position, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, what
            continue
        assert set(g) == set(w), f"{what}: logprob token ids at position {position}"
        for token_id, logprob in w.items():
            assert math.isclose(g[token_id].logprob, logprob.logprob, abs_tol=LOGPROB_TOLERANCE), \
                f"{what}: logprob of token {token_id} at position {position}"


def assert_same_completion(got: CompletionOutput, want: CompletionOutput, what: str) -> None:
    for name in ("token_ids", "text", "finish_reason", "stop_reason"):
        assert getattr(got, name) == getattr(want, name), f"{what}: {name}"
    assert_logprobs_close(got.logprobs, want.logprobs, f"{what} logprobs")
    if want.cumulative_logprob is not None:
        assert math.isclose(got.cumulative_logprob, want.cumulative_logprob, abs_tol=LOGPROB_TOLERANCE * 32), what


def assert_same_output(got: RequestOutput, want: RequestOutput, what: str) -> None:
    assert got.finished and [c.index for c in got.outputs] == [c.index for c in want.outputs], what
    for g, w in zip(got.outputs, want.outputs):
        assert_same_completion(g, w, f"{what}, sample {w.index}")
    assert_logprobs_close(got.prompt_logprobs, want.prompt_logprobs, f"{what} prompt_logprobs")


def assert_sane(output: RequestOutput, request: PlannedRequest) -> None:
    """What an unseeded request's output must satisfy, whatever it sampled."""
    assert output.finished and len(output.outputs) == request.params.n, request.request_id
    for completion in output.outputs:
        assert completion.finish_reason in ("stop", "length"), request.request_id
        assert len(completion.token_ids) <= request.params.max_tokens, request.request_id
        if completion.finish_reason == "length":
            assert len(completion.token_ids) == request.params.max_tokens, request.request_id


def solo_outputs(llm: LLM, case: Case) -> dict[str, RequestOutput]:
    """Each reproducible request alone, through the public generate(), on the case's engine."""
    solo = {}
    for request in case.requests:
        if request.reproducible:
            [solo[request.request_id]] = llm.generate(request.prompt_input, request.params, use_tqdm=False)
            assert_llm_idle(llm, f"after {request.request_id} alone")
    return solo


# ---- LLM: the engine driven step by step ---------------------------------------------


def run_llm_batch(llm: LLM, case: Case) -> tuple[dict[str, RequestOutput], set[str]]:
    """Add each request before its arrival step, abort on schedule between steps, step until done.

    Returns the final outputs by request id, and the ids aborted before they finished.
    """
    engine = llm.llm_engine
    pending = sorted(case.requests, key=lambda r: r.arrival)
    added_at: dict[str, int] = {}
    finished: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    for step in range(MAX_STEPS):
        while pending and pending[0].arrival <= step:
            request = pending.pop(0)
            prompt = llm.input_processor.tokenize_prompt(request.prompt_input)
            made = engine.make_requests(request.request_id, prompt, request.params, priority=request.priority)
            engine.add_request(request.request_id, prompt, request.params, made, output_kind=OutputKind.FINAL_ONLY)
            added_at[request.request_id] = step
        for request in case.requests:
            arrived = added_at.get(request.request_id)
            if request.abort_after is not None and arrived is not None and arrived + request.abort_after == step:
                if request.request_id not in finished:
                    aborted.add(request.request_id)
                engine.abort_request([request.request_id])
        if not pending and not engine.has_unfinished_requests:
            return finished, aborted
        if engine.has_unfinished_requests:
            for output in engine.step():
                assert output.request_id not in finished, f"{output.request_id} finished twice"
                finished[output.request_id] = output
    raise AssertionError(f"not done after {MAX_STEPS} steps")


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_llm_batch_with_random_aborts_matches_solo_runs_and_frees_everything(model, probe, seed):
    case = draw_case(seed, probe)
    with replayable(case):
        llm = LLM(model, **case.engine_args)
        solo = solo_outputs(llm, case)
        finished, aborted = run_llm_batch(llm, case)
        assert_llm_idle(llm, "after the batch")
        assert set(finished) == {r.request_id for r in case.requests} - aborted, "an unaborted request gave no output"
        for request in case.requests:
            if request.request_id in aborted:
                continue
            if request.reproducible:
                assert_same_output(finished[request.request_id], solo[request.request_id],
                                   f"{request.request_id} in the batch vs alone")
            else:
                assert_sane(finished[request.request_id], request)
        # Whatever the stressed batch left in the prefix cache must not change what comes next.
        reproducible = [r for r in case.requests if r.reproducible]
        again = llm.generate([r.prompt_input for r in reproducible], [r.params for r in reproducible], use_tqdm=False)
        for request, output in zip(reproducible, again):
            assert_same_output(output, solo[request.request_id], f"{request.request_id} in generate() afterwards")
        assert_llm_idle(llm, "after generate()")


def test_the_workloads_stop_strings_and_stop_tokens_really_fire(probe):
    finish = set()
    for seed in SEEDS[:10]:
        case = draw_case(seed, probe)
        outputs = probe.generate([r.prompt_input for r in case.requests], [r.params for r in case.requests],
                                 use_tqdm=False)
        finish |= {(c.finish_reason, type(c.stop_reason).__name__) for o in outputs for c in o.outputs}
    assert {("stop", "str"), ("stop", "int"), ("length", "NoneType")} <= finish
