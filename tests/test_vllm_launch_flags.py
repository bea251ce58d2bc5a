"""vLLM's launch flags that vLLM's own tests and users' launch scripts pass (cli/vllm_flags.py).

Each one either starts the server and does what it does in vLLM, checked through the official
openai client and plain HTTP, or is refused by name with exit status 2 before anything loads.
"""

import base64
import io
import json
import subprocess
import sys

import httpx
import openai
import pytest
import torch

from tests.hf_reference import hf_model
from tests.shared_server import MAX_MODEL_LEN, MODEL, model_folder
from tinyserve.cli.main import main
from tinyserve.cli.vllm_flags import vllm_argv
from tinyserve.testing import ServerProcess, free_port

# A template unlike the model's ChatML one, so that what it renders is unmistakable.
TEMPLATE = ("{% for message in messages %}<<{{ message['role'] }}>> {{ message['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>> {% endif %}")
METRICS_FIELDS = {"time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second"}


# ---- spellings: no server --------------------------------------------------------------


def test_underscore_spellings_become_the_dashed_flags():
    assert vllm_argv(["serve", "--max_model_len", "4096", "--served_model_name=a_b", "--max-num-seqs", "8"]) == \
        ["serve", "--max-model-len", "4096", "--served-model-name=a_b", "--max-num-seqs", "8"]
    # values are left alone: a negative number, a path with dots, anything after "--"
    assert vllm_argv(["complete", "--temperature", "-0.5", "--trace-dir=./a.b", "--", "--x_y"]) == \
        ["complete", "--temperature", "-0.5", "--trace-dir=./a.b", "--", "--x_y"]


def test_dotted_flags_become_one_json_object_merged_with_the_whole_one():
    assert vllm_argv(["serve", "--structured-outputs-config.backend", "xgrammar"]) == \
        ["serve", "--structured-outputs-config", '{"backend": "xgrammar"}']
    argv = vllm_argv(["serve", "--speculative-config", '{"method": "ngram"}',
                      "--speculative_config.num_speculative_tokens=3", "--speculative-config.x.y", "z"])
    assert argv[:2] == ["serve", "--speculative-config"]
    assert json.loads(argv[2]) == {"method": "ngram", "num_speculative_tokens": 3, "x": {"y": "z"}}
    assert len(argv) == 3


@pytest.mark.parametrize("flags, named", [
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["--chat-template", "{% for m in messages %}{{ m.content }"], "--chat-template"),
])
def test_a_flag_that_would_change_outputs_unimplemented_is_refused_by_name(flags, named, capsys):
    assert main(["serve", *flags]) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("config, named", [
    ('{"backend": "outlines"}', "backend"),
    ('{"reasoning_parser": "qwen3"}', "reasoning_parser"),
    ('{"no_such_field": 1}', "no_such_field"),
])
def test_structured_outputs_config_refuses_what_it_cannot_do(config, named, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--structured-outputs-config", config])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err


def test_structured_outputs_config_backend_is_the_engine_backend():
    from tinyserve.cli.engine_flags import structured_outputs_backend
    from tinyserve.cli.main import build_parser

    def backend(*flags):
        return structured_outputs_backend(build_parser().parse_args(vllm_argv(["serve", *flags])))

    assert backend() == "xgrammar"
    assert backend("--structured-outputs-config.backend", "guidance") == "guidance"
    assert backend("--structured-outputs-config.backend", "auto") == "xgrammar"
    assert backend("--structured-outputs-backend", "llguidance") == "llguidance"


# ---- one server with all of them -----------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "template.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess(model_folder(), "--served_model_name", MODEL, "--num_kv_blocks", "512",
                         "--max_model_len", str(MAX_MODEL_LEN), "--chat-template", str(template),
                         "--structured-outputs-config.backend", "xgrammar", "--enable-per-request-metrics",
                         "--metrics-prefix", "vllm", "--enable-prompt-embeds")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(vllm_server):
    return openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.server
def test_the_chat_template_flag_renders_chats(vllm_server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    rendered = "<<system>> Be brief.\n<<user>> Hello\n<<assistant>> "
    as_chat = httpx.post(f"{vllm_server.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    as_text = httpx.post(f"{vllm_server.url}/tokenize",
                         json={"model": MODEL, "prompt": rendered, "add_special_tokens": False}).json()
    assert as_chat["tokens"] == as_text["tokens"]
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert answer.usage.prompt_tokens == len(as_text["tokens"])
    # the same greedy tokens as the rendered text sent as a completion
    completion = client.completions.create(model=MODEL, prompt=as_text["tokens"], max_tokens=4, temperature=0)
    assert answer.choices[0].message.content == completion.choices[0].text
    info = httpx.get(f"{vllm_server.url}/tokenizer_info").json()
    assert info["chat_template"] == TEMPLATE


@pytest.mark.server
def test_the_dotted_structured_outputs_backend_constrains(client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "pick"}], max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert answer.choices[0].message.content in ("yes", "no")


def check_metrics(metrics: dict, num_generated: int) -> None:
    assert set(metrics) >= METRICS_FIELDS
    assert metrics["queue_time_ms"] >= 0 and metrics["time_to_first_token_ms"] > 0
    assert metrics["generation_time_ms"] >= 0 and metrics["tokens_per_second"] > 0
    assert (metrics["mean_itl_ms"] is None) == (num_generated < 2)


@pytest.mark.server
def test_per_request_metrics_ride_on_answers(vllm_server, client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0, extra_body={"ignore_eos": True})
    check_metrics(chat.model_extra["metrics"], chat.usage.completion_tokens)
    completion = client.completions.create(model=MODEL, prompt="Flat is", max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
    check_metrics(completion.model_extra["metrics"], 6)
    # streamed: on the usage chunk, and only there
    chunks = list(client.completions.create(model=MODEL, prompt="Flat is", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert [c for c in chunks[:-1] if (c.model_extra or {}).get("metrics")] == []
    check_metrics(chunks[-1].model_extra["metrics"], 6)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    check_metrics(chunks[-1].model_extra["metrics"], 6)
    # several sequences: no metrics, as in vLLM (whose timestamps would they be?)
    several = httpx.post(f"{vllm_server.url}/v1/completions", timeout=60,
                         json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2}).json()
    assert "metrics" not in several
    several = httpx.post(f"{vllm_server.url}/v1/chat/completions", timeout=60,
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2,
                               "max_tokens": 2}).json()
    assert "metrics" not in several


# ---- run-batch --------------------------------------------------------------------------------


@pytest.mark.slow
def test_run_batch_serves_metrics_while_it_runs(tmp_path):
    port = free_port()
    body = {"model": MODEL, "prompt": "Beautiful is", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": "/v1/completions", "body": body})
             for i in range(16)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    process = subprocess.Popen(
        [sys.executable, "-m", "tinyserve.cli.main", "run-batch", "-i", str(tmp_path / "in.jsonl"), "-o",
         str(tmp_path / "out.jsonl"), model_folder(), "--served-model-name", MODEL, "--num-kv-blocks", "512",
         "--enable-metrics", "--host", "127.0.0.1", "--port", str(port), "--metrics-prefix", "vllm"],
        stderr=subprocess.PIPE, text=True)
    try:
        for line in process.stderr:
            if "/metrics" in line:
                break
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert "vllm:num_requests_running" in scraped
        rest = process.stderr.read()
        assert process.wait(120) == 0, rest
    finally:
        process.kill()
        process.wait()
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 16


# ---- --enable-prompt-embeds: completions' prompt_embeds ----------------------------------------


def encoded(tensor: torch.Tensor) -> str:
    """A tensor as vLLM's clients send prompt_embeds: torch.save's bytes in base64."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


def embeddings_of(vllm_server, text: str) -> tuple[list[int], torch.Tensor]:
    ids = httpx.post(f"{vllm_server.url}/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    with torch.no_grad():
        return ids, hf_model(model_folder()).get_input_embeddings()(torch.tensor(ids)).clone()


@pytest.mark.server
def test_prompt_embeds_complete_as_the_same_prompt_as_tokens(vllm_server, client):
    ids, embeds = embeddings_of(vllm_server, "Flat is better than nested")
    other_ids, other = embeddings_of(vllm_server, "Sparse is better")
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0, "extra_body": {"ignore_eos": True}}
    by_ids = client.completions.create(prompt=ids, **greedy)
    by_embeds = client.completions.create(prompt=None, **{**greedy, "extra_body": {
        "ignore_eos": True, "prompt_embeds": encoded(embeds)}})
    assert by_embeds.choices[0].text == by_ids.choices[0].text
    assert by_embeds.usage.prompt_tokens == len(ids)
    stream = client.completions.create(prompt=None, stream=True, **{**greedy, "extra_body": {
        "ignore_eos": True, "prompt_embeds": encoded(embeds)}})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == by_ids.choices[0].text
    # a list of two, and a prompt beside them: one choice each, the embeddings first (as vLLM orders them)
    both = client.completions.create(prompt=other_ids, **{**greedy, "extra_body": {
        "ignore_eos": True, "prompt_embeds": [encoded(embeds), encoded(other[None])]}})
    other_text = client.completions.create(prompt=other_ids, **greedy).choices[0].text
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == \
        [by_ids.choices[0].text, other_text, other_text]
    assert both.usage.prompt_tokens == len(ids) + 2 * len(other_ids)


@pytest.mark.server
def test_malformed_prompt_embeds_are_a_400_naming_them(vllm_server):
    _, embeds = embeddings_of(vllm_server, "Flat is better")
    cases = {
        "not base64": "not base64!",
        "could not be read": base64.b64encode(b"plain bytes").decode(),
        "dense torch tensor": encoded({"rows": embeds}),
        "hidden_size": encoded(embeds[:, :-1]),
        "2-D": encoded(embeds[None].repeat(2, 1, 1)),
        "not finite": encoded(torch.full_like(embeds, float("nan"))),
        "max_model_len": encoded(embeds[:1].repeat(MAX_MODEL_LEN + 1, 1)),
        "more than a tensor": "A" * (MAX_MODEL_LEN * embeds.shape[1] * 12),
    }
    for named, prompt_embeds in cases.items():
        response = httpx.post(f"{vllm_server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 2, "prompt_embeds": prompt_embeds})
        assert response.status_code == 400, (named, response.text)
        error = response.json()["error"]
        assert error["param"] == "prompt_embeds" and named in error["message"], (named, error)
    for field, value in [("echo", True), ("prompt_logprobs", 1), ("truncate_prompt_tokens", 2)]:
        response = httpx.post(f"{vllm_server.url}/v1/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 2, "prompt_embeds": encoded(embeds), field: value})
        assert response.status_code == 400 and response.json()["error"]["param"] == field, response.text
