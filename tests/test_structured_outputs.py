"""Structured outputs through the offline LLM: whatever the random-weight model prefers, the grammar decides.

A random-weight model never emits EOS on its own and repeats tokens, so an output that
parses, matches or validates here does so because the grammar's bitmask left it no
other token, and a request that finishes with "stop" does so because its grammar ended
and allowed only EOS.
"""

import json
import re

import jsonschema
import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["answer", "count", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["The Zen of Python", "Beautiful is better than", "Errors should never pass", "Simple is"]


@pytest.fixture(scope="module")
def folder():
    return str(tiny_model_with_tokenizer("llama"))


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def llm(request, folder):
    return LLM(folder, num_kv_blocks=64, structured_outputs_backend=request.param)


def constrained(max_tokens: int = 200, **constraint) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def generate_one(llm, params, prompt: str = PROMPTS[0]):
    [output] = llm.generate(prompt, params, use_tqdm=False)
    return output.outputs[0]


def test_json_schema_output_validates_and_stops(llm):
    output = generate_one(llm, constrained(json=SCHEMA))
    jsonschema.validate(json.loads(output.text), SCHEMA)
    assert output.finish_reason == "stop"


def test_json_schema_given_as_text_is_the_same_constraint(llm):
    as_text = generate_one(llm, constrained(json=json.dumps(SCHEMA)))
    assert as_text.text == generate_one(llm, constrained(json=SCHEMA)).text


def test_regex_output_matches_in_full(llm):
    output = generate_one(llm, constrained(regex=r"[ab]{3}-[0-9]{2}"))
    assert re.fullmatch(r"[ab]{3}-[0-9]{2}", output.text) and output.finish_reason == "stop"


def test_choice_output_is_one_of_the_choices(llm):
    choices = ["red", "green", "blue sky"]
    texts = {generate_one(llm, constrained(choice=choices), prompt).text for prompt in PROMPTS}
    assert texts <= set(choices)


def test_ebnf_grammar_output_is_in_its_language(llm):
    output = generate_one(llm, constrained(grammar='root ::= "(" ("x" | "y")+ ")"', max_tokens=60))
    assert re.fullmatch(r"\([xy]+\)", output.text) and output.finish_reason == "stop"


def test_json_object_output_is_a_json_object(llm):
    # Any object is allowed, so the model may also write one key for ever: with this prompt its greedy
    # path closes the object (the schema tests above bound every value, and so always end).
    output = generate_one(llm, constrained(json_object=True), "The Zen")
    assert isinstance(json.loads(output.text), dict) and output.finish_reason == "stop"


def test_unconstrained_output_is_not_json(llm):
    """The contrast that makes the tests above mean something: without a grammar this model writes no JSON."""
    output = generate_one(llm, SamplingParams(temperature=0.0, max_tokens=30))
    with pytest.raises(ValueError):
        json.loads(output.text)
    assert output.finish_reason == "length"


def test_sampled_constrained_requests_stay_in_the_grammar(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    [output] = llm.generate(PROMPTS[1], params, use_tqdm=False)
    for sample in output.outputs:
        jsonschema.validate(json.loads(sample.text), SCHEMA)


def test_constrained_and_free_requests_share_a_batch(llm):
    params = [constrained(regex="[0-9]{4}"), SamplingParams(temperature=0.0, max_tokens=8),
              constrained(choice=["on", "off"])]
    outputs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    alone = generate_one(llm, params[1], PROMPTS[1])
    assert re.fullmatch("[0-9]{4}", outputs[0].outputs[0].text)
    assert outputs[1].outputs[0].token_ids == alone.token_ids  # the bitmask touched only its own rows
    assert outputs[2].outputs[0].text in ("on", "off")


def test_a_schema_the_backend_cannot_compile_is_refused_naming_the_problem(llm):
    bad = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}  # refused before it reaches the library
    with pytest.raises(ValueError, match=r"not a usable JSON schema: .*no-such-type"):
        llm.generate(PROMPTS[0], constrained(json=bad), use_tqdm=False)
    uncompilable = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}
    with pytest.raises(ValueError, match=r"structured_outputs\.json cannot be compiled by \w+: "):
        llm.generate(PROMPTS[0], constrained(json=uncompilable), use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.regex cannot be compiled"):
        llm.generate(PROMPTS[0], constrained(regex="(unclosed"), use_tqdm=False)


def test_a_grammar_not_compiled_by_the_deadline_fails_the_call_and_the_engine_serves_the_next(folder):
    llm = LLM(folder, num_kv_blocks=32, structured_outputs_compile_timeout=0.5)
    # 1,200 optional properties: within the size limits, about 7 s of xgrammar's compile on two cores
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1200)}}
    free = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(ValueError, match=r"not compiled within 0\.5 s \(--structured-outputs-compile-timeout\)"):
        llm.generate(PROMPTS[:2], [constrained(json=slow), free], use_tqdm=False)
    # The call's other request went with it: nothing waits or runs (the worker hears of the abort with the next
    # step, so the client may still have that one, empty, step to take).
    assert not llm.engine_core.has_unfinished_requests
    answer = json.loads(generate_one(llm, constrained(json=SCHEMA)).text)
    jsonschema.validate(answer, SCHEMA)


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ["b"]}, "exactly one of"),
    ({"choice": []}, "non-empty list of non-empty strings"),
    ({"choice": ["a", ""]}, "non-empty list of non-empty strings"),
    ({"json": "{not json"}, "not valid JSON"),
])
def test_structured_outputs_params_are_checked_when_made(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_an_unknown_backend_is_refused_at_start(folder):
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of"):
        LLM(folder, structured_outputs_backend="outlines-v0")


def test_grammars_survive_preemption_and_chunked_prefill(folder):
    """Four long constrained outputs in 8 blocks of 16 tokens with a 16-token budget: requests are preempted
    and recomputed, prompts prefilled in chunks; each output is what it is alone, and matches."""
    pattern = "[0-9]{60}"
    params = constrained(regex=pattern, max_tokens=90)
    alone = [generate_one(LLM(folder, num_kv_blocks=64), params, prompt).token_ids for prompt in PROMPTS]
    tight = LLM(folder, num_kv_blocks=8, block_size=16, max_num_batched_tokens=16)
    outputs = tight.generate(PROMPTS, params, use_tqdm=False)
    assert tight.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone
    assert all(re.fullmatch(pattern, o.outputs[0].text) for o in outputs)


def test_traces_show_the_grammar_stage_and_the_constrained_steps(folder, tmp_path):
    """A tinyserve.structured_output span per constrained request (a cache hit for the second with the same
    schema), and each step says how many requests its bitmask constrained and how long filling it took."""
    from tinyserve.lifecycle import schema
    from tinyserve.lifecycle.tracing import shutdown_tracing
    from tinyserve.trace_reading.otlp_json import read_spans

    try:
        llm = LLM(folder, trace_dir=str(tmp_path), num_kv_blocks=64)
        llm.generate(PROMPTS[0], constrained(json=SCHEMA), use_tqdm=False)
        llm.generate(PROMPTS[1:3], [constrained(json=SCHEMA), SamplingParams(temperature=0, max_tokens=4)],
                     use_tqdm=False)
        [run] = list(tmp_path.iterdir())
        spans = read_spans(run / schema.OFFLINE_TRACE_FILE)
    finally:
        shutdown_tracing()
    grammar_spans = sorted((s for s in spans if s.name == schema.STRUCTURED_OUTPUT), key=lambda s: s.start_ns)
    assert [s.attributes[schema.STRUCTURED_OUTPUT_CACHE_HIT] for s in grammar_spans] == [False, True]
    assert {s.attributes[schema.STRUCTURED_OUTPUT_KIND] for s in grammar_spans} == {"json"}
    assert {s.attributes[schema.STRUCTURED_OUTPUT_BACKEND] for s in grammar_spans} == {"xgrammar"}
    steps = [s for s in spans if s.name == schema.STEP]
    constrained_counts = {s.attributes[schema.STEP_NUM_CONSTRAINED_REQUESTS] for s in steps}
    assert constrained_counts >= {1}  # and 0 for steps only the free request sampled in
    for step in steps:
        constrained_requests = step.attributes[schema.STEP_NUM_CONSTRAINED_REQUESTS]
        assert (step.attributes[schema.STEP_GRAMMAR_BITMASK_TIME] > 0) == (constrained_requests > 0)


def test_llm_chat_shows_the_tools_to_the_template(llm):
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "What time is it?"}]
    [plain] = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    [with_tool] = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, tools=[tool])
    assert len(with_tool.prompt_token_ids) > len(plain.prompt_token_ids)
    assert "get_time" in llm.get_tokenizer().decode(with_tool.prompt_token_ids)


@pytest.mark.slow
def test_tensor_parallel_ranks_apply_the_same_bitmask(folder):
    """The bitmask crosses to the other ranks inside the SchedulerOutput: the same constrained tokens as one rank."""
    params = constrained(regex="[0-9]{5}-[ab]+", max_tokens=30)
    alone = generate_one(LLM(folder, num_kv_blocks=64), params)
    tp_llm = LLM(folder, num_kv_blocks=64, tensor_parallel_size=2)
    try:
        split = generate_one(tp_llm, params)
    finally:
        tp_llm.shutdown()  # its ranks and its process group: one per process
    assert split.token_ids == alone.token_ids and re.fullmatch("[0-9]{5}-[ab]+", split.text)
