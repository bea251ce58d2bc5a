"""Reading tool calls out of generated text (tool_calls.py, anthropic_tools.py), fed as a stream would be."""

import json

import pytest

from tinyserve.entrypoints.api.other_apis.anthropic_tools import BlockEvents, content_blocks
from tinyserve.entrypoints.api.tools.tool_calls import ToolCallDeltas, ToolCallParser, required_calls_schema

HERMES = ('Let me look. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call> and '
          '<tool_call>{"name": "g"}</tool_call>')


def fed(parser: ToolCallParser, text: str, step: int = 1):
    content, calls = "", []
    for start in range(0, len(text), step):
        more, new = parser.feed(text[start:start + step])
        content, calls = content + more, calls + new
    more, new = parser.finish()
    return content + more, [(c.name, json.loads(c.arguments)) for c in calls + new]


@pytest.mark.parametrize("step", [1, 3, len(HERMES)])
def test_hermes_calls_are_found_however_the_text_is_cut(step):
    assert fed(ToolCallParser("hermes"), HERMES, step) == ("Let me look.  and ", [("f", {"a": 1}), ("g", {})])


def test_hermes_text_that_only_looks_like_a_call_stays_text():
    text = "a <tool_ and <tool_call>not json</tool_call> and <tool_call>{\"name\": 1"
    assert fed(ToolCallParser("hermes"), text) == (text, [])


def test_hermes_holds_back_only_what_may_open_a_call():
    parser = ToolCallParser("hermes")
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.feed("box>") == ("<toolbox>", [])


REQUIRED = ('[{"name": "f", "parameters": {"a": [1, "x}]"], "b": {"c": null}}}, '
            '{"name":"g","parameters":{"q":"say \\"hi\\""}}]')


def streamed_required(text: str, step: int, finished: bool = True) -> tuple[list[dict], ToolCallDeltas]:
    deltas = ToolCallDeltas("required")
    out = [d for start in range(0, len(text), step) for d in deltas.feed(text[start:start + step], finished=False)]
    return out + (deltas.feed("", finished=True) if finished else []), deltas


@pytest.mark.parametrize("step", [1, 2, 5, len(REQUIRED)])
def test_required_calls_stream_a_name_first_then_arguments_in_pieces_however_the_text_is_cut(step):
    out, deltas = streamed_required(REQUIRED, step)
    assert [(c.name, json.loads(c.arguments)) for c in deltas.calls] == [
        ("f", {"a": [1, "x}]"], "b": {"c": None}}), ("g", {"q": 'say "hi"'})]
    heads = [call for d in out for call in d["tool_calls"] if "id" in call]
    assert [(h["index"], h["function"]) for h in heads] == [(0, {"name": "f", "arguments": ""}),
                                                           (1, {"name": "g", "arguments": ""})]
    pieces = [call for d in out for call in d["tool_calls"] if "id" not in call]
    for index, call in enumerate(deltas.calls):  # the pieces add up to each call's arguments, in order
        assert "".join(p["function"]["arguments"] for p in pieces if p["index"] == index) == call.arguments
    if step < 5:
        assert len(pieces) > 2  # the arguments came in pieces, not whole at the end
    assert deltas.message(REQUIRED)["tool_calls"] and not any("content" in d for d in out)


def test_a_required_call_cut_short_keeps_what_was_generated():
    cut = REQUIRED[:REQUIRED.index('"b"')]  # max_tokens ended it inside the first call's arguments
    message = ToolCallDeltas("required").message(cut)
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "f" and call["function"]["arguments"] == '{"a": [1, "x}]"], '
    before_a_name = ToolCallDeltas("required").message('[{"name": "f')
    assert before_a_name == {"content": '[{"name": "f'}  # no call can be read: the text itself


def test_required_schema_names_only_the_tools_and_limits_parallel_calls():
    schema = required_calls_schema([{"name": "f", "parameters": {"type": "object"}}], parallel_tool_calls=False)
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"enum": ["f"]}


def test_named_function_arguments_stream_after_its_id_and_name():
    deltas = ToolCallDeltas("named", "f")
    first = deltas.feed('{"a"', finished=False)
    assert first[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""} and "id" in first[0]["tool_calls"][0]
    assert first[1] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert deltas.feed(": 1}", finished=True) == [{"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]
    assert deltas.finish_reason("stop") == "tool_calls" and deltas.finish_reason("length") == "length"


def test_anthropic_blocks_from_hermes_text():
    blocks = content_blocks(ToolCallDeltas("hermes"), HERMES)
    assert [b["type"] for b in blocks] == ["text", "tool_use", "tool_use"]
    assert blocks[1]["input"] == {"a": 1} and blocks[1]["id"].startswith("toolu_")


def test_anthropic_stream_opens_a_block_per_kind_and_closes_each():
    deltas, blocks = ToolCallDeltas("hermes"), BlockEvents()
    events = [e for ch in HERMES for e in blocks.events(deltas.feed(ch, finished=False))]
    events += blocks.events(deltas.feed("", finished=True)) + blocks.close()
    kinds = [json.loads(e.split("data: ", 1)[1])["type"] for e in events]
    starts = [json.loads(e.split("data: ", 1)[1])["content_block"]["type"]
              for e in events if "content_block_start" in e]
    assert starts == ["text", "tool_use", "text", "tool_use"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 4


LLAMA3 = '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {}}'


@pytest.mark.parametrize("step", [1, 4, len(LLAMA3)])
def test_llama3_json_calls_are_found_however_the_text_is_cut(step):
    assert fed(ToolCallParser("llama3_json"), LLAMA3, step) == ("", [("f", {"a": 1}), ("g", {})])


def test_llama3_json_without_the_python_tag_is_calls_too():
    assert fed(ToolCallParser("llama3_json"), ' {"name": "f", "parameters": {}}') == ("", [("f", {})])


def test_llama3_json_a_reply_that_is_not_json_is_text():
    text = "Paris is {sunny} today"
    assert fed(ToolCallParser("llama3_json"), text) == (text, [])


def test_llama3_json_holds_back_only_what_may_be_the_python_tag():
    parser = ToolCallParser("llama3_json")
    assert parser.feed("<|py") == ("", [])
    assert parser.feed("thon!") == ("<|python!", [])


def test_llama3_json_what_is_not_a_call_stays_text():
    assert fed(ToolCallParser("llama3_json"), '{"city": "Oslo"} {"name": "f"') == ('{"city": "Oslo"} {"name": "f"', [])


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    deltas = ToolCallDeltas("hermes", parallel_tool_calls=False)
    assert [call["function"]["name"] for call in deltas.message(HERMES)["tool_calls"]] == ["f"]
