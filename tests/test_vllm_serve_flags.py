"""vLLM's `vllm serve` launch flags, taken by `tinyserve serve` (tinyserve/cli/vllm_flags.py).

Each is implemented (--return-tokens-as-token-ids), asks for what tinyserve always does
(--enable-chunked-prefill, --enable-prompt-tokens-details, --enable-tokenizer-info-endpoint),
changes nothing here and says so in one warning line (--disable-frontend-multiprocessing,
--show-hidden-metrics-for-version), or would change the output and is refused
(--no-enable-chunked-prefill). Parsed through `tinyserve serve`'s own parser; one test
starts a server with all of them, and with vLLM's `guidance` backend and a Lark grammar.
"""

import http.server
import logging
import re
import threading

import httpx
import pytest

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve.cli.engine_flags import engine_args_from
from tinyserve.cli.main import build_parser, main
from tinyserve.cli.vllm_flags import check_vllm_flags
from tinyserve.testing import ServerProcess

MODEL = "tiny"
IMPLEMENTED_OR_ALWAYS_ON = ("--return-tokens-as-token-ids", "--enable-chunked-prefill",
                            "--enable-prompt-tokens-details", "--enable-tokenizer-info-endpoint")
NO_EFFECT = {"--disable-frontend-multiprocessing": (), "--show-hidden-metrics-for-version": ("0.9",)}
ALL_FLAGS = (*IMPLEMENTED_OR_ALWAYS_ON, *(part for flag, value in NO_EFFECT.items() for part in (flag, *value)))


def parse(*flags: str):
    return build_parser().parse_args(["serve", *flags])


@pytest.mark.parametrize("flag", IMPLEMENTED_OR_ALWAYS_ON)
def test_a_flag_that_does_what_vllms_does_is_accepted_without_a_warning(flag, caplog):
    with caplog.at_level(logging.WARNING, logger="tinyserve.cli"):
        assert check_vllm_flags(parse(flag)) is None
    assert not caplog.records


@pytest.mark.parametrize("flag", NO_EFFECT)
def test_a_flag_that_changes_nothing_here_is_accepted_with_one_warning_naming_it(flag, caplog):
    with caplog.at_level(logging.WARNING, logger="tinyserve.cli"):
        assert check_vllm_flags(parse(flag, *NO_EFFECT[flag])) is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.getMessage().startswith(f"{flag} has no effect here: ")


def test_show_hidden_metrics_for_version_takes_a_version():
    assert parse("--show-hidden-metrics-for-version", "0.8").show_hidden_metrics_for_version == "0.8"
    with pytest.raises(SystemExit):
        parse("--show-hidden-metrics-for-version")  # vLLM's flag takes a value: so does this one


def test_return_tokens_as_token_ids_is_a_boolean_the_server_passes_on():
    assert parse().return_tokens_as_token_ids is False
    assert parse("--return-tokens-as-token-ids").return_tokens_as_token_ids is True


def test_return_tokens_as_token_ids_reaches_the_serving_context():
    from tinyserve.entrypoints.api.serving_engine import ServingContext

    assert ServingContext(engine=None, model_names=[MODEL]).return_tokens_as_token_ids is False
    context = ServingContext(engine=None, model_names=[MODEL], return_tokens_as_token_ids=True)
    assert context.tokens_as_ids(None) is True and context.tokens_as_ids(False) is False


def test_turning_chunked_prefill_off_is_refused_before_anything_starts(capsys):
    args = parse("--no-enable-chunked-prefill")
    assert args.enable_chunked_prefill is False
    assert "--no-enable-chunked-prefill is not implemented" in check_vllm_flags(args)
    assert main(["serve", "--no-enable-chunked-prefill"]) == 2  # the exit status of a bad command line
    assert "error: --no-enable-chunked-prefill is not implemented" in capsys.readouterr().err


def test_all_of_them_at_once_parse_and_every_flag_is_in_the_help(capsys):
    assert check_vllm_flags(parse(*ALL_FLAGS)) is None
    with pytest.raises(SystemExit):
        parse("--help")
    text = capsys.readouterr().out
    for flag in (*IMPLEMENTED_OR_ALWAYS_ON, *NO_EFFECT):
        assert flag in text
    assert "vLLM serves /tokenizer_info only with this flag" in " ".join(text.split())


@pytest.mark.parametrize("spelling", ["guidance", "llguidance"])
def test_guidance_is_vllms_name_for_the_llguidance_backend(spelling):
    args = parse("--structured-outputs-backend", spelling)
    assert engine_args_from(args).structured_outputs_backend == "llguidance"


class _Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver on loopback: the paths it was sent spans on."""

    paths: list = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.paths.append(self.path)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.server
def test_a_server_started_with_vllms_flags_answers_as_they_say():
    """One server for vLLM's launch line: these flags, vLLM's `guidance` backend with a Lark grammar, and
    --otlp-traces-endpoint (vLLM's name for --otlp-endpoint)."""
    lark = 'start: "id-" NUMBER\nNUMBER: /[0-9]{1,3}/'  # a Lark grammar, under vLLM's name for llguidance
    collector = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    server = ServerProcess(str(tiny_model_with_tokenizer("llama")), "--served-model-name", MODEL,
                           "--num-kv-blocks", "64", "--structured-outputs-backend", "guidance", *ALL_FLAGS,
                           "--otlp-traces-endpoint", endpoint)
    try:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Your number?"}], "max_tokens": 8,
                "temperature": 0, "logprobs": True, "top_logprobs": 1}
        answer = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
        content = answer["choices"][0]["logprobs"]["content"]
        assert content and all(re.fullmatch(r"token_id:\d+", entry["token"]) for entry in content)
        assert answer["usage"]["prompt_tokens_details"] is not None
        assert httpx.get(f"{server.url}/tokenizer_info", timeout=60).status_code == 200
        constrained = {**chat, "max_tokens": 16, "structured_outputs": {"grammar": lark}}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=constrained, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert re.fullmatch(r"id-[0-9]{1,3}", choice["message"]["content"]) and choice["finish_reason"] == "stop"
    finally:
        output = server.stop()  # the spans are flushed on the way out
        collector.shutdown()
    assert "/v1/traces" in _Collector.paths
    for flag in NO_EFFECT:
        assert output.count(f"{flag} has no effect here") == 1
