"""The offline LLM API: prompts in every form, sampling, prefix caching, bad input."""

import json
import shutil

import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64)


def greedy(max_tokens=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def assert_pool_idle(llm):
    pool = llm.engine_core.kv_cache_manager.pool
    pool.check_integrity()
    assert pool.num_free_blocks == pool.num_blocks


def test_string_prompt_returns_text_and_token_ids(llm):
    [output] = llm.generate("Beautiful is better than ugly.", greedy(), use_tqdm=False)
    completion = output.outputs[0]
    assert output.prompt == "Beautiful is better than ugly."
    assert output.prompt_token_ids == llm.get_tokenizer().encode("Beautiful is better than ugly.")
    assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
    assert completion.text == llm.get_tokenizer().decode(completion.token_ids, skip_special_tokens=True)
    assert output.finished and output.metrics.first_token_time >= output.metrics.arrival_time


def test_string_and_token_id_prompts_give_the_same_tokens(llm):
    ids = llm.get_tokenizer().encode("Simple is better than complex.")
    by_text, by_ids = llm.generate(["Simple is better than complex.", {"prompt_token_ids": ids}], greedy(), use_tqdm=False)
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_ids.prompt is None


def test_one_sampling_params_per_prompt(llm):
    outputs = llm.generate(["a", "b"], [greedy(max_tokens=3), greedy(max_tokens=5)], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 5]


def test_repeated_prompt_hits_the_prefix_cache_with_the_same_tokens(llm):
    prompt = {"prompt_token_ids": list(range(10, 60))}
    first = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    second = llm.generate(prompt, greedy(), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48  # three full 16-token blocks
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert_pool_idle(llm)


def test_same_seed_same_tokens_alone_and_in_a_batch(llm):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=12)
    alone = llm.generate("Errors should never pass silently.", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12)
    batch = llm.generate(["Now is better than never.", "Errors should never pass silently.", "Flat is better"],
                         [others, seeded, others], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, seed=43, max_tokens=12)
    assert llm.generate("Errors should never pass silently.", different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_returns_indexed_completions(llm):
    [output] = llm.generate("Readability counts.", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6), use_tqdm=False)
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) > 1


def test_stop_string_ends_the_text_before_it(llm):
    [free] = llm.generate("Special cases", greedy(max_tokens=12), use_tqdm=False)
    text = free.outputs[0].text
    stop = text[3:6]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    [stopped] = llm.generate("Special cases", greedy(max_tokens=12, stop=[stop]), use_tqdm=False)
    completion = stopped.outputs[0]
    assert completion.text == text[: text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert_pool_idle(llm)


def test_logprobs_hold_the_sampled_token_and_the_top_k(llm):
    [output] = llm.generate("In the face of ambiguity", greedy(max_tokens=4, logprobs=3), use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.logprobs) == 4
    for token_id, position in zip(completion.token_ids, completion.logprobs):
        assert position[token_id].rank == 1  # greedy: the sampled token is the most likely one
        assert sorted(lp.rank for lp in position.values()) == [1, 2, 3]


def test_logit_bias_steers_greedy_and_sampled_choices(llm):
    prompt = "Special cases aren't special enough"
    [free] = llm.generate(prompt, greedy(max_tokens=4), use_tqdm=False)
    first = free.outputs[0].token_ids[0]
    [banned] = llm.generate(prompt, greedy(max_tokens=4, logit_bias={first: -100}), use_tqdm=False)
    assert banned.outputs[0].token_ids[0] != first
    chosen = 42
    for params in (greedy(max_tokens=4, logit_bias={chosen: 100}),
                   SamplingParams(temperature=1.0, seed=1, max_tokens=4, logit_bias={chosen: 100})):
        [forced] = llm.generate(prompt, params, use_tqdm=False)
        assert forced.outputs[0].token_ids == [chosen] * 4


def test_prompt_logprobs_score_every_prompt_token_and_skip_the_prefix_cache(llm):
    prompt = "Now is better than never. Although never is often better than right now."
    params = greedy(max_tokens=2, prompt_logprobs=0)
    llm.generate(prompt, greedy(max_tokens=2), use_tqdm=False)  # leaves the prompt's blocks cached
    assert llm.generate(prompt, greedy(max_tokens=2), use_tqdm=False)[0].num_cached_tokens > 0
    [output] = llm.generate(prompt, params, use_tqdm=False)
    assert output.num_cached_tokens == 0  # every prompt position had to be computed
    assert len(output.prompt_logprobs) == len(output.prompt_token_ids) and output.prompt_logprobs[0] is None
    for token_id, position in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):
        assert list(position) == [token_id] and position[token_id].logprob <= 0


def test_prompt_forms_as_in_vllm(llm):
    ids = llm.get_tokenizer().encode("Readability counts.")
    as_dict = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(ids, greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids == as_dict
    assert [o.prompt for o in llm.generate(("a", "b"), greedy(max_tokens=1), use_tqdm=False)] == ["a", "b"]
    assert llm.generate([], greedy(), use_tqdm=False) == []
    with pytest.raises(ValueError, match="this model takes no images"):  # a text model (images: test_multimodal.py)
        llm.generate({"prompt": "Describe:", "multi_modal_data": {"image": None}}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="mm_processor_kwargs is not supported"):  # a field never dropped unsaid
        llm.generate({"prompt": "Describe:", "mm_processor_kwargs": {}}, greedy(), use_tqdm=False)


def test_completion_output_sums_logprobs_and_says_finished_as_vllm(llm):
    [with_logprobs] = llm.generate("Flat is better", greedy(max_tokens=4, logprobs=1), use_tqdm=False)
    completion = with_logprobs.outputs[0]
    sampled = [position[token].logprob for token, position in zip(completion.token_ids, completion.logprobs)]
    assert completion.cumulative_logprob == pytest.approx(sum(sampled))
    assert completion.finished() and with_logprobs.finished
    [without] = llm.generate("Flat is better", greedy(max_tokens=4), use_tqdm=False)
    assert without.outputs[0].cumulative_logprob is None


def test_an_interrupted_generate_leaves_the_engine_idle(llm, monkeypatch):
    step = llm.engine_core.step_fn  # the step the engine's loop calls (the batch queue's under PP)
    calls = []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in a notebook, in the middle of generation
        return step()

    monkeypatch.setattr(llm.engine_core, "step_fn", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Sparse is better than dense."] * 3, greedy(max_tokens=8), use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine_core.has_unfinished_requests and not llm.llm_engine.output_processor.parents
    assert_pool_idle(llm)
    [output] = llm.generate("Sparse is better than dense.", greedy(max_tokens=2), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 2


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{{ greeting }}: {% for m in messages %}{{ m['content'] }}{% endfor %}"
    [output] = llm.chat([{"role": "user", "content": "hi"}], greedy(max_tokens=1), use_tqdm=False,
                        chat_template=template, chat_template_kwargs={"greeting": "Ahoy"})
    assert output.prompt == "Ahoy: hi"
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set"):
        llm.chat([{"role": "user", "content": "hi"}], greedy(max_tokens=1), use_tqdm=False,
                 chat_template_kwargs={"tokenize": True})


def test_chat_messages_keep_their_name_for_the_template(llm):
    template = "{% for m in messages %}{{ m.get('name', m['role']) }}: {{ m['content'] }}\n{% endfor %}"
    messages = [{"role": "user", "name": "Tim", "content": "hi"}, {"role": "user", "content": "hello"}]
    [output] = llm.chat(messages, greedy(max_tokens=1), use_tqdm=False, chat_template=template)
    assert output.prompt == "Tim: hi\nuser: hello\n"


def test_chat_renders_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    [output] = llm.chat(messages, greedy(max_tokens=4), use_tqdm=False)
    rendered = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert output.prompt == rendered
    assert len(output.outputs[0].token_ids) == 4


def test_chat_can_continue_the_final_message(llm):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hello to you"}]
    [output] = llm.chat(messages, greedy(max_tokens=4), use_tqdm=False, add_generation_prompt=False,
                        continue_final_message=True)
    assert output.prompt.endswith("<|im_start|>assistant\nHello to you")
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(messages, greedy(max_tokens=4), use_tqdm=False, continue_final_message=True)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "prompt must not be empty"),
        ({"prompt_token_ids": []}, SamplingParams(), "prompt must not be empty"),
        ({"prompt_token_ids": [1, 99999]}, SamplingParams(), "outside the vocabulary"),
        ({"prompt_token_ids": [5] * 600}, SamplingParams(), "max_model_len"),
        ("fine", SamplingParams(logit_bias={99999: 1.0}), "logit_bias contains 99999, outside the vocabulary"),
    ],
)
def test_bad_prompts_raise_before_anything_is_scheduled(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine prompt", prompt], params, use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests
    assert llm.generate("still serving", greedy(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        # Wrong types once passed here and failed inside an engine step instead.
        ({"logprobs": True}, "logprobs"),
        ({"top_k": 2.0}, "top_k"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_token_ids": [1.5]}, "stop_token_ids"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
    ],
)
def test_bad_sampling_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_unknown_engine_argument_is_an_error():
    with pytest.raises(ValueError, match="unknown engine argument.*gpu_magic"):
        LLM(str(tiny_model_with_tokenizer("llama")), gpu_magic=True)


def test_request_that_can_never_fit_the_pool_is_rejected():
    small = LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate({"prompt_token_ids": list(range(3, 40))}, greedy(max_tokens=8), use_tqdm=False)


def test_aborting_running_requests_frees_every_block(llm):
    from tinyserve.frontend.input_processor import ProcessedPrompt

    for i in range(3):
        [request] = llm.llm_engine.make_requests(f"abort-{i}", ProcessedPrompt(None, list(range(5, 45))),
                                                 greedy(max_tokens=50))
        llm.engine_core.add_request(request)
    llm.engine_core.step()
    llm.engine_core.step()
    outputs = llm.engine_core.abort_requests(["abort-0", "abort-1", "abort-2"])
    assert [o.finish_reason for o in outputs] == ["abort"] * 3
    assert_pool_idle(llm)


def test_top_k_beyond_any_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=2**63)


def test_engine_starts_warmed_up_with_every_block_free():
    llm = LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=4)
    pool = llm.engine_core.kv_cache_manager.pool
    assert pool.num_free_blocks == 4 and not pool.cached_blocks
    # Block 0 held the warm-up's K/V; a request given block 0 still gets the right tokens.
    prompt = {"prompt_token_ids": list(range(20, 40))}
    fresh = llm.generate(prompt, greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    llm.engine_core.reset_prefix_cache()
    assert llm.generate(prompt, greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids == fresh


@pytest.fixture(scope="module")
def model_with_generation_config(tmp_path_factory):
    """The tiny model, with a generation_config.json that asks for greedy decoding and 3 new tokens."""
    folder = tmp_path_factory.mktemp("generation-config") / "model"
    shutil.copytree(tiny_model_with_tokenizer("llama"), folder)
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**config, "temperature": 0.0, "top_k": 5, "max_new_tokens": 3}))
    return folder


def test_generation_config_sets_the_default_sampling_params(model_with_generation_config):
    llm = LLM(str(model_with_generation_config), num_kv_blocks=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.top_p) == (0.0, 5, 3, 1.0)
    [first] = llm.generate("Namespaces are one honking great idea", use_tqdm=False)
    [again] = llm.generate("Namespaces are one honking great idea", use_tqdm=False)
    assert len(first.outputs[0].token_ids) == 3 and first.outputs[0].token_ids == again.outputs[0].token_ids
    # An explicit SamplingParams is used as given.
    [explicit] = llm.generate("Namespaces", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert len(explicit.outputs[0].token_ids) == 5

