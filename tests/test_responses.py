"""The Responses API (/v1/responses) with the real openai client: plain, streamed, continued, refused.

The server serves the built-in model, which answers a chat turn with a line and ends it,
so a reply can finish by itself ("completed") as well as be cut short ("incomplete").
"""

import httpx
import openai
import pytest

from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

MODEL = "tinyserve-default"
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done", "response.completed"]


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess(None, "--served-model-name", MODEL, "--num-kv-blocks", "128")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_text(client, messages, max_tokens=64) -> tuple[str, int]:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    return answer.choices[0].message.content, answer.usage.prompt_tokens


def test_a_text_input_is_answered_as_the_same_chat_turn(client):
    response = client.responses.create(model=MODEL, input="Readability counts.", temperature=0)
    text, num_prompt = chat_text(client, [{"role": "user", "content": "Readability counts."}])
    assert response.status == "completed" and response.output_text == text and text
    assert response.usage.input_tokens == num_prompt and response.usage.output_tokens > 0
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")


def test_instructions_and_a_message_list_are_rendered_in_order(client):
    messages = [{"role": "user", "content": "Beautiful is better than ugly."},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Explicit is better."}]},
                {"role": "user", "content": [{"type": "input_text", "text": "Simple is better."}]}]
    response = client.responses.create(model=MODEL, instructions="Answer with the Zen.", input=messages,
                                       temperature=0)
    text, num_prompt = chat_text(client, [
        {"role": "system", "content": "Answer with the Zen."},
        {"role": "user", "content": "Beautiful is better than ugly."},
        {"role": "assistant", "content": "Explicit is better."}, {"role": "user", "content": "Simple is better."}])
    assert (response.output_text, response.usage.input_tokens) == (text, num_prompt)


def test_max_output_tokens_cuts_the_reply_and_says_so(client):
    response = client.responses.create(model=MODEL, input="Readability counts.", max_output_tokens=2, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_temperature_and_top_p_reach_the_sampler(client):
    greedy = {client.responses.create(model=MODEL, input="Flat", temperature=0).output_text for _ in range(2)}
    assert len(greedy) == 1
    sampled = {client.responses.create(model=MODEL, input="Flat", temperature=2.0, top_p=1.0,
                                       max_output_tokens=12).output_text for _ in range(4)}
    assert len(sampled) > 1
    # top_p so small that only the most likely token is left: greedy again, whatever the temperature.
    narrowed = client.responses.create(model=MODEL, input="Flat", temperature=2.0, top_p=1e-9).output_text
    assert {narrowed} == greedy


def test_a_stream_has_the_documented_event_sequence_and_the_same_text(client):
    plain = client.responses.create(model=MODEL, input="Errors should never pass silently.", temperature=0)
    with client.responses.stream(model=MODEL, input="Errors should never pass silently.", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = [i for i, kind in enumerate(kinds) if kind == "response.output_text.delta"]
    assert deltas and kinds[:deltas[0]] == EVENTS[:4] and kinds[deltas[-1] + 1:] == EVENTS[5:]
    assert set(kinds[deltas[0]:deltas[-1] + 1]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert "".join(events[i].delta for i in deltas) == final.output_text == plain.output_text
    assert final.status == "completed" and final.usage.output_tokens == plain.usage.output_tokens


def test_stream_true_through_create_gives_the_same_events(client):
    kinds = [event.type for event in client.responses.create(model=MODEL, input="Hi", temperature=0, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model=MODEL, input="Now is better than never.", temperature=0)
    second = client.responses.create(model=MODEL, input="Although never is often better.", temperature=0,
                                     previous_response_id=first.id)
    text, num_prompt = chat_text(client, [{"role": "user", "content": "Now is better than never."},
                                          {"role": "assistant", "content": first.output_text},
                                          {"role": "user", "content": "Although never is often better."}])
    assert (second.output_text, second.usage.input_tokens) == (text, num_prompt)
    assert client.responses.retrieve(second.id).output_text == second.output_text


def test_an_unknown_or_unstored_previous_response_is_404_naming_it(client):
    unstored = client.responses.create(model=MODEL, input="hi", store=False, max_output_tokens=2)
    for response_id in ("resp_unknown", unstored.id):
        with pytest.raises(openai.NotFoundError) as refused:
            client.responses.create(model=MODEL, input="again", previous_response_id=response_id)
        assert refused.value.body["param"] == "previous_response_id"


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize("change, param, named", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type", "'web_search' tools are not supported"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice.type", "'mcp'"),
    ({"reasoning": {"effort": "high", "summary": "detailed"}}, "reasoning.summary", "not supported"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]}, "input.0.reasoning.encrypted_content",
     "None"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input.0.function_call.arguments", "JSON"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
])
def test_what_is_not_implemented_or_malformed_is_400_naming_it(server, change, param, named):
    body = {"model": MODEL, "input": "hi", **change}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and named in response.json()["error"]["message"]


def test_auto_tool_choice_without_a_parser_is_refused_as_in_chat(server):
    body = {"model": MODEL, "input": "hi", "tools": [FUNCTION]}
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in response.json()["error"]["message"]


def test_retrieving_a_response_wants_an_id_of_the_servers_form(server):
    response = httpx.get(f"{server.url}/v1/responses/not-an-id", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["param"] == "response_id"
    assert httpx.get(f"{server.url}/v1/responses/resp_{'0' * 32}", timeout=10).status_code == 404


def test_the_response_store_is_bounded_by_bytes_as_well_as_by_count():
    from tinyserve.entrypoints.api.other_apis.responses_protocol import ResponseStore

    store = ResponseStore(max_entries=100, max_bytes=10_000)
    for i in range(20):  # each about 3 kB of JSON
        store.put({"id": f"resp_{i}", "text": {"format": "x" * 3000}}, [{"role": "user", "content": "hi"}])
    kept = [f"resp_{i}" for i in range(20) if store.response(f"resp_{i}") is not None]
    assert kept == ["resp_17", "resp_18", "resp_19"] and store.num_bytes <= 10_000
    store.put({"id": "resp_huge", "text": {"format": "y" * 50_000}}, [])
    assert store.response("resp_huge") is not None and store.response("resp_19") is None  # the newest stays
    store.put({"id": "resp_huge", "text": {"format": "z"}}, [])  # stored again under its id: counted once
    assert store.num_bytes < 100
