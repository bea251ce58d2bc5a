"""The endpoints and fields real clients use beyond plain generation, with the real clients on loopback.

/v1/messages/count_tokens, /tokenizer_info (as lm-eval's local-completions reads it),
/v1/models/{id}, echo with max_tokens 0, prompt_logprobs, cached_tokens, priority,
Anthropic's thinking; and, on a server of their own (an API key, a template with a
thinking switch), x-api-key, x-request-id and chat_template_kwargs.
"""

import re
import shutil
import uuid

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests import shared_server
from tests.tiny_tokenizer import tiny_tokenizer_files
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

MODEL = shared_server.MODEL
KEY = "sk-fields-test"
BLOCK_SIZE = 16  # the servers' KV block size (the default)
# Qwen3's switch: with enable_thinking false, the reply opens with an empty thought.
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """A server with --api-key, of a model whose chat template has Qwen3's enable_thinking switch."""
    folder = tmp_path_factory.mktemp("thinking-model")
    shutil.copytree(shared_server.model_folder(), folder, dirs_exist_ok=True)
    tiny_tokenizer_files(folder, chat_template=THINKING_TEMPLATE)
    proc = ServerProcess(str(folder), "--served-model-name", MODEL, "--api-key", KEY, "--num-kv-blocks", "64")
    proc.model_folder = str(folder)
    yield proc
    proc.stop()


def unique_text(words: int) -> str:
    """A prompt no earlier request has sent, so that nothing of it is in the prefix cache."""
    zen = "beautiful is better than ugly explicit implicit simple complex flat nested sparse dense".split()
    salt = uuid.uuid4().int
    return " ".join(zen[(salt >> (4 * i)) % len(zen)] for i in range(words))


# ---- Anthropic: count_tokens, thinking -------------------------------------------


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "The Zen says"}],  # a prefill
])
def test_count_tokens_equals_the_input_tokens_of_the_same_messages(claude, messages):
    counted = claude.messages.count_tokens(model=MODEL, system="Be terse.", messages=messages)
    sent = claude.messages.create(model=MODEL, max_tokens=1, system="Be terse.", messages=messages)
    assert counted.input_tokens == sent.usage.input_tokens > 0


def test_count_tokens_with_tools_equals_the_input_tokens_of_the_same_request(claude):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                  tools=[{"name": "f", "description": "does f", "input_schema": {"type": "object"}}],
                  tool_choice={"type": "any"})  # "auto" would need --enable-auto-tool-choice
    counted = claude.messages.count_tokens(**kwargs)
    assert counted.input_tokens == claude.messages.create(max_tokens=1, **kwargs).usage.input_tokens > 0


def test_anthropic_thinking_is_refused_unless_disabled(claude):
    kwargs = dict(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="thinking"):
        claude.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kwargs)
    assert claude.messages.create(thinking={"type": "disabled"}, **kwargs).usage.output_tokens == 2


# ---- /tokenizer_info and lm-eval's use of it ---------------------------------------


def test_tokenizer_info_gives_what_lm_evals_remote_tokenizer_reads(server):
    # lm-eval's local-completions, given only base_url, calls /tokenizer_info (it wants eos_token)
    # and /tokenize to choose its remote tokenizer (lm_eval.utils.check_remote_tokenizer_support).
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=10).json()
    reference = AutoTokenizer.from_pretrained(shared_server.model_folder())
    assert info["eos_token"] == reference.eos_token and info["bos_token"] == reference.bos_token
    assert info["chat_template"] == reference.chat_template
    assert info["tokenizer_class"]
    tokenize = {"prompt": info["eos_token"], "add_special_tokens": False}
    assert httpx.post(f"{server.url}/tokenize", json=tokenize).json()["tokens"] == [reference.eos_token_id]


def test_lm_evals_loglikelihood_request_scores_the_continuation_as_the_prompt_logprobs_do(server):
    # lm-eval's payload for a multiple-choice answer: context + continuation as token ids, echo,
    # logprobs=1, max_tokens=1; it sums token_logprobs[len(context):-1] (the -1 drops the generated token).
    tokenize = lambda text: httpx.post(f"{server.url}/tokenize", json={  # noqa: E731
        "prompt": text, "add_special_tokens": False}).json()["tokens"]
    context = tokenize("Flat is better than")
    choices = [tokenize(" nested"), tokenize(" sparse and dense")]
    body = {"model": MODEL, "prompt": [context + c for c in choices], "temperature": 0, "max_tokens": 1,
            "logprobs": 1, "seed": 1234, "echo": True}
    answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    scores = [sum(choice["logprobs"]["token_logprobs"][len(context):-1])
              for choice in sorted(answer["choices"], key=lambda c: c["index"])]
    scored = {**body, "max_tokens": 0, "logprobs": None, "prompt_logprobs": 0}
    for index, choice in enumerate(httpx.post(f"{server.url}/v1/completions", json=scored, timeout=60).json()[
            "choices"]):
        tokens = context + choices[index]
        own = [position[str(token)]["logprob"] for token, position in
               zip(tokens[len(context):], choice["prompt_logprobs"][len(context):])]
        assert scores[index] == pytest.approx(sum(own), abs=1e-4)


# ---- /v1/models/{id} ------------------------------------------------------------------


def test_a_model_is_retrieved_by_its_id_and_an_unknown_one_is_404(client):
    [listed] = client.models.list().data
    assert client.models.retrieve(MODEL).model_dump() == listed.model_dump()
    with pytest.raises(openai.NotFoundError, match="gpt-9"):
        client.models.retrieve("gpt-9")


# ---- echo with max_tokens 0, prompt_logprobs --------------------------------------------


def test_echo_with_max_tokens_zero_scores_the_prompt_and_generates_nothing(client):
    prompt = "Readability counts"
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    [choice] = scored.choices
    assert choice.text == prompt and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    generated = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                          temperature=0)
    num_prompt = generated.usage.prompt_tokens
    assert choice.logprobs.token_logprobs == generated.choices[0].logprobs.token_logprobs[:num_prompt]
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == num_prompt


def test_echo_with_max_tokens_zero_streams_the_prompt_alone(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Readability counts", echo=True, max_tokens=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "Readability counts"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_zero_without_echo_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens") as refused:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_completion_prompt_logprobs_score_each_prompt_token_after_the_first(server, client):
    prompt = "Sparse is better than dense"
    answer = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    positions = answer.choices[0].model_extra["prompt_logprobs"]
    assert len(positions) == len(prompt_ids) == answer.usage.prompt_tokens and positions[0] is None
    for token_id, position in zip(prompt_ids[1:], positions[1:]):
        assert str(token_id) in position and 2 <= len(position) <= 3  # the prompt's own token and the top 2
        assert {entry["rank"] for entry in position.values()} >= {1, 2}


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client):
    answer = client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hi"}],
                                            extra_body={"prompt_logprobs": 0})
    positions = answer.model_extra["prompt_logprobs"]
    assert len(positions) == answer.usage.prompt_tokens and positions[0] is None
    assert all(len(position) == 1 for position in positions[1:])  # the prompt's own token alone


def test_prompt_logprobs_with_stream_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    assert refused.value.body["param"] == "prompt_logprobs"


# ---- cached_tokens -------------------------------------------------------------------------


def test_cached_tokens_count_the_prompt_tokens_found_in_the_prefix_cache(client):
    prompt = unique_text(60)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    cached = second.usage.prompt_tokens_details.cached_tokens
    num_prompt = second.usage.prompt_tokens
    assert num_prompt >= 3 * BLOCK_SIZE
    # Full blocks only, and never the last prompt token (its logits must be computed).
    assert cached == (num_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_cached_tokens_are_in_a_streamed_chats_usage(client):
    messages = [{"role": "user", "content": unique_text(60)}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True})
    [first_usage] = [c.usage for c in client.chat.completions.create(**kwargs) if c.usage]
    [second_usage] = [c.usage for c in client.chat.completions.create(**kwargs) if c.usage]
    assert first_usage.prompt_tokens_details.cached_tokens == 0
    full_blocks = (second_usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert second_usage.prompt_tokens_details.cached_tokens == full_blocks


# ---- priority under FCFS ---------------------------------------------------------------------


def test_a_priority_under_fcfs_scheduling_is_400_naming_it(client):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="scheduling-policy") as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={"priority": 3})
    assert refused.value.body["param"] == "priority"
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                          extra_body={"priority": 0}).usage.completion_tokens == 1


# ---- on a server of their own: x-api-key, x-request-id, chat_template_kwargs -------------------


def test_x_api_key_is_accepted_wherever_a_bearer_key_is(keyed_server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for method, path, body in (("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
                               ("POST", "/v1/chat/completions", chat)):
        for headers, status in (({"x-api-key": KEY}, 200), ({"Authorization": f"Bearer {KEY}"}, 200),
                                ({"x-api-key": "sk-wrong"}, 401), ({}, 401)):
            response = httpx.request(method, f"{keyed_server.url}{path}", json=body, headers=headers, timeout=30)
            assert response.status_code == status, (path, headers, response.text)


def test_every_route_that_runs_the_model_or_the_tokenizer_wants_the_key(keyed_server):
    """/pooling and /tokenize answered without the key /v1/embeddings wants (hardening-4, Medium 10): a client
    without it could run the model and the tokenizer. Each such route is a 401 without the key, served with it;
    the routes of load balancers and scrapers stay open."""
    routes = [("POST", "/tokenize", {"model": MODEL, "prompt": "hello"}, 200),
              ("POST", "/detokenize", {"model": MODEL, "tokens": [5, 6]}, 200),
              ("GET", "/tokenizer_info", None, 200),
              ("POST", "/pooling", {"model": MODEL, "input": "hello"}, 400),  # a generating server: --runner, named
              ("POST", "/v1/embeddings", {"model": MODEL, "input": "hello"}, 400),
              ("POST", "/invocations", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, 200)]
    for method, path, body, served in routes:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"x-api-key": "sk-wrong"}):
            refused = httpx.request(method, f"{keyed_server.url}{path}", json=body, headers=headers, timeout=30)
            assert refused.status_code == 401, (path, headers, refused.text)
            assert refused.json()["error"]["message"] == "invalid or missing API key"
        response = httpx.request(method, f"{keyed_server.url}{path}", json=body, headers={"x-api-key": KEY},
                                 timeout=60)
        assert response.status_code == served, (path, response.text)
        assert path != "/pooling" or "--runner" in response.text
    for path in ("/health", "/ping", "/load", "/version", "/metrics"):
        assert httpx.get(f"{keyed_server.url}{path}", timeout=30).status_code == 200, path
    document = httpx.get(f"{keyed_server.url}/openapi.json", timeout=30).json()
    for path in ("/pooling", "/tokenize", "/detokenize", "/tokenizer_info"):
        [operation] = document["paths"][path].values()
        assert "401" in operation["responses"] and operation["security"], path


def test_every_response_carries_the_clients_request_id_or_a_new_one(keyed_server):
    url = f"{keyed_server.url}/v1/models"
    for headers, status in (({"x-api-key": KEY}, 200), ({}, 401)):
        echoed = httpx.get(url, headers={**headers, "x-request-id": "trace-42"})
        assert (echoed.status_code, echoed.headers["x-request-id"]) == (status, "trace-42")
    made = [httpx.get(f"{keyed_server.url}/health").headers["x-request-id"] for _ in range(2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", made_id) for made_id in made) and made[0] != made[1]


def test_chat_template_kwargs_reach_the_template(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    no_thinking = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={
        "chat_template_kwargs": {"enable_thinking": False}}).usage.prompt_tokens
    reference = AutoTokenizer.from_pretrained(keyed_server.model_folder)
    rendered = reference.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                             return_dict=False)
    assert no_thinking == len(rendered) > plain


def test_chat_template_kwargs_cannot_set_the_renderers_own_arguments(keyed_server):
    client = openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    assert refused.value.body["param"] == "chat_template_kwargs"
