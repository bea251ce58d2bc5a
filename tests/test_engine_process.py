"""The engine in processes of its own: same tokens as in-process, load spread, aborts, failures, clean-up.

Every client here serves the same tiny checkpoint. The greedy tokens each client
returns are compared with the offline `LLM.generate` on the same prompts, which
steps an EngineCore in the test process. Engine processes are spawned (a fresh
interpreter that imports torch: a few seconds each), so the clients are shared
where a test leaves its client as it found it.
"""

import asyncio
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import msgspec
import psutil
import pytest
import torch

from tests.patience import patient
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.frontend.core_client import MPClient
from tinyserve.frontend.engine_client import EngineDeadError, EngineStartupError
from tinyserve.frontend.inproc_client import AsyncInprocClient
from tinyserve.frontend.input_processor import InputProcessor, ProcessedPrompt
from tinyserve.wire.ipc import FINISH_REASON_ERROR
from tinyserve.wire.messages import EngineCoreRequest
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.sampling_params import SamplingParams

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
NUM_KV_BLOCKS = 64
PROMPT_LENGTHS = (5, 17, 33, 9)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)  # still running when we act on it


# ---- fixtures ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def loop():
    # One event loop for the module: a started client belongs to the loop it was started on.
    loop = asyncio.new_event_loop()
    yield loop
    # Let the clients' cancelled output tasks finish before the loop goes.
    loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
    loop.close()


def run(loop, coroutine, timeout: float = patient(40)):
    """Run `coroutine` on `loop`, failing after `timeout` s (two engines starting took over 60 s on a busy machine)."""
    return loop.run_until_complete(asyncio.wait_for(coroutine, timeout))


@pytest.fixture(scope="module")
def model_folder() -> pathlib.Path:
    return tiny_model_with_tokenizer()


@pytest.fixture(scope="module")
def engine_args(model_folder) -> EngineArgs:
    return EngineArgs(model=str(model_folder), num_kv_blocks=NUM_KV_BLOCKS)


@pytest.fixture(scope="module")
def model_info(engine_args) -> ModelInfo:
    return ModelInfo.from_args(engine_args)


@pytest.fixture(scope="module")
def input_processor(model_info, engine_args) -> InputProcessor:
    return InputProcessor(model_info, load_tokenizer(model_info.path), engine_args.block_size)


@pytest.fixture(scope="module")
def prompts(model_info) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, model_info.vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference_ids(model_folder, prompts) -> list[list[int]]:
    llm = LLM(str(model_folder), num_kv_blocks=NUM_KV_BLOCKS)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def start_client(loop, client):
    run(loop, client.start())
    return client


@pytest.fixture(scope="module")
def inproc_client(loop, engine_args, model_info):
    client = start_client(loop, AsyncInprocClient(engine_args, model_info))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def mp_client(loop, engine_args, model_info):
    client = start_client(loop, MPClient(engine_args, model_info))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def dp_client(loop, engine_args, model_info):
    # Over TCP, as engines on other hosts would be reached.
    client = start_client(loop, MPClient(engine_args, model_info, data_parallel_size=2, transport="tcp"))
    yield client
    client.shutdown()


# ---- helpers -----------------------------------------------------------------------


def make_request(input_processor, request_id: str, prompt: list[int], params: SamplingParams = GREEDY):
    [request] = input_processor.make_requests(request_id, ProcessedPrompt(None, prompt), params, num_kv_blocks=NUM_KV_BLOCKS)
    return request


async def generate(client, input_processor, prompts, prefix: str):
    """Send every prompt, collect until all finish: (token ids per prompt, engine per prompt, engine of each output)."""
    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    sent_to = {}
    for request_id, prompt in zip(ids, prompts):
        sent_to[request_id] = await client.add_request(make_request(input_processor, request_id, prompt))
    tokens = {request_id: [] for request_id in ids}
    output_engines = {request_id: set() for request_id in ids}
    unfinished = set(ids)
    while unfinished:
        outputs = await client.get_outputs()
        for output in outputs.outputs:
            tokens[output.request_id] += output.new_token_ids
            output_engines[output.request_id].add(outputs.engine_index)
            if output.finished:
                unfinished.discard(output.request_id)
    return [tokens[i] for i in ids], [sent_to[i] for i in ids], [output_engines[i] for i in ids]


async def wait_for_tokens(client, request_ids: set[str]) -> None:
    """Read outputs until every one of request_ids has produced a token."""
    started = set()
    while started < request_ids:
        outputs = await client.get_outputs()
        started |= {o.request_id for o in outputs.outputs if o.new_token_ids}


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until_gone(pids, timeout: float) -> bool:
    deadline = time.monotonic() + patient(timeout)
    while time.monotonic() < deadline:
        if all(is_gone(pid) for pid in pids):
            return True
        time.sleep(0.05)
    return False


# ---- same tokens everywhere ------------------------------------------------------------


def test_inproc_client_matches_llm_generate(loop, inproc_client, input_processor, prompts, reference_ids):
    tokens, _, _ = run(loop, generate(inproc_client, input_processor, prompts, "inproc"))
    assert tokens == reference_ids


def test_engine_process_matches_llm_generate(loop, mp_client, input_processor, prompts, reference_ids):
    tokens, engines, _ = run(loop, generate(mp_client, input_processor, prompts, "mp"))
    assert tokens == reference_ids
    assert engines == [0] * len(prompts)
    assert mp_client.in_flight == {}


@pytest.mark.slow
def test_data_parallel_engines_match_llm_generate(loop, dp_client, input_processor, prompts, reference_ids):
    tokens, _, _ = run(loop, generate(dp_client, input_processor, prompts, "dp"))
    assert tokens == reference_ids


@pytest.mark.slow
def test_data_parallel_spreads_a_burst_over_both_engines(loop, dp_client, input_processor, prompts):
    burst = prompts * 2
    _, sent_to, output_engines = run(loop, generate(dp_client, input_processor, burst, "burst"))
    assert sorted(sent_to) == [0] * (len(burst) // 2) + [1] * (len(burst) // 2)
    # Each request's tokens came from the engine it was sent to, and from no other.
    assert output_engines == [{engine} for engine in sent_to]


@pytest.mark.slow
def test_handshake_reports_each_engines_kv_pool_and_context(dp_client, model_info):
    assert dp_client.num_kv_blocks == [NUM_KV_BLOCKS, NUM_KV_BLOCKS]
    assert dp_client.max_model_len == model_info.max_model_len
    assert len(set(dp_client.engine_pids)) == 2


# ---- requests in flight ------------------------------------------------------------------


@pytest.mark.parametrize("client_fixture", ["inproc_client", "mp_client"])
def test_abort_mid_generation_frees_the_kv_blocks(loop, client_fixture, input_processor, prompts, request):
    client = request.getfixturevalue(client_fixture)

    async def scenario():
        ids = {"abort-0", "abort-1"}
        for request_id, prompt in zip(sorted(ids), prompts):
            await client.add_request(make_request(input_processor, request_id, prompt, LONG))
        await wait_for_tokens(client, ids)
        busy = await client.call_utility("get_stats")
        await client.abort_requests(sorted(ids))
        aborted = set()
        while aborted != ids:
            outputs = await client.get_outputs()
            aborted |= {o.request_id for o in outputs.outputs if o.finish_reason == "abort"}
        return busy, await client.call_utility("get_stats")

    busy, after = run(loop, scenario())
    assert busy.num_running_reqs == 2 and busy.num_kv_blocks_used > 0
    assert after.num_running_reqs == 0 and after.num_waiting_reqs == 0
    assert after.num_kv_blocks_used == 0 and after.kv_cache_usage == 0.0
    assert client.in_flight == {}


def test_request_the_engine_process_refuses_finishes_with_an_error(loop, mp_client, model_info):
    client = mp_client
    # The front end validates first; this is the engine process's own check of what its socket brings.
    outside_vocabulary = EngineCoreRequest(
        "refused", [5, model_info.vocab_size], GREEDY, model_info.eos_token_ids, arrival_time=time.time()
    )

    async def scenario():
        await client.add_request(outside_vocabulary)
        return await client.get_outputs()

    output = run(loop, scenario()).outputs[0]
    assert output.request_id == "refused" and output.finish_reason == FINISH_REASON_ERROR
    assert "outside the vocabulary" in output.stop_reason
    assert output.error == output.stop_reason and output.error_param == "prompt"  # the front end's 400 names it
    assert client.in_flight == {}


def test_malformed_messages_are_dropped_and_the_engine_keeps_serving(
    loop, mp_client, input_processor, prompts, reference_ids
):
    socket = mp_client._input_sockets[0]
    socket.send_multipart([b"A", b"\xff\x00 not msgpack"])  # undecodable request
    socket.send_multipart([b"A", msgspec.msgpack.encode(["id", [1, 2], {"temperature": -1.0}, [], 0.0])])  # invalid
    socket.send_multipart([b"?", b""])  # unknown kind
    socket.send(b"one frame")
    tokens, _, _ = run(loop, generate(mp_client, input_processor, prompts[:1], "after-garbage"))
    assert tokens == reference_ids[:1]
    assert mp_client.is_healthy


def test_utility_call_to_an_unknown_method_is_refused(loop, mp_client):
    with pytest.raises(ValueError, match="method must be one of"):
        run(loop, mp_client.call_utility("__del__"))
    assert run(loop, mp_client.call_utility("reset_prefix_cache")) is True


# ---- the engine process itself ----------------------------------------------------------------


@pytest.mark.slow
def test_engine_process_title_names_its_rank(dp_client):
    for rank, pid in enumerate(dp_client.engine_pids):
        assert f"tinyserve-engine-{rank}" in " ".join(psutil.Process(pid).cmdline())


@pytest.mark.slow
def test_an_engine_started_as_rank_1_alone_answers_as_engine_1(loop, engine_args, model_info, input_processor,
                                                              prompts, reference_ids):
    # --data-parallel-rank 1: one engine, whose index is 1 in every message and answer.
    client = start_client(loop, MPClient(engine_args, model_info, start_index=1))
    try:
        tokens, sent_to, output_engines = run(loop, generate(client, input_processor, prompts[:2], "rank1"))
        assert tokens == reference_ids[:2]
        assert sent_to == [1, 1] and output_engines == [{1}, {1}]
        assert run(loop, client.call_utility("reset_prefix_cache", engine_index=1)) is True
        with pytest.raises(ValueError, match=r"engine_index must be in \[1, 2\), got 0"):
            run(loop, client.call_utility("reset_prefix_cache", engine_index=0))
        [pid] = client.engine_pids
        assert "tinyserve-engine-1" in " ".join(psutil.Process(pid).cmdline())
    finally:
        client.shutdown()


def test_engine_ignores_sigint(loop, mp_client, input_processor, prompts, reference_ids):
    # Ctrl-C in a terminal reaches the whole process group; the API process decides.
    os.kill(mp_client.engine_pids[0], signal.SIGINT)
    time.sleep(0.2)
    tokens, _, _ = run(loop, generate(mp_client, input_processor, prompts[:1], "after-sigint"))
    assert tokens == reference_ids[:1] and mp_client.is_healthy


def test_idle_engine_does_not_spin(mp_client):
    # An idle engine's main thread waits on the input queue until a message comes: the
    # kernel keeps it asleep, and it is never switched in, however busy the machine is.
    # A loop that polls would be seen running or runnable, and one that sleeps between
    # polls would be switched in at every poll. (On Linux, psutil reads a process's
    # state and context switches from its main thread.)
    engine = psutil.Process(mp_client.engine_pids[0])
    deadline = time.monotonic() + patient(10)  # the step that served the last test may still be ending
    while engine.status() != psutil.STATUS_SLEEPING:
        assert time.monotonic() < deadline, f"the engine never went to sleep: {engine.status()}"
        time.sleep(0.05)
    switches_before = sum(engine.num_ctx_switches())
    states = []
    for _ in range(40):
        states.append(engine.status())
        time.sleep(0.025)
    assert states == [psutil.STATUS_SLEEPING] * len(states)
    assert sum(engine.num_ctx_switches()) - switches_before <= 2


@pytest.mark.slow
def test_engine_startup_failure_is_reported_not_hung(loop, model_folder, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(model_folder, broken)
    (broken / "model.safetensors").write_bytes(b"this is not a safetensors file")
    args = EngineArgs(model=str(broken), num_kv_blocks=NUM_KV_BLOCKS)
    client = MPClient(args, ModelInfo.from_args(args), ipc_dir=str(tmp_path))
    with pytest.raises(EngineStartupError, match=r"engine 0 failed to start: EngineCore\(\) raised"):
        run(loop, client.start())
    assert wait_until_gone(client.engine_pids, timeout=5.0)
    assert [p.name for p in tmp_path.iterdir()] == ["broken-model"]  # the socket directory is gone


# ---- failures and shutdown ---------------------------------------------------------------


@pytest.mark.slow
def test_killed_engine_fails_outputs_within_seconds(loop, engine_args, model_info, input_processor, prompts):
    client = start_client(loop, MPClient(engine_args, model_info))
    try:
        run(loop, client.add_request(make_request(input_processor, "doomed", prompts[0], LONG)))
        run(loop, wait_for_tokens(client, {"doomed"}))
        os.kill(client.engine_pids[0], signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):
            run(loop, _drain_until_dead(client))
        assert time.monotonic() - killed_at < patient(2.0)  # event-driven: ~0.1 s idle, not a poll or a timeout
        assert not client.is_healthy
        with pytest.raises(EngineDeadError):
            run(loop, client.add_request(make_request(input_processor, "too-late", prompts[0])), timeout=patient(0.5))
        with pytest.raises(EngineDeadError):
            run(loop, client.get_outputs(), timeout=patient(0.5))  # and again: it stays dead
    finally:
        client.shutdown()


async def _drain_until_dead(client):
    while True:
        await client.get_outputs()


@pytest.mark.slow
def test_sigterm_stops_an_idle_engine_cleanly(loop, engine_args, model_info):
    client = start_client(loop, MPClient(engine_args, model_info))
    try:
        os.kill(client.engine_pids[0], signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="exit code 0"):
            run(loop, client.get_outputs(), timeout=patient(3.0))
    finally:
        client.shutdown()


@pytest.mark.slow
def test_shutdown_leaves_no_processes_and_no_socket_directory(loop, engine_args, model_info, input_processor, tmp_path):
    client = start_client(loop, MPClient(engine_args, model_info, data_parallel_size=2, ipc_dir=str(tmp_path)))
    pids = client.engine_pids
    assert len(list(tmp_path.iterdir())) == 1 and client.is_healthy
    client.shutdown()
    client.shutdown()  # idempotent
    assert all(is_gone(pid) for pid in pids)
    assert list(tmp_path.iterdir()) == []
    assert not client.is_healthy
    with pytest.raises(EngineDeadError, match="shut down"):
        run(loop, client.add_request(make_request(input_processor, "after-shutdown", [5, 6])))


@pytest.mark.slow
def test_engines_launched_before_the_event_loop_load_meanwhile_and_start_waits_for_them(
        loop, engine_args, model_info, input_processor, prompts, inproc_client, tmp_path):
    """`tinyserve serve` launches its engines first, then sets itself up; start() then only waits."""
    client = MPClient(engine_args, model_info, ipc_dir=str(tmp_path))
    try:
        client.launch()  # before the loop runs: the sockets take the loop that first uses them
        pids = client.engine_pids
        assert len(pids) == 1 and psutil.pid_exists(pids[0])
        client.launch()  # once
        start_client(loop, client)
        assert client.engine_pids == pids and client.is_healthy  # start() spawned nothing more
        tokens, _, _ = run(loop, generate(client, input_processor, prompts[:2], "launched"))
        expected, _, _ = run(loop, generate(inproc_client, input_processor, prompts[:2], "in-process"))
        assert tokens == expected and all(tokens)
    finally:
        client.shutdown()
    assert wait_until_gone(pids, 10) and list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_engines_launched_but_never_started_are_stopped_by_shutdown(engine_args, model_info, tmp_path):
    client = MPClient(engine_args, model_info, ipc_dir=str(tmp_path))
    client.launch()
    pids = client.engine_pids
    client.shutdown()
    assert wait_until_gone(pids, 10) and list(tmp_path.iterdir()) == []


PARENT_SCRIPT = """
import asyncio, json, sys
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.frontend.core_client import MPClient

async def main():
    args = EngineArgs(model=sys.argv[1], num_kv_blocks=16)
    client = MPClient(args, ModelInfo.from_args(args), ipc_dir=sys.argv[2])
    await client.start()
    print(json.dumps(client.engine_pids), flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow
def test_engines_exit_when_their_parent_is_killed(model_folder, tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_SCRIPT, str(model_folder), str(tmp_path)], cwd=REPO_ROOT, stdout=subprocess.PIPE
    )
    try:
        engine_pids = json.loads(parent.stdout.readline())
        assert engine_pids and not any(is_gone(pid) for pid in engine_pids)
    finally:
        parent.kill()
        parent.wait()
    assert wait_until_gone(engine_pids, timeout=5.0)
