"""A pooling server (`tinyserve serve --runner pooling`) through the official openai client and plain HTTP.

Its embeddings equal transformers' last-token pooling, L2-normalised; /pooling answers vLLM's shape;
what it cannot do (generate, shorten a vector, truncate a prompt) is a 400 naming why.
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
    ("/v1/embeddings", {"input": "hi", "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens",
     "never truncated"),
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
