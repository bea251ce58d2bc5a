"""Pipeline parallelism: the layers split over stages give transformers' greedy tokens.

Every family is checked in one process, its stages chained by an in-memory link in place of
torch.distributed's send/recv, through the pipeline scheduler with two batches in flight:
the split (vLLM's get_pp_indices), the loader's share of the weights for each stage, the
stage runners and the tokens the stages before the last learn from the SchedulerOutput.
Real processes (gloo send/recv, the batch queue) are checked on one model offline with
PP=2 x TP=2, and through `tinyserve serve --pipeline-parallel-size 2`.
"""

from collections import deque

import pytest
import torch

from tests.hf_reference import MAX_TOKENS, hf_greedy
from tests.tiny_checkpoints import tiny_checkpoint, tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.assemble import engine_args
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request
from tinyserve.models.pipeline_parallel import PipelineStage, get_pp_indices
from tinyserve.pipeline_parallel.scheduler import PipelineScheduler

PROMPT_LENGTHS = (5, 17, 40)


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def test_layers_split_as_vllms_get_pp_indices():
    # vLLM's own cases (tests/distributed/test_pipeline_partition.py): even, and the remainder given to
    # the stages before the last, nearest it first.
    assert [get_pp_indices(20, r, 4) for r in range(4)] == [(0, 5), (5, 10), (10, 15), (15, 20)]
    assert [get_pp_indices(5, r, 3) for r in range(3)] == [(0, 2), (2, 4), (4, 5)]
    assert [get_pp_indices(3, r, 2) for r in range(2)] == [(0, 2), (2, 3)]
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(--pipeline-parallel-size\) 3 is more than "
                                         r"the model's 2 layers"):
        PipelineStage.of(0, 3, 2)


class InMemoryLink:
    """A StageLink without torch.distributed: what one stage sends, the next receives, in order."""

    def __init__(self, inbox: deque | None, outbox: deque | None) -> None:
        self.inbox, self.outbox, self.recv_wait_s = inbox, outbox, 0.0

    def recv(self, num_tokens: int):
        hidden, residual = self.inbox.popleft()
        assert hidden.shape[0] == num_tokens
        return hidden, residual

    def send(self, hidden, residual) -> None:
        self.outbox.append((hidden.clone(), residual.clone()))

    def wait_sent(self) -> None:
        pass


def pipeline_greedy(folder, num_stages: int, prompts: list[list[int]], num_blocks: int = 64):
    """Greedy tokens of `folder` split over num_stages stage runners in this process, num_stages batches in
    flight: each batch runs on stage 0 when scheduled and on the later stages when it retires, in order."""
    from tinyserve.kernels.backend import default_attention_backend, get_attention_backend
    from tinyserve.models.loader import load_model
    from tinyserve.pipeline_parallel.stage_runner import PipelineStageRunner

    info = ModelInfo.from_args(EngineArgs(model=str(folder)))
    device = torch.device("cpu")
    backend = get_attention_backend(default_attention_backend(device), device, info.max_model_len)
    layers = __import__("json").loads((folder / "config.json").read_text())["num_hidden_layers"]
    boxes = [deque() for _ in range(num_stages - 1)]
    runners = []
    for rank in range(num_stages):
        stage = PipelineStage.of(rank, num_stages, layers)
        model, _ = load_model(folder, torch.float32, device, backend, pp=stage)
        link = InMemoryLink(boxes[rank - 1] if rank else None, boxes[rank] if rank < num_stages - 1 else None)
        runners.append(PipelineStageRunner(model, link=link, num_blocks=num_blocks, block_size=16,
                                           dtype=torch.float32, device=device))
    scheduler = PipelineScheduler(KVCacheManager(num_blocks, 16, True), max_num_batched_tokens=5, max_num_seqs=8,
                                  max_model_len=info.max_model_len)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                                      eos_token_ids=info.eos_token_ids, arrival_time=0.0))
    tokens, in_flight, most_in_flight = {str(i): [] for i in range(len(prompts))}, deque(), 0
    while scheduler.has_unfinished_requests:
        scheduler_output = scheduler.schedule() if len(in_flight) < num_stages else None
        if scheduler_output is not None and not scheduler_output.is_empty:
            runners[0].execute_model(scheduler_output)
            in_flight.append(scheduler_output)
            most_in_flight = max(most_in_flight, len(in_flight))
            continue
        if scheduler_output is not None:  # finished ids only: every stage forgets them
            for runner in runners:
                runner.execute_model(scheduler_output)
        if in_flight:
            retiring = in_flight.popleft()
            output = [runner.execute_model(retiring) for runner in runners[1:]][-1]
            for engine_output in scheduler.update_from_output(retiring, output):
                tokens[engine_output.request_id] += engine_output.new_token_ids
    assert most_in_flight == num_stages  # a batch on every stage at once (5 tokens a batch: one request each)
    assert scheduler.kv.pool.num_free_blocks == num_blocks and not scheduler.in_flight
    pipeline_greedy.num_preemptions = scheduler.num_preemptions
    return [tokens[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize(("family", "tied", "num_layers", "num_stages"), [
    ("llama", False, 3, 2),  # an odd count: [0:2] and [2:3]
    ("mistral", False, 2, 2),
    ("qwen2", True, 2, 2),  # tied: the last stage's own lm_head takes the embedding's matrix
    ("qwen3", False, 3, 3),  # one layer a stage; the middle one neither embeds nor samples
])
def test_every_family_split_into_stages_gives_transformers_greedy_tokens(family, tied, num_layers, num_stages):
    folder = tiny_checkpoint(family, tie_word_embeddings=tied, num_hidden_layers=num_layers)
    prompts = prompts_for(384)
    assert pipeline_greedy(folder, num_stages, prompts) == [hf_greedy(folder, p) for p in prompts]


def test_requests_preempted_while_their_batch_is_in_flight_still_get_transformers_tokens():
    """5 blocks of 16 for two requests that need 7 at their longest: the pool runs out, running requests
    (some in flight, whose batch's token is then dropped) are preempted and recomputed."""
    folder = tiny_checkpoint("llama", num_hidden_layers=3)
    prompts = prompts_for(384)[1:]
    assert pipeline_greedy(folder, 2, prompts, num_blocks=5) == [hf_greedy(folder, p) for p in prompts]
    assert pipeline_greedy.num_preemptions > 0


def test_a_stage_holds_only_its_own_weights():
    from tinyserve.kernels.backend import get_attention_backend
    from tinyserve.models.loader import load_model
    from tinyserve.models.pipeline_parallel import PPMissingLayer

    folder = tiny_checkpoint("llama", tie_word_embeddings=True, num_hidden_layers=3)
    backend = get_attention_backend("torch", torch.device("cpu"), 512)
    first, _ = load_model(folder, torch.float32, "cpu", backend, pp=PipelineStage.of(0, 2, 3))
    last, _ = load_model(folder, torch.float32, "cpu", backend, pp=PipelineStage.of(1, 2, 3))
    names = lambda model: {name.split(".")[0] + ("." + name.split(".")[1] if name.startswith("layers.") else "")
                           for name, _ in model.named_parameters()}
    assert names(first) == {"embed_tokens", "layers.0", "layers.1"}
    assert names(last) == {"layers.2", "norm", "lm_head"}
    assert isinstance(first.lm_head, PPMissingLayer) and isinstance(last.embed_tokens, PPMissingLayer)
    assert first.num_layers == 2 and last.num_layers == 1  # each stage's KV cache: its own layers only


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"pipeline_parallel_size": 0}, r"pipeline_parallel_size \(--pipeline-parallel-size\) must be at least 1"),
    ({"pipeline_parallel_size": 2, "enable_lora": True}, r"not supported with enable_lora \(--enable-lora\)"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     r"not supported with speculative_config \(--speculative-config\)"),
    ({"pipeline_parallel_size": 2, "runner": "pooling"}, r"not supported with runner='pooling'"),
    ({"pipeline_parallel_size": 2, "kv_transfer_config": {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"}},
     r"not supported with kv_transfer_config \(--kv-transfer-config\)"),
])
def test_what_pipeline_parallelism_refuses_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_args(**kwargs)


def test_more_stages_than_layers_is_refused_before_any_process_starts():
    folder = tiny_checkpoint("llama")  # 2 layers
    with pytest.raises(ValueError, match=r"pipeline_parallel_size \(--pipeline-parallel-size\) 3 is more than the "
                                         r"model's 2 layers"):
        ModelInfo.from_args(EngineArgs.from_kwargs(model=str(folder), pipeline_parallel_size=3))


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks_give_transformers_greedy_tokens_and_trace_each_stage(tmp_path):
    """... and stage 0's second rank stopped (it holds rank 0 in an all-reduce, inside the engine's own step) fails
    the next step naming it, within --tensor-parallel-watchdog-timeout."""
    import os
    import signal
    import time

    from tests.patience import patient
    from tinyserve.lifecycle.tracing import shutdown_tracing
    from tinyserve.trace_reading import load_run

    folder = tiny_model_with_tokenizer("llama", num_hidden_layers=3)
    prompts = prompts_for(384)[:2]
    try:
        # 5 tokens a batch: the first prompt (5 tokens) fills one, so the second goes in the next, in flight with it
        llm = LLM(str(folder), pipeline_parallel_size=2, tensor_parallel_size=2, num_kv_blocks=64,
                  max_num_batched_tokens=5, trace_dir=str(tmp_path), tensor_parallel_watchdog_s=patient(1))
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.llm_engine.flush_spans()
    finally:
        shutdown_tracing()
    try:
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(folder, p) for p in prompts]
        core = llm.engine_core
        assert len(core.other_ranks.processes) == 3  # stage 0's second rank, and stage 1's two
        assert core.model_runner.kv_caches[0].shape[3] == 1  # 2 KV heads over 2 TP ranks
        assert len(core.model_runner.kv_caches) == 2  # stage 0's layers only
        assert core.kv_cache_manager.pool.num_free_blocks == 64 and core.scheduler.num_batches_in_flight == 0
        processes = list(core.other_ranks.processes)
        os.kill(processes[0].pid, signal.SIGSTOP)  # stage 0's second rank: alive, and never at its next all-reduce
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 \(stopped\) did not answer"):
            llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        assert time.monotonic() - started < patient(20)  # the watchdog's bound, not gloo's timeout (minutes)
        processes[0].join(patient(5))  # the watchdog's SIGKILL is sent; the process is reaped a moment later
        assert processes[0].exitcode == -signal.SIGKILL  # killed: nothing is left stopped
    finally:
        llm.shutdown()
    assert all(process.exitcode is not None for process in processes)  # no rank left behind
    [run_dir] = list(tmp_path.iterdir())
    steps = [step for step in load_run(run_dir).steps if step.request_ids]
    for step in steps:  # one execute per rank of each stage; stage 1 begins by waiting for stage 0's stream
        assert [(r["stage"], r["rank"]) for r in step.ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(0 <= r["recv_wait_s"] <= r["execute_s"] for r in step.ranks)
        assert all(r["recv_wait_s"] == 0 for r in step.ranks[:2])  # stage 0 embeds: it waits for nobody
        assert all(r["all_reduce_s"] > 0 for r in step.ranks)
    # Two batches in flight: a step (scheduled → its batch back) begins before the one before it ends.
    assert any(later.start_ns < earlier.end_ns for earlier, later in zip(steps, steps[1:]))


def test_serve_help_shows_the_flag_and_a_bad_value_is_an_error_naming_it(capsys):
    from tinyserve.cli.main import main

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert "--pipeline-parallel-size" in capsys.readouterr().out
    folder = tiny_checkpoint("llama")  # 2 layers
    assert main(["serve", str(folder), "--port", "0", "--pipeline-parallel-size", "3"]) == 2
    assert "pipeline_parallel_size (--pipeline-parallel-size) 3 is more than the model's 2 layers" \
        in capsys.readouterr().err


@pytest.mark.server
def test_a_two_stage_server_gives_transformers_tokens_frees_its_blocks_and_goes_down_naming_a_silent_stage():
    """... and goes down, naming the stage, when its last stage stops answering."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import psutil

    from tests.patience import patient
    from tests.server_checks import metric, wait_until
    from tinyserve.testing import ServerProcess

    folder = tiny_model_with_tokenizer("llama", num_hidden_layers=3)
    server = ServerProcess(str(folder), "--served-model-name", "tiny", "--pipeline-parallel-size", "2",
                           "--num-kv-blocks", "64", "--max-num-batched-tokens", "16",
                           "--tensor-parallel-watchdog-timeout", "3")
    try:
        prompts = prompts_for(384)

        def token_ids(prompt):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0,
                    "return_tokens_as_token_ids": True}
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
            return [int(t.removeprefix("token_id:")) for t in answer["choices"][0]["logprobs"]["tokens"]]

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(token_ids, prompts))
        assert got == [hf_greedy(folder, p) for p in prompts]
        wait_until(lambda: metric(server.url, "kv_cache_usage_perc") == 0, 10, "every KV block is free")
        engine = [c for c in psutil.Process(server.process.pid).children() if "engine" in c.name()][0]
        [stage1] = [c for c in engine.children() if c.name().endswith("-pp1")]
        stage1.suspend()  # SIGSTOP: alive and silent; after 3 s the engine kills the ranks and fails
        assert httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4},
                          timeout=patient(30)).status_code >= 500
        assert server.process.wait(patient(10)) == 1
        assert "pipeline-parallel rank 1 (stage 1, stopped) did not answer" in server.output()
    finally:
        server.stop()
