"""--reasoning-parser: a reasoning model's answer split into its reasoning and its content, as vLLM 0.33 does.

First the parsers alone (tinyserve/reasoning/parsers.py): vLLM's deepseek_r1 and qwen3 rules, and a
stream cut anywhere adding up to the whole answer's split. Then one server of a checkpoint that
reasons by rote (tests/reasoning_checkpoints.py: its greedy answer is REASONING, </think>, CONTENT),
through the official openai client: the whole text is transformers' greedy text, and chat and the
Responses API split it, streamed and not, with the reasoning tokens counted and the span written
(and the anthropic client's messages, a thinking block); a constraint (a JSON schema, a regex, a
choice) applies from the reasoning's end, as in vLLM, on completions too, whose text stays whole.
"""

import json
import re
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest

from tests.hf_reference import hf_greedy
from tests.reasoning_checkpoints import CONTENT, REASONING, reasoning_checkpoint
from tests.server_checks import wait_until
from tests.tiny_tokenizer import TINY_VOCAB_SIZE
from tinyserve.cli.main import main
from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler_output import CachedRequestData, SchedulerOutput
from tinyserve.engine.structured_output import StructuredOutputManager
from tinyserve.lifecycle import schema
from tinyserve.models.tokenizer import load_tokenizer
from tinyserve.reasoning.parsers import REASONING_PARSERS, MarkerIds, ThinkingReader, reasoning_open, split
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tinyserve.testing import ServerProcess
from tinyserve.trace_reading.otlp_json import read_spans
from tinyserve.wire.messages import ReasoningEnd

MODEL = "reasoner"
START, END, TOOL, BOUNDARY = 10, 11, 12, 1  # made-up ids of <think>, </think>, <tool_call>, <|im_start|>
R1, QWEN3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
IDS = {R1: MarkerIds(START, END), QWEN3: MarkerIds(START, END, TOOL, frozenset({BOUNDARY}))}  # as MarkerIds.of gives


@pytest.mark.parametrize("rules, text, expected", [
    (R1, "plan</think>answer", ("plan", "answer")),
    (R1, "<think>plan</think>answer</think>", ("plan", "answer</think>")),  # content is kept as it is
    (R1, "still thinking", ("still thinking", None)),  # never ended: all reasoning, content null
    (QWEN3, "<think>plan</think>answer</think>!", ("plan", "answer!")),  # a second </think> is dropped
    (QWEN3, "plan<tool_call>{}</tool_call>", ("plan", "<tool_call>{}</tool_call>")),  # a call ends the reasoning
    (QWEN3, "</think>answer", (None, "answer")),
])
def test_a_whole_answer_splits_by_the_parsers_rules(rules, text, expected):
    assert split(ThinkingReader(rules, IDS[rules], True), text, []) == expected


@pytest.mark.parametrize("rules", [R1, QWEN3], ids=["deepseek_r1", "qwen3"])
def test_a_stream_cut_anywhere_adds_up_to_the_whole_split(rules):
    text = "<think>a</think> b<tool_call>c</think>d"
    whole = split(ThinkingReader(rules, IDS[rules], True), text, [])
    for cut in range(len(text) + 1):
        for second_cut in range(cut, len(text) + 1):
            reader = ThinkingReader(rules, IDS[rules], True)
            deltas = [d for piece in (text[:cut], text[cut:second_cut], text[second_cut:])
                      for d in reader.read(piece, [], False)] + reader.read("", [], True)
            streamed = tuple("".join(d.get(kind, "") for d in deltas) or None for kind in ("reasoning", "content"))
            assert streamed == whole, (cut, second_cut)


def test_where_the_reasoning_starts_follows_the_prompt_as_in_vllm():
    assert reasoning_open(R1, IDS[R1], [5, START, 6], None)
    assert not reasoning_open(R1, IDS[R1], [START, 6, END, BOUNDARY, 7], None)  # the last marker closes it
    assert reasoning_open(QWEN3, IDS[QWEN3], [START, 6, END, BOUNDARY, 7], None)  # an earlier turn's does not
    assert not reasoning_open(QWEN3, IDS[QWEN3], [BOUNDARY, START, END], None)
    assert not reasoning_open(QWEN3, IDS[QWEN3], [BOUNDARY, START], {"enable_thinking": False})
    assert reasoning_open(R1, IDS[R1], [BOUNDARY], {"enable_thinking": False})  # deepseek_r1 has no switch


def test_reasoning_tokens_are_the_tokens_read_in_reasoning():
    reader = ThinkingReader(QWEN3, IDS[QWEN3], True)
    reader.read("<think>ab</think>c", [START, 20, 21, END, 22], True)
    assert (reader.num_reasoning_tokens, reader.ended_at) == (2, 4)


def test_a_tokenizer_without_the_markers_and_an_unknown_parser_are_refused(capsys):
    with pytest.raises(ValueError, match="<think>"):
        MarkerIds.of(R1, {"</think>": 3})
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--reasoning-parser", "granite"])
    assert exit_info.value.code == 2 and "--reasoning-parser" in capsys.readouterr().err


def test_the_grammar_waits_for_the_reasoning_end_and_masks_only_the_implicit_ends_until_then():
    """The engine's side, stepped by hand: the manager's bitmask rows and the request's grammar (vLLM's
    reasoning_ended). A reasoning request gets a row only to mask an implicit end, then the grammar's."""
    folder = reasoning_checkpoint()
    vocab = load_tokenizer(folder).get_vocab()
    end, implicit = vocab["</think>"], vocab["<think>"]  # <think> stands in for an implicit end (Qwen3's <tool_call>)
    manager = StructuredOutputManager("xgrammar", folder, TINY_VOCAB_SIZE + 8, [2])
    params = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    masking = Request("masking", [5], params, [2], time.time(), reasoning_end=ReasoningEnd([end], [implicit]))
    free = Request("free", [5], params, [2], time.time(), reasoning_end=ReasoningEnd([end]))
    requests = {r.request_id: r for r in (masking, free)}
    for request in requests.values():
        manager.add_request(request)
        request.grammar.result(timeout=60)

    def allowed() -> dict[str, set[int]]:
        step = SchedulerOutput(0, [CachedRequestData(i, 1, 1, True, False, []) for i in requests])
        manager.grammar_bitmask(step, requests)
        rows = np.frombuffer(step.grammar_bitmask or b"", dtype=np.int32).reshape(-1, (TINY_VOCAB_SIZE + 39) // 32)
        bits = np.unpackbits(rows.view(np.uint8), axis=1, bitorder="little")[:, :TINY_VOCAB_SIZE + 8]
        return {i: set(np.flatnonzero(row).tolist()) for i, row in zip(step.structured_output_request_ids, bits)}

    assert allowed() == {"masking": set(range(TINY_VOCAB_SIZE + 8)) - {implicit}}  # "free" reasons unmasked
    for request in requests.values():
        request.append_output_token(7, time.time())  # a reasoning token: the grammar does not take it
        request.append_output_token(end, time.time())
    assert all(r.reasoning_ended and r.times.structured_output_grammar_start == 2 for r in requests.values())
    rows = allowed()
    assert rows["masking"] == rows["free"] and end not in rows["free"] and len(rows["free"]) < 10  # the grammar's
    manager.shutdown()


# ---- one server of the reasoning checkpoint ---------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def reasoner(tmp_path_factory):
    trace_dir = tmp_path_factory.mktemp("trace")
    proc = ServerProcess(str(reasoning_checkpoint()), "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                         "--num-kv-blocks", "64", "--max-model-len", "256", "--trace", "--trace-dir", str(trace_dir))
    proc.trace_dir = trace_dir
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(reasoner):
    return openai.OpenAI(base_url=f"{reasoner.url}/v1", api_key="unused", max_retries=0)


def chat(client, stream=False, max_tokens=16, **extra):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0,
                                          stream=stream, extra_body=extra or None,
                                          **({"stream_options": {"include_usage": True}} if stream else {}))


def streamed(chunks) -> tuple[str, str, list]:
    reasoning, content, usages = "", "", []
    for chunk in chunks:
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            content += choice.delta.content or ""
    return reasoning, content, usages


@pytest.mark.server
def test_the_whole_text_is_transformers_greedy_text_and_chat_splits_it(reasoner, client):
    prompt = httpx.post(f"{reasoner.url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0]
    expected = hf_greedy(str(reasoning_checkpoint()), prompt)
    assert whole.token_ids == expected[:len(whole.token_ids)] and whole.finish_reason == "stop"
    assert whole.text == REASONING + "</think>" + CONTENT

    answer = chat(client)
    message = answer.choices[0].message
    assert (message.reasoning, message.content) == (REASONING, CONTENT)
    assert message.reasoning + "</think>" + message.content == whole.text
    num_reasoning = len(expected) - len(CONTENT.split()) - 2  # less </think>, the content and the end token
    assert answer.usage.completion_tokens_details.reasoning_tokens == num_reasoning

    reasoning, content, [usage] = streamed(chat(client, stream=True))
    assert (reasoning, content) == (REASONING, CONTENT)
    assert usage.completion_tokens_details.reasoning_tokens == num_reasoning


@pytest.mark.server
@pytest.mark.parametrize("extra", [{"chat_template_kwargs": {"enable_thinking": False}},
                                   {"reasoning_effort": "none"}], ids=["enable_thinking", "reasoning_effort"])
def test_thinking_switched_off_in_the_template_is_all_content(client, extra):
    message = chat(client, **extra).choices[0].message
    assert (message.reasoning, message.content) == (None, CONTENT)
    assert streamed(chat(client, stream=True, **extra))[:2] == ("", CONTENT)


@pytest.mark.server
def test_include_reasoning_false_leaves_the_reasoning_out_but_counts_it(client):
    answer = chat(client, include_reasoning=False)
    assert (answer.choices[0].message.reasoning, answer.choices[0].message.content) == (None, CONTENT)
    assert answer.usage.completion_tokens_details.reasoning_tokens > 0
    assert streamed(chat(client, stream=True, include_reasoning=False))[:2] == ("", CONTENT)


@pytest.mark.server
def test_an_assistant_turns_reasoning_reaches_the_template(reasoner):
    for name in ("reasoning", "reasoning_content"):  # vLLM 0.33's name, and its older one
        messages = [*MESSAGES, {"role": "assistant", "content": "Hi.", name: "greet"}, *MESSAGES]
        tokens = httpx.post(f"{reasoner.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
        prompt = httpx.post(f"{reasoner.url}/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
        assert "<|im_start|>assistant\n<think>greet</think>Hi.<|im_end|>" in prompt


VERDICT = {"type": "object", "properties": {"verdict": {"enum": ["yes", "no"]}}, "required": ["verdict"],
           "additionalProperties": False}
# A constraint of each kind, as its field is spelled, and what a content that keeps to it is. The checkpoint's own
# content (CONTENT) keeps to none of them: a content that does was written under the grammar.
CONSTRAINTS = {
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": VERDICT}}},
                    lambda content: json.loads(content) in ({"verdict": "yes"}, {"verdict": "no"})),
    "regex": ({"structured_outputs": {"regex": "[0-9]{3}"}}, lambda content: re.fullmatch("[0-9]{3}", content)),
    "choice": ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda content: content in ("yes", "no")),
}


@pytest.mark.server
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_a_constraint_applies_from_the_reasoning_end_as_in_vllm(client, kind):
    """The reasoning is the unconstrained greedy run's, up to </think>; the content keeps to the constraint."""
    constraint, kept = CONSTRAINTS[kind]
    answer = chat(client, max_tokens=64, **constraint)
    message = answer.choices[0].message
    assert message.reasoning == REASONING and kept(message.content), message
    assert answer.choices[0].finish_reason == "stop"
    reasoning, content, _ = streamed(chat(client, stream=True, max_tokens=64, **constraint))
    assert (reasoning, content) == (REASONING, message.content)


@pytest.mark.server
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_a_prompt_that_closed_the_reasoning_is_constrained_from_the_first_token(client, kind):
    constraint, kept = CONSTRAINTS[kind]
    message = chat(client, max_tokens=64, chat_template_kwargs={"enable_thinking": False}, **constraint)
    assert message.choices[0].message.reasoning is None and kept(message.choices[0].message.content)


@pytest.mark.server
def test_a_responses_text_format_applies_from_the_reasoning_end(client):
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=64, temperature=0, text={
        "format": {"type": "json_schema", "name": "v", "schema": VERDICT}})
    reasoning, message = response.output
    assert reasoning.content[0].text == REASONING and CONSTRAINTS["json_schema"][1](response.output_text)


@pytest.mark.server
def test_a_completions_constraint_applies_from_the_reasoning_end_and_its_text_stays_whole(client):
    """As vLLM's engine reads a completion's prompt: open reasoning (the prompt's last marker a <think>), the grammar
    starts after </think>; closed, from the first token. The text is not split: completions parse no reasoning."""
    constraint, kept = CONSTRAINTS["json_schema"]
    opened = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>"  # the chat template's prompt

    def complete(prompt, stream=False) -> str:
        answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=64, temperature=0, stream=stream,
                                           extra_body=constraint)
        return "".join(chunk.choices[0].text for chunk in answer) if stream else answer.choices[0].text

    reasoning, end, content = complete(opened).partition("</think>")
    assert (reasoning, end) == (REASONING, "</think>") and kept(content), content
    assert complete(opened, stream=True) == REASONING + "</think>" + content
    closed = complete(opened + "</think>")
    assert kept(closed), closed


@pytest.mark.server
def test_anthropic_messages_give_a_thinking_block_and_constrain_after_it(reasoner):
    """As vLLM's /v1/messages (its chat's reading): the reasoning a thinking block before the text, streamed and
    not, and output_config.format's schema applied from the reasoning's end."""
    claude = anthropic.Anthropic(base_url=reasoner.url, api_key="unused", max_retries=0)
    kwargs = {"model": MODEL, "max_tokens": 64, "messages": MESSAGES}
    thinking, text = claude.messages.create(**kwargs, extra_body={"temperature": 0}).content
    assert (thinking.type, thinking.thinking, text.text) == ("thinking", REASONING, CONTENT) and thinking.signature
    config = {"temperature": 0, "output_config": {"format": {"type": "json_schema", "schema": VERDICT}}}
    thinking, text = claude.messages.create(**kwargs, extra_body=config).content
    assert thinking.thinking == REASONING and CONSTRAINTS["json_schema"][1](text.text), text
    with claude.messages.stream(**kwargs, extra_body=config) as stream:
        events = [event.type for event in stream if event.type.startswith("content_block")]
        message = stream.get_final_message()
    assert [(block.type, getattr(block, "thinking", None) or block.text) for block in message.content] == [
        ("thinking", REASONING), ("text", text.text)] and message.content[0].signature
    assert events[0] == "content_block_start" and events.count("content_block_stop") == 2


@pytest.mark.server
def test_the_grammars_span_says_it_started_after_the_reasoning(reasoner, client):
    answer = chat(client, max_tokens=64, **CONSTRAINTS["choice"][0])
    reasoning_end = answer.usage.completion_tokens_details.reasoning_tokens + 1  # the reasoning, then </think>

    def grammar_starts() -> list:
        return [span.attributes[schema.STRUCTURED_OUTPUT_GRAMMAR_START]
                for path in reasoner.trace_dir.rglob("engine-*.jsonl") for span in read_spans(path)
                if span.name == schema.STRUCTURED_OUTPUT and span.attributes[schema.REQUEST_ID] == answer.id]

    wait_until(grammar_starts, 60, "the request's tinyserve.structured_output span is written")
    assert grammar_starts() == [reasoning_end]


@pytest.mark.server
def test_responses_give_a_reasoning_item_and_count_its_tokens(client):
    response = client.responses.create(model=MODEL, input="hi", max_output_tokens=16, temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and response.output_text == CONTENT
    assert response.usage.output_tokens_details.reasoning_tokens > 0

    events = list(client.responses.create(model=MODEL, input="hi", max_output_tokens=16, temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == CONTENT
    done = events[-1].response
    assert [item.type for item in done.output] == ["reasoning", "message"] and done.output[0].content[0].text == REASONING
    assert done.usage.output_tokens_details.reasoning_tokens == response.usage.output_tokens_details.reasoning_tokens


@pytest.mark.server
def test_a_reasoning_input_item_is_taken_as_vllm_takes_it(reasoner, client):
    item = {"type": "reasoning", "id": "lol", "summary": [],
            "content": [{"type": "reasoning_text", "text": "We need to respond: greeting."}]}
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=16,
                                       input=[{"type": "message", "content": "Hello.", "role": "user"}, item])
    assert [item.type for item in response.output] == ["reasoning", "message"]
    shown = client.responses.create(model=MODEL, max_output_tokens=1, extra_body={"enable_response_messages": True},
                                    input=[{"role": "user", "content": "Hello."}, item,
                                           {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "?"}])
    assert "<think>We need to respond: greeting.</think>Hi.<|im_end|>" in shown.input_messages[0]["message"]
    refused = httpx.post(f"{reasoner.url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": [{**item, "encrypted_content": "abc"}]})
    assert refused.status_code == 400 and "input" in refused.json()["error"]["param"]


@pytest.mark.server
def test_the_reading_is_a_span_in_the_requests_trace(reasoner, client):
    chat(client)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        spans = [json.loads(line) for path in reasoner.trace_dir.rglob("api.jsonl")
                 for line in path.read_text().splitlines() if f'"{schema.REASONING}"' in line]
        if spans:
            break
        time.sleep(0.2)
    text = json.dumps(spans)
    assert all(f'"{key}"' in text for key in (schema.REASONING_PARSER, schema.REASONING_NUM_TOKENS,
                                               schema.REASONING_ENDED_AT)) and '"qwen3"' in text
