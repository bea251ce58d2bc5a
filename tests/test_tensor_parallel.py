"""Tensor parallelism: the model split over N worker processes gives transformers' greedy tokens.

Each test starts real ranks (processes started as `python -m tinyserve.engine.child_process`, joined by torch.distributed over gloo, fed
each SchedulerOutput over ZeroMQ) on the CPU. The tiny checkpoints have 4 query heads
over 2 KV heads: TP=2 splits both, TP=4 replicates each KV head on two ranks.
"""

import os
import signal
import time

import pytest
import torch

from tests.hf_reference import MAX_TOKENS, hf_greedy, hf_model
from tests.patience import patient
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = (5, 17, 40)


def prompts_for(folder) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = hf_model(folder).config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generate(llm: LLM, prompts, params=None) -> list[list[int]]:
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


@pytest.fixture
def tp_llm():
    """Make tensor-parallel LLMs; each is shut down afterwards (one process group per process)."""
    made = []

    def make(folder, size, **kwargs):
        llm = LLM(str(folder), tensor_parallel_size=size, num_kv_blocks=64, **kwargs)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


@pytest.mark.parametrize(("family", "size", "extra"), [
    ("llama", 2, {}),
    ("llama", 4, {}),  # 2 KV heads over 4 ranks: each KV head replicated
    ("qwen2", 2, {}),  # biases on q/k/v: split with their rows
    ("llama", 2, {"attention_bias": True, "mlp_bias": True}),  # o_proj/down_proj biases: added once, after the sum
], ids=["llama-tp2", "llama-tp4-replicated-kv", "qwen2-tp2", "llama-biases-tp2"])
def test_greedy_matches_transformers(tp_llm, family, size, extra):
    folder = tiny_model_with_tokenizer(family, **extra)
    prompts = prompts_for(folder)
    llm = tp_llm(folder, size, max_num_batched_tokens=16)  # chunked prefill as well
    assert generate(llm, prompts) == [hf_greedy(folder, p) for p in prompts]
    # Each rank's KV cache holds its own heads only: 2 KV heads / 2 ranks, or 1 replicated.
    assert llm.engine_core.model_runner.kv_caches[0].shape[3] == 1


def test_each_rank_keeps_its_share_of_an_fp8_kv_cache_and_the_tokens_are_transformers_rounding_the_same_way(tp_llm):
    folder = tiny_model_with_tokenizer("llama")
    prompts = prompts_for(folder)
    llm = tp_llm(folder, 2, kv_cache_dtype="fp8")
    assert generate(llm, prompts) == [hf_greedy(folder, p, kv_dtype=torch.float8_e4m3fn) for p in prompts]
    assert llm.engine_core.model_runner.kv_caches[0].dtype == torch.float8_e4m3fn


def test_a_one_rank_group_runs_the_tensor_parallel_path_with_the_plain_paths_tokens(tp_llm):
    from tinyserve.models.tensor_parallel import RowParallelLinear

    folder = tiny_model_with_tokenizer("llama")
    prompts = prompts_for(folder)
    llm = tp_llm(folder, 1, force_tensor_parallel=True)
    workers = llm.engine_core.other_ranks
    assert workers.processes == [] and workers.tp.size == 1
    row_parallel = [m for m in llm.engine_core.model_runner.model.modules() if isinstance(m, RowParallelLinear)]
    assert row_parallel and all(m.tp is workers.tp for m in row_parallel)  # every one of them all-reduces
    assert generate(llm, prompts) == generate(LLM(str(folder), num_kv_blocks=64), prompts)
    assert workers.tp.timer.seconds > 0


def test_seeded_sampling_is_the_same_split_or_not(tp_llm):
    folder = tiny_model_with_tokenizer("llama")
    prompts = prompts_for(folder)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    whole = generate(LLM(str(folder), num_kv_blocks=64), prompts, params)
    assert generate(tp_llm(folder, 2), prompts, params) == whole


def test_heads_that_do_not_split_are_refused_by_name():
    folder = tiny_model_with_tokenizer("llama")
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by tensor_parallel_size \(3\)"):
        LLM(str(folder), tensor_parallel_size=3, num_kv_blocks=64)


def test_a_second_tensor_parallel_llm_in_one_process_is_refused_until_the_first_is_shut_down(tp_llm):
    folder = tiny_model_with_tokenizer("llama")
    first = tp_llm(folder, 2)
    with pytest.raises(ValueError, match="already running in this process"):
        LLM(str(folder), tensor_parallel_size=2, num_kv_blocks=64)
    first.shutdown()
    assert generate(tp_llm(folder, 2), prompts_for(folder)[:1])  # a new group forms


def test_a_rank_that_dies_fails_the_step_instead_of_hanging(tp_llm):
    folder = tiny_model_with_tokenizer("llama")
    llm = tp_llm(folder, 2)
    [worker] = llm.engine_core.other_ranks.processes
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 died \(killed by SIGKILL\)"):
        generate(llm, prompts_for(folder))


def test_a_stopped_rank_fails_the_step_naming_it_within_the_watchdogs_bound(tp_llm):
    folder = tiny_model_with_tokenizer("llama")
    llm = tp_llm(folder, 2, tensor_parallel_watchdog_s=patient(1))  # a busy machine stalls a rank for seconds
    assert generate(llm, prompts_for(folder)[:1])  # the group works
    [worker] = llm.engine_core.other_ranks.processes
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but it will never reach the next all_reduce
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(stopped\) did not answer: rank 0 waited \d+ s"):
        generate(llm, prompts_for(folder))
    assert time.monotonic() - started < patient(10)  # the watchdog's bound, not the group's timeout (minutes)
    worker.join(patient(5))
    assert worker.exitcode == -signal.SIGKILL  # the watchdog killed it: nothing is left stopped


@pytest.mark.server
def test_a_server_with_two_ranks_serves_and_goes_down_when_a_rank_stops_answering():
    import httpx
    import psutil

    from tinyserve.testing import ServerProcess

    folder = tiny_model_with_tokenizer("llama")
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                           "--num-kv-blocks", "64", "--tensor-parallel-watchdog-timeout", str(patient(1)))
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == len(hf_greedy(folder, [5, 6, 7, 8]))
        engine = [c for c in psutil.Process(server.process.pid).children() if "engine" in c.name()][0]
        [rank1] = [c for c in engine.children() if c.name().endswith("-tp1")]
        rank1.suspend()  # SIGSTOP: alive, silent; the watchdog makes it a dead rank
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=patient(30))
        assert response.status_code >= 500
        assert server.process.wait(patient(10)) == 1  # the engine died with its rank: the server goes down
        assert "tensor-parallel rank 1 (stopped) did not answer" in server.output()
    finally:
        server.stop()


def test_each_traced_step_has_one_execute_span_per_rank_with_its_all_reduce_time(tmp_path, tp_llm):
    from tinyserve.lifecycle.tracing import shutdown_tracing
    from tinyserve.trace_reading import load_run

    folder = tiny_model_with_tokenizer("llama")
    try:
        llm = tp_llm(folder, 2, trace_dir=str(tmp_path))
        generate(llm, prompts_for(folder))
        llm.llm_engine.flush_spans()
    finally:
        shutdown_tracing()
    [run_dir] = list(tmp_path.iterdir())
    steps = load_run(run_dir).steps
    assert steps and steps[0].request_ids
    for step in steps:
        if not step.request_ids:  # the last: it only tells the workers of released requests, no forward pass
            assert step is steps[-1] and step.released_request_ids and not step.ranks
            continue
        assert [r["rank"] for r in step.ranks] == [0, 1] and {r["device"] for r in step.ranks} == {"cpu"}
        # two all-reduces per layer on every rank; waiting in them is part of each rank's forward pass
        assert all(0 < r["all_reduce_s"] < r["execute_s"] for r in step.ranks)
        assert step.execute_s == step.ranks[0]["execute_s"]


def test_an_engine_that_fails_after_its_group_formed_ends_the_group(tp_llm, monkeypatch):
    """A failure between the weights and the first step (the KV cache, say) leaves no process group behind."""
    import torch.distributed as dist

    from tinyserve import assemble

    folder = tiny_model_with_tokenizer("llama")

    def no_memory(*args, **kwargs):
        raise MemoryError("no room for the KV cache")

    with monkeypatch.context() as patch:
        patch.setattr(assemble, "KVCacheManager", no_memory)
        with pytest.raises(MemoryError, match="no room for the KV cache"):
            LLM(str(folder), tensor_parallel_size=2, num_kv_blocks=64)
    assert not dist.is_initialized()
    prompts = prompts_for(folder)
    assert generate(tp_llm(folder, 2), prompts) == generate(LLM(str(folder), num_kv_blocks=64), prompts)


def test_rank_zeros_store_takes_the_port_it_binds_and_the_others_find_it_there():
    """No port is picked free and bound later (another process could take it between): the
    store binds port 0, the system's choice, and the other ranks are told the port it got."""
    from tinyserve.engine.worker.tp_group import host_store, join_store

    first, second = host_store("127.0.0.1", 2), host_store("127.0.0.1", 2)
    assert first.port > 0 and second.port > 0 and first.port != second.port
    joined = join_store("127.0.0.1", first.port, 2)
    joined.set("rank 1", b"here")
    assert first.get("rank 1") == b"here"


def exits_at_start_up(**kwargs):
    """A rank's entry point that fails before it reaches the group (unpickled in the rank's process)."""
    raise SystemExit(3)


def test_a_rank_that_fails_to_start_fails_the_engine_within_seconds_not_the_rendezvous_timeout(monkeypatch):
    from tests.patience import patient
    from tinyserve.engine.worker import tensor_parallel_workers

    monkeypatch.setattr(tensor_parallel_workers, "run_worker", exits_at_start_up)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 exited during start-up \(exit code 3\)"):
        LLM(str(tiny_model_with_tokenizer("llama")), tensor_parallel_size=2, num_kv_blocks=64)
    assert time.monotonic() - started < patient(10) < tensor_parallel_workers.RENDEZVOUS_TIMEOUT_S


UNGUARDED_SCRIPT = """
from tinyserve import LLM, SamplingParams

llm = LLM({folder!r}, tensor_parallel_size=2, num_kv_blocks=64)
outputs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}],
                       SamplingParams(temperature=0.0, max_tokens={max_tokens}), use_tqdm=False)
print([o.outputs[0].token_ids for o in outputs])
"""


def test_a_script_with_a_tensor_parallel_llm_at_module_level_runs_as_written(tmp_path):
    """No `if __name__ == "__main__":` guard: the ranks do not import the user's script again."""
    import subprocess
    import sys

    folder = tiny_model_with_tokenizer("llama")
    prompts = prompts_for(folder)
    script = tmp_path / "tp_script.py"
    script.write_text(UNGUARDED_SCRIPT.format(folder=str(folder), prompts=prompts, max_tokens=MAX_TOKENS))
    done = subprocess.run([sys.executable, script.name], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str([hf_greedy(folder, p) for p in prompts])
