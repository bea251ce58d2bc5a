"""The field walk: every request field a real client can send is implemented or refused, never ignored.

The fields come from the installed clients' own request types (the openai and anthropic
TypedDicts) and from vLLM's protocol (vllm/entrypoints/openai/protocol.py, its chat and
completion extra parameters, listed below). Each is one of three things
(tinyserve/entrypoints/api/request_fields.py): a field of the body's model, refused
(a 400 naming it whenever it asks for something), or without effect on the output. Then,
against a real server: every refused field is refused, every field without effect leaves
the output as it was, and every implemented field changes it as documented.
"""

import json

import anthropic.types.beta.message_count_tokens_params as anthropic_beta_count_tokens
import anthropic.types.beta.message_create_params as anthropic_beta_messages
import anthropic.types.message_count_tokens_params as anthropic_count_tokens
import anthropic.types.message_create_params as anthropic_messages
import httpx
import openai.types.chat.completion_create_params as openai_chat
import openai.types.completion_create_params as openai_completions
import openai.types.responses.response_create_params as openai_responses
import pytest
from typing_extensions import is_typeddict

from tests import shared_server
from tinyserve.entrypoints.api.other_apis.anthropic_serving import MessagesCountTokensRequest, MessagesRequest
from tinyserve.entrypoints.api.openai_protocol import ChatCompletionRequest, CompletionRequest
from tinyserve.entrypoints.api.request_fields import NO_EFFECT, REFUSED
from tinyserve.entrypoints.api.other_apis.responses_protocol import ResponsesRequest

MODEL = shared_server.MODEL

# vLLM's extra request fields (vllm/entrypoints/openai/protocol.py: chat-completion-sampling-params,
# chat-completion-extra-params, completion-sampling-params, completion-extra-params), with the
# structured-output fields of later releases (structured_outputs, return_token_ids).
VLLM_SAMPLING = ["best_of", "use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty",
                 "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids"]
VLLM_SHARED = ["response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs", "priority", "request_id",
               "logits_processors", "return_tokens_as_token_ids", "return_token_ids", "cache_salt",
               "kv_transfer_params", "vllm_xargs", "add_special_tokens", "logprob_token_ids"]
VLLM_CHAT = [*VLLM_SAMPLING, *VLLM_SHARED, "bad_words", "echo", "add_generation_prompt", "continue_final_message",
             "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "structural_tag",
             "reasoning_effort", "include_reasoning", "truncation_side"]
VLLM_COMPLETIONS = [*VLLM_SAMPLING, *VLLM_SHARED, "prompt_embeds", "truncation_side"]
# vLLM's ResponsesRequest (vllm/entrypoints/openai/responses/protocol.py): its fields beyond OpenAI's, and
# min_tokens, which benchmark clients send to every endpoint.
VLLM_RESPONSES = ["top_k", "logit_bias", "skip_special_tokens", "include_stop_str_in_output", "request_id",
                  "mm_processor_kwargs", "priority", "cache_salt", "enable_response_messages",
                  "previous_input_messages", "previous_response", "structured_outputs", "repetition_penalty", "seed",
                  "stop", "ignore_eos", "vllm_xargs", "min_tokens"]
# vLLM's AnthropicMessagesRequest (vllm/entrypoints/anthropic/protocol.py): its extras, and ignore_eos,
# which vLLM's benchmark clients send.
VLLM_MESSAGES = ["kv_transfer_params", "chat_template_kwargs", "ignore_eos"]


def client_fields(module) -> set[str]:
    """Every key of the request TypedDicts a client module defines (streaming and not)."""
    fields = set()
    for name, value in vars(module).items():
        if is_typeddict(value) and name.endswith(("Params", "ParamsStreaming", "ParamsNonStreaming")):
            fields |= value.__required_keys__ | value.__optional_keys__
    return fields


def beta_fields(module) -> set[str]:
    """client_fields of an anthropic beta module's own request TypedDicts (not the ones it imports), less
    `betas`, which the client sends as the anthropic-beta header."""
    own = {name: value for name, value in vars(module).items() if getattr(value, "__module__", None) == module.__name__}
    return client_fields(type("own", (), own)) - {"betas"}


ENDPOINTS = {  # kind in request_fields.py: (the body's model, the fields clients send)
    "chat": (ChatCompletionRequest, client_fields(openai_chat) | set(VLLM_CHAT)),
    "completions": (CompletionRequest, client_fields(openai_completions) | set(VLLM_COMPLETIONS)),
    "responses": (ResponsesRequest, client_fields(openai_responses) | set(VLLM_RESPONSES)),
    "messages": (MessagesRequest, client_fields(anthropic_messages) | beta_fields(anthropic_beta_messages)
                 | {"temperature", "top_p", "top_k", "stream"} | set(VLLM_MESSAGES)),
    "count_tokens": (MessagesCountTokensRequest, client_fields(anthropic_count_tokens)
                     | beta_fields(anthropic_beta_count_tokens) | {"chat_template_kwargs"}),
}
TABLES = {"count_tokens": "messages"}  # count_tokens takes the messages endpoint's tables


def classes(kind: str, field: str) -> list[str]:
    """What the tables and the body's model make of a field: exactly one of the three, if all is well."""
    model, _ = ENDPOINTS[kind]
    table = TABLES.get(kind, kind)
    return [name for name, holds in (("refused", field in REFUSED[table]),
                                     ("no effect", field in NO_EFFECT[table]),
                                     ("implemented", field in model.model_fields and field not in NO_EFFECT[table]))
            if holds]


def walk(wanted: str) -> list[tuple[str, str]]:
    return sorted((kind, field) for kind, (_, fields) in ENDPOINTS.items() for field in fields
                  if classes(kind, field) == [wanted])


@pytest.mark.parametrize("kind", sorted(ENDPOINTS))
def test_every_field_a_client_sends_is_implemented_refused_or_without_effect(kind):
    _, fields = ENDPOINTS[kind]
    assert len(fields) > 5  # the client's types were read
    unclear = {field: classes(kind, field) for field in fields if len(classes(kind, field)) != 1}
    assert unclear == {}, "each field must be exactly one of implemented, refused, without effect"


# ---- against a real server ----------------------------------------------------------------

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Beautiful is better than ugly"}],
        "max_tokens": 8, "temperature": 0}
COMPLETION = {"model": MODEL, "prompt": "Beautiful is better than ugly", "max_tokens": 8, "temperature": 0}
MESSAGES = {"model": MODEL, "messages": [{"role": "user", "content": "Beautiful is better than ugly"}],
            "max_tokens": 8, "temperature": 0}
BODIES = {"chat": ("/v1/chat/completions", CHAT), "completions": ("/v1/completions", COMPLETION),
          "responses": ("/v1/responses", {"model": MODEL, "input": "Beautiful", "max_output_tokens": 8,
                                          "temperature": 0}),
          "messages": ("/v1/messages", MESSAGES),
          "count_tokens": ("/v1/messages/count_tokens", {"model": MODEL, "messages": MESSAGES["messages"]})}
# A value that asks for something, where the generic one would not read as what a client sends.
ASKING = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "tool_choice": "required", "response_format": {"type": "json_object"}, "best_of": 2,
    "thinking": {"type": "enabled", "budget_tokens": 1024}, "modalities": ["text", "audio"],
    "echo": True, "use_beam_search": True, "length_penalty": 0.5, "include_reasoning": False,
    "spaces_between_special_tokens": False, "add_special_tokens": True, "parallel_tool_calls": True,
    "background": True, "top_logprobs": 2, "suffix": "end",
    "reasoning": {"effort": "low", "summary": "detailed"}, "include": ["message.output_text.logprobs"],
}
# What a client typically sends in each field without effect.
TYPICAL = {"metadata": {"user_id": "u-1"}, "store": True, "service_tier": "auto", "safety_identifier": "s-1",
           "prompt_cache_key": "k-1", "prompt_cache_retention": "24h", "prompt_cache_options": {},
           "request_id": "r-1", "user": "u-1", "cache_control": {"type": "ephemeral"}, "inference_geo": "us",
           "speed": "standard", "diagnostics": {}, "user_profile_id": "p-1", "workspace_id": "w-1",
           "truncation": "auto", "billing_policy": {"type": "billing_policy", "bill_to": "self"},
           "fallback_credit_token": "t-1", "fallbacks": "default"}


def post(server, kind: str, **changes) -> httpx.Response:
    path, body = BODIES[kind]
    if kind == "completions" and changes.get("add_special_tokens") is True:
        changes["add_special_tokens"] = False  # True is completions' own default
    if kind == "responses" and "max_tokens" in changes:  # the checks written for chat, in the Responses API's name
        changes.setdefault("max_output_tokens", changes.pop("max_tokens"))
    return httpx.post(f"{server.url}{path}", json={**body, **changes}, timeout=60)


@pytest.mark.server
@pytest.mark.parametrize("kind, field", walk("refused"))
def test_a_refused_field_that_asks_for_something_is_400_naming_it(server, kind, field):
    response = post(server, kind, **{field: ASKING.get(field, {"asks": "something"})})
    assert response.status_code == 400, response.text
    if kind in ("messages", "count_tokens"):  # Anthropic's error body has no param: the message names it
        assert response.json()["error"]["message"].startswith(f"{field}: is not supported")
    else:
        assert response.json()["error"]["param"] == field


@pytest.mark.server
@pytest.mark.parametrize("kind, field", walk("no effect"))
def test_a_field_without_effect_leaves_the_output_as_it_was(server, kind, field):
    plain, given = post(server, kind), post(server, kind, **{field: TYPICAL[field]})
    assert given.status_code == plain.status_code == 200, given.text
    assert output(kind, plain.json()) == output(kind, given.json())


def output(kind: str, answer: dict):
    """What a request produced: its text (and tokens counted), not its ids, times or prefix-cache hits."""
    if kind == "count_tokens":
        return answer["input_tokens"]
    return answer_text(kind, answer), num_prompt(answer), num_generated(answer)


# ---- implemented fields change the output as documented -----------------------------------


def answer_text(kind: str, answer: dict) -> str:
    if kind == "chat":
        return answer["choices"][0]["message"]["content"]
    if kind == "completions":
        return answer["choices"][0]["text"]
    if kind == "messages":
        return answer["content"][0]["text"]
    return answer["output"][0]["content"][0]["text"]


def ok(server, kind: str, **changes) -> dict:
    response = post(server, kind, **changes)
    assert response.status_code == 200, response.text
    return response.json()


def text(server, kind: str, **changes) -> str:
    return answer_text(kind, ok(server, kind, **changes))


def num_generated(answer: dict) -> int:
    usage = answer["usage"]
    return usage.get("completion_tokens", usage.get("output_tokens"))


def num_prompt(answer: dict) -> int:
    usage = answer.get("usage", answer)
    return usage.get("prompt_tokens", usage.get("input_tokens"))


def token_id(server, text_: str) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text_, "add_special_tokens": False}).json()["tokens"][0]


def eos_id(server) -> int:
    """The id that ends the served model's replies (its generation config's, which the engine stops on)."""
    with open(f"{shared_server.model_folder()}/generation_config.json") as config:
        eos = json.load(config)["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


def stop_in_greedy_text(server, kind: str) -> tuple[str, str]:
    greedy = text(server, kind, max_tokens=16, ignore_eos=True)
    stop = greedy[3:6]
    assert stop.strip(), greedy
    return greedy, stop


def streamed(server, kind: str, **changes) -> list[dict]:
    response = post(server, kind, stream=True, **changes)
    assert response.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def check_differs(**changes):
    def check(server, kind):
        assert text(server, kind, **changes) != text(server, kind)
    return check


def check_greedy_again(**changes):
    """A sampling filter so narrow that only the most likely token is left: greedy output, however hot."""
    def check(server, kind):
        hot = {"temperature": 2.0, "seed": 0} if kind in ("chat", "completions") else {"temperature": 1.0}
        assert text(server, kind, **hot, **changes) == text(server, kind)
        if "seed" in hot:
            assert text(server, kind, **hot) != text(server, kind)  # without the filter it is not
    return check


def check_penalty(field):
    """Twenty tokens boosted alike: the model repeats its favourites, unless repeats are penalized."""
    def check(server, kind):
        favourites = list(dict.fromkeys(httpx.post(f"{server.url}/tokenize", json={
            "prompt": "Flat is better than nested. Sparse is better than dense. Readability counts.",
            "add_special_tokens": False}).json()["tokens"]))[:20]
        boosted = {"max_tokens": 16, "logit_bias": {str(t): 100 for t in favourites}}
        logprobs = {"logprobs": True} if kind == "chat" else {"logprobs": 0}

        def distinct(**changes) -> int:
            answer = ok(server, kind, **boosted, **logprobs, **changes)["choices"][0]["logprobs"]
            return len(set(answer["tokens"] if kind == "completions" else [p["token"] for p in answer["content"]]))

        assert distinct(**{field: 2.0}) > distinct()
    return check


def check_sampling_varies(server, kind):
    greedy = text(server, kind)
    assert any(text(server, kind, temperature=1.0) != greedy for _ in range(4))


def check_seed(server, kind):
    one = [text(server, kind, temperature=1.0, seed=1) for _ in range(2)]
    assert one[0] == one[1] != text(server, kind, temperature=1.0, seed=2)


def check_logit_bias(server, kind):
    forced = token_id(server, " is")
    answer = ok(server, kind, logit_bias={str(forced): 100}, ignore_eos=True)
    expected = httpx.post(f"{server.url}/detokenize", json={"tokens": [forced] * 8}).json()["prompt"]
    assert answer_text(kind, answer) == expected


def check_allowed_token_ids(server, kind):
    """One token allowed: it is all the reply, however hot the sampling."""
    forced = token_id(server, " is")
    answer = ok(server, kind, allowed_token_ids=[forced], temperature=2.0, seed=0)
    expected = httpx.post(f"{server.url}/detokenize", json={"tokens": [forced] * 8}).json()["prompt"]
    assert answer_text(kind, answer) == expected


def check_bad_words(server, kind):
    """A token forced by logit_bias, named as a bad word: banned all the same."""
    forced = {"logit_bias": {str(token_id(server, " is")): 100}, "ignore_eos": True}
    expected = httpx.post(f"{server.url}/detokenize", json={"tokens": [token_id(server, " is")] * 8}).json()["prompt"]
    assert text(server, kind, **forced) == expected != text(server, kind, **forced, bad_words=["is"])


def check_logprobs(server, kind):
    if kind == "chat":
        answer = ok(server, kind, logprobs=True, top_logprobs=2)
        content = answer["choices"][0]["logprobs"]["content"]
        assert len(content) == num_generated(answer) and all(len(p["top_logprobs"]) == 2 for p in content)
    else:
        answer = ok(server, kind, logprobs=2)
        logprobs = answer["choices"][0]["logprobs"]
        assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == num_generated(answer)
        # The sampled token and the 2 most likely (fewer keys where two tokens read the same).
        assert all(token in top and len(top) <= 3 for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]))


def check_top_logprobs(server, kind):
    content = ok(server, kind, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(position["top_logprobs"]) == 3 for position in content)


def check_max_tokens(field):
    def check(server, kind):
        changes = {"max_tokens": None} if field != "max_tokens" else {}
        answer = ok(server, kind, **changes, **{field: 3}, **({"ignore_eos": True} if kind != "messages" else {}))
        assert num_generated(answer) == 3
    return check


def check_n(server, kind):
    assert len(ok(server, kind, n=3, temperature=1.0)["choices"]) == 3


def check_stop(field, include=False):
    def check(server, kind):
        greedy, stop = stop_in_greedy_text(server, kind)
        extra = {"include_stop_str_in_output": True} if include else {}
        cut = greedy.index(stop) + (len(stop) if include else 0)
        assert text(server, kind, max_tokens=16, ignore_eos=True, **{field: [stop]}, **extra) == greedy[:cut]
    return check


def check_messages_stop(server, kind):
    greedy = text(server, kind, max_tokens=16)
    stop = greedy[3:6]
    assert text(server, kind, max_tokens=16, stop_sequences=[stop]) == greedy[:greedy.index(stop)]


def check_stream(server, kind):
    if kind in ("chat", "completions"):
        chunks = streamed(server, kind)
        pieces = [c["choices"][0]["delta"].get("content", "") if kind == "chat" else c["choices"][0]["text"]
                  for c in chunks if c["choices"]]
        assert "".join(pieces) == text(server, kind)
    else:
        response = post(server, kind, stream=True)
        assert response.headers["content-type"].startswith("text/event-stream") and "event: " in response.text


def check_stream_options(server, kind):
    usages = [c["usage"] for c in streamed(server, kind, stream_options={"include_usage": True}) if c.get("usage")]
    assert [u["completion_tokens"] for u in usages] == [8]


def check_model(server, kind):
    assert post(server, kind, model="no-such-model").status_code == 404


def check_prompt_changes_prompt_tokens(field, value):
    def check(server, kind):
        assert num_prompt(ok(server, kind, **{field: value})) != num_prompt(ok(server, kind))
    return check


def check_more_prompt(field, value):
    def check(server, kind):
        assert num_prompt(ok(server, kind, **{field: value})) > num_prompt(ok(server, kind))
    return check


def check_ignore_eos(server, kind):
    eos = {"logit_bias": {str(eos_id(server)): 100}}
    stopped, ignored = ok(server, kind, **eos), ok(server, kind, **eos, ignore_eos=True)
    assert (num_generated(stopped), stopped["choices"][0]["finish_reason"]) == (1, "stop")
    assert (num_generated(ignored), ignored["choices"][0]["finish_reason"]) == (8, "length")


def check_min_tokens(server, kind):
    answer = ok(server, kind, logit_bias={str(eos_id(server)): 100}, min_tokens=3)
    assert (num_generated(answer), answer["choices"][0]["finish_reason"]) == (4, "stop")


def check_stop_token_ids(server, kind):
    forced = token_id(server, " is")
    choice = ok(server, kind, logit_bias={str(forced): 100}, stop_token_ids=[forced])["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", forced)


def check_skip_special_tokens(server, kind):
    eos_text = httpx.post(f"{server.url}/detokenize", json={"tokens": [eos_id(server)]}).json()["prompt"]
    forced = {"logit_bias": {str(eos_id(server)): 100}, "ignore_eos": True, "max_tokens": 2}
    assert eos_text in text(server, kind, **forced, skip_special_tokens=False)
    assert eos_text not in text(server, kind, **forced)


def check_prompt_logprobs(server, kind):
    answer = ok(server, kind, prompt_logprobs=1)
    positions = answer["prompt_logprobs"] if kind == "chat" else answer["choices"][0]["prompt_logprobs"]
    assert len(positions) == num_prompt(answer) and positions[0] is None


def check_priority(server, kind):
    response = post(server, kind, priority=1)  # the shared server schedules FCFS
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"


def check_kv_transfer_params(server, kind):
    response = post(server, kind, kv_transfer_params={"do_remote_decode": True})  # no --kv-transfer-config there
    assert response.status_code == 400 and response.json()["error"]["param"] == "kv_transfer_params"


def check_add_generation_prompt(server, kind):
    assert num_prompt(ok(server, kind, add_generation_prompt=False)) < num_prompt(ok(server, kind))


def check_continue_final_message(server, kind):
    messages = [*CHAT["messages"], {"role": "assistant", "content": "Explicit"}]
    closed = ok(server, kind, messages=messages, add_generation_prompt=False)
    continued = ok(server, kind, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert num_prompt(continued) < num_prompt(closed)


def check_chat_template_kwargs(server, kind):
    # A template that reads a variable (enable_thinking) is tested in test_api_fields.py; here, that they
    # reach the renderer, which refuses the arguments that are its own.
    response = post(server, kind, chat_template_kwargs={"add_generation_prompt": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


def check_reasoning_fields(field: str, value):
    """reasoning_effort, include_reasoning (chat) and reasoning (Responses) take effect with --reasoning-parser,
    checked against a server that has one in test_reasoning.py; this server has none: no reasoning is read out
    of the answer, and the field changes nothing, as in vLLM without a parser. A summary is refused (none is made)."""
    def check(server, kind):
        assert output(kind, ok(server, kind, **{field: value})) == output(kind, ok(server, kind))
        if field == "reasoning":
            refused = post(server, kind, reasoning={"effort": "low", "summary": "detailed"})
            assert refused.status_code == 400 and "reasoning" in refused.json()["error"]["param"]
    return check


def check_echo(server, kind):
    if kind == "chat":  # vLLM's chat echo: the continued assistant message comes before the reply
        messages = [*CHAT["messages"], {"role": "assistant", "content": "Explicit"}]
        fields = dict(messages=messages, add_generation_prompt=False, continue_final_message=True, temperature=0)
        assert text(server, kind, echo=True, **fields) == "Explicit" + text(server, kind, **fields)
        return
    assert text(server, kind, echo=True).startswith(COMPLETION["prompt"])


def check_request_id(server, kind):
    """vLLM's: the answer's id is the request's, after chat's "chatcmpl-" or completions' "cmpl-"."""
    assert ok(server, kind, request_id="r-1")["id"] == {"chat": "chatcmpl-r-1", "completions": "cmpl-r-1"}[kind]


def check_return_tokens_as_token_ids(server, kind):
    logprobs = {"logprobs": True, "top_logprobs": 1} if kind == "chat" else {"logprobs": 1}
    answer = ok(server, kind, return_tokens_as_token_ids=True, **logprobs)["choices"][0]["logprobs"]
    tokens = [entry["token"] for entry in answer["content"]] if kind == "chat" else answer["tokens"]
    assert tokens and all(token.startswith("token_id:") for token in tokens)


def check_store(server, kind):
    kept, unkept = ok(server, kind, store=True), ok(server, kind, store=False)
    assert httpx.get(f"{server.url}/v1/responses/{kept['id']}").status_code == 200
    assert httpx.get(f"{server.url}/v1/responses/{unkept['id']}").status_code == 404


def check_previous_response_id(server, kind):
    first = ok(server, kind)
    assert num_prompt(ok(server, kind, previous_response_id=first["id"])) > num_prompt(first)


def check_count_messages(server, kind):
    other = [{"role": "user", "content": "Flat is better than nested, sparse is better than dense"}]
    assert ok(server, kind, messages=other)["input_tokens"] != ok(server, kind)["input_tokens"]


ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}
OTHER_TOOL = {"type": "function", "function": {"name": "get_date", "parameters": ZONE}}
ANTHROPIC_TOOL = {"name": "get_time", "input_schema": ZONE}


RESPONSES_TOOL = {"type": "function", "name": "get_time", "parameters": ZONE}  # the Responses API's flat shape
RESPONSES_OTHER_TOOL = {**RESPONSES_TOOL, "name": "get_date"}


def check_tools(server, kind):
    """Tools are shown to the chat template: a longer prompt (tool_choice "none": the reply is text)."""
    if kind == "chat":
        assert num_prompt(ok(server, kind, tools=[TOOL], tool_choice="none")) > num_prompt(ok(server, kind))
    elif kind == "responses":
        assert num_prompt(ok(server, kind, tools=[RESPONSES_TOOL], tool_choice="none")) > num_prompt(ok(server, kind))
    elif kind == "messages":
        given = ok(server, kind, tools=[ANTHROPIC_TOOL], tool_choice={"type": "none"})
        assert num_prompt(given) > num_prompt(ok(server, kind))
    else:
        assert ok(server, kind, tools=[ANTHROPIC_TOOL])["input_tokens"] > ok(server, kind)["input_tokens"]


def check_tool_choice(server, kind):
    """A required call is constrained to the tools' schemas, so even this model makes one."""
    if kind == "chat":
        choice = ok(server, kind, tools=[TOOL], tool_choice="required", max_tokens=100)["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"][0]["function"]["name"] \
            == "get_time"
    elif kind == "responses":
        calls = ok(server, kind, tools=[RESPONSES_TOOL], tool_choice="required", max_output_tokens=100)["output"]
        assert calls and {(call["type"], call["name"]) for call in calls} == {("function_call", "get_time")}
    elif kind == "messages":
        answer = ok(server, kind, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"}, max_tokens=100)
        assert answer["stop_reason"] == "tool_use" and answer["content"][0]["name"] == "get_time"
    else:  # the prompt is the same whichever tool is chosen; one that is not there is refused
        counted = ok(server, kind, tools=[ANTHROPIC_TOOL])["input_tokens"]
        assert ok(server, kind, tools=[ANTHROPIC_TOOL], tool_choice={"type": "any"})["input_tokens"] == counted
        assert post(server, kind, tools=[ANTHROPIC_TOOL], tool_choice={"type": "tool", "name": "nope"}).status_code \
            == 400


def check_parallel_tool_calls(server, kind):
    if kind == "responses":
        answer = ok(server, kind, tools=[RESPONSES_TOOL, RESPONSES_OTHER_TOOL], tool_choice="required",
                    parallel_tool_calls=False, max_output_tokens=100)
        assert [item["type"] for item in answer["output"]] == ["function_call"]
        return
    answer = ok(server, kind, tools=[TOOL, OTHER_TOOL], tool_choice="required", parallel_tool_calls=False,
                max_tokens=100)
    assert len(answer["choices"][0]["message"]["tool_calls"]) == 1


def check_text_format(server, kind):
    text_format = {"format": {"type": "json_schema", "name": "zone", "schema": ZONE}}
    assert json.loads(text(server, kind, text=text_format, max_output_tokens=60)) in ({"zone": "UTC"},
                                                                                      {"zone": "CET"})


def check_responses_ignore_eos(server, kind):
    eos = {"logit_bias": {str(eos_id(server)): 100}}
    stopped, ignored = ok(server, kind, **eos), ok(server, kind, **eos, ignore_eos=True)
    assert (num_generated(stopped), stopped["status"]) == (1, "completed")
    assert (num_generated(ignored), ignored["status"], ignored["incomplete_details"]) == (
        8, "incomplete", {"reason": "max_output_tokens"})


def check_responses_min_tokens(server, kind):
    answer = ok(server, kind, logit_bias={str(eos_id(server)): 100}, min_tokens=3)
    assert (num_generated(answer), answer["status"]) == (4, "completed")


def check_responses_repetition_penalty(server, kind):
    """Twenty tokens boosted alike: the model repeats its favourites, unless repeats are penalized."""
    favourites = list(dict.fromkeys(httpx.post(f"{server.url}/tokenize", json={
        "prompt": "Flat is better than nested. Sparse is better than dense. Readability counts.",
        "add_special_tokens": False}).json()["tokens"]))[:20]
    boosted = {"max_output_tokens": 16, "logit_bias": {str(t): 100 for t in favourites}}

    def distinct(**changes) -> int:  # the reply's distinct tokens, as it tokenizes again
        reply = text(server, kind, **boosted, **changes)
        return len(set(httpx.post(f"{server.url}/tokenize", json={"prompt": reply, "add_special_tokens": False})
                       .json()["tokens"]))

    assert distinct(repetition_penalty=2.0) > distinct()


def check_max_tool_calls(server, kind):
    """With "," favoured after each call, a required tool_choice goes on calling; the bound closes the list."""
    calling = {"tools": [RESPONSES_TOOL, RESPONSES_OTHER_TOOL], "tool_choice": "required", "max_output_tokens": 200,
               "logit_bias": {str(token_id(server, ",")): 100}}

    def calls(answer: dict) -> list[dict]:
        return [item for item in answer["output"] if item["type"] == "function_call"]

    assert len(calls(ok(server, kind, **calling))) > 2
    bounded = ok(server, kind, **calling, max_tool_calls=2)
    assert (len(calls(bounded)), bounded["status"], bounded["max_tool_calls"]) == (2, "completed", 2)


def check_messages_ignore_eos(server, kind):
    """A reply its grammar has ended (only EOS may follow) goes on to max_tokens."""
    config = {"format": {"type": "json_schema", "schema": {"enum": ["a"]}}}
    ended, ignored = ok(server, kind, output_config=config), ok(server, kind, output_config=config, ignore_eos=True)
    assert (ended["stop_reason"], ignored["stop_reason"], num_generated(ignored)) == ("end_turn", "max_tokens", 8)
    assert answer_text(kind, ignored) == answer_text(kind, ended)  # the EOS tokens after it are not text


def check_messages_chat_template_kwargs(server, kind):
    # As chat's check: they reach the renderer, which refuses the arguments that are its own.
    response = post(server, kind, chat_template_kwargs={"add_generation_prompt": False})
    assert response.status_code == 400 and "chat_template_kwargs" in response.json()["error"]["message"]
    assert post(server, kind, chat_template_kwargs={"enable_thinking": False}).status_code == 200


def check_output_config(server, kind):
    """The reply follows the schema; the prompt, and so the count, is the same."""
    config = {"format": {"type": "json_schema", "schema": ZONE}}
    if kind == "count_tokens":
        assert ok(server, kind, output_config=config)["input_tokens"] == ok(server, kind)["input_tokens"]
        assert post(server, kind, output_config={"format": {"type": "xml"}}).status_code == 400
        return
    assert json.loads(text(server, kind, output_config=config, max_tokens=60)) in ({"zone": "UTC"}, {"zone": "CET"})


def check_response_format(server, kind):
    schema = {"type": "json_schema", "json_schema": {"name": "zone", "schema": ZONE}}
    assert json.loads(text(server, kind, response_format=schema, max_tokens=60)) in ({"zone": "UTC"}, {"zone": "CET"})


def check_return_token_ids(server, kind):
    answer = ok(server, kind, return_token_ids=True)
    prompt_ids = answer["prompt_token_ids"] if kind == "chat" else answer["choices"][0]["prompt_token_ids"]
    assert len(prompt_ids) == num_prompt(answer) and len(answer["choices"][0]["token_ids"]) == num_generated(answer)


def check_logprob_token_ids(server, kind):
    asked = [token_id(server, " is"), token_id(server, ",")]
    answer = ok(server, kind, **({"logprobs": True} if kind == "chat" else {"logprobs": 1}), logprob_token_ids=asked)
    logprobs = answer["choices"][0]["logprobs"]
    tops = [p["top_logprobs"] for p in logprobs["content"]] if kind == "chat" else logprobs["top_logprobs"]
    assert tops and all(len(top) in (2, 3) for top in tops)  # the sampled token and the two asked


def check_responses_include(server, kind):
    [part] = ok(server, kind, include=["message.output_text.logprobs"])["output"][0]["content"]
    assert part["logprobs"] and all(entry["top_logprobs"] == [] for entry in part["logprobs"])
    assert ok(server, kind)["output"][0]["content"][0]["logprobs"] == []


def check_responses_top_logprobs(server, kind):
    [part] = ok(server, kind, include=["message.output_text.logprobs"], top_logprobs=3)["output"][0]["content"]
    assert part["logprobs"] and all(len(entry["top_logprobs"]) == 3 for entry in part["logprobs"])


def check_enable_response_messages(server, kind):
    answer = ok(server, kind, enable_response_messages=True)
    [given], [made] = answer["input_messages"], answer["output_messages"]
    assert (len(given["tokens"]), len(made["tokens"])) == (num_prompt(answer), num_generated(answer))
    assert "input_messages" not in ok(server, kind)


def check_truncate_prompt_tokens(server, kind):
    assert num_prompt(ok(server, kind, truncate_prompt_tokens=3)) == 3 < num_prompt(ok(server, kind))


def check_truncation_side(server, kind):
    left, right = (text(server, kind, truncate_prompt_tokens=3, truncation_side=side) for side in ("left", "right"))
    assert left == text(server, kind, truncate_prompt_tokens=3) != right


def check_structured_outputs(server, kind):
    assert text(server, kind, structured_outputs={"choice": ["alpha", "beta"]}) in ("alpha", "beta")


def check_prompt_embeds(server, kind):
    """Served only with --enable-prompt-embeds (test_vllm_launch_flags.py's server generates from them); the
    shared server, started without it, says so by name instead of reading the prompt alone."""
    response = post(server, kind, prompt_embeds="AAAA")
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_embeds"
    assert "--enable-prompt-embeds" in response.json()["error"]["message"]


OPENAI_SHARED = {
    "temperature": check_differs(temperature=2.0, seed=0), "seed": check_seed,
    "top_p": check_greedy_again(top_p=1e-9), "top_k": check_greedy_again(top_k=1),
    "min_p": check_greedy_again(min_p=1.0),
    "frequency_penalty": check_penalty("frequency_penalty"), "presence_penalty": check_penalty("presence_penalty"),
    "repetition_penalty": check_penalty("repetition_penalty"),
    "logit_bias": check_logit_bias, "logprobs": check_logprobs, "max_tokens": check_max_tokens("max_tokens"),
    "n": check_n, "stop": check_stop("stop"), "include_stop_str_in_output": check_stop("stop", include=True),
    "stream": check_stream, "stream_options": check_stream_options, "model": check_model,
    "ignore_eos": check_ignore_eos, "min_tokens": check_min_tokens, "stop_token_ids": check_stop_token_ids,
    "skip_special_tokens": check_skip_special_tokens, "prompt_logprobs": check_prompt_logprobs,
    "priority": check_priority, "response_format": check_response_format,
    "structured_outputs": check_structured_outputs, "return_tokens_as_token_ids": check_return_tokens_as_token_ids,
    "allowed_token_ids": check_allowed_token_ids, "request_id": check_request_id,
    "kv_transfer_params": check_kv_transfer_params, "return_token_ids": check_return_token_ids,
    "logprob_token_ids": check_logprob_token_ids,
}
IMPLEMENTED = {
    "chat": {**OPENAI_SHARED, "messages": check_prompt_changes_prompt_tokens("messages", [
        {"role": "user", "content": "Flat is better than nested, sparse is better than dense"}]),
        "max_completion_tokens": check_max_tokens("max_completion_tokens"), "top_logprobs": check_top_logprobs,
        "add_generation_prompt": check_add_generation_prompt, "continue_final_message": check_continue_final_message,
        "chat_template_kwargs": check_chat_template_kwargs, "tools": check_tools, "tool_choice": check_tool_choice,
        "parallel_tool_calls": check_parallel_tool_calls, "echo": check_echo, "bad_words": check_bad_words,
        "reasoning_effort": check_reasoning_fields("reasoning_effort", "low"),
        "include_reasoning": check_reasoning_fields("include_reasoning", False),
        "truncate_prompt_tokens": check_truncate_prompt_tokens, "truncation_side": check_truncation_side},
    "completions": {**OPENAI_SHARED, "echo": check_echo, "truncate_prompt_tokens": check_truncate_prompt_tokens,
                    "truncation_side": check_truncation_side, "prompt_embeds": check_prompt_embeds,
                    "prompt": check_prompt_changes_prompt_tokens("prompt", "Flat is better than nested")},
    "messages": {"model": check_model, "max_tokens": check_max_tokens("max_tokens"),
                 "messages": check_prompt_changes_prompt_tokens("messages", [
                     {"role": "user", "content": "Flat is better than nested, sparse is better than dense"}]),
                 "system": check_more_prompt("system", "Be terse."), "stop_sequences": check_messages_stop,
                 "temperature": check_sampling_varies, "top_p": check_greedy_again(top_p=1e-9),
                 "top_k": check_greedy_again(top_k=1), "stream": check_stream, "tools": check_tools,
                 "tool_choice": check_tool_choice, "output_config": check_output_config,
                 "ignore_eos": check_messages_ignore_eos, "chat_template_kwargs": check_messages_chat_template_kwargs},
    "count_tokens": {"model": check_model, "messages": check_count_messages,
                     "system": check_more_prompt("system", "Be terse."), "tools": check_tools,
                     "tool_choice": check_tool_choice, "output_config": check_output_config,
                     "chat_template_kwargs": check_messages_chat_template_kwargs},
    "responses": {"model": check_model, "input": check_prompt_changes_prompt_tokens("input", "Flat is better"),
                  "instructions": check_more_prompt("instructions", "Be terse."),
                  "max_output_tokens": check_max_tokens("max_output_tokens"), "temperature": check_sampling_varies,
                  "top_p": check_greedy_again(top_p=1e-9), "stream": check_stream, "store": check_store,
                  "previous_response_id": check_previous_response_id, "tools": check_tools,
                  "tool_choice": check_tool_choice, "parallel_tool_calls": check_parallel_tool_calls,
                  "text": check_text_format, "max_tool_calls": check_max_tool_calls,
                  # vLLM's extras, as chat's (the checks written for chat that read only the text) or their own
                  **{name: OPENAI_SHARED[name] for name in (
                      "top_k", "seed", "stop", "include_stop_str_in_output", "logit_bias", "skip_special_tokens",
                      "structured_outputs", "priority")},
                  "ignore_eos": check_responses_ignore_eos, "min_tokens": check_responses_min_tokens,
                  "repetition_penalty": check_responses_repetition_penalty,
                  "include": check_responses_include, "top_logprobs": check_responses_top_logprobs,
                  "enable_response_messages": check_enable_response_messages,
                  "reasoning": check_reasoning_fields("reasoning", {"effort": "low", "summary": "auto"})},
}


def test_every_implemented_field_has_a_behaviour_check():
    assert walk("implemented") == sorted((kind, field) for kind, checks in IMPLEMENTED.items() for field in checks)


@pytest.mark.server
@pytest.mark.parametrize("kind, field", walk("implemented"))
def test_an_implemented_field_changes_the_output_as_documented(server, kind, field):
    IMPLEMENTED[kind][field](server, kind)
