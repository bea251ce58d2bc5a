"""vLLM's request fields of its 0.33 entrypoint tests, on the shared server, through the openai client and httpx:

    truncate_prompt_tokens, truncation_side   a long prompt keeps its last (or first) N tokens (-1: the context);
                                              a chat's: of the conversation as the template renders it
    return_token_ids                          prompt_token_ids and each choice's token_ids, streamed too
    logprob_token_ids                         exactly the asked ids' logprobs, beside the sampled token's
    seed                                      any int64
"""

import json

import httpx
import openai
import pytest

from tests.shared_server import MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.server
PROMPT = "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than complex."


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def token_ids(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]


def greedy(client, prompt, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=extra)


# ---- truncate_prompt_tokens ---------------------------------------------------------------


def test_truncation_keeps_the_last_tokens_by_default_and_the_first_on_the_right(server, client):
    ids = token_ids(server, PROMPT)
    assert len(ids) > 10
    left = greedy(client, PROMPT, truncate_prompt_tokens=5)
    assert left.usage.prompt_tokens == 5
    assert left.choices[0].text == greedy(client, ids[-5:]).choices[0].text
    right = greedy(client, PROMPT, truncate_prompt_tokens=5, truncation_side="right")
    assert right.usage.prompt_tokens == 5
    assert right.choices[0].text == greedy(client, ids[:5]).choices[0].text
    # token-id prompts too, and a prompt shorter than N is left as it is
    assert greedy(client, ids, truncate_prompt_tokens=5).choices[0].text == left.choices[0].text
    assert greedy(client, ids, truncate_prompt_tokens=1000).usage.prompt_tokens == len(ids)


def test_truncation_streamed_and_echoed(server, client):
    ids = token_ids(server, PROMPT)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"truncate_prompt_tokens": 5}))
    assert chunks[-1].usage.prompt_tokens == 5
    assert "".join(c.choices[0].text for c in chunks if c.choices) == greedy(client, ids[-5:]).choices[0].text
    # echo gives back what was kept of the prompt
    echoed = greedy(client, PROMPT, truncate_prompt_tokens=5, echo=True).choices[0].text
    kept = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": ids[-5:]}).json()["prompt"]
    assert echoed.startswith(kept) and not echoed.startswith(PROMPT[:10])


def test_truncation_to_the_context_and_beyond_it(server, client):
    long_prompt = " ".join(["flat"] * (MAX_MODEL_LEN + 200))
    assert len(token_ids(server, long_prompt[:20000])) > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError):  # without truncation: too long
        greedy(client, long_prompt)
    # -1: as much as the context takes, a token left for the output; max_tokens capped to it, as vLLM does
    answer = greedy(client, long_prompt, truncate_prompt_tokens=-1)
    assert answer.usage.prompt_tokens == MAX_MODEL_LEN - 1 and answer.usage.completion_tokens <= 1
    with pytest.raises(openai.BadRequestError) as error:
        greedy(client, "hi", truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    assert error.value.body["param"] == "truncate_prompt_tokens"
    assert "cannot be greater than max_model_len" in error.value.body["message"]
    bad_side = httpx.post(f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "hi", "truncate_prompt_tokens": 1, "truncation_side": "up"})
    assert bad_side.status_code == 400 and bad_side.json()["error"]["param"] == "truncation_side"


def rendered_ids(server, messages: list[dict]) -> list[int]:
    """The ids a chat request's prompt has: /tokenize of its messages, rendered as the chat renders them."""
    answer = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    return answer.json()["tokens"]


def chat(client, messages, **extra):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          extra_body=extra)


CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": PROMPT}]


def test_chat_truncation_keeps_the_last_tokens_of_the_rendered_conversation(server, client):
    ids = rendered_ids(server, CHAT)
    assert len(ids) > 10
    left = chat(client, CHAT, truncate_prompt_tokens=5, return_token_ids=True)
    assert left.usage.prompt_tokens == 5 and left.model_extra["prompt_token_ids"] == ids[-5:]
    assert left.choices[0].message.content == greedy(client, ids[-5:]).choices[0].text  # what the engine was given
    right = chat(client, CHAT, truncate_prompt_tokens=5, truncation_side="right", return_token_ids=True)
    assert right.usage.prompt_tokens == 5 and right.model_extra["prompt_token_ids"] == ids[:5]
    assert chat(client, CHAT, truncate_prompt_tokens=1000).usage.prompt_tokens == len(ids)  # shorter: as it is
    # streamed the same
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"truncate_prompt_tokens": 5}))
    assert chunks[-1].usage.prompt_tokens == 5
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == left.choices[0].message.content
    # the request's log line has the ids the engine was given, and no prompt text (what is left of it is its ids)
    [line] = [line for line in server.output().splitlines() if f"Received request {left.id}" in line]
    assert "prompt: None" in line and f"prompt_token_ids: {ids[-5:]} (5 tokens)" in line


def test_chat_truncation_to_the_context_and_beyond_it(server, client):
    long_chat = [{"role": "user", "content": " ".join(["flat"] * (MAX_MODEL_LEN + 200))}]
    ids = rendered_ids(server, long_chat)
    assert len(ids) > MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError):  # without truncation: too long
        chat(client, long_chat)
    # -1: as much as the context takes, a token left for the output; max_tokens capped to it, as vLLM does
    answer = chat(client, long_chat, truncate_prompt_tokens=-1, return_token_ids=True)
    assert answer.usage.prompt_tokens == MAX_MODEL_LEN - 1 and answer.usage.completion_tokens <= 1
    assert answer.model_extra["prompt_token_ids"] == ids[-(MAX_MODEL_LEN - 1):]
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, CHAT, truncate_prompt_tokens=MAX_MODEL_LEN + 1)
    assert error.value.body["param"] == "truncate_prompt_tokens"
    assert error.value.body["message"] == (f"truncate_prompt_tokens={MAX_MODEL_LEN + 1} cannot be greater than "
                                           f"max_model_len = {MAX_MODEL_LEN}. Please request a smaller "
                                           "truncation size.")
    bad_side = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL, "messages": CHAT, "truncate_prompt_tokens": 1, "truncation_side": "up"})
    assert bad_side.status_code == 400 and bad_side.json()["error"]["param"] == "truncation_side"


# ---- return_token_ids ------------------------------------------------------------------------


def test_completions_return_token_ids(server, client):
    ids = token_ids(server, PROMPT)
    answer = greedy(client, [PROMPT, "Flat is"], return_token_ids=True)
    first, second = answer.choices
    assert first.model_extra["prompt_token_ids"] == ids
    assert second.model_extra["prompt_token_ids"] == token_ids(server, "Flat is")
    generated = first.model_extra["token_ids"]
    assert len(generated) == answer.usage.completion_tokens - len(second.model_extra["token_ids"])
    text = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": generated}).json()["prompt"]
    assert text == first.text
    # without it: neither field
    assert "token_ids" not in (greedy(client, PROMPT).choices[0].model_extra or {})
    # streamed: the prompt's ids with each choice's first chunk, each chunk's own tokens with it
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    with_prompt = [c for c in chunks if c.choices[0].model_extra.get("prompt_token_ids")]
    assert with_prompt == chunks[:1] and chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == \
        greedy(client, PROMPT, return_token_ids=True).choices[0].model_extra["token_ids"]


def test_completions_echo_with_token_ids_gives_the_prompt_as_ids_as_vllm(server, client):
    choice = greedy(client, PROMPT, return_token_ids=True, echo=True).choices[0]
    assert choice.model_extra["prompt_token_ids"] == token_ids(server, PROMPT)
    assert choice.text == greedy(client, PROMPT).choices[0].text  # the prompt's text is left out, as in vLLM


def test_chat_return_token_ids(server, client):
    messages = [{"role": "user", "content": "Hello"}]
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2,
                                            extra_body={"return_token_ids": True})
    assert answer.model_extra["prompt_token_ids"] == rendered
    assert sum(len(c.model_extra["token_ids"]) for c in answer.choices) == answer.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == rendered
    streamed = [t for c in chunks[1:] for t in c.choices[0].model_extra["token_ids"]]
    single = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                            extra_body={"return_token_ids": True})
    assert streamed == single.choices[0].model_extra["token_ids"]
    assert "prompt_token_ids" not in (client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2).model_extra or {})


# ---- logprob_token_ids ------------------------------------------------------------------------


def test_logprob_token_ids_gives_exactly_the_asked_tokens(server, client):
    asked = token_ids(server, " is better than")[-3:]
    reference = greedy(client, PROMPT, logprobs=20)  # the same positions' top 20, to compare values with
    answer = greedy(client, PROMPT, logprobs=1, logprob_token_ids=asked)
    assert answer.choices[0].text == reference.choices[0].text
    vocab_text = {t: httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": [t]}).json()["prompt"]
                  for t in asked}
    logprobs = answer.choices[0].logprobs
    for token, top, reference_top in zip(logprobs.tokens, logprobs.top_logprobs, reference.choices[0].logprobs.top_logprobs):
        assert set(top) == {token, *vocab_text.values()}  # the sampled token, then exactly the asked ones
        for key, value in top.items():
            if key in reference_top:
                assert value == pytest.approx(reference_top[key], abs=1e-4)
    # chat: the sampled token first, then the asked ids in the order asked, whatever top_logprobs says
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=5,
                                          extra_body={"logprob_token_ids": asked})
    for position in chat.choices[0].logprobs.content:
        tops = [entry.token for entry in position.top_logprobs]
        assert tops[0] == position.token and tops[1:] == [vocab_text[t] for t in asked if vocab_text[t] != tops[0]] \
            or tops == [position.token, *[vocab_text[t] for t in asked]]
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0, logprobs=True, stream=True,
                                                   extra_body={"logprob_token_ids": asked}))
    positions = [p for c in streamed if c.choices and c.choices[0].logprobs for p in c.choices[0].logprobs.content]
    assert [len(p.top_logprobs) for p in positions] == [len(p.top_logprobs) for p in chat.choices[0].logprobs.content]


def test_logprob_token_ids_needs_logprobs_and_ids_in_the_vocabulary(server):
    for body, param in (({"logprob_token_ids": [5]}, "logprob_token_ids"),
                        ({"logprob_token_ids": [10**9], "logprobs": 1}, "logprob_token_ids"),
                        ({"logprob_token_ids": list(range(129)), "logprobs": 1}, "logprob_token_ids")):
        response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# ---- seeds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 2**63 - 2])
def test_any_int64_seed_is_taken_and_reproducible(server, client, seed):
    def sampled():
        return client.completions.create(model=MODEL, prompt="Flat is", max_tokens=8, temperature=1.0,
                                         seed=seed).choices[0].text

    assert sampled() == sampled()
    chat = [client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                           temperature=1.0, seed=seed).choices[0].message.content for _ in range(2)]
    assert chat[0] == chat[1]
    streamed = client.completions.create(model=MODEL, prompt="Flat is", max_tokens=8, temperature=1.0, seed=seed,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == sampled()


def test_a_seed_beyond_int64_is_a_400_naming_it(server):
    for seed in (2**63, -(2**63) - 1):
        response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed})
        assert response.status_code == 400 and response.json()["error"]["param"] == "seed", response.text
    response = httpx.post(f"{server.url}/v1/responses", timeout=60,
                          json={"model": MODEL, "input": "hi", "max_output_tokens": 2, "seed": 2**63 - 1})
    assert response.status_code == 200, response.text


# ---- error shapes -------------------------------------------------------------------------------


def test_every_bad_logit_bias_key_is_named(server):
    for kind, body in (("completions", {"prompt": "hi"}), ("chat/completions", {"messages": [{"role": "user",
                                                                                             "content": "hi"}]})):
        response = httpx.post(f"{server.url}/v1/{kind}", timeout=60, json={
            "model": MODEL, "max_tokens": 2, **body, "logit_bias": {"abc": 1, "5": 1, "-3": 2, "x y": 1}})
        assert response.status_code == 400 and response.json()["error"]["param"] == "logit_bias"
        message = response.json()["error"]["message"]
        assert all(repr(key) in message for key in ("abc", "-3", "x y")) and "'5'" not in message
        outside = httpx.post(f"{server.url}/v1/{kind}", timeout=60, json={
            "model": MODEL, "max_tokens": 2, **body, "logit_bias": {"99999": 1, "5": 1, "123456": 1}})
        assert outside.status_code == 400 and "99999, 123456" in outside.json()["error"]["message"]


def test_no_prompt_and_empty_prompt_embeds_blames_the_prompt(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=None, max_tokens=5, temperature=0.0,
                                  extra_body={"prompt_embeds": []})
    assert error.value.body["param"] == "prompt"
    assert "Either prompt or prompt_embeds must be provided and non-empty." in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:  # embeddings given to a server without the flag
        client.completions.create(model=MODEL, prompt=None, max_tokens=5, extra_body={"prompt_embeds": ["AAAA"]})
    assert error.value.body["param"] == "prompt_embeds"
    assert "--enable-prompt-embeds" in error.value.body["message"]


# ---- Responses: include message.output_text.logprobs ------------------------------------------


def test_responses_include_logprobs_with_top_logprobs(server, client):
    asked = dict(model=MODEL, input="Hello", max_output_tokens=8, temperature=0,
                 include=["message.output_text.logprobs"], top_logprobs=2)
    answer = client.responses.create(**asked)
    [part] = answer.output[0].content
    assert len(part.logprobs) == answer.usage.output_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    # the same tokens, and logprobs, as chat gives for the same conversation
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    assert [e.token for e in part.logprobs] == [e.token for e in chat.choices[0].logprobs.content]
    assert [e.logprob for e in part.logprobs] == pytest.approx([e.logprob for e in chat.choices[0].logprobs.content],
                                                               abs=1e-4)
    # streamed: each text delta carries its tokens' logprobs; the done event, all of them
    events = list(client.responses.create(**asked, stream=True))
    deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    [done] = [event for event in events if event.type == "response.output_text.done"]
    assert [e.token for e in deltas] == [e.token for e in done.logprobs] == [e.token for e in part.logprobs]
    [completed] = [event for event in events if event.type in ("response.completed", "response.incomplete")]
    assert len(completed.response.output[0].content[0].logprobs) == len(part.logprobs)
    # without include: no logprobs
    assert client.responses.create(model=MODEL, input="Hello", max_output_tokens=4).output[0].content[0].logprobs == []


def test_responses_include_refuses_what_it_cannot_give(server):
    response = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "include": ["message.output_text.nonsense"]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "include", response.text
    never_made = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": "hi", "max_output_tokens": 2, "include": ["reasoning.encrypted_content"]})
    assert never_made.status_code == 200


def test_responses_enable_response_messages_gives_the_raw_input_and_output(server, client):
    answer = client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0,
                                     extra_body={"enable_response_messages": True})
    [given], [made] = answer.model_extra["input_messages"], answer.model_extra["output_messages"]
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": [
        {"role": "user", "content": "Hello"}]}).json()["tokens"]
    assert given["tokens"] == rendered and given["type"] == "raw_message_tokens" and "Hello" in given["message"]
    assert made["message"] == answer.output_text and len(made["tokens"]) == answer.usage.output_tokens
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=6, temperature=0, stream=True,
                                          extra_body={"enable_response_messages": True}))
    final = events[-1].response.model_extra
    assert final["output_messages"][0]["tokens"] == made["tokens"] and final["input_messages"] == [given]
