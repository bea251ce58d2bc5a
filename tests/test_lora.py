"""LoRA adapters offline: greedy tokens equal transformers + PEFT for each adapter and the base model,
in one mixed batch; more adapters than slots take turns; the prefix cache keeps adapters apart;
adapters this engine cannot serve are refused, named."""

import pytest
import torch

from tests.hf_reference import MAX_TOKENS
from tests.lora_adapters import peft_adapter, peft_greedy, tampered_adapter
from tests.tiny_checkpoints import tiny_checkpoint, tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.assemble import engine_args
from tinyserve.lora.request import LoRARequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def prompts(count: int, vocab_size: int = 300) -> list[list[int]]:
    generator = torch.Generator().manual_seed(99)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (6, 23, 41)[:count]]


def generate(llm, prompt_list, loras) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], GREEDY, use_tqdm=False,
                           lora_request=loras)
    return [list(o.outputs[0].token_ids) for o in outputs]


def batches_seen(llm) -> list[set]:
    """Record, for every forward pass from now on, the adapters of its batch (None: the base model)."""
    seen = []
    llm.engine_core.model_runner.input_hooks.append(lambda scheduled, states: seen.append(
        {s.lora_request.lora_name if s.lora_request else None for s in states}))
    return seen


def assert_blocks_all_free(llm) -> None:
    pool = llm.engine_core.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_integrity()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_matches_peft_for_each_adapter_and_the_base_in_one_mixed_batch(family):
    folder = tiny_model_with_tokenizer(family)
    # Two adapters: one on every projection; one of another rank, rsLoRA's scaling, and only q, v and
    # down (so qkv_proj gets a delta in two of its three slices, gate_up_proj none).
    sql = peft_adapter(folder, "sql", r=4, lora_alpha=8, seed=1)
    chat = peft_adapter(folder, "chat", r=8, lora_alpha=16, seed=2, use_rslora=True,
                        target_modules=("q_proj", "v_proj", "down_proj"))
    adapters = [None, LoRARequest("sql", 1, str(sql)), LoRARequest("chat", 2, str(chat))]
    prompt_list = prompts(3)
    expected = [peft_greedy(folder, path, p) for path in (None, sql, chat) for p in prompt_list]

    llm = LLM(str(folder), enable_lora=True, max_loras=2, max_lora_rank=8)
    seen = batches_seen(llm)
    got = generate(llm, prompt_list * 3, [lora for lora in adapters for _ in prompt_list])
    assert got == expected
    assert {None, "sql", "chat"} in seen  # the base model and both adapters in one forward pass
    assert_blocks_all_free(llm)


def test_more_adapters_than_slots_take_turns_and_are_read_again_once_evicted():
    folder = tiny_model_with_tokenizer("llama")
    paths = [peft_adapter(folder, "sql", seed=1), peft_adapter(folder, "chat", r=8, lora_alpha=16, seed=2)]
    loras = [LoRARequest("sql", 1, str(paths[0])), LoRARequest("chat", 2, str(paths[1]))]
    prompt_list = prompts(2)
    expected = [peft_greedy(folder, path, p) for path in paths for p in prompt_list]

    llm = LLM(str(folder), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    manager = llm.engine_core.hooks.parts["lora"]
    seen = batches_seen(llm)
    assert generate(llm, prompt_list * 2, [lora for lora in loras for _ in prompt_list]) == expected
    assert all(len(batch - {None}) <= 1 for batch in seen)  # one slot: one adapter at a time, the other waits
    assert {"sql"} in seen and {"chat"} in seen
    assert manager.num_loads == 2 and list(manager.loaded) == [2]
    # max_cpu_loras=1: "sql" was evicted, and is read from its folder again
    assert generate(llm, prompt_list[:1], loras[0]) == expected[:1]
    assert manager.num_loads == 3
    assert_blocks_all_free(llm)


def test_adapters_stay_loaded_up_to_max_cpu_loras():
    folder = tiny_model_with_tokenizer("llama")
    paths = [peft_adapter(folder, "sql", seed=1), peft_adapter(folder, "chat", r=8, lora_alpha=16, seed=2)]
    loras = [LoRARequest("sql", 1, str(paths[0])), LoRARequest("chat", 2, str(paths[1]))]
    llm = LLM(str(folder), enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    for lora in [*loras, *loras]:
        generate(llm, prompts(1), lora)
    assert llm.engine_core.hooks.parts["lora"].num_loads == 2  # swapped in and out of the one slot, read once each


def test_the_prefix_cache_keeps_each_adapters_blocks_apart():
    folder = tiny_model_with_tokenizer("llama")
    path = peft_adapter(folder, "sql", seed=1)
    sql = LoRARequest("sql", 1, str(path))
    prompt = prompts(3)[2]  # 41 tokens: two full blocks of 16
    llm = LLM(str(folder), enable_lora=True, max_lora_rank=8, block_size=16)

    def run(lora):
        [output] = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)
        return list(output.outputs[0].token_ids), output.num_cached_tokens

    base_tokens, base_hit = run(None)
    sql_tokens, sql_hit = run(sql)
    assert base_hit == 0 and sql_hit == 0  # the same prompt under an adapter is other K/V: no hit
    assert sql_tokens == peft_greedy(folder, path, prompt) and base_tokens == peft_greedy(folder, None, prompt)
    assert run(sql) == (sql_tokens, 32)  # under the same adapter: its own two blocks
    assert run(None) == (base_tokens, 32)
    assert_blocks_all_free(llm)


@pytest.fixture(scope="module")
def lora_llm():
    return LLM(str(tiny_model_with_tokenizer("llama")), enable_lora=True, max_lora_rank=8)


@pytest.mark.parametrize("config, message", [
    ({"r": 16, "lora_alpha": 16}, "has rank 16, over this server's max_lora_rank 8"),
    ({"use_dora": True}, "DoRA (use_dora) is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "lora_only"}, "bias='lora_only' is not supported"),
    ({"target_modules": ("q_proj", "lm_head")}, "target modules ['lm_head'] are not supported"),
], ids=["rank", "dora", "modules_to_save", "bias", "lm_head"])
def test_an_adapter_this_engine_cannot_serve_is_refused_with_its_name_and_why(lora_llm, config, message):
    folder = tiny_model_with_tokenizer("llama")
    path = peft_adapter(folder, "odd", **config)
    with pytest.raises(ValueError, match="LoRA adapter 'odd'") as error:
        generate(lora_llm, prompts(1), LoRARequest("odd", 7, str(path)))
    assert message in str(error.value)
    assert not lora_llm.llm_engine.has_unfinished_requests


def test_an_adapter_of_another_base_model_is_refused(lora_llm):
    other_base = tiny_checkpoint("llama", intermediate_size=96)
    path = peft_adapter(other_base, "elsewhere")
    with pytest.raises(ValueError, match="LoRA adapter 'elsewhere' was trained for another base model: "
                                         r"layer 0 down_proj has lora_A \[4, 96\] and lora_B \[64, 4\], this model needs \[4, 128\] and \[64, 4\]"):
        generate(lora_llm, prompts(1), LoRARequest("elsewhere", 8, str(path)))


def test_requests_for_adapters_need_enable_lora_and_a_peft_folder(lora_llm, tmp_path):
    folder = tiny_model_with_tokenizer("llama")
    with pytest.raises(ValueError, match=r"LoRA adapter 'sql' asked for, but LoRA is not enabled \(enable_lora=True"):
        generate(LLM(str(folder)), prompts(1), LoRARequest("sql", 1, str(peft_adapter(folder, "sql"))))
    with pytest.raises(ValueError, match="LoRA adapter 'nowhere': '.*' holds no readable PEFT adapter"):
        generate(lora_llm, prompts(1), LoRARequest("nowhere", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_request must be one LoRARequest"):
        generate(lora_llm, prompts(2), [None])
    with pytest.raises(ValueError, match="lora_int_id must be an integer of at least 1"):
        LoRARequest("sql", 0, "/x")


def test_the_engine_reads_an_adapter_as_its_request_arrives_and_refuses_one_it_cannot_read(lora_llm, tmp_path):
    """The engine's own check (EngineCore.check_request, which an engine process runs on what its socket brings):
    an adapter whose folder went away after the front end checked it refuses that request, naming the model."""
    from tinyserve.errors import InvalidInputError
    from tinyserve.wire.messages import EngineCoreRequest

    core = lora_llm.engine_core
    path = peft_adapter(tiny_model_with_tokenizer("llama"), "sql")
    request = EngineCoreRequest("ok", [5, 6, 7], GREEDY, [], 0.0, lora_request=LoRARequest("sql", 31, str(path)))
    core.check_request(request)
    assert 31 in core.hooks.parts["lora"].loaded  # read now: its first step finds it in memory
    missing = EngineCoreRequest("gone", [5, 6, 7], GREEDY, [], 0.0, lora_request=LoRARequest("gone", 32, str(tmp_path)))
    with pytest.raises(InvalidInputError, match=r"LoRA adapter 'gone' cannot be loaded from .*holds no readable PEFT adapter") \
            as refused:
        core.check_request(missing)
    assert refused.value.param == "model" and 32 not in core.hooks.parts["lora"].loaded


def test_lora_settings_are_checked():
    with pytest.raises(ValueError, match="enable_lora is not supported with tensor parallelism"):
        engine_args(enable_lora=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        engine_args(enable_lora=True, max_loras=0)
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        engine_args(enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_traces_carry_the_adapter_and_replay_runs_each_request_under_it(tmp_path):
    from tinyserve.lifecycle import schema
    from tinyserve.trace_reading.replay import replay_run
    from tinyserve.trace_reading.run import load_run

    folder = tiny_model_with_tokenizer("qwen2")
    path = peft_adapter(folder, "sql", seed=3)
    sql = LoRARequest("sql", 1, str(path))
    prompt_list = prompts(2)
    traced = LLM(str(folder), enable_lora=True, max_lora_rank=8, trace_dir=str(tmp_path))
    generate(traced, prompt_list, [sql, None])
    run = load_run(traced.trace_run_dir)

    by_prompt = {tuple(r.inputs.prompt_token_ids): r for r in run.requests}
    logged = by_prompt[tuple(prompt_list[0])]
    assert logged.inputs.lora_request == {"lora_name": "sql", "lora_int_id": 1, "lora_path": str(path)}
    assert by_prompt[tuple(prompt_list[1])].inputs.lora_request is None
    [queue] = [s.stages[schema.QUEUE] for s in logged.sequences]
    assert queue.attributes[schema.LORA_NAME] == "sql"
    first_step = run.steps[0].span.attributes
    assert first_step[schema.STEP_LORA_ADAPTERS] == ["sql"]  # the base model's request shares the step
    assert first_step[schema.STEP_RUNNING_LORA_ADAPTERS] == ["sql"]

    results = replay_run(run, LLM(str(folder), enable_lora=True, max_lora_rank=8))
    assert [r.matched for r in results] == [True, True]
    # Replayed on an engine without LoRA, the adapter's request is refused, and says why.
    [refused, base] = replay_run(run, LLM(str(folder)))
    assert refused.skipped and "LoRA is not enabled" in refused.skipped_reason and base.matched


def test_each_request_output_names_the_adapter_it_ran_under(lora_llm):
    path = str(peft_adapter(tiny_model_with_tokenizer("llama"), "sql"))
    sql = LoRARequest("sql", 41, path)
    outputs = lora_llm.generate([{"prompt_token_ids": p} for p in prompts(2)], GREEDY, use_tqdm=False,
                                lora_request=[sql, None])
    assert [output.lora_request for output in outputs] == [sql, None]  # as vLLM's RequestOutput.lora_request


def test_run_batch_serves_the_adapters_of_lora_modules(tmp_path):
    import json

    from tinyserve.cli.main import main

    folder = tiny_model_with_tokenizer("llama")
    sql = peft_adapter(folder, "sql")
    prompt = prompts(1)[0]
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    lines = [{"custom_id": model, "method": "POST", "url": "/v1/completions", "body": {"model": model, **body}}
             for model in ("tiny", "sql")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl"), str(folder),
                 "--served-model-name", "tiny", "--enable-lora", "--lora-modules", f"sql={sql}"]) == 0
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    tokens = {r["custom_id"]: [int(t.removeprefix("token_id:"))
                               for t in r["response"]["body"]["choices"][0]["logprobs"]["tokens"]] for r in records}
    assert tokens == {"tiny": peft_greedy(folder, None, prompt), "sql": peft_greedy(folder, sql, prompt)}


@pytest.mark.parametrize("tamper, message", [
    ({"config": {"lora_alpha": float("nan")}}, "lora_alpha must be a finite number, got nan"),
    ({"config": {"lora_alpha": "x"}}, "lora_alpha must be a finite number, got 'x'"),
    ({"config": {"r": "4"}}, "r must be a positive integer, got '4'"),
    ({"config": {"use_rslora": "yes"}}, "use_rslora must be true or false"),
    ({"config": {"target_modules": [["q_proj"]]}}, "target_modules must be a list of module names"),
    ({"fill": 1e30}, "could change a weight by up to 8.17e+30"),
    ({"fill": float("inf")}, "lora_B holds values that are not finite in float32"),
    ({"fill": float("nan")}, "lora_B holds values that are not finite in float32"),
], ids=["alpha-nan", "alpha-str", "r-str", "rslora-str", "targets-nested", "1e30", "inf", "nan"])
def test_an_adapter_with_values_that_would_overflow_is_refused_alone_when_read(lora_llm, tmp_path, tamper, message):
    """The attack that killed the engine (NaN scaling, or 1e30 weights: a ZeroDivisionError in the decode kernel's
    softmax on the first step) is refused as the adapter is read, by the front end's check and by the engine's own
    as the request arrives, naming the adapter and why; the engine then serves the next request."""
    from tinyserve.errors import InvalidInputError
    from tinyserve.wire.messages import EngineCoreRequest

    folder = tiny_model_with_tokenizer("llama")
    good = peft_adapter(folder, "sql")
    path = str(tampered_adapter(good, tmp_path / "evil", **tamper))
    with pytest.raises(ValueError, match="LoRA adapter 'evil'") as refused:
        generate(lora_llm, prompts(1), LoRARequest("evil", 61, path))
    assert message in str(refused.value)
    core = lora_llm.engine_core
    request = EngineCoreRequest("evil", [5, 6, 7], GREEDY, [], 0.0, lora_request=LoRARequest("evil", 62, path))
    with pytest.raises(InvalidInputError, match="LoRA adapter 'evil' cannot be loaded") as refused:
        core.check_request(request)
    assert message in str(refused.value) and refused.value.param == "model"
    assert not lora_llm.llm_engine.has_unfinished_requests
    assert generate(lora_llm, prompts(1), LoRARequest("sql", 63, str(good))) == [peft_greedy(folder, good, prompts(1)[0])]


def test_queued_adapters_stay_within_max_cpu_loras_and_one_unloaded_and_deleted_while_waiting_fails_alone(tmp_path):
    """max_cpu_loras bounds the adapters held for queued requests too (they were all kept as they arrived), and
    the forward pass never reads a disk: a waiting request whose adapter was let go is read again as it is
    admitted, and if that adapter was unloaded and its folder deleted meanwhile, that request alone ends with a
    400 naming it (it killed the engine: `no adapter_config.json` raised inside a step)."""
    import shutil

    from tinyserve.wire.messages import EngineCoreRequest

    folder = tiny_model_with_tokenizer("llama")
    good = peft_adapter(folder, "sql")
    llm = LLM(str(folder), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8)
    core, manager = llm.engine_core, llm.engine_core.hooks.parts["lora"]
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def arrive(request_id: str, lora_id: int, path) -> None:
        request = EngineCoreRequest(request_id, [5, 6, 7], long, [], 0.0,
                                    lora_request=LoRARequest(request_id, lora_id, str(path)))
        core.check_request(request)  # what an engine process runs on each request its socket brings
        core.add_request(request)

    arrive("first", 1, good)
    core.step()  # "first" runs, and holds the one slot
    copies = [tampered_adapter(good, tmp_path / f"copy{i}") for i in range(8)]
    for i, path in enumerate(copies):
        arrive(f"queued{i}", 10 + i, path)
        assert len(manager.loaded) <= 1 and 1 in manager.loaded  # the running request's adapter stays
    assert manager.remove_lora(10) is False  # unloaded while it waits (not held: already let go) ...
    shutil.rmtree(copies[0])  # ... and its folder deleted
    outputs = {}
    while core.has_requests:
        for output in core.step().outputs:
            if output.finish_reason is not None:
                outputs[output.request_id] = output
    failed = outputs.pop("queued0")
    assert failed.error.startswith("LoRA adapter 'queued0' cannot be loaded from") and failed.error_param == "model"
    assert "holds no readable PEFT adapter" in failed.error
    assert all(o.error is None and o.finish_reason == "length" for o in outputs.values()) and len(outputs) == 8
    assert len(manager.loaded) <= 1
    assert_blocks_all_free(llm)
