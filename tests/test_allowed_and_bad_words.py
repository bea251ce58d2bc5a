"""allowed_token_ids and bad_words (vLLM's sampling fields), and /tokenize's token_strs.

vLLM's rules, from vllm/sampling_params.py and vllm/v1/sample/ops/bad_words.py:
allowed_token_ids leaves only those tokens to sample (an empty list or an id outside
the vocabulary is refused). Each bad word is tokenized without its leading spaces and
again after one space (that spelling kept when it starts with another token and has
as many); a spelling's last token is banned whenever the output so far ends with its
other tokens, so a one-token spelling is always banned.

Offline through tinyserve.LLM on the tiny Llama; then through the shared server with
the openai client (both endpoints), and /tokenize through httpx.
"""

import itertools

import httpx
import openai
import pytest
import torch

from tests import shared_server
from tests.shared_server import MODEL
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tests.tiny_tokenizer import TINY_VOCAB_SIZE
from tinyserve import LLM, SamplingParams
from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.sampler import Sampler
from tinyserve.errors import InvalidInputError

PROMPTS = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "Flat is better than nested."]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(tiny_model_with_tokenizer("llama")), num_kv_blocks=64)


def generate(llm, prompt, **params) -> list[int]:
    params = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **params}
    [output] = llm.generate(prompt, SamplingParams(**params), use_tqdm=False)
    return output.outputs[0].token_ids


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def spellings(tokenizer, word: str) -> list[list[int]]:
    """The token sequences vLLM bans for a word (the rule in this module's docstring)."""
    plain, spaced = encode(tokenizer, word.lstrip()), encode(tokenizer, " " + word.lstrip())
    return [plain, spaced] if spaced[0] != plain[0] and len(spaced) == len(plain) else [plain]


def one_token_word(tokenizer, token_ids: list[int]) -> tuple[int, str]:
    """The first token of an output whose text, as a bad word, bans it on its own."""
    for token in token_ids:
        word = tokenizer.decode([token]).strip()
        if word.isprintable() and word and [token] in spellings(tokenizer, word):
            return token, word
    raise AssertionError(f"no token of {token_ids} is a word of one token")


def two_token_word(tokenizer, token_ids: list[int]) -> tuple[int, int, int, str]:
    """(position of the second token, first, second, word): two different tokens of the output that
    together spell a word of letters, as one of its spellings (and each of its spellings is two tokens)."""
    for position in range(1, len(token_ids)):
        first, second = token_ids[position - 1], token_ids[position]
        word = tokenizer.decode([first, second]).strip()
        if first != second and word.isalpha() and [first, second] in spellings(tokenizer, word) \
                and all(len(s) == 2 for s in spellings(tokenizer, word)):
            return position, first, second, word
    raise AssertionError(f"no two tokens of {token_ids} spell a word")


# ---- allowed_token_ids ------------------------------------------------------------------------------------


def test_with_allowed_token_ids_every_token_is_one_of_them_greedy_and_sampled(llm):
    allowed = [5, 9, 40, 133, 301]
    assert not set(generate(llm, PROMPTS[0])) <= set(allowed)  # without the field, other tokens come
    assert set(generate(llm, PROMPTS[0], allowed_token_ids=allowed)) <= set(allowed)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=1.5, seed=0, n=3, max_tokens=24, ignore_eos=True,
                                                   allowed_token_ids=allowed), use_tqdm=False)
    sampled = [tuple(c.token_ids) for o in outputs for c in o.outputs]
    assert all(set(tokens) <= set(allowed) for tokens in sampled) and len(set(sampled)) > 1


def test_one_allowed_token_is_all_the_output(llm):
    assert generate(llm, PROMPTS[1], allowed_token_ids=[77], temperature=1.0, seed=3) == [77] * 24


# ---- bad_words -------------------------------------------------------------------------------------------


def test_a_one_token_bad_word_never_appears(llm):
    tokenizer = llm.get_tokenizer()
    greedy = generate(llm, PROMPTS[0])
    token, word = one_token_word(tokenizer, greedy)
    # Made to repeat by logit_bias, the token is everywhere; as a bad word, nowhere.
    assert generate(llm, PROMPTS[0], logit_bias={token: 100}) == [token] * 24
    assert token not in generate(llm, PROMPTS[0], logit_bias={token: 100}, bad_words=[word])
    banned = generate(llm, PROMPTS[0], bad_words=[word])
    assert token not in banned
    first = greedy.index(token)
    assert banned[:first] == greedy[:first] and banned != greedy  # the same output up to the token


def test_every_one_token_spelling_of_a_bad_word_is_banned(llm):
    tokenizer = llm.get_tokenizer()
    _, word = one_token_word(tokenizer, generate(llm, PROMPTS[0]))
    banned = {s[0] for s in spellings(tokenizer, word) if len(s) == 1}
    forced = {t: 100 for t in banned}
    assert set(generate(llm, PROMPTS[2], logit_bias=forced)) <= banned
    assert not banned & set(generate(llm, PROMPTS[2], logit_bias=forced, bad_words=[" " + word]))


def test_a_two_token_bad_word_bans_its_last_token_only_after_its_first(llm):
    tokenizer = llm.get_tokenizer()
    greedy = generate(llm, PROMPTS[0], max_tokens=48)
    position, first, second, word = two_token_word(tokenizer, greedy)
    banned = generate(llm, PROMPTS[0], max_tokens=48, bad_words=[word])
    assert banned[:position] == greedy[:position] and banned[position] != second  # after `first`: not `second`
    assert (first, second) not in set(itertools.pairwise(banned))
    # Anywhere else the last token is free: forced by logit_bias, it is the whole output.
    assert generate(llm, PROMPTS[0], logit_bias={second: 100}, bad_words=[word]) == [second] * 24


def test_bad_words_are_matched_against_the_output_so_far():
    """vLLM's v1 check on hand-made logits: the last token of a word is -inf only after the rest of it."""
    def sampled(output, bad_words_token_ids):
        params = SamplingParams(temperature=0.0, max_tokens=32, _bad_words_token_ids=bad_words_token_ids)
        request = CachedRequestState("r", [1, 2], params, eos_token_ids=[0], output_token_ids=list(output))
        logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
        return Sampler(torch.device("cpu")).sample(logits, [request])[0][0]

    assert sampled([], [[5]]) == 4  # one token: always banned
    assert sampled([], [[3, 5]]) == 5  # nothing generated yet: no prefix to match
    assert sampled([1, 3], [[3, 5]]) == 4
    assert sampled([3, 1], [[3, 5]]) == 5
    assert sampled([2, 3], [[2, 3, 5], [4]]) == 3
    assert sampled([1, 3], [[2, 3, 5]]) == 5


# ---- validation -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "words"), [
    ({"allowed_token_ids": []}, "must not be empty"),
    ({"allowed_token_ids": [1, "2"]}, "must be a list of token ids"),
    ({"allowed_token_ids": 5}, "must be a list of token ids"),
    ({"bad_words": "ugly"}, "must be a list of strings"),
    ({"bad_words": ["ugly", 3]}, "must be a list of strings"),
])
def test_sampling_params_refuse_malformed_fields_naming_them(params, words):
    with pytest.raises(InvalidInputError, match=words) as refused:
        SamplingParams(**params)
    assert refused.value.param == next(iter(params))


@pytest.mark.parametrize(("params", "param", "words"), [
    ({"allowed_token_ids": [3, TINY_VOCAB_SIZE]}, "allowed_token_ids", f"{TINY_VOCAB_SIZE}, outside the vocabulary"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids", "-1, outside the vocabulary"),
    ({"bad_words": [" "]}, "bad_words", "at least one token"),
    ({"bad_words": [f"w{i}" for i in range(130)]}, "bad_words", "more than the limit of 128"),
    ({"bad_words": ["is " * 600]}, "bad_words", "more than the limit of 1024"),
])
def test_generate_refuses_what_the_vocabulary_cannot_hold_naming_the_field(llm, params, param, words):
    with pytest.raises(InvalidInputError, match=words) as refused:
        generate(llm, PROMPTS[0], **params)
    assert refused.value.param == param


def test_one_sampling_params_serves_many_prompts_with_its_bad_words_untouched(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, bad_words=["is"])
    llm.generate(PROMPTS, params, use_tqdm=False)
    assert params.bad_words == ["is"] and params.bad_words_token_ids is None


# ---- through the server ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


class ServerTokenizer:
    """The served model's tokenizer, through /tokenize and /detokenize."""

    def __init__(self, server) -> None:
        self.url = server.url

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return httpx.post(f"{self.url}/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens},
                          timeout=60).json()["tokens"]

    def decode(self, token_ids: list[int]) -> str:
        return httpx.post(f"{self.url}/detokenize", json={"tokens": token_ids}, timeout=60).json()["prompt"]


def answer_ids(client, endpoint: str, **extra) -> list[int]:
    """The ids of a greedy answer of 16 tokens (logprobs with return_tokens_as_token_ids)."""
    body = {"return_tokens_as_token_ids": True, "ignore_eos": True, **extra}
    if endpoint == "chat":
        answer = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=16, temperature=0,
            logprobs=True, extra_body=body)
        tokens = [entry.token for entry in answer.choices[0].logprobs.content]
    else:
        answer = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=0,
                                           extra_body=body)
        tokens = answer.choices[0].logprobs.tokens
    return [int(token.removeprefix("token_id:")) for token in tokens]


@pytest.mark.server
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_server_allowed_token_ids(client, endpoint):
    allowed = [5, 9, 40, 133, 301]
    assert not set(answer_ids(client, endpoint)) <= set(allowed)
    assert set(answer_ids(client, endpoint, allowed_token_ids=allowed)) <= set(allowed)
    assert set(answer_ids(client, endpoint, allowed_token_ids=allowed, temperature=1.5, seed=1)) <= set(allowed)


@pytest.mark.server
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_server_bad_words(server, client, endpoint):
    """The first token of the greedy answer that is a word of one token, banned: gone, even when forced."""
    greedy = answer_ids(client, endpoint)
    token, word = one_token_word(ServerTokenizer(server), greedy)
    assert token not in answer_ids(client, endpoint, bad_words=[word])
    assert token not in answer_ids(client, endpoint, bad_words=[word], logit_bias={str(token): 100})


@pytest.mark.server
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"allowed_token_ids": []}, "allowed_token_ids", "at least 1 item"),
    ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids", "outside the vocabulary"),
    ({"bad_words": [""]}, "bad_words", "at least one token"),
])
def test_server_refuses_bad_values_naming_the_field(client, endpoint, extra, param, words):
    with pytest.raises(openai.BadRequestError, match=words) as refused:
        answer_ids(client, endpoint, **extra)
    assert refused.value.body["param"] == param


# ---- /tokenize's token_strs ------------------------------------------------------------------------------


@pytest.mark.server
@pytest.mark.parametrize("form", [{"prompt": "Beautiful is better than ugly."},
                                  {"messages": [{"role": "user", "content": "Beautiful is better than ugly."}]}])
def test_tokenize_returns_token_strs_only_when_asked(server, form):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(shared_server.model_folder())
    plain = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **form}).json()
    asked = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **form, "return_token_strs": True}).json()
    assert plain["token_strs"] is None and set(plain) == {"tokens", "count", "max_model_len", "token_strs"}
    assert asked["tokens"] == plain["tokens"] and asked["count"] == len(asked["token_strs"]) == plain["count"]
    assert asked["token_strs"] == tokenizer.convert_ids_to_tokens(plain["tokens"])
    assert any(s.startswith("Ġ") for s in asked["token_strs"])  # the vocabulary's spelling, not decoded text
    refused = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, **form, "return_token_strs": "yes"})
    assert refused.status_code == 400
