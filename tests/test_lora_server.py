"""LoRA adapters over HTTP: `tinyserve serve --enable-lora --lora-modules name=path`, with the openai client.

Concurrent requests naming different adapters (and the base model) get transformers + PEFT's
greedy tokens; /v1/models lists each adapter with its base as parent; adapters are loaded and
unloaded at run time behind TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING; bad adapters and unknown
names are 4xx naming the problem; vllm:lora_requests_info is exported; the trace's logged
inputs replay under their adapters."""

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.hf_reference import MAX_TOKENS
from tests.lora_adapters import peft_adapter, peft_greedy
from tests.server_checks import metric, wait_until
from tests.tiny_checkpoints import tiny_checkpoint, tiny_model_with_tokenizer
from tinyserve.lora.registry import runtime_lora_updating_allowed
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

BASE = "tiny"
PROMPTS = ([5, 17, 33, 90, 121, 7], [250, 3, 18, 77, 140, 201, 9, 64, 31, 12, 99, 45])


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    folder = tiny_model_with_tokenizer("llama")
    sql = peft_adapter(folder, "sql", seed=1)
    trace_dir = tmp_path_factory.mktemp("lora-traces")
    server = ServerProcess(str(folder), "--served-model-name", BASE, "--enable-lora", "--lora-modules", f"sql={sql}",
                           "--max-loras", "2", "--max-lora-rank", "8", "--num-kv-blocks", "256",
                           "--trace", "--trace-dir", str(trace_dir),
                           env={"TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    server.folder, server.sql, server.trace_dir = folder, sql, trace_dir
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)


def greedy_ids(client, model: str, prompt: list[int]) -> list[int]:
    completion = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    assert completion.model == model
    return [int(token.removeprefix("token_id:")) for token in completion.choices[0].logprobs.tokens]


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=60)


def test_models_lists_each_adapter_with_its_base_as_parent(lora_server, client):
    cards = {card.id: card for card in client.models.list().data}
    assert list(cards) == [BASE, "sql"]
    assert cards["sql"].parent == BASE and cards["sql"].root == str(lora_server.sql)
    assert getattr(cards[BASE], "parent", None) is None
    assert client.models.retrieve("sql").parent == BASE


def test_concurrent_requests_under_different_adapters_equal_peft_and_free_every_block(lora_server, client):
    folder = lora_server.folder
    chat = peft_adapter(folder, "chat", r=8, lora_alpha=16, seed=2)
    response = load(lora_server, "chat", chat)
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'chat' added successfully."
    jobs = [(model, prompt) for model in (BASE, "sql", "chat") for prompt in PROMPTS] * 2
    paths = {BASE: None, "sql": lora_server.sql, "chat": chat}
    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(lambda job: greedy_ids(client, *job), jobs))
    assert got == [peft_greedy(folder, paths[model], prompt) for model, prompt in jobs]
    wait_until(lambda: metric(lora_server.url, "kv_cache_usage_perc") == 0, 30, "every KV block is free")
    # vLLM's gauge: the labels name the adapters, the value is when they were set
    text = httpx.get(f"{lora_server.url}/metrics", timeout=10).text
    assert re.search(r'^tinyserve:lora_requests_info\{max_lora="2",running_lora_adapters="(chat,)?sql",'
                     r'waiting_lora_adapters=""\} \d', text, re.MULTILINE)
    assert 'running_lora_adapters="chat,sql"' in text or 'waiting_lora_adapters="chat,sql"' in text


def test_an_unloaded_adapter_is_a_404_and_can_be_loaded_again(lora_server, client):
    other = peft_adapter(lora_server.folder, "other", seed=5)
    assert load(lora_server, "other", other).status_code == 200
    before = greedy_ids(client, "other", PROMPTS[0])
    response = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "other"}, timeout=30)
    assert response.status_code == 200 and "removed" in response.text
    with pytest.raises(openai.NotFoundError, match="The model `other` does not exist"):
        greedy_ids(client, "other", PROMPTS[0])
    again = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "other"}, timeout=30)
    assert again.status_code == 404 and "The lora adapter 'other' cannot be found." in again.json()["error"]["message"]
    assert load(lora_server, "other", other).status_code == 200
    assert greedy_ids(client, "other", PROMPTS[0]) == before == peft_greedy(lora_server.folder, other, PROMPTS[0])


def test_an_adapter_gone_from_disk_after_loading_refuses_its_request_and_the_engine_serves_on(lora_server, client):
    gone = peft_adapter(lora_server.folder, "gone", seed=7)
    assert load(lora_server, "gone", gone).status_code == 200  # its config read and checked: it was there
    (gone / "adapter_model.safetensors").unlink()  # the engine reads its weights with its first request
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="gone", prompt=PROMPTS[0], max_tokens=2)
    assert refused.value.body["param"] == "model", refused.value.body
    assert "LoRA adapter 'gone'" in refused.value.body["message"]
    assert "holds no readable PEFT adapter" in refused.value.body["message"]
    assert greedy_ids(client, "sql", PROMPTS[0]) == peft_greedy(lora_server.folder, lora_server.sql, PROMPTS[0])
    assert httpx.get(f"{lora_server.url}/health", timeout=10).json()["status"] == "ok"


def test_bad_adapters_and_unknown_names_are_refused_naming_the_problem(lora_server, client):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt=[5, 6], max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    folder = lora_server.folder
    cases = {
        "big": (peft_adapter(folder, "big", r=16, lora_alpha=16), "has rank 16, over this server's max_lora_rank 8"),
        "dora": (peft_adapter(folder, "dora", use_dora=True), "DoRA (use_dora) is not supported"),
        "elsewhere": (peft_adapter(tiny_checkpoint("llama", intermediate_size=96), "elsewhere"),
                      "was trained for another base model"),
        "sql": (lora_server.sql, "The lora adapter 'sql' has already been loaded."),
    }
    for name, (path, message) in cases.items():
        response = load(lora_server, name, path)
        assert response.status_code == 400, name
        assert message in response.json()["error"]["message"]
    assert httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={"lora_name": "x"}).status_code == 400
    assert [card.id for card in client.models.list().data][:2] == [BASE, "sql"]


def test_the_trace_logs_each_adapter_and_replays_under_it(lora_server, client):
    from tinyserve import LLM
    from tinyserve.trace_reading.replay import replay_run
    from tinyserve.trace_reading.run import load_run

    ids = greedy_ids(client, "sql", PROMPTS[1])
    [run_dir] = [p for p in lora_server.trace_dir.iterdir() if p.is_dir()]

    def logged():
        run = load_run(run_dir)
        return run, [r for r in run.requests if r.inputs.lora_request and r.completions
                     and r.completions[0].token_ids == ids and r.inputs.prompt_token_ids == list(PROMPTS[1])]

    wait_until(lambda: logged()[1], 30, "the request's spans are written")
    run, found = logged()  # one reading: the run the request was found in
    request = found[-1]
    assert request.inputs.lora_request["lora_name"] == "sql"
    [result] = replay_run(run, LLM(str(lora_server.folder), enable_lora=True, max_lora_rank=8), [request.request_id])
    assert result.matched, result.describe()


def test_runtime_updating_needs_its_switch(server):
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}).status_code == 404
    assert runtime_lora_updating_allowed({"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert runtime_lora_updating_allowed({"TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})
    assert not runtime_lora_updating_allowed({"TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING": "false"})


def test_the_openapi_document_does_not_bound_model_names_while_adapters_may_be_loaded(lora_server):
    document = httpx.get(f"{lora_server.url}/openapi.json", timeout=30).json()
    [model_id] = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert "enum" not in model_id["schema"]  # a name loaded at run time is served too
