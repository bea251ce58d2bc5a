"""Randomized properties of LLM and AsyncLLM under stress settings, each case drawn from one seed.

A case (tests/random_workloads.py) is a set of engine settings from stress ranges and a
workload of requests with every sampling option, late arrivals and random aborts.
For each case:

1. Batch invariance: every greedy or seeded request that is not aborted gives, in the
   batch, what it gives alone on the same engine settings: the same token ids, text,
   finish and stop reasons, logprobs (to float tolerance).
2. Nothing leaks: after every run, every KV block is free (`pool.check_integrity()`),
   the scheduler and the KV cache manager hold no request, the output processor no
   parent or child, the client nothing in flight.
3. AsyncLLM: streamed deltas add up to the final output, an aborted stream ends (no
   hang) with a prefix of what the request gives alone, and the others equal their
   solo runs. In-process for every seed, over a real engine process for a few.

By default a fixed list of seeds runs (about a minute on two busy cores). More:

    TINYSERVE_PROPERTY_CASES=200 pytest tests/test_random_properties.py   # seeds 0 .. 199
    TINYSERVE_PROPERTY_SEEDS=17,42 pytest tests/test_random_properties.py  # exactly these

A failing case's report ends with its seed, its engine settings and every request. The
seed replays an LLM case exactly; an AsyncLLM case's workload, not its interleaving,
which depends on timing.
"""

import asyncio
import contextlib
import math
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.patience import patient
from tests.random_workloads import Case, PlannedRequest, draw_case
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, AsyncLLM, EngineArgs
from tinyserve.frontend.output_processor import OutputKind
from tinyserve.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.slow  # about a minute of random workloads: in `make test`, not test-fast

DEFAULT_NUM_CASES = 30
MAX_STEPS = 20_000  # far more than any case needs: more means the engine stopped making progress
ASYNC_TIMEOUT_S = 120.0  # a whole async case; a stream that never ends fails it with its name
LOGPROB_TOLERANCE = 1e-4


def case_seeds() -> list[int]:
    if os.environ.get("TINYSERVE_PROPERTY_SEEDS"):
        return [int(s) for s in os.environ["TINYSERVE_PROPERTY_SEEDS"].split(",")]
    return list(range(int(os.environ.get("TINYSERVE_PROPERTY_CASES", DEFAULT_NUM_CASES))))


SEEDS = case_seeds()
ENGINE_PROCESS_SEEDS = SEEDS[: max(1, len(SEEDS) // 20)]


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
    # The worker's own request state goes with the finished ids of one more, empty, step, which the
    # engine loops take by themselves (has_requests): nothing is left for the next call.
    assert not llm.engine_core.has_requests, f"{where}: finished ids the worker was never told of"
    assert not llm.engine_core.model_runner.requests, \
        f"{where}: the worker holds {sorted(llm.engine_core.model_runner.requests)}"


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


def assert_batch_matches_solo(case, finished: dict, aborted: set, solo: dict) -> None:
    """Every request not aborted: in the batch, what it gave alone (reproducible ones), or a sane output."""
    for request in case.requests:
        if request.request_id in aborted:
            continue
        if request.reproducible:
            assert_same_output(finished[request.request_id], solo[request.request_id],
                               f"{request.request_id} in the batch vs alone")
        else:
            assert_sane(finished[request.request_id], request)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_llm_batch_with_random_aborts_matches_solo_runs_and_frees_everything(model, probe, seed):
    case = draw_case(seed, probe)
    with replayable(case):
        llm = LLM(model, **case.engine_args)
        solo = solo_outputs(llm, case)
        finished, aborted = run_llm_batch(llm, case)
        assert_llm_idle(llm, "after the batch")
        assert set(finished) == {r.request_id for r in case.requests} - aborted, "an unaborted request gave no output"
        assert_batch_matches_solo(case, finished, aborted, solo)
        # Whatever the stressed batch left in the prefix cache must not change what comes next.
        reproducible = [r for r in case.requests if r.reproducible]
        again = llm.generate([r.prompt_input for r in reproducible], [r.params for r in reproducible], use_tqdm=False)
        for request, output in zip(reproducible, again):
            assert_same_output(output, solo[request.request_id], f"{request.request_id} in generate() afterwards")
        assert_llm_idle(llm, "after generate()")


IMAGE_SEEDS = SEEDS[:6]


@pytest.fixture(scope="module")
def llava_probe() -> LLM:
    from tests.llava_checkpoints import llava_checkpoint

    return LLM(str(llava_checkpoint()), num_kv_blocks=256)


@pytest.mark.parametrize("seed", IMAGE_SEEDS, ids=lambda seed: f"seed={seed}")
def test_llm_batch_with_images_mixed_in_matches_solo_runs_and_frees_everything(llava_probe, seed):
    """The same workloads on a LLaVA checkpoint, about half the prompts carrying images (some the same image),
    under encoder budgets and caches of one or two images: batch invariance, nothing leaks, and the encoder
    cache holds no more than it may."""
    from tests.llava_checkpoints import image, llava_checkpoint

    case = draw_case(seed, llava_probe, pictures=[image(0), image(1, 64, 32), image(2, 100, 100)])
    assert any(r.images for r in case.requests)
    with replayable(case):
        llm = LLM(str(llava_checkpoint()), **case.engine_args)
        solo = solo_outputs(llm, case)
        finished, aborted = run_llm_batch(llm, case)
        assert_llm_idle(llm, "after the batch")
        assert_batch_matches_solo(case, finished, aborted, solo)
        cache = llm.engine_core.hooks.parts["multimodal"].cache
        assert cache.rows == sum(rows.shape[0] for rows in cache.entries.values())
        # Past its size only by images the last step needed (one found there while another was encoded, or an
        # image larger than the cache)
        needed = sum(rows.shape[0] for h, rows in cache.entries.items() if h in cache.needed)
        assert cache.rows <= max(cache.max_rows, needed), (cache.rows, cache.max_rows, needed)
        assert cache.queries > 0


SPEC_SEEDS = SEEDS[:8]


def speculative_config(seed: int, model: str) -> dict:
    """n-gram drafts for even seeds, a draft model (the target itself) for odd ones."""
    if seed % 2 == 0:
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return {"method": "draft_model", "model": model, "num_speculative_tokens": 2}


@pytest.mark.parametrize("seed", SPEC_SEEDS, ids=lambda seed: f"seed={seed}")
def test_llm_batch_with_speculation_matches_solo_runs_and_frees_everything(model, probe, seed):
    """The same workloads with --speculative-config: greedy and seeded requests give, in the batch, what they
    give alone, and what the plain engine gives; nothing leaks, the draft model's own blocks included."""
    case = draw_case(seed, probe)
    with replayable(case):
        llm = LLM(model, **case.engine_args, speculative_config=speculative_config(seed, model))
        solo = solo_outputs(llm, case)
        reproducible = [r for r in case.requests if r.reproducible]
        plain = probe.generate([r.prompt_input for r in reproducible], [r.params for r in reproducible],
                               use_tqdm=False)
        for request, want in zip(reproducible, plain):
            assert_same_output(solo[request.request_id], want, f"{request.request_id} alone vs without speculation")
        finished, aborted = run_llm_batch(llm, case)
        assert_llm_idle(llm, "after the batch")
        proposer = llm.engine_core.model_runner.proposer
        if hasattr(proposer, "block_ids"):
            assert not proposer.block_ids and proposer.num_free_blocks == proposer.kv_caches[0].shape[1]
        assert_batch_matches_solo(case, finished, aborted, solo)
        assert llm.engine_core.scheduler.spec_stats.num_drafts > 0


def test_the_workloads_stop_strings_and_stop_tokens_really_fire(probe):
    finish = set()
    for seed in SEEDS[:10]:
        case = draw_case(seed, probe)
        outputs = probe.generate([r.prompt_input for r in case.requests], [r.params for r in case.requests],
                                 use_tqdm=False)
        finish |= {(c.finish_reason, type(c.stop_reason).__name__) for o in outputs for c in o.outputs}
    assert {("stop", "str"), ("stop", "int"), ("length", "NoneType")} <= finish


# ---- AsyncLLM: concurrent streams --------------------------------------------------


@dataclass
class StreamRecord:
    """What one request's stream delivered."""

    request: PlannedRequest
    outputs: list[RequestOutput] = field(default_factory=list)
    abort_issued: bool = False
    ended: bool = False

    @property
    def finished(self) -> bool:
        return bool(self.outputs) and self.outputs[-1].finished


def merge_deltas(outputs: list[RequestOutput]) -> dict[int, CompletionOutput]:
    """Each sample's deltas joined into one cumulative CompletionOutput."""
    merged: dict[int, CompletionOutput] = {}
    for output in outputs:
        for delta in output.outputs:
            whole = merged.setdefault(delta.index, CompletionOutput(delta.index, "", [], logprobs=None))
            whole.text += delta.text
            whole.token_ids += delta.token_ids
            whole.finish_reason, whole.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.logprobs is not None:
                whole.logprobs = (whole.logprobs or []) + delta.logprobs
            whole.cumulative_logprob = delta.cumulative_logprob
    return merged


async def consume(engine: AsyncLLM, record: StreamRecord) -> None:
    """Send the request after its arrival delay and read its stream, aborting it as planned."""
    request = record.request
    await asyncio.sleep(request.arrival * 0.002)
    args = (request.prompt_input, request.params, request.request_id)
    abort_after, style = request.abort_after, request.abort_style

    async def abort() -> None:
        record.abort_issued = True
        await engine.abort(request.request_id)

    if abort_after == 0 and style != "abort-later":
        # Before reading anything: through add_request, the server's way in, which sends at once.
        stream = await engine.add_request(*args, priority=request.priority)
        await (abort() if style == "abort" else stream.close())
        record.abort_issued = True
        record.outputs += [output async for output in stream]
        await stream.close()
        record.ended = True
        return
    aborter = None
    if abort_after is not None and style == "abort-later":
        async def abort_later() -> None:
            await asyncio.sleep(abort_after * 0.003)
            await abort()
        aborter = asyncio.create_task(abort_later())
    async with contextlib.aclosing(engine.generate(*args, priority=request.priority)) as stream:
        async for output in stream:
            record.outputs.append(output)
            if len(record.outputs) == abort_after and style in ("abort", "leave") and not output.finished:
                if style == "leave":
                    record.abort_issued = True
                    break
                await abort()
    if aborter is not None:
        await aborter
    record.ended = True


def check_streams(records: list[StreamRecord], solo: dict[str, RequestOutput]) -> None:
    for record in records:
        request_id = record.request.request_id
        assert not any(output.finished for output in record.outputs[:-1]), f"{request_id}: outputs after the last"
        if not record.finished:
            assert record.abort_issued, f"{request_id}: the stream ended unfinished without an abort"
        merged = merge_deltas(record.outputs)
        if not record.request.reproducible:
            if record.finished:
                assert sorted(merged) == list(range(record.request.params.n)), request_id
            continue
        want = solo[request_id]
        if record.finished:
            got = RequestOutput(request_id, None, [], [merged[i] for i in sorted(merged)], True,
                                prompt_logprobs=record.outputs[-1].prompt_logprobs)
            assert_same_output(got, want, f"{request_id}'s stream vs alone")
            continue
        for index, completion in merged.items():  # aborted: what came is the start of the solo output
            whole = want.outputs[index]
            what = f"{request_id} sample {index}, aborted, vs alone"
            assert completion.token_ids == whole.token_ids[:len(completion.token_ids)], what
            assert whole.text.startswith(completion.text), what
            if completion.finish_reason is not None:
                assert_same_completion(completion, whole, what)


async def run_streams(engine: AsyncLLM, case: Case) -> list[StreamRecord]:
    records = [StreamRecord(request) for request in case.requests]
    tasks = [asyncio.create_task(consume(engine, record)) for record in records]
    done, unfinished = await asyncio.wait(tasks, timeout=ASYNC_TIMEOUT_S)
    for task in unfinished:
        task.cancel()
    assert not unfinished, f"streams that never ended: {[r.request.request_id for r in records if not r.ended]}"
    for task in done:
        task.result()  # raise what a reader raised
    return records


async def wait_until(condition, what: str, timeout_s: float = 10.0) -> None:
    """Poll `condition` (an async callable) until it holds: aborts reach an engine a moment after they return."""
    for _ in range(int(patient(timeout_s) / 0.01)):
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what} after {timeout_s} s")


def assert_front_end_idle(engine: AsyncLLM, where: str) -> None:
    assert not engine.queues, f"{where}: streams still registered {sorted(engine.queues)}"
    assert_output_processor_empty(engine.output_processor, where)
    assert not engine.client.in_flight, f"{where}: in flight {sorted(engine.client.in_flight)}"


@pytest.mark.parametrize("seed", SEEDS, ids=lambda seed: f"seed={seed}")
def test_async_llm_streams_with_random_aborts_match_solo_runs_and_end(model, probe, seed):
    case = draw_case(seed, probe)

    async def scenario():
        engine = await AsyncLLM.create(EngineArgs(model=model, **case.engine_args), in_process=True)
        try:
            records = await run_streams(engine, case)
            inproc = engine.client.client

            async def drained() -> bool:
                return not inproc.has_unfinished_requests

            await wait_until(drained, "the engine still has requests")
            assert_front_end_idle(engine, "after the streams")
            assert_engine_core_idle(inproc.engine_core, "after the streams")
            return records
        finally:
            engine.shutdown()

    with replayable(case):
        solo = solo_outputs(LLM(model, **case.engine_args), case)
        check_streams(asyncio.run(scenario()), solo)


@pytest.mark.parametrize("seed", ENGINE_PROCESS_SEEDS, ids=lambda seed: f"seed={seed}")
def test_async_llm_over_an_engine_process_with_random_aborts_matches_solo_runs_and_ends(model, probe, seed,
                                                                                         monkeypatch):
    case = draw_case(seed, probe)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the engine process's torch threads, as this process's

    async def scenario():
        engine = await AsyncLLM.create(EngineArgs(model=model, **case.engine_args))
        try:
            records = await run_streams(engine, case)

            async def idle() -> bool:
                [stats] = await engine.get_stats()
                return stats.num_kv_blocks_used == stats.num_running_reqs == stats.num_waiting_reqs == 0

            await wait_until(idle, "the engine process still holds requests or KV blocks")
            assert_front_end_idle(engine, "after the streams")
            return records
        finally:
            engine.shutdown()

    with replayable(case):
        solo = solo_outputs(LLM(model, **case.engine_args), case)
        check_streams(asyncio.run(scenario()), solo)
