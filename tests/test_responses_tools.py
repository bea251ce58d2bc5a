"""Function tools and text.format in the Responses API, through the real openai client.

The tiny random-weight model knows nothing of JSON or tools: a parsed object, a call that
validates against its tool's schema, a reply that ends by itself, all come from the grammar
(structured outputs), which allows nothing else. The round trip (a call, its output handed
back, a final answer) is the one a client's tool loop makes.
"""

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests import shared_server
from tests.shared_server import MODEL
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The forecast", "parameters": WEATHER,
          "strict": True},
         {"type": "function", "name": "get_time", "parameters": TIME, "strict": True}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = "What is the weather in Paris?"
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


class Verdict(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=9)


@pytest.fixture(scope="module")
def client():
    proc = ServerProcess(shared_server.model_folder(), *shared_server.FLAGS, "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes")
    yield openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0)
    proc.stop()


def create(client, **kwargs):
    return client.responses.create(**{"model": MODEL, "input": QUESTION, "temperature": 0,
                                      "max_output_tokens": 200, **kwargs})


def calls_of(response) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in response.output if item.type == "function_call"]


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- text.format ---------------------------------------------------------------


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client):
    response = client.responses.parse(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=200,
                                      text_format=Verdict)
    assert isinstance(response.output_parsed, Verdict) and response.status == "completed"
    assert response.text.format.type == "json_schema"


def test_a_json_schema_format_streams_the_same_text(client):
    text = {"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}}
    full = create(client, text=text)
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=200,
                                 text=text) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == full.output_text
    jsonschema.validate(json.loads(full.output_text), WEATHER)


def test_a_json_object_format_begins_an_object(client):
    response = create(client, text={"format": {"type": "json_object"}}, max_output_tokens=8)
    assert response.output_text.startswith("{")


# ---- function tools ------------------------------------------------------------


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_function_calls_that_validate(client, parallel):
    response = create(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel)
    assert response.status == "completed" and response.output_text == ""
    check_calls(calls_of(response))
    calls = [item for item in response.output if item.type == "function_call"]
    assert all(c.status == "completed" and c.call_id.startswith("call_") and c.id.startswith("fc_") for c in calls)
    assert len({c.call_id for c in calls}) == len(calls)
    if not parallel:
        assert len(calls) == 1
    assert response.tool_choice == "required" and [tool.name for tool in response.tools] == ["get_weather",
                                                                                            "get_time"]


def test_streamed_calls_have_the_documented_events_and_are_the_same_calls(client):
    full = create(client, tools=TOOLS, tool_choice="required")
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=200, tools=TOOLS,
                                 tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    per_call = [kind for kind in kinds[2:-1] if kind != "response.function_call_arguments.delta"]
    assert per_call == [kind for kind in CALL_EVENTS if "delta" not in kind] * len(calls_of(full))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert calls_of(final) == calls_of(full)
    done = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert [(event.name, event.arguments) for event in done] == calls_of(full)


def test_a_named_function_is_called_streamed_and_not(client):
    choice = {"type": "function", "name": "get_time"}
    [(name, arguments)] = calls_of(create(client, tools=TOOLS, tool_choice=choice))
    assert name == "get_time"
    check_calls([(name, arguments)])
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=200, tools=TOOLS,
                                 tool_choice=choice) as stream:
        kinds = [event.type for event in stream]
        assert calls_of(stream.get_final_response()) == [(name, arguments)]
    assert kinds.count("response.function_call_arguments.delta") > 1  # the arguments stream as they come


def test_auto_tool_choice_without_a_call_is_a_message(client):
    response = create(client, tools=TOOLS, max_output_tokens=6)
    assert [item.type for item in response.output] == ["message"] and response.status == "incomplete"


def test_tool_choice_none_shows_the_tools_to_the_template(client):
    with_tools = create(client, tools=TOOLS, tool_choice="none", max_output_tokens=3)
    without = create(client, max_output_tokens=3)
    assert calls_of(with_tools) == [] and with_tools.usage.input_tokens > without.usage.input_tokens + 20


def test_a_round_trip_hands_the_call_and_its_output_back(client):
    first = create(client, tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
    [call] = [item for item in first.output if item.type == "function_call"]
    conversation = [{"role": "user", "content": QUESTION}, *first.output,
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    final = create(client, input=conversation, tools=TOOLS, tool_choice="none", max_output_tokens=4)
    assert [item.type for item in final.output] == ["message"] and final.output_text
    assert final.usage.input_tokens > first.usage.input_tokens + 10  # the call and its output were rendered
    # The same turn after previous_response_id: the stored reply holds the call.
    continued = create(client, previous_response_id=first.id, tools=TOOLS, tool_choice="none", max_output_tokens=4,
                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert (continued.output_text, continued.usage.input_tokens) == (final.output_text, final.usage.input_tokens)


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "not among the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "cannot be combined"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "distinct names"),
])
def test_inconsistent_tool_requests_are_refused(client, body, message):
    with pytest.raises(openai.BadRequestError, match=message):
        create(client, **body)
