"""Ray as the distributed backend: vLLM's --distributed-executor-backend ray and --data-parallel-backend ray.

The cluster is Ray's own test cluster (ray.cluster_utils.Cluster), one per module: a head node
and a second node that alone has the custom resource "node_b", both on this machine's loopback.
`--ray-resources '{"node_b": 1}'` must put the actors there: a tensor-parallel rank whose
all-reduces then cross two Ray nodes and still give transformers' greedy tokens, and two
data-parallel engines serving a burst through the front end's ZeroMQ sockets, each its share.
An engine actor killed fails the requests it held and the server exits 1, as an engine process.
"""

import concurrent.futures
import json
import os
import signal

import httpx
import psutil
import pytest

from tests.hf_reference import hf_greedy
from tests.patience import patient
from tests.ray_turns import ray_cluster_turn
from tests.server_checks import long_context_model, sse_lines, wait_until
from tests.test_tensor_parallel import generate, prompts_for
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM
from tinyserve.cli.main import main

NODE_B = {"node_b": 4}  # the second node's custom resource: room for every actor of a test


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes on loopback; RAY_ADDRESS names the cluster for this process and the servers it starts."""
    saved = {name: os.environ.get(name) for name in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's nodes on 127.0.0.1 (read as Ray is imported)
    import ray  # the ray extra, which scripts/setup.sh installs
    from ray.cluster_utils import Cluster

    with ray_cluster_turn():  # no other test's Ray cluster beside this one (tests/ray_turns.py)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        node_b = cluster.add_node(num_cpus=4, resources=NODE_B)
        os.environ["RAY_ADDRESS"] = cluster.address
        try:
            yield cluster, node_b
        finally:
            ray.shutdown()
            cluster.shutdown()
            for name, value in saved.items():
                os.environ.pop(name, None) if value is None else os.environ.__setitem__(name, value)


@pytest.mark.slow
def test_a_rank_on_another_ray_node_keeps_transformers_greedy_tokens_and_its_death_fails_the_step(cluster):
    _, node_b = cluster
    folder = tiny_model_with_tokenizer("llama")
    prompts = prompts_for(folder)
    llm = LLM(str(folder), tensor_parallel_size=2, num_kv_blocks=64, max_num_batched_tokens=16,
              distributed_executor_backend="ray", ray_resources={"node_b": 1})
    try:
        assert generate(llm, prompts) == [hf_greedy(folder, p) for p in prompts]
        [rank1] = llm.engine_core.other_ranks.processes
        assert rank1.node_id == node_b.node_id  # placed by its bundle's resource, not beside rank 0
        assert llm.engine_core.model_runner.kv_caches[0].shape[3] == 1  # each rank holds its own KV head
        os.kill(rank1.pid, signal.SIGKILL)  # the actor's process, as a crash would end it
        rank1.join(patient(10))
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 died \(Ray actor tinyserve-engine-0-tp1 died"):
            generate(llm, prompts)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_a_bundle_no_node_can_hold_is_refused_at_once_naming_the_resource(cluster):
    folder = tiny_model_with_tokenizer("llama")
    with pytest.raises(ValueError, match=r'no node of the Ray cluster has the resources of the bundle .*"gpu_node": 1'):
        LLM(str(folder), tensor_parallel_size=2, num_kv_blocks=64, distributed_executor_backend="ray",
            ray_resources={"gpu_node": 1})


def completion(url: str, i: int, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": "tiny", "prompt": f"story {i}", "max_tokens": max_tokens, "ignore_eos": True}
    if not stream:
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        return {"status": response.status_code, "tokens": response.json().get("usage", {}).get("completion_tokens")}
    outcome = {"status": None, "error": None}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as response:
        outcome["status"] = response.status_code
        for line in sse_lines(response):
            if line.startswith("data: {") and "error" in (chunk := json.loads(line.removeprefix("data: "))):
                outcome["error"] = chunk["error"]
    return outcome


def engine_actors(raylet_pid: int) -> dict[int, psutil.Process]:
    """The engines' actor processes under this raylet (node B's), by engine index, found by their titles
    (Ray names a worker process after the call it runs: ray::tinyserve-engine-<i>)."""
    found = {}
    for child in psutil.Process(raylet_pid).children():
        index = " ".join(child.cmdline()).strip().removeprefix("ray::tinyserve-engine-")
        if index.isdigit():
            found[int(index)] = child
    return found


@pytest.mark.slow
@pytest.mark.server
def test_two_engines_on_ray_serve_a_burst_and_a_killed_one_fails_its_requests_and_the_server_exits_1(cluster, tmp_path):
    from tests.test_dp_rank_loss import by_engine
    from tinyserve.testing import ServerProcess
    from tinyserve.trace_reading import load_run

    _, node_b = cluster
    raylet_b = node_b.all_processes["raylet"][0].process.pid
    server = ServerProcess(long_context_model(), "--served-model-name", "tiny", "--num-kv-blocks", "2048",
                           "--data-parallel-size", "2", "--data-parallel-backend", "ray",
                           "--ray-resources", '{"node_b": 1}', "--trace", "--trace-dir", str(tmp_path),
                           "--shutdown-timeout", "1")  # RAY_ADDRESS: this module's cluster
    try:
        # Both on node B, the node with the resource; none a child of the server. Ray retitles an actor's
        # process as its first call runs, which may come just after the server answers /health.
        wait_until(lambda: sorted(engine_actors(raylet_b)) == [0, 1], 30, "both engine actors run on node B")
        actors = engine_actors(raylet_b)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # a burst: the balancer spreads it
            burst = list(pool.map(lambda i: completion(server.url, i, 8), range(8)))
        assert burst == [{"status": 200, "tokens": 8}] * 8
        finished = by_engine(server.url)["finished"]
        assert set(finished) == {"0", "1"} and all(count >= 1 for count in finished.values()), finished
        assert sum(finished.values()) == 8
        # Each actor writes its spans into the run folder as an engine process does, in batches: wait for
        # engine 1's first before it is killed (a SIGKILL loses what it had not written yet).
        wait_until(lambda: any(p.stat().st_size for p in tmp_path.glob("*/engine-1.jsonl")), 60,
                   "engine 1's spans reach the run folder")

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(completion, server.url, 100 + i, 4000, True) for i in range(4)]
            wait_until(lambda: all(by_engine(server.url)["running"].get(e, 0) >= 1 for e in ("0", "1")), 60,
                       "both engines run a stream")
            actors[1].send_signal(signal.SIGKILL)  # the actor's process dies as a crashed engine's would
            outcomes = [stream.result(timeout=180) for stream in streams]
        failed = [o for o in outcomes if o["error"] is not None]
        assert failed, outcomes
        for outcome in failed:
            assert outcome["status"] == 200 and outcome["error"]["code"] == 503, outcome
            assert "engine 1 died" in outcome["error"]["message"], outcome
            assert "Ray actor tinyserve-engine-1 died" in outcome["error"]["message"], outcome
        assert server.process.wait(patient(10)) == 1  # no --keep-alive-on-engine-death: the server goes down
    finally:
        output = server.stop()
    assert "Ray actor tinyserve-engine-1 died" in output, output[-3000:]
    [run_dir] = [p for p in tmp_path.iterdir() if p.is_dir()]
    run = load_run(run_dir)  # each actor wrote its spans into the run folder, as an engine process does
    assert run.engine_indices == [0, 1] and run.engine_steps(0) and run.engine_steps(1)
    assert {r.engine_index for r in run.requests if r.engine_index is not None} == {0, 1}


@pytest.mark.parametrize("flags, message", [
    (["--ray-resources", '{"node_b": 1}'],
     "--ray-resources places Ray actors: it needs --data-parallel-backend ray or --distributed-executor-backend ray"),
    (["--data-parallel-backend", "ray", "--data-parallel-size", "2", "--data-parallel-rank", "1"],
     "--data-parallel-rank is for --data-parallel-backend mp: with ray, Ray places every engine"),
    (["--data-parallel-backend", "ray", "--data-parallel-size", "2", "--data-parallel-size-local", "1"],
     "--data-parallel-size-local is for --data-parallel-backend mp: with ray, Ray places every engine"),
])
def test_ray_flags_that_cannot_fit_exit_2_naming_them(tmp_path, capsys, flags, message):
    assert main(["serve", str(tmp_path / "no-such-model"), *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_without_ray_installed_either_ray_backend_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    from tinyserve.assemble import check_engine_args
    from tinyserve.config import EngineArgs
    from tinyserve.distributed import ray_cluster

    monkeypatch.setattr(ray_cluster, "ray_installed", lambda: False)
    assert main(["serve", str(tmp_path / "no-such-model"), "--data-parallel-backend", "ray"]) == 2
    assert capsys.readouterr().err == ("error: --data-parallel-backend ray needs Ray, which is not installed: "
                                       "the ray extra, pip install 'tinyserve[ray]'\n")
    with pytest.raises(ValueError, match=r"--distributed-executor-backend ray needs Ray, which is not installed: "
                                         r"the ray extra, pip install 'tinyserve\[ray\]'"):
        check_engine_args(EngineArgs(distributed_executor_backend="ray"))
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"with --pipeline-parallel-size the stages run as processes: use mp"):
        check_engine_args(EngineArgs(distributed_executor_backend="ray", tensor_parallel_size=2,
                                     pipeline_parallel_size=2))
    with pytest.raises(ValueError, match=r"ray_resources \(--ray-resources\) names \['CPU'\]"):
        check_engine_args(EngineArgs(ray_resources={"CPU": 2}))
