"""vLLM's extra fields on /v1/responses and /v1/messages, through the official openai and anthropic clients.

Each is honoured, refused with a 400 naming it, or accepted where it cannot change the output
(request_fields.py). The tiny random-weight model of the shared server never ends a reply by
itself, so an end is forced: by a logit_bias on its EOS token, or by a grammar that, once
complete, allows nothing else. `vllm bench serve --backend openai-responses` sends ignore_eos
and counts the tokens that come back: they are exactly max_output_tokens.
"""

import json

import anthropic
import httpx
import openai
import pytest

from tests import shared_server
from tests.shared_server import MAX_MODEL_LEN, MODEL
from tinyserve.entrypoints.api.other_apis.responses_serving import bounded_calls
from tinyserve.entrypoints.api.serving_engine import ToolCallPlan
from tinyserve.entrypoints.api.tools.tool_calls import ToolCallDeltas

ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_time", "parameters": ZONE},
         {"type": "function", "name": "get_date", "parameters": ZONE}]
MESSAGES = [{"role": "user", "content": "Beautiful is better than ugly"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def eos(server) -> int:
    """The id that ends the served model's replies (its generation config's, which the engine stops on)."""
    with open(f"{shared_server.model_folder()}/generation_config.json") as config:
        eos_token_id = json.load(config)["eos_token_id"]
    return eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id


def token_id(server, text: str) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"][0]


def create(client, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.responses.create(**{"model": MODEL, "input": "Beautiful is better than ugly", "temperature": 0,
                                      "max_output_tokens": 8, **kwargs}, extra_body=extra)


def function_calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


# ---- honoured -----------------------------------------------------------------------------


@pytest.mark.server
def test_ignore_eos_gives_exactly_max_output_tokens(client, eos):
    ending = {"logit_bias": {str(eos): 100}}  # without ignore_eos the reply ends at its first token
    assert create(client, max_output_tokens=40, extra_body=ending).usage.output_tokens == 1
    response = create(client, max_output_tokens=40, extra_body={**ending, "ignore_eos": True})
    assert (response.usage.output_tokens, response.status, response.incomplete_details.reason) == (
        40, "incomplete", "max_output_tokens")


@pytest.mark.server
def test_ignore_eos_streamed_counts_the_same(client, eos):
    events = list(create(client, max_output_tokens=24, stream=True,
                         extra_body={"logit_bias": {str(eos): 100}, "ignore_eos": True}))
    assert events[-1].type == "response.incomplete" and events[-1].response.usage.output_tokens == 24


@pytest.mark.server
def test_min_tokens_holds_the_end_back(client, eos):
    response = create(client, max_output_tokens=16, extra_body={"logit_bias": {str(eos): 100}, "min_tokens": 5})
    assert (response.usage.output_tokens, response.status) == (6, "completed")


@pytest.mark.server
def test_stop_cuts_the_reply_before_the_stop_string(client):
    greedy = create(client, max_output_tokens=16).output_text
    stop = greedy[3:6]
    assert stop.strip(), greedy
    cut = create(client, max_output_tokens=16, extra_body={"stop": [stop]})
    assert (cut.output_text, cut.status) == (greedy[:greedy.index(stop)], "completed")
    kept = create(client, max_output_tokens=16, extra_body={"stop": stop, "include_stop_str_in_output": True})
    assert kept.output_text == greedy[:greedy.index(stop) + len(stop)]


@pytest.mark.server
def test_structured_outputs_choice_is_one_of_the_choices(client):
    response = create(client, extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert response.output_text in ("alpha", "beta") and response.status == "completed"


@pytest.mark.server
def test_structured_outputs_and_text_format_cannot_both_constrain(client):
    with pytest.raises(openai.BadRequestError, match="give one"):
        create(client, text={"format": {"type": "json_object"}}, extra_body={"structured_outputs": {"regex": "a+"}})


@pytest.mark.server
def test_max_tool_calls_bounds_the_calls_of_a_required_tool_choice(client, server):
    """With "," favoured after each call the model goes on calling; the bound closes the list (maxItems)."""
    calling = {"tools": TOOLS, "tool_choice": "required", "max_output_tokens": 200}
    favour_more = {"logit_bias": {str(token_id(server, ",")): 100}}
    assert len(function_calls(create(client, **calling, extra_body=favour_more))) > 1
    response = create(client, **calling, max_tool_calls=1, extra_body=favour_more)
    [call] = function_calls(response)
    assert call.name in ("get_time", "get_date") and json.loads(call.arguments)["zone"] in ("UTC", "CET")
    assert (response.status, response.max_tool_calls, len(response.output)) == ("completed", 1, 1)


def test_max_tool_calls_drops_the_calls_read_from_free_text_past_the_bound():
    """tool_choice "auto": the calls in the text cannot be constrained, so those past the bound are dropped."""
    text = "".join(f'<tool_call>{{"name": "get_time", "arguments": {{"zone": "{zone}"}}}}</tool_call>'
                   for zone in ("UTC", "CET", "UTC"))
    plan = bounded_calls(ToolCallPlan(None, None, lambda: ToolCallDeltas("hermes")), 2)
    deltas = plan.make_calls().feed(text, finished=True)
    calls = [call for delta in deltas for call in delta.get("tool_calls", ())]
    assert [(call["index"], json.loads(call["function"]["arguments"])) for call in calls] == [
        (0, {"zone": "UTC"}), (1, {"zone": "CET"})]


@pytest.mark.server
def test_vllm_sampling_extras_reach_the_sampler(client, server):
    forced = token_id(server, " is")
    assert create(client, extra_body={"logit_bias": {str(forced): 100}, "ignore_eos": True}).output_text == \
        httpx.post(f"{server.url}/detokenize", json={"tokens": [forced] * 8}).json()["prompt"]
    greedy = create(client).output_text
    assert create(client, temperature=1.0, extra_body={"top_k": 1}).output_text == greedy
    seeded = [create(client, temperature=1.0, extra_body={"seed": 7}).output_text for _ in range(2)]
    assert seeded[0] == seeded[1]


@pytest.mark.server
def test_anthropic_ignore_eos_goes_on_to_max_tokens(claude):
    """A reply its grammar has ended (only EOS may follow) ends there, or goes on to max_tokens with ignore_eos."""
    config = {"format": {"type": "json_schema", "schema": {"enum": ["a"]}}}
    kwargs = {"model": MODEL, "max_tokens": 12, "messages": MESSAGES}
    ended = claude.messages.create(**kwargs, extra_body={"temperature": 0, "output_config": config})
    ignored = claude.messages.create(**kwargs, extra_body={"temperature": 0, "output_config": config,
                                                           "ignore_eos": True})
    assert (ended.stop_reason, ignored.stop_reason, ignored.usage.output_tokens) == ("end_turn", "max_tokens", 12)


# ---- accepted where they change nothing ---------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("given", [
    {"reasoning": {"effort": "high"}},  # a model that does not reason answers the same, as in vLLM
    {"reasoning": {"effort": "low", "summary": "auto"}},
    {"include": ["reasoning.encrypted_content", "file_search_call.results"]},  # items never made here
    {"truncation": "auto"},  # the input fits
])
def test_values_that_ask_nothing_of_this_model_are_accepted_and_change_nothing(client, given):
    plain = create(client)
    answer = create(client, **given)
    assert (answer.output_text, answer.usage.output_tokens) == (plain.output_text, plain.usage.output_tokens)


@pytest.mark.server
def test_truncation_auto_echoes_and_an_input_that_does_not_fit_is_400_naming_it(client):
    assert create(client, truncation="auto").truncation == "auto"
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, truncation="auto", input="word " * MAX_MODEL_LEN)
    assert refused.value.body["param"] == "truncation" and "never truncates" in refused.value.body["message"]


@pytest.mark.server
@pytest.mark.parametrize("given", [
    {"speed": "fast"}, {"inference_geo": "us"}, {"cache_control": {"type": "ephemeral"}},
    {"fallbacks": "default"},
])
def test_anthropic_fields_of_a_hosted_api_change_nothing(claude, given):
    kwargs = {"model": MODEL, "max_tokens": 6, "messages": MESSAGES}
    plain = claude.messages.create(**kwargs, extra_body={"temperature": 0})
    answer = claude.messages.create(**kwargs, extra_body={"temperature": 0, **given})
    assert (answer.content[0].text, answer.usage.output_tokens) == (plain.content[0].text, plain.usage.output_tokens)


# ---- refused ------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("field, value", [
    ("mm_processor_kwargs", {"num_crops": 4}),
    ("cache_salt", "salt"),
    ("vllm_xargs", {"x": 1}),
    ("previous_input_messages", [{"role": "user", "content": "hi"}]),
    ("previous_response", {"id": "resp_1"}),
    ("background", True),
])
def test_a_refused_responses_field_is_400_naming_it(client, field, value):
    with pytest.raises(openai.BadRequestError) as refused:
        create(client, extra_body={field: value})
    assert refused.value.body["param"] == field and "not supported" in refused.value.body["message"]


@pytest.mark.server
@pytest.mark.parametrize("field, value", [
    ("mcp_servers", [{"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}]),
    ("context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]}),
    ("compaction", {"type": "enabled"}),
    ("thread", {"type": "create"}),
    ("kv_transfer_params", {"do_remote_prefill": True}),
    ("container", "container-1"),
])
def test_a_refused_messages_field_is_400_naming_it(claude, field, value):
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=6, messages=MESSAGES, extra_body={field: value})
    assert refused.value.body["error"]["message"].startswith(f"{field}: is not supported")


@pytest.mark.server
def test_beta_fields_sent_by_the_beta_client_are_refused_too(claude):
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers: is not supported"):
        claude.beta.messages.create(model=MODEL, max_tokens=6, messages=MESSAGES, mcp_servers=[
            {"type": "url", "url": "https://mcp.example.com/sse", "name": "example"}])
