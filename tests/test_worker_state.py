"""The worker reads only SchedulerOutput and keeps its own state per request (request_state.py)."""

import pytest
import torch

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.wire.messages import EngineCoreRequest


@pytest.fixture(scope="module")
def folder():
    return str(tiny_model_with_tokenizer("llama"))


def prompts(lengths, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 300, (n,), generator=generator).tolist()} for n in lengths]


def preempted_after_first_token(output) -> bool:
    times = output.metrics
    return any(t > times.first_token_time for t in times.preemption_times)


def test_a_seeded_request_preempted_mid_decode_gets_the_same_tokens_as_unpreempted(folder):
    # Penalties read the output tokens the worker holds: after the preemption they come
    # back with the request, and its seeded generator carries on where it was.
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=30, ignore_eos=True, top_k=50,
                             repetition_penalty=1.3, frequency_penalty=0.4) for i in range(4)]
    batch = prompts((40, 40, 17, 33))
    roomy = LLM(folder).generate(batch, params, use_tqdm=False)
    # 9 blocks of 16 tokens cannot hold four requests growing to up to 5 blocks each.
    tight_llm = LLM(folder, num_kv_blocks=9, block_size=16, max_num_batched_tokens=24)
    tight = tight_llm.generate(batch, params, use_tqdm=False)
    assert any(preempted_after_first_token(output) for output in tight)
    assert [o.outputs[0].token_ids for o in tight] == [o.outputs[0].token_ids for o in roomy]
    assert len(set(roomy[0].outputs[0].token_ids)) > 5  # really sampled


def test_the_worker_forgets_every_request_once_finished_or_aborted(folder):
    llm = LLM(folder, num_kv_blocks=9, block_size=16, max_num_batched_tokens=24, max_num_seqs=3)
    core, runner = llm.engine_core, llm.engine_core.model_runner
    llm.generate(prompts((40, 40, 17, 33)), SamplingParams(temperature=1.0, seed=1, max_tokens=30), use_tqdm=False)
    assert core.scheduler.num_preemptions > 0
    assert runner.requests == {} and not core.has_requests  # generate() delivered the last finished ids
    # Running, mid-prefill and waiting (never scheduled) requests, all aborted.
    for i, prompt in enumerate(prompts((20, 60, 10, 10), seed=6)):
        core.add_request(EngineCoreRequest(f"abort-{i}", prompt["prompt_token_ids"], SamplingParams(max_tokens=50),
                                           eos_token_ids=[], arrival_time=0.0))
    core.step()
    core.step()
    assert sorted(runner.requests) == ["abort-0", "abort-1"]  # decoding, and in the middle of its prefill
    core.abort_requests([f"abort-{i}" for i in range(4)])
    assert not core.has_unfinished_requests
    # Finished and aborted ids reach the worker with the next step's SchedulerOutput: one
    # more, empty, step, which the engine loops take while has_requests says so.
    assert core.has_requests
    core.step()
    assert runner.requests == {} and not core.has_requests
