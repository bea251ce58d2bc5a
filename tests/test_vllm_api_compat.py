"""What vLLM's own OpenAI-entrypoint tests expect of a server, through the openai client and httpx.

Logprobs under every kind of constraint (a token the grammar masks out has a logprob of
-inf, answered as vLLM's -9999.0), a server fault answered 500 and counted rather than a
400 that blames the client, `prompt_logprobs: null` when not asked, an empty model name,
chat echo, tokens named by id, custom roles, and -1 logprobs.
"""

import asyncio
import json
import logging
import math

import httpx
import openai
import pytest

from tests.server_checks import sse_lines
from tests.shared_server import MODEL
from tests.tiny_tokenizer import TINY_VOCAB_SIZE

FLOOR = -9999.0
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
           "additionalProperties": False}
# One constraint of each kind, as each endpoint spells it (structured_outputs is vLLM's field).
CONSTRAINTS = {
    "choice": {"structured_outputs": {"choice": ["Python", "Java"]}},
    "regex": {"structured_outputs": {"regex": "(yes|no)[0-9]"}},
    "json": {"structured_outputs": {"json": WEATHER}},
    "grammar": {"structured_outputs": {"grammar": 'root ::= "a" ("b" | "c") "d"'}},
    "json_object": {"response_format": {"type": "json_object"}},
}
MESSAGES = [{"role": "user", "content": "Which language?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def logprob_values(choice: dict, chat: bool) -> list[float]:
    """Every logprob number of a choice's logprobs object (the sampled tokens' and the top ones')."""
    if chat:
        return [v for e in choice["logprobs"]["content"] for v in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))]
    lp = choice["logprobs"]
    return [*lp["token_logprobs"], *(v for top in lp["top_logprobs"] for v in top.values())]


def stream_choices(response: httpx.Response, chat: bool) -> list[dict]:
    """The streamed chunks' choices (each parsed strictly: JSON has no -inf, NaN or Infinity)."""
    choices = []
    for line in sse_lines(response):
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line[6:], parse_constant=lambda name: pytest.fail(f"{name} in a chunk"))
            choices += [c for c in chunk["choices"] if c.get("logprobs")]
    return choices


# ---- 1. logprobs together with every kind of constraint -------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_logprobs_under_every_constraint_are_finite_and_masked_tokens_read_minus_9999(server, kind, endpoint, stream):
    chat = endpoint == "chat"
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": stream, **CONSTRAINTS[kind],
            **({"messages": MESSAGES, "logprobs": True, "top_logprobs": 5} if chat
               else {"prompt": "Which language?", "logprobs": 5})}
    url = f"{server.url}/v1/{'chat/completions' if chat else 'completions'}"
    if stream:
        with httpx.stream("POST", url, json=body, timeout=120) as response:
            assert response.status_code == 200, response.read()
            choices = stream_choices(response, chat)
    else:
        response = httpx.post(url, json=body, timeout=120)
        assert response.status_code == 200, response.text
        choices = json.loads(response.text, parse_constant=lambda name: pytest.fail(f"{name} in the body"))["choices"]
    values = [v for choice in choices for v in logprob_values(choice, chat)]
    assert values and all(math.isfinite(v) and FLOOR <= v <= 0 for v in values)
    # Five alternatives are asked for at each position; the grammar leaves fewer at some, so the others
    # are tokens it masked out: -inf in the engine, vLLM's floor in the answer.
    assert FLOOR in values


# ---- 2. a server fault is a 500, counted, never a 400 ---------------------------------------------------


@pytest.fixture
def app_with_faults():
    """The server's app, its own exception handlers and metrics, with routes that fail in each way."""
    from fastapi.responses import JSONResponse

    from tinyserve.entrypoints.api.metrics import ServerMetrics
    from tinyserve.entrypoints.api.server import build_app
    from tinyserve.entrypoints.api.serving_engine import ServingContext
    from tinyserve.errors import InvalidInputError

    metrics = ServerMetrics(MODEL, [0], 128)
    app = build_app(ServingContext(engine=None, model_names=[MODEL]), metrics)

    @app.get("/broken-serialiser")
    async def broken_serialiser():
        return JSONResponse({"logprob": float("-inf")})  # the JSON encoder refuses it: a ValueError

    @app.get("/bad-input")
    async def bad_input():
        raise InvalidInputError("stop must be a list of non-empty strings", "stop")

    return app, metrics


def test_a_server_side_value_error_is_a_logged_counted_500_and_bad_input_a_400(app_with_faults, caplog):
    app, metrics = app_with_faults

    async def get_both():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://server") as http:
            with caplog.at_level(logging.ERROR, logger="tinyserve.api"):
                broken = await http.get("/broken-serialiser")
            return broken, await http.get("/bad-input")

    broken, bad = asyncio.run(get_both())
    assert broken.status_code == 500
    assert broken.json()["error"]["type"] == "server_error" and "Out of range" not in broken.text
    assert any("/broken-serialiser" in r.getMessage() and r.exc_info for r in caplog.records)
    assert bad.status_code == 400
    assert bad.json()["error"] == {"message": "stop must be a list of non-empty strings",
                                   "type": "invalid_request_error", "param": "stop", "code": 400}
    text = metrics.render().decode()
    assert 'tinyserve:server_errors_total{path="/broken-serialiser"} 1.0' in text
    assert 'path="/bad-input"' not in text


# ---- 4, 5, 8: fields vLLM always sends, the empty model name, custom roles ------------------------------


@pytest.mark.server
def test_prompt_logprobs_is_null_when_not_asked_and_there_when_asked(server):
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2}).json()
    completion = httpx.post(f"{server.url}/v1/completions", timeout=60,
                            json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2}).json()
    assert "prompt_logprobs" in chat and chat["prompt_logprobs"] is None
    assert "prompt_logprobs" in completion["choices"][0] and completion["choices"][0]["prompt_logprobs"] is None
    asked = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "prompt_logprobs": 1}).json()
    positions = asked["choices"][0]["prompt_logprobs"]
    assert positions[0] is None and all(isinstance(p, dict) and p for p in positions[1:])


@pytest.mark.server
def test_an_empty_model_name_is_the_served_model(client):
    chat = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=2)
    completion = client.completions.create(model="", prompt="Hello", max_tokens=2)
    assert chat.model == completion.model == MODEL
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hello", max_tokens=2)


@pytest.mark.server
def test_a_custom_role_goes_to_the_chat_template(server, client):
    messages = [{"role": "narrator", "content": "Once upon a time"}, {"role": "user", "content": "Go on"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    assert response.choices[0].message.content
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60).json()
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": rendered["tokens"]}, timeout=60).json()["prompt"]
    assert "narrator" in text and "Once upon a time" in text
    empty = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": [{"role": "", "content": "x"}], "max_tokens": 2})
    assert empty.status_code == 400 and "role" in empty.text


# ---- 6. chat echo ---------------------------------------------------------------------------------------


@pytest.mark.server
def test_chat_echo_puts_the_continued_message_before_the_reply(client):
    messages = [*MESSAGES, {"role": "assistant", "content": "I would pick"}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, n=2,
                  extra_body={"add_generation_prompt": False, "continue_final_message": True})
    plain = client.chat.completions.create(**kwargs)
    echoed = client.chat.completions.create(**kwargs | {"extra_body": kwargs["extra_body"] | {"echo": True}})
    assert [c.message.content for c in echoed.choices] == ["I would pick" + c.message.content for c in plain.choices]
    assert echoed.usage == plain.usage  # the echoed text is not generated
    chunks = list(client.chat.completions.create(stream=True, **kwargs | {"extra_body": kwargs["extra_body"] | {"echo": True}}))
    for choice in plain.choices:
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == choice.index)
        assert text == "I would pick" + choice.message.content
    # A generation prompt opens the assistant's turn: a user message is not the answer's, nothing is echoed.
    opened = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                            extra_body={"echo": True})
    assert opened.choices[0].message.content == client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0).choices[0].message.content


# ---- 7. return_tokens_as_token_ids ----------------------------------------------------------------------


@pytest.mark.server
def test_return_tokens_as_token_ids_names_every_logprob_token_by_its_id(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    entries = chat.choices[0].logprobs.content
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    assert all(e.token.startswith("token_id:") and e.bytes == list(e.token.encode()) for e in entries)
    assert all(t.token.startswith("token_id:") for e in entries for t in e.top_logprobs)
    detokenized = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=60).json()["prompt"]
    assert detokenized == chat.choices[0].message.content  # the ids are the answer's own tokens
    completion = client.completions.create(model=MODEL, prompt="Now is better", max_tokens=5, temperature=0,
                                           logprobs=1, extra_body={"return_tokens_as_token_ids": True})
    lp = completion.choices[0].logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    assert all(top[token] == value for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]  # vLLM counts so
    plain = client.completions.create(model=MODEL, prompt="Now is better", max_tokens=5, temperature=0, logprobs=1,
                                      extra_body={"return_tokens_as_token_ids": False})
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


# ---- 12. -1 logprobs: the whole vocabulary, where --max-logprobs allows it ------------------------------


@pytest.mark.server
def test_minus_one_logprobs_beyond_max_logprobs_is_a_400_naming_the_field(server):
    for endpoint, body in (("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}),
                           ("completions", {"prompt": "Hello", "logprobs": -1})):
        response = httpx.post(f"{server.url}/v1/{endpoint}", json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
        assert response.status_code == 400, response.text
        assert "whole vocabulary" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == ("top_logprobs" if endpoint.startswith("chat") else "logprobs")
    too_negative = httpx.post(f"{server.url}/v1/completions", timeout=60,
                              json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "logprobs": -2})
    assert too_negative.status_code == 400


def test_minus_one_logprobs_are_the_whole_vocabulary_with_max_logprobs_minus_one():
    from tests.tiny_checkpoints import tiny_model_with_tokenizer
    from tinyserve import LLM, SamplingParams

    llm = LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=32, max_logprobs=-1)
    [output] = llm.generate(["Hello"], SamplingParams(max_tokens=2, temperature=0, logprobs=-1, prompt_logprobs=-1),
                            use_tqdm=False)
    assert all(len(position) == TINY_VOCAB_SIZE for position in output.outputs[0].logprobs)
    assert all(len(position) == TINY_VOCAB_SIZE for position in output.prompt_logprobs[1:])
