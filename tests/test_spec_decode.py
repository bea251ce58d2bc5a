"""Speculative decoding (tinyserve/spec_decode/): greedy outputs equal transformers', sampled ones the
target's distribution; drafts are counted, rolled back and freed; bad configurations are refused."""

import math

import pytest
import torch

from tests.hf_reference import MAX_TOKENS, hf_greedy, hf_model
from tests.spec_checkpoints import repeating_checkpoint
from tests.test_llm_parity import MODELS, prompts_for
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.sampler import Sampler
from tinyserve.spec_decode.ngram_proposer import NgramProposer
from tinyserve.spec_decode.rejection_sampler import RejectionSampler

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def draft_config(folder, k=3) -> dict:
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k}


def repetitive_prompts(vocab_size: int) -> list[list[int]]:
    """Random prompts, and one that repeats itself (so the n-gram proposer has something to copy)."""
    return prompts_for(vocab_size) + [[5, 6, 7, 8] * 6]


def generate_ids(llm, prompts, **params) -> list[list[int]]:
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": MAX_TOKENS, **params})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def assert_nothing_held(llm) -> None:
    scheduler = llm.engine_core.scheduler
    pool = llm.engine_core.kv_cache_manager.pool
    assert not scheduler.requests and pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: f"{m[0]}-{'tied' if m[1] else 'untied'}")
def model_and_reference(request):
    family, tied = request.param
    folder = tiny_model_with_tokenizer(family, tied)
    prompts = repetitive_prompts(hf_model(folder).config.vocab_size)
    return folder, prompts, [hf_greedy(folder, p) for p in prompts]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_speculation_matches_transformers(model_and_reference, method):
    folder, prompts, expected = model_and_reference
    config = NGRAM if method == "ngram" else draft_config(folder)
    llm = LLM(str(folder), speculative_config=config)
    assert generate_ids(llm, prompts) == expected
    stats = llm.engine_core.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    if method == "draft_model":  # the draft is the target: it guesses right (all but where max_tokens cuts)
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    assert_nothing_held(llm)


@pytest.mark.slow  # about 20 s
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_with_speculation_chunked_prefill_preemption_and_prefix_caching(method):
    folder = tiny_model_with_tokenizer("llama", False)
    prompts = repetitive_prompts(hf_model(folder).config.vocab_size)
    expected = [hf_greedy(folder, p) for p in prompts]
    config = NGRAM if method == "ngram" else draft_config(folder)
    # 8 blocks of 16 cannot hold five growing requests; a 16-token budget chunks prompts and cuts drafts.
    llm = LLM(str(folder), num_kv_blocks=8, block_size=16, max_num_batched_tokens=16, speculative_config=config)
    assert generate_ids(llm, prompts) == expected
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert_nothing_held(llm)
    # Prefix caching: twice on a roomier pool, the second time the prompts' blocks come from the cache.
    llm = LLM(str(folder), block_size=4, speculative_config=config)
    assert generate_ids(llm, prompts) == expected
    assert generate_ids(llm, prompts) == expected
    assert llm.engine_core.kv_cache_manager.prefix_cache_hits > 0
    assert_nothing_held(llm)


def test_every_draft_of_a_repeating_model_is_accepted_and_steps_are_fewer():
    folder = repeating_checkpoint()
    prompt = [[9, 4, 7, 7, 7]]
    plain = LLM(str(folder))
    spec = LLM(str(folder), speculative_config={**NGRAM, "num_speculative_tokens": 4})
    want = generate_ids(plain, prompt, max_tokens=40)
    assert want == [[7] * 40]
    steps_before = spec.engine_core.scheduler.step_id
    assert generate_ids(spec, prompt, max_tokens=40) == want
    stats = spec.engine_core.scheduler.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    # 40 tokens, up to 5 a step: 1 prefill step and then at most 8 more (the first drafts are shorter).
    assert spec.engine_core.scheduler.step_id - steps_before <= 12
    assert stats.num_accepted_tokens_per_pos[0] == stats.num_drafts


def test_rejected_drafts_roll_back_and_free_their_blocks():
    folder = tiny_model_with_tokenizer("llama", False)
    # A model that rarely agrees with the drafts: one block per token, so every rejection frees blocks.
    llm = LLM(str(folder), block_size=1, speculative_config={**NGRAM, "num_speculative_tokens": 4})
    engine = llm.engine_core
    prompt = [5, 6, 7, 8] * 6
    engine.add_request(_engine_request(llm, "r", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))
    pool, scheduler = engine.kv_cache_manager.pool, engine.scheduler
    rejections = 0
    while engine.has_requests:
        engine.step()
        request = scheduler.requests.get("r")
        if request is None:
            continue
        verified = scheduler.last_verified.get("r")
        if verified and verified[1] < verified[0]:
            rejections += 1
        # Blocks held: exactly those of the computed tokens plus none for rejected drafts.
        assert len(engine.kv_cache_manager.get_block_ids("r")) == request.num_computed_tokens
        assert request.num_computed_tokens == request.num_tokens - 1
        assert pool.num_used_blocks == request.num_computed_tokens
    assert rejections > 0
    assert_nothing_held(llm)


def _engine_request(llm, request_id, prompt, params):
    from tinyserve.wire.messages import EngineCoreRequest

    return EngineCoreRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=params,
                             eos_token_ids=llm.engine_core.model_info.eos_token_ids, arrival_time=0.0)


def test_stops_inside_a_draft_end_the_request_there():
    folder = repeating_checkpoint()
    llm = LLM(str(folder), speculative_config={**NGRAM, "num_speculative_tokens": 4})
    prompt = [[9, 4, 7, 7, 7, 7, 7, 7, 7]]
    # max_tokens in the middle of a run of accepted drafts
    assert generate_ids(llm, prompt, max_tokens=7) == [[7] * 7]
    # a stop token the drafts all are: the first one ends it
    outputs = llm.generate([{"prompt_token_ids": prompt[0]}],
                           SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[7]), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == [7] and outputs[0].outputs[0].finish_reason == "stop"
    # min_tokens masks the stop token in the draft rows too (each row sees the drafts before it)
    outputs = llm.generate([{"prompt_token_ids": prompt[0]}],
                           SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[7], min_tokens=6),
                           use_tqdm=False)
    plain = LLM(str(folder)).generate([{"prompt_token_ids": prompt[0]}],
                                      SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[7], min_tokens=6),
                                      use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert 7 not in outputs[0].outputs[0].token_ids[:6]
    assert_nothing_held(llm)


def test_stop_string_inside_a_draft_emits_nothing_after_it():
    folder = tiny_model_with_tokenizer("llama", False)
    plain, spec = LLM(str(folder)), LLM(str(folder), speculative_config=draft_config(folder, 4))
    prompt = {"prompt_token_ids": [5, 6, 7, 8] * 4}
    text = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], logprobs=1)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
    assert len(got.logprobs) == len(got.token_ids)
    assert spec.engine_core.scheduler.spec_stats.num_accepted_tokens > 0


def test_logprobs_penalties_and_n_equal_plain_decoding():
    folder = tiny_model_with_tokenizer("qwen2", True)
    prompts = repetitive_prompts(hf_model(folder).config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2, n=2)
    plain = LLM(str(folder)).generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    spec_llm = LLM(str(folder), speculative_config=draft_config(folder))
    spec = spec_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for want, got in zip(plain, spec):
        for w, g in zip(want.outputs, got.outputs):
            assert g.token_ids == w.token_ids
            for lw, lg in zip(w.logprobs, g.logprobs):
                assert lw.keys() == lg.keys()
                assert all(math.isclose(lw[t].logprob, lg[t].logprob, abs_tol=1e-4) for t in lw)
    assert spec_llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampled_requests_give_the_tokens_they_give_without_speculation(method):
    """Each position draws its own random numbers from the request's generator, whatever was drafted."""
    # n-gram drafts are right often for the repeating model only; the draft model is the target itself
    folder = repeating_checkpoint() if method == "ngram" else tiny_model_with_tokenizer("llama", False)
    prompts = repetitive_prompts(hf_model(folder).config.vocab_size)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=MAX_TOKENS, seed=7, logprobs=1)
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(str(folder)).generate(requests, params, use_tqdm=False)
    llm = LLM(str(folder), speculative_config=NGRAM if method == "ngram" else draft_config(folder))
    spec = llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert len({tuple(o.outputs[0].token_ids) for o in spec}) > 1
    assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0


def test_ngram_proposer_copies_what_followed_the_longest_recurring_suffix():
    proposer = NgramProposer(3, prompt_lookup_min=2, prompt_lookup_max=4)
    assert proposer.propose_one([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1]
    assert proposer.propose_one([1, 2, 3, 9, 2, 3]) == [9, 2, 3]
    assert proposer.propose_one([1, 2, 3, 4]) == []  # no suffix of 2 recurs
    assert proposer.propose_one([1, 2, 3, 4, 5, 1, 2, 3], max_drafts=1) == [4]
    # the longest suffix wins: [2, 3] recurs twice, [8, 2, 3] once, followed by 7
    assert proposer.propose_one([2, 3, 5, 8, 2, 3, 7, 8, 2, 3]) == [7, 8, 2]


def test_rejection_sampling_gives_the_target_distribution():
    """Chi-square: the first emitted token, over many draws, with drafts that are often wrong."""
    torch.manual_seed(0)
    vocab, num_draws = 8, 20000
    logits = torch.randn(vocab) * 1.5
    probs = torch.softmax(logits, dim=-1)
    params = SamplingParams(temperature=1.0)
    states = [CachedRequestState(str(i), [1], params, []) for i in range(num_draws)]
    # drafts: the likeliest token, the least likely, and a middle one, in turn; two drafts each
    order = probs.argsort().tolist()
    drafts = [[order[(i % 3) * 3 % vocab], order[-1]] for i in range(num_draws)]
    rows = logits.repeat(3 * num_draws, 1)
    emitted, _ = RejectionSampler(Sampler(torch.device("cpu"), seed=1))(rows, states, drafts)
    counts = torch.bincount(torch.tensor([tokens[0] for tokens in emitted]), minlength=vocab).float()
    expected = probs * num_draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (counts, expected)  # the 0.999 quantile with 7 degrees of freedom
    # and the second token, when the first draft was accepted: again p (rows are independent here)
    second = [tokens[1] for tokens, d in zip(emitted, drafts) if len(tokens) > 1]
    counts = torch.bincount(torch.tensor(second), minlength=vocab).float()
    expected = probs * len(second)
    assert float(((counts - expected) ** 2 / expected).sum()) < 24.3


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "['model']"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 2}, "prompt_lookup_max"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(config, message):
    folder = tiny_model_with_tokenizer("llama", False)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LLM(str(folder), speculative_config=config)


def test_a_draft_with_another_vocabulary_is_refused():
    folder = tiny_model_with_tokenizer("llama", False)
    other = repeating_checkpoint(vocab_size=200)
    with pytest.raises(ValueError, match="speculative_config.model.*vocab_size"):
        LLM(str(folder), speculative_config=draft_config(other))


def test_structured_outputs_are_refused_under_speculation():
    from tinyserve.sampling_params import StructuredOutputsParams

    folder = tiny_model_with_tokenizer("llama", False)
    llm = LLM(str(folder), speculative_config=NGRAM)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="structured outputs.*speculative"):
        llm.generate(["hello"], params, use_tqdm=False)


def test_get_metrics_and_the_server_counters_report_vllms_spec_decode_counters():
    from prometheus_client.parser import text_string_to_metric_families

    from tinyserve.entrypoints.api.metrics import ServerMetrics
    from tinyserve.wire.messages import EngineCoreOutputs

    folder = repeating_checkpoint()
    llm = LLM(str(folder), speculative_config={**NGRAM, "num_speculative_tokens": 4})
    assert LLM(str(folder)).get_metrics() == []
    generate_ids(llm, [[9, 4, 7, 7, 7]], max_tokens=30)
    metrics = {m.name: m for m in llm.get_metrics()}
    stats = llm.engine_core.scheduler.spec_stats
    assert metrics["tinyserve:spec_decode_num_drafts"].value == stats.num_drafts > 0
    assert metrics["tinyserve:spec_decode_num_draft_tokens"].value == stats.num_draft_tokens
    assert metrics["tinyserve:spec_decode_num_accepted_tokens"].value == stats.num_accepted_tokens == \
        stats.num_draft_tokens  # every draft of this model is right
    per_pos = metrics["tinyserve:spec_decode_num_accepted_tokens_per_pos"].values
    assert len(per_pos) == 4 and sum(per_pos) == stats.num_accepted_tokens and per_pos[0] == stats.num_drafts
    # The server's Prometheus counters add the engine's running totals' increments.
    server = ServerMetrics("m", [0], 512, prefix="vllm")
    for _ in range(2):  # the same totals twice: counted once
        server.on_outputs(EngineCoreOutputs(engine_index=0, scheduler_stats=llm.engine_core.get_stats()))
    samples = {(s.name, s.labels.get("position")): s.value
               for family in text_string_to_metric_families(server.render().decode()) for s in family.samples}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == stats.num_drafts
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == stats.num_accepted_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", "3")] == per_pos[3]


def test_the_speculative_config_flag_is_checked_when_parsed():
    import argparse

    from tinyserve.cli.engine_flags import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["m", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert engine_args_from(args).speculative_config == {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'])


def test_step_spans_carry_each_requests_drafts_and_the_time_proposing_and_verifying(tmp_path):
    from tinyserve.lifecycle import schema
    from tinyserve.trace_reading.run import load_run

    folder = repeating_checkpoint()
    llm = LLM(str(folder), speculative_config={**NGRAM, "num_speculative_tokens": 4}, trace_dir=str(tmp_path))
    generate_ids(llm, [[9, 4, 7, 7, 7], [3, 5, 5, 5, 5, 5]], max_tokens=20)
    run = load_run(llm.trace_run_dir)
    steps = [step.span.attributes for step in run.steps]
    verifying = [a for a in steps if a.get(schema.STEP_SPEC_REQUEST_IDS)]
    assert verifying and all(a[schema.STEP_SPEC_VERIFY_TIME] > 0 and a[schema.STEP_SPEC_PROPOSE_TIME] > 0
                             for a in verifying)
    proposed = sum(sum(a[schema.STEP_SPEC_NUM_PROPOSED]) for a in verifying)
    accepted = sum(sum(a[schema.STEP_SPEC_NUM_ACCEPTED]) for a in verifying)
    rejected = sum(sum(a[schema.STEP_SPEC_NUM_REJECTED]) for a in verifying)
    stats = llm.engine_core.scheduler.spec_stats
    assert (proposed, accepted, rejected) == (stats.num_draft_tokens, stats.num_accepted_tokens, 0)
    assert all(len(a[schema.STEP_SPEC_REQUEST_IDS]) == len(a[schema.STEP_SPEC_NUM_ACCEPTED]) for a in verifying)
    # Each request's decode span: its own totals, which add up to the engine's
    decodes = [s.stages[schema.DECODE].attributes for r in run.requests for s in r.sequences]
    assert len(decodes) == 2 and all(d[schema.SPEC_NUM_ACCEPTED] > 0 == d[schema.SPEC_NUM_REJECTED] for d in decodes)
    assert sum(d[schema.SPEC_NUM_PROPOSED] for d in decodes) == stats.num_draft_tokens
    assert sum(d[schema.SPEC_NUM_ACCEPTED] for d in decodes) == stats.num_accepted_tokens
    assert not llm.engine_core.scheduler.request_totals  # nothing kept for finished requests


def test_a_rollbacks_freed_blocks_are_on_its_step_span_and_block_tables_drop_them(tmp_path):
    """The scheduler's own tables, step by step, are what a reader rebuilds from the step spans alone."""
    from tinyserve.engine.core.scheduler_output import SchedulerOutput
    from tinyserve.lifecycle import schema
    from tinyserve.trace_reading.run import load_run

    folder = tiny_model_with_tokenizer("llama", False)  # rarely agrees with the drafts: rejections
    llm = LLM(str(folder), block_size=2, speculative_config=NGRAM, trace_dir=str(tmp_path))
    engine = llm.engine_core
    scheduler, kv = engine.scheduler, engine.kv_cache_manager
    held: dict[int, dict[str, list[int]]] = {}  # step id -> each request's table while the step ran
    schedule = scheduler.schedule

    def schedule_and_look():
        output = schedule()
        held[output.step_id] = {r: kv.get_block_ids(r) for r in scheduler.requests if kv.get_block_ids(r)}
        return output

    scheduler.schedule = schedule_and_look
    generate_ids(llm, [[5, 6, 7, 8] * 6, [9, 3, 9, 3, 9, 3, 9, 3, 1]], max_tokens=24)
    run = load_run(llm.trace_run_dir)
    assert run.rollback_frees_recorded
    rollbacks = 0
    for step in run.steps:
        attributes = step.span.attributes
        assert len(attributes[schema.STEP_SPEC_NUM_FREED_BLOCK_IDS]) == len(attributes[schema.STEP_SPEC_REQUEST_IDS])
        for request_id, freed in step.rollback_freed_block_ids.items():
            proposed, accepted = step.drafts[request_id]
            assert not freed or accepted < proposed  # only rejected drafts free blocks
            assert set(freed) <= set(held[step.step_id][request_id])  # held while the step ran
            rollbacks += bool(freed)
        # the table at each step, rebuilt from the spans: without the frees, the next one would still list them
        assert run.block_tables(0)[step.step_id] == held[step.step_id]
    assert rollbacks > 0
    # A step that runs no forward pass has no verify or propose time (not the step before's)
    engine.model_runner.execute_model(SchedulerOutput(step_id=10_000))
    [attributes] = [hook(None) for hook in engine.hooks.step_attributes]
    assert schema.STEP_SPEC_VERIFY_TIME not in attributes and schema.STEP_SPEC_PROPOSE_TIME not in attributes


def test_a_draft_model_without_model_takes_the_built_in_draft_or_says_it_needs_one(monkeypatch):
    import tinyserve.models.default_model as default_model

    folder = tiny_model_with_tokenizer("llama", False)
    config = {"method": "draft_model", "num_speculative_tokens": 2}
    monkeypatch.delattr(default_model, "default_draft_path", raising=False)
    with pytest.raises(ValueError, match="method 'draft_model' needs 'model'"):
        LLM(str(folder), speculative_config=config)
    monkeypatch.setattr(default_model, "default_draft_path", lambda: folder, raising=False)
    llm = LLM(str(folder), speculative_config=config)
    assert generate_ids(llm, [[5, 6, 7, 8] * 3], max_tokens=8) == [hf_greedy(folder, [5, 6, 7, 8] * 3)[:8]]
    assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("other, message", [
    ({"tensor_parallel_size": 2}, "tensor parallelism"),
    ({"enable_lora": True}, "enable_lora"),
    ({"runner": "pooling"}, "runner='generate'"),
])
def test_speculation_is_refused_with_what_it_does_not_support(other, message):
    from tinyserve.assemble import engine_args

    with pytest.raises(ValueError, match=message):
        engine_args(model="m", speculative_config=NGRAM, **other)
