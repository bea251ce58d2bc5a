"""A pooling server (`tinyserve serve --runner pooling`) through the official openai client and plain HTTP.

Its embeddings equal transformers' last-token pooling, L2-normalised; /pooling answers vLLM's shape;
what it cannot do (generate, shorten a vector) is a 400 naming why.
"""

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.hf_reference import hf_model
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server
MODEL = "tiny-embed"


@pytest.fixture(scope="module")
def folder():
    return tiny_model_with_tokenizer("qwen2", True)


@pytest.fixture(scope="module")
def server(folder):
    server = ServerProcess(str(folder), "--runner", "pooling", "--served-model-name", MODEL,
                           "--max-num-batched-tokens", "32")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def reference(folder, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model(folder).model(torch.tensor([token_ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden, dim=0)


def cosine(vector, expected: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.tensor(vector, dtype=torch.float32), expected, dim=0))


def test_the_openai_client_gets_transformers_embeddings_for_texts_and_token_ids(client, folder):
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    texts = ["hello world", "a longer text, which the server computes in more than one chunk of 32 tokens " * 2]
    answer = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert [item.index for item in answer.data] == [0, 1] and answer.model == MODEL
    ids = [tokenizer(text)["input_ids"] for text in texts]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    for item, token_ids in zip(answer.data, ids):
        assert cosine(item.embedding, reference(folder, token_ids)) >= 0.9999
    by_ids = client.embeddings.create(model=MODEL, input=[[5, 6, 7, 8], [9, 10]], encoding_format="float")
    for item, token_ids in zip(by_ids.data, [[5, 6, 7, 8], [9, 10]]):
        assert cosine(item.embedding, reference(folder, token_ids)) >= 0.9999
    [single] = client.embeddings.create(model=MODEL, input=[5, 6, 7, 8], encoding_format="float").data
    assert single.embedding == by_ids.data[0].embedding


def test_base64_is_the_float32_values_little_endian(server, folder):
    body = {"model": MODEL, "input": [5, 6, 7, 8]}
    as_floats = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()["data"][0]["embedding"]
    encoded = httpx.post(f"{server.url}/v1/embeddings", json={**body, "encoding_format": "base64"},
                         timeout=60).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    assert decoded.tolist() == np.array(as_floats, dtype=np.float32).tolist()


def test_pooling_route_answers_vllms_shape_and_normalize_false_gives_the_raw_state(server, folder):
    answer = httpx.post(f"{server.url}/pooling", json={"model": MODEL, "input": [5, 6, 7], "normalize": False},
                        timeout=60).json()
    assert answer["object"] == "list" and answer["id"].startswith("pool-")
    [item] = answer["data"]
    assert item["object"] == "pooling" and item["index"] == 0
    with torch.no_grad():
        raw = hf_model(folder).model(torch.tensor([[5, 6, 7]])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(item["data"]), raw, rtol=1e-4, atol=1e-4)


def test_concurrent_requests_are_all_answered_each_with_its_own_vector(client, folder):
    inputs = [[3 + i, 4 + i, 5 + i] * (1 + i % 5) for i in range(12)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda ids: client.embeddings.create(model=MODEL, input=ids), inputs))
    for answer, ids in zip(answers, inputs):
        assert cosine(answer.data[0].embedding, reference(folder, ids)) >= 0.9999


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/embeddings", {"input": "hi", "dimensions": 8}, 400, "dimensions", "does not support Matryoshka"),
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 513}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens value is greater than max_model_len. Please request a smaller truncation size."),
    ("/v1/embeddings", {"input": []}, 400, "input", "must not be empty"),
    ("/v1/embeddings", {"input": "hi", "model": "another"}, 404, "model", "does not exist"),
    ("/v1/embeddings", {"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", ""),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, 400, "model", "pooling (embedding) model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model",
     "it does not generate text"),
])
def test_what_a_pooling_server_cannot_do_is_a_4xx_naming_why(server, path, body, status, param, words):
    response = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_models_and_metrics_count_the_pooling_requests(server, client):
    assert [m.id for m in client.models.list()] == [MODEL]
    before = _successes(server)
    client.embeddings.create(model=MODEL, input=["one", "two", "three"])
    assert _successes(server) == before + 3


def _successes(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tinyserve:request_success_total{") and 'finished_reason="stop"' in line)


def test_truncation_keeps_the_first_tokens_unless_told_otherwise(client, folder):
    ids = list(range(5, 25))
    first, last = (client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                            extra_body={"truncate_prompt_tokens": 6, **side}) for side in
                   ({}, {"truncation_side": "left"}))
    assert first.usage.prompt_tokens == last.usage.prompt_tokens == 6
    assert cosine(first.data[0].embedding, reference(folder, ids[:6])) >= 0.9999
    assert cosine(last.data[0].embedding, reference(folder, ids[-6:])) >= 0.9999
    # a text too long for the context, truncated to all of it (-1): max_model_len tokens, as vLLM
    answer = client.embeddings.create(model=MODEL, input="hello world " * 600, extra_body={"truncate_prompt_tokens": -1})
    assert answer.usage.prompt_tokens == 512


def raw_state(folder, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(folder).model(torch.tensor([token_ids])).last_hidden_state[0, -1]


def test_use_activation_true_normalises_as_vllm_and_false_gives_the_raw_state(client, server, folder):
    ids = [5, 6, 7, 8]
    activated = client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                         extra_body={"use_activation": True}).data[0].embedding
    assert activated == client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding
    assert cosine(activated, reference(folder, ids)) >= 0.9999
    raw = client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                   extra_body={"use_activation": False}).data[0].embedding
    torch.testing.assert_close(torch.tensor(raw), raw_state(folder, ids), rtol=1e-4, atol=1e-4)
    disagree = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                          json={"model": MODEL, "input": ids, "use_activation": True, "normalize": False})
    assert disagree.status_code == 400 and disagree.json()["error"]["param"] == "use_activation"


def test_padding_max_length_pads_with_the_pad_token_to_the_context(client, folder):
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    ids = [5, 6, 7]
    padded = client.embeddings.create(model=MODEL, input=ids, encoding_format="float",
                                      extra_body={"padding": "max_length"})
    assert padded.usage.prompt_tokens == 512
    expected = ids + [tokenizer.pad_token_id] * (512 - len(ids))
    assert cosine(padded.data[0].embedding, reference(folder, expected)) >= 0.9999
    plain = client.embeddings.create(model=MODEL, input=ids, extra_body={"padding": "do_not_pad"})
    assert plain.usage.prompt_tokens == 3


def test_messages_are_rendered_with_the_chat_template(server, folder):
    conversation = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "hi"}]
    rendered = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": conversation,
                                                           "add_generation_prompt": False}).json()["tokens"]
    answer = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                        json={"model": MODEL, "messages": conversation}).json()
    assert answer["usage"]["prompt_tokens"] == len(rendered)
    assert cosine(answer["data"][0]["embedding"], reference(folder, rendered)) >= 0.9999
    batch = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                       json={"model": MODEL, "messages": [conversation, conversation[:1]]}).json()
    assert [item["index"] for item in batch["data"]] == [0, 1]
    assert batch["data"][0]["embedding"] == answer["data"][0]["embedding"]
    both = httpx.post(f"{server.url}/v1/embeddings", timeout=60,
                      json={"model": MODEL, "messages": conversation, "input": "hi"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("embed_dtype, endianness, numpy_dtype, torch_dtype", [
    ("float32", "big", ">f4", torch.float32), ("float16", "little", "<f2", torch.float16),
    ("bfloat16", "native", "=i2", torch.bfloat16), ("fp8_e4m3", "native", "u1", torch.float8_e4m3fn),
])
def test_embed_dtype_and_endianness_shape_the_base64_and_the_bytes(server, embed_dtype, endianness, numpy_dtype,
                                                                   torch_dtype):
    body = {"model": MODEL, "input": [[5, 6, 7, 8], [9, 10]]}
    floats = [item["embedding"] for item in
              httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()["data"]]

    def decode(raw: bytes) -> torch.Tensor:
        array = np.frombuffer(raw, dtype=numpy_dtype).astype(numpy_dtype.lstrip("<>="))
        return torch.from_numpy(array.copy()).view(torch_dtype).float()

    expected = [torch.tensor(f).to(torch_dtype).float() for f in floats]
    options = {"embed_dtype": embed_dtype, "endianness": endianness}
    encoded = httpx.post(f"{server.url}/v1/embeddings", json={**body, **options, "encoding_format": "base64"},
                         timeout=60).json()
    for item, vector in zip(encoded["data"], expected):
        assert torch.equal(decode(base64.b64decode(item["embedding"])), vector)
    response = httpx.post(f"{server.url}/v1/embeddings", json={**body, **options, "encoding_format": "bytes"},
                          timeout=60)
    assert response.headers["content-type"] == "application/octet-stream"
    metadata = __import__("json").loads(response.headers["metadata"])
    assert metadata["usage"] == {"prompt_tokens": 6, "total_tokens": 6} and metadata["model"] == MODEL
    for item, vector in zip(metadata["data"], expected):
        assert item["embed_dtype"] == embed_dtype and item["endianness"] == endianness
        assert torch.equal(decode(response.content[item["start"]:item["end"]]), vector)
    only = httpx.post(f"{server.url}/v1/embeddings", json={**body, **options, "encoding_format": "bytes_only"},
                      timeout=60)
    assert only.content == response.content and "metadata" not in only.headers


def test_invocations_answers_an_embeddings_body_on_a_pooling_server(server):
    body = {"model": MODEL, "input": [5, 6, 7, 8]}
    direct = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60).json()
    routed = httpx.post(f"{server.url}/invocations", json=body, timeout=60)
    assert routed.status_code == 200 and routed.json()["data"] == direct["data"]
    conversation = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(f"{server.url}/invocations", json=conversation, timeout=60).json()["data"] == \
        httpx.post(f"{server.url}/v1/embeddings", json=conversation, timeout=60).json()["data"]
    neither = httpx.post(f"{server.url}/invocations", json={"model": MODEL, "prompt": "hi"}, timeout=60)
    assert neither.status_code == 400 and "EmbeddingRequest" in neither.json()["error"]["message"]


def test_vllm_bench_serve_openai_embeddings_gets_what_it_reads(server, folder):
    """`vllm bench serve --backend openai-embeddings --endpoint /v1/embeddings`, as vLLM 0.33's benchmark sends it
    (vllm/benchmarks/lib/endpoint_request_func.py, async_request_openai_embeddings): the model's id and root from
    GET /v1/models, then one body per prompt, truncate_prompt_tokens -1 and an x-request-id (none on its first,
    ready-check request). A 200 is a success, and usage.prompt_tokens is the prompt's length it reports."""
    [model] = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"]
    assert model["id"] == MODEL and model["root"]
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(folder)
    for index, prompt in enumerate(["a prompt of the random dataset", "hello world " * 600]):
        headers = {"Content-Type": "application/json", **({"x-request-id": f"bench-1a2b3c4d-{index}"} if index else {})}
        response = httpx.post(f"{server.url}/v1/embeddings", headers=headers, timeout=60,
                              json={"model": model["id"], "input": prompt, "truncate_prompt_tokens": -1})
        assert response.status_code == 200, response.text
        expected = min(len(tokenizer(prompt)["input_ids"]), 512)  # -1: as much as the context takes
        assert response.json()["usage"]["prompt_tokens"] == expected
