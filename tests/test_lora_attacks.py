"""LoRA adapters attacked through a real server (`tinyserve serve --enable-lora`, runtime loading on): an adapter
whose values overflow, one swapped on disk for such after it was loaded, one unloaded and deleted while a request
for it waits, paths probed for what exists. Each is refused alone, with a 4xx naming the adapter and why; the engine never dies, and the server
serves the base model and the other adapters as before (they killed the engine: hardening-4, High 1 and 2)."""

import json
import shutil
import threading

import httpx
import pytest

from tests.hf_reference import MAX_TOKENS
from tests.patience import patient
from tests.lora_adapters import peft_adapter, peft_greedy, tampered_adapter
from tests.server_checks import metric, wait_until
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.testing import ServerProcess

pytestmark = pytest.mark.server

BASE = "tiny"
PROMPT = [5, 17, 33, 90, 121, 7]


@pytest.fixture(scope="module")
def lora_server():
    # 8192 positions: a request of 8000 tokens holds the slot for seconds, while others wait behind it.
    folder = tiny_model_with_tokenizer("llama", max_position_embeddings=8192)
    sql = peft_adapter(folder, "sql", seed=1)
    # One slot and one adapter in memory: a second adapter's request waits, and its adapter is let go meanwhile.
    server = ServerProcess(str(folder), "--served-model-name", BASE, "--enable-lora", "--lora-modules", f"sql={sql}",
                           "--max-loras", "1", "--max-cpu-loras", "1", "--max-lora-rank", "8",
                           env={"TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    server.folder, server.sql = folder, sql
    yield server
    server.stop()


def load(server, name: str, path) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)},
                      timeout=60)


def complete(server, model: str, **body) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True, **body}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def assert_serves_on(server) -> None:
    """The engine lives: the base model and the adapter of --lora-modules answer as transformers + PEFT."""
    assert server.process.poll() is None, server.output()[-3000:]
    assert token_ids(complete(server, "sql")) == peft_greedy(server.folder, server.sql, PROMPT)
    assert token_ids(complete(server, BASE)) == peft_greedy(server.folder, None, PROMPT)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("tamper, message", [
    ({"config": {"lora_alpha": float("nan")}}, "lora_alpha must be a finite number, got nan"),
    ({"config": {"lora_alpha": "x"}}, "lora_alpha must be a finite number, got 'x'"),
    ({"fill": 1e30}, "could change a weight by up to"),
    ({"fill": float("inf")}, "holds values that are not finite"),
    ({"fill": float("nan")}, "holds values that are not finite"),
], ids=["alpha-nan", "alpha-str", "1e30", "inf", "nan"])
def test_an_adapter_whose_values_overflow_is_refused_when_loaded(lora_server, tmp_path, tamper, message):
    path = tampered_adapter(lora_server.sql, tmp_path / "evil", **tamper)
    response = load(lora_server, "evil", path)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "LoRA adapter 'evil'" in error["message"] and message in error["message"], error
    assert "evil" not in [card["id"] for card in httpx.get(f"{lora_server.url}/v1/models").json()["data"]]
    assert_serves_on(lora_server)


def test_a_load_says_the_same_of_a_missing_path_a_file_and_a_folder_that_holds_no_adapter(lora_server, tmp_path):
    """Whoever may load adapters names any path: the answer must not tell which exist (it did: hardening-4)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "half").mkdir()
    shutil.copy(lora_server.sql / "adapter_config.json", tmp_path / "half")  # a config, no weights
    paths = [tmp_path / "missing", tmp_path / "missing" / "deeper", tmp_path / "empty", tmp_path / "a_file",
             tmp_path / "half", "/proc/1/root", "/etc"]
    messages = set()
    for path in paths:
        response = load(lora_server, "probe", path)
        assert response.status_code == 400, response.text
        messages.add(response.json()["error"]["message"].replace(repr(str(path)), "PATH"))
    assert messages == {"LoRA adapter 'probe': PATH holds no readable PEFT adapter (adapter_config.json and "
                        "adapter_model.safetensors: only PEFT's safetensors format is read)"}, messages
    assert_serves_on(lora_server)


@pytest.mark.parametrize("fill", [1e30, float("nan")], ids=["1e30", "nan"])
def test_an_adapter_swapped_on_disk_after_loading_refuses_its_request_alone(lora_server, tmp_path, fill):
    """Loaded while sound, then its weights overwritten before its first request: the engine reads it as the
    request arrives and refuses that request, a 400 naming the adapter, instead of running it into a NaN step."""
    path = tampered_adapter(lora_server.sql, tmp_path / "swapped")
    name = f"swapped-{len(str(fill))}"
    assert load(lora_server, name, path).status_code == 200
    tampered_adapter(lora_server.sql, path, fill=fill)  # the same folder, its weights replaced
    response = complete(lora_server, name)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "model" and f"LoRA adapter {name!r}" in error["message"], error
    assert "could change a weight by up to" in error["message"] or "not finite" in error["message"], error
    assert_serves_on(lora_server)


def test_an_adapter_unloaded_and_deleted_while_its_request_waits_fails_that_request_alone(lora_server, tmp_path):
    """max_loras=1: a long request under "sql" holds the slot, so one under "doomed" waits (its adapter read as it
    arrived, then let go: max_cpu_loras=1). "doomed" is unloaded and its folder deleted; once the slot frees,
    the waiting request's adapter cannot be read again: it alone ends, a 400 naming it (this killed the engine)."""
    doomed = tampered_adapter(lora_server.sql, tmp_path / "doomed")
    assert load(lora_server, "doomed", doomed).status_code == 200
    body = {"model": "sql", "prompt": PROMPT, "max_tokens": 8000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    started, stop = threading.Event(), threading.Event()

    def hold_the_slot() -> None:  # read as a client does (one that stops reading is cut off), until told to stop
        with httpx.stream("POST", f"{lora_server.url}/v1/completions", json=body, timeout=120) as long:
            assert long.status_code == 200
            for _ in long.iter_lines():
                started.set()
                if stop.is_set():
                    return

    waiting_before = metric(lora_server.url, "num_requests_waiting")
    holder = threading.Thread(target=hold_the_slot)
    holder.start()
    assert started.wait(patient(30)), "the long request streams"
    answers = {}
    waiter = threading.Thread(target=lambda: answers.update(doomed=complete(lora_server, "doomed")))
    waiter.start()
    wait_until(lambda: metric(lora_server.url, "num_requests_waiting") > waiting_before, 30,
               "the request for 'doomed' waits")
    response = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "doomed"}, timeout=30)
    assert response.status_code == 200, response.text
    shutil.rmtree(doomed)
    stop.set()
    holder.join(timeout=patient(30))
    # The long stream closed: its request is aborted, the slot frees, the waiting request is admitted.
    waiter.join(timeout=patient(60))
    assert not waiter.is_alive()
    response = answers["doomed"]
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "LoRA adapter 'doomed' cannot be loaded" in error["message"] and error["param"] == "model", error
    assert_serves_on(lora_server)
    log = lora_server.output()
    assert "Traceback" not in log, log[-3000:]


def test_queued_requests_for_many_adapters_are_all_served_within_max_cpu_loras(lora_server, tmp_path):
    """Twelve adapters queued at once with one slot and max_cpu_loras=1: each is read as its request arrives and
    again as it starts (never kept beyond the limit), and every request gets its adapter's own answer."""
    names = [f"many{i}" for i in range(12)]
    for name in names:
        assert load(lora_server, name, tampered_adapter(lora_server.sql, tmp_path / name)).status_code == 200
    results = {}
    threads = [threading.Thread(target=lambda n=n: results.update({n: complete(lora_server, n)})) for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    expected = peft_greedy(lora_server.folder, lora_server.sql, PROMPT)  # copies of sql: its answer
    assert {name: token_ids(results[name]) for name in names} == {name: expected for name in names}
    assert_serves_on(lora_server)
    assert json.loads(httpx.get(f"{lora_server.url}/health", timeout=10).text)["status"] == "ok"


# ---- --api-server-count 2: the API processes share one table of adapters ------------------------------------


@pytest.fixture(scope="module")
def two_api_processes():
    folder = tiny_model_with_tokenizer("llama")
    sql = peft_adapter(folder, "sql", seed=1)
    server = ServerProcess(str(folder), "--served-model-name", BASE, "--enable-lora", "--lora-modules", f"sql={sql}",
                           "--max-loras", "2", "--max-lora-rank", "8", "--api-server-count", "2",
                           env={"TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    server.folder, server.sql = folder, sql
    yield server
    server.stop()


def answered_by(server, method: str, path: str, **kwargs) -> tuple[int, httpx.Response]:
    """(the index of the API process that answered, its response), on a connection of its own."""
    from tests.test_api_server_count import api_processes, holder

    with httpx.Client(timeout=120) as client:
        response = client.request(method, f"{server.url}{path}", **kwargs)
        client_port = response.extensions["network_stream"].get_extra_info("client_addr")[1]
        return holder(api_processes(server), client_port), response


def from_each_process(server, method: str, path: str, **kwargs) -> dict[int, list[httpx.Response]]:
    """Responses to the same request, on new connections, until each of the two API processes has answered."""
    by_process: dict[int, list[httpx.Response]] = {}
    for _ in range(60):
        index, response = answered_by(server, method, path, **kwargs)
        by_process.setdefault(index, []).append(response)
        if len(by_process.keys() - {None}) == 2 and sum(map(len, by_process.values())) >= 4:
            break
    assert by_process.keys() - {None} == {0, 1}, f"one API process answered every connection: {by_process.keys()}"
    return by_process


def test_every_api_process_agrees_on_each_runtime_adapter_and_runs_it_alone(two_api_processes, tmp_path):
    """Each API process kept its own table and id counter: one id named different adapters, a request for `x0`
    was answered with `g1`'s exact text, and /v1/models differed by process (hardening-4, High 3). Adapters
    loaded through either process are now listed alike by both, and each request runs under its own."""
    server = two_api_processes
    paths = {f"g{i}": peft_adapter(server.folder, f"g{i}", seed=10 + i) for i in range(4)}
    for name, path in paths.items():  # each load on a connection of its own: through either process
        response = load(server, name, path)
        assert response.status_code == 200, response.text
    listings = from_each_process(server, "GET", "/v1/models")
    expected_ids = [BASE, "sql", *paths]
    for index, responses in listings.items():
        assert all([card["id"] for card in r.json()["data"]] == expected_ids for r in responses), index
    paths["sql"] = server.sql
    expected = {name: peft_greedy(server.folder, path, PROMPT) for name, path in paths.items()}
    assert len({tuple(tokens) for tokens in expected.values()}) == len(expected)  # each adapter answers its own way
    for name in paths:
        body = {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
                "return_tokens_as_token_ids": True}
        for index, responses in from_each_process(server, "POST", "/v1/completions", json=body).items():
            assert [token_ids(r) for r in responses] == [expected[name]] * len(responses), (name, index)

    # Unloaded through one process: a 404 from both; loaded again (another adapter under the name): its answer.
    response = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "g0"}, timeout=30)
    assert response.status_code == 200, response.text
    body = {"model": "g0", "prompt": PROMPT, "max_tokens": 2}
    for responses in from_each_process(server, "POST", "/v1/completions", json=body).values():
        assert all(r.status_code == 404 and "g0" in r.text for r in responses)
    again = peft_adapter(server.folder, "g0-again", seed=30)
    assert load(server, "g0", again).status_code == 200
    body = {"model": "g0", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    for responses in from_each_process(server, "POST", "/v1/completions", json=body).values():
        assert [token_ids(r) for r in responses] == [peft_greedy(server.folder, again, PROMPT)] * len(responses)
    assert load(server, "g1", paths["g1"]).status_code == 400  # already loaded, whichever process is asked
