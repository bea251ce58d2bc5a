"""The server through the official openai client, on a real loopback port."""

import httpx
import openai
import pytest

from tests.shared_server import MAX_MODEL_LEN, MODEL
from tests.tiny_tokenizer import TINY_VOCAB_SIZE

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Explain the Zen of Python."}]


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_completion(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + 8


def test_streamed_chat_text_equals_non_streamed_text_at_temperature_0(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12


def test_completion_streamed_equals_non_streamed(client):
    full = client.completions.create(model=MODEL, prompt="Flat is better than", max_tokens=10, temperature=0)
    stream = client.completions.create(model=MODEL, prompt="Flat is better than", max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text
    assert full.object == "text_completion" and full.usage.completion_tokens == 10


def test_completion_with_token_ids_and_echo(client):
    tokens = httpx.post(f"{client.base_url}".replace("/v1/", "") + "/tokenize", json={"prompt": "Sparse is better"}).json()["tokens"]
    response = client.completions.create(model=MODEL, prompt=tokens, max_tokens=4, temperature=0, echo=True)
    assert response.choices[0].text.startswith("Sparse is better")
    assert response.usage.prompt_tokens == len(tokens)


def test_n_2_with_a_seed_is_reproducible(client):
    def run():
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=2, seed=11, temperature=1.0)
        return [(c.index, c.message.content) for c in response.choices]

    first = run()
    assert [index for index, _ in first] == [0, 1]
    assert run() == first


def test_chat_logprobs_shape(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(entry.top_logprobs) == 3 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob for entry in content)


def test_completion_logprobs_shape(client):
    response = client.completions.create(model=MODEL, prompt="Now is better", max_tokens=4, temperature=0, logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.text_offset) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    for num_top in (0, 1, 2):
        response = client.completions.create(model=MODEL, prompt="Now is better", max_tokens=12, temperature=2.0,
                                             seed=5, logprobs=num_top)
        logprobs = response.choices[0].logprobs
        for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert top[token] == logprob
            assert num_top <= len(top) <= num_top + 1


def test_streamed_completion_text_offsets_count_from_the_start_of_the_text(client):
    kwargs = dict(model=MODEL, prompt="Now is better", max_tokens=8, temperature=0, logprobs=1)
    full = client.completions.create(**kwargs).choices[0].logprobs
    streamed = [offset for chunk in client.completions.create(stream=True, **kwargs)
                if chunk.choices[0].logprobs for offset in chunk.choices[0].logprobs.text_offset]
    assert streamed == full.text_offset
    assert full.text_offset == [sum(len(t) for t in full.tokens[:i]) for i in range(len(full.tokens))]


def test_echo_with_logprobs_scores_the_prompt_tokens_too(server, client):
    prompt = "Errors should never pass silently."
    prompt_ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=1)
    plain = client.completions.create(**kwargs).choices[0].logprobs
    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    logprobs = echoed.logprobs
    assert echoed.text.startswith(prompt)
    num_prompt = len(prompt_ids)
    assert len(logprobs.tokens) == num_prompt + 4
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # nothing predicts it
    for token, logprob, top in zip(logprobs.tokens[1:num_prompt], logprobs.token_logprobs[1:num_prompt],
                                   logprobs.top_logprobs[1:num_prompt]):
        assert logprob <= 0 and top[token] == logprob and len(top) in (1, 2)
    # The generated part is scored as without echo; offsets run over every token's text from 0.
    assert logprobs.tokens[num_prompt:] == plain.tokens
    assert logprobs.token_logprobs[num_prompt:] == pytest.approx(plain.token_logprobs, abs=1e-5)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(logprobs.tokens))]
    streamed = [chunk.choices[0].logprobs for chunk in client.completions.create(echo=True, stream=True, **kwargs)
                if chunk.choices[0].logprobs]
    assert [t for chunk in streamed for t in chunk.tokens] == logprobs.tokens
    assert [o for chunk in streamed for o in chunk.text_offset] == logprobs.text_offset


def test_stop_string_is_honoured_and_not_emitted(client):
    free = client.completions.create(model=MODEL, prompt="Although never is", max_tokens=16, temperature=0).choices[0].text
    stop = free[4:7]
    assert stop.strip()
    for stream in (False, True):
        response = client.completions.create(model=MODEL, prompt="Although never is", max_tokens=16, temperature=0,
                                             stop=[stop], stream=stream)
        if stream:
            chunks = list(response)
            text = "".join(c.choices[0].text for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            text, finish = response.choices[0].text, [response.choices[0].finish_reason]
        assert text == free[: free.index(stop)]
        assert stop not in text and finish == ["stop"]


NEVER_SEEN = "\u2603" * 40  # a stop string the model does not write: the detokenizer holds back 39 characters


def test_a_token_whose_text_is_held_back_still_streams_a_chunk(client):
    """As vLLM: every generated token gets its chunk, with empty text while its text is held back (a
    possible stop string, half a character). A client's first chunk is the first token, not the first text."""
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0, stop=[NEVER_SEEN])
    full = client.completions.create(prompt="Although never is", **kwargs).choices[0].text
    chunks = list(client.completions.create(prompt="Although never is", stream=True, **kwargs))
    assert len(chunks) == 8 and chunks[0].choices[0].text == ""
    assert "".join(c.choices[0].text for c in chunks) == full
    full = client.chat.completions.create(messages=MESSAGES, **kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len(chunks[1:]) == 8 and chunks[1].choices[0].delta.content == ""
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full


def test_vllm_extra_sampling_fields_are_accepted(client):
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0.8, seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 6},
    )
    assert response.usage.completion_tokens == 6


def test_stop_token_ids_end_the_request_on_that_token_without_its_text(client):
    # Every id is a stop token here, so the first token generated ends the request.
    response = client.completions.create(model=MODEL, prompt="Flat is better than", max_tokens=8, temperature=0,
                                         extra_body={"stop_token_ids": list(range(TINY_VOCAB_SIZE))})
    choice = response.choices[0]
    assert (choice.finish_reason, choice.text, response.usage.completion_tokens) == ("stop", "", 1)
    assert isinstance(choice.model_extra["stop_reason"], int)


PREFILLED = [{"role": "user", "content": "Explain the Zen of Python."}, {"role": "assistant", "content": "The Zen says"}]


def tokenize_messages(server, messages, **options) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages, **options}).json()["tokens"]


def test_continue_final_message_renders_the_last_message_open(server, client):
    continued = tokenize_messages(server, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": continued}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe Zen says")  # no end of turn, no new turn
    assert len(continued) < len(tokenize_messages(server, PREFILLED))
    response = client.chat.completions.create(
        model=MODEL, messages=PREFILLED, max_tokens=4, temperature=0,
        extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert response.usage.prompt_tokens == len(continued)


def test_logit_bias_forces_a_token(server, client):
    chosen = 42
    response = client.completions.create(model=MODEL, prompt="Flat is better than", max_tokens=3, temperature=1.0,
                                         seed=2, logit_bias={str(chosen): 100})
    expected = httpx.post(f"{server.url}/detokenize", json={"tokens": [chosen] * 3}).json()["prompt"]
    assert response.choices[0].text == expected


def test_max_completion_tokens_is_honoured(client):
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=3, temperature=0)
    assert response.usage.completion_tokens == 3


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "Namespaces are one honking great idea"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert "Namespaces are one honking great idea" in text


def test_health_and_version(server):
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json()["version"]


def test_log_requests_logs_inputs_and_one_access_line_per_request(server, client):
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "log me"}],
                                              max_tokens=2, temperature=0)
    log = server.output()
    [inputs] = [line for line in log.splitlines() if f"Received request {response.id}" in line]
    assert "log me" in inputs and "prompt_token_ids" in inputs and "max_tokens=2" in inputs
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
