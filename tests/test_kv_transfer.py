"""The KV connector's two halves, in one process: a prefill engine (kv_producer) and a decode engine
(kv_consumer), each an offline LLM, hand a prompt's K/V over as vLLM's disaggregated prefill does.

The decode engine's greedy tokens equal transformers' own; it computes one prompt token (the last,
to sample from, as vLLM recomputes it) and receives the rest; a pull that cannot complete fails its
request, named, and no KV block stays held on either side. The attacks, with real ZeroMQ peers (a
misbehaving producer in a process of its own, tests/fake_kv_producer.py): kv_transfer_params a client
made up are refused before anything connects; a peer's NaN or misshapen K/V fail their request and
enter no prefix cache; a frame larger than a layer's blocks is dropped at its header, the consumer's
memory unchanged; pulls from a silent peer time out and free their threads. The scheduler side alone, with the worker's
reports written by hand: WAITING_FOR_REMOTE_KVS, an abort mid-pull, a failed pull. tests/test_kv_transfer_server.py
runs the same through `tinyserve serve` and the router's P/D mode.
"""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.hf_reference import MAX_TOKENS, hf_greedy
from tests.patience import patient
from tests.required_tools import missing
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.distributed.kv_transfer.config import KVTransferConfig, default_connector
from tinyserve.distributed.kv_transfer.metadata import prompt_hash
from tinyserve.distributed.kv_transfer.trust import SECRET_ENV, sign_params
from tinyserve.errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 4
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 61, 7, 12, 33], [300, 2, 2, 140, 9, 77, 18, 4, 4, 4, 51, 6, 90, 13, 27, 8]]
CONNECTORS = ["ZmqConnector", "MooncakeConnector"]


def needs_loadable(connector: str) -> None:
    """Mooncake's transfer engine needs its wheel (the [pd] extra) and the system's libibverbs1 (.ci/run)."""
    if connector == "MooncakeConnector" and default_connector() != "MooncakeConnector":
        missing("Mooncake's transfer engine does not load here (pip install -e '.[pd]'; Debian: libibverbs1)")


SECRET = "a secret the test's engines share"


@pytest.fixture(autouse=True)
def shared_secret(monkeypatch):
    """Every engine of these tests is a peer of the others: they share the secret (trust.py)."""
    monkeypatch.setenv(SECRET_ENV, SECRET)


@pytest.fixture(scope="module")
def folder():
    return str(tiny_model_with_tokenizer("llama"))


def engine(folder, connector: str, role: str, **extra) -> LLM:
    config = {"kv_connector": connector, "kv_role": role, **({"kv_connector_extra_config": extra} if extra else {})}
    return LLM(folder, kv_transfer_config=config, num_kv_blocks=64, block_size=BLOCK_SIZE)


def greedy(max_tokens: int, kv_transfer_params: dict) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, extra_args={"kv_transfer_params": kv_transfer_params})


def blocks_in_use(llm: LLM) -> int:
    return llm.engine_core.kv_cache_manager.pool.num_used_blocks


def step_until_released(llm: LLM, seconds: float = 10) -> None:
    """A producer frees the blocks it kept for a consumer at its next steps after the pull (or the timeout)."""
    core, deadline = llm.engine_core, time.monotonic() + patient(seconds)
    while core.scheduler.held:
        assert time.monotonic() < deadline, f"blocks still held for {list(core.scheduler.held)}"
        core.step()


@pytest.mark.parametrize("connector", CONNECTORS)
def test_a_decode_engine_continues_from_the_prefill_engines_kv_as_transformers_does(folder, connector):
    needs_loadable(connector)
    producer, consumer = engine(folder, connector, "kv_producer"), engine(folder, connector, "kv_consumer")
    prefills = producer.generate(PROMPTS, greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = [output.kv_transfer_params for output in prefills]
    for prompt, handed in zip(PROMPTS, params):  # vLLM's fields, as its NixlConnector returns them
        assert handed["do_remote_prefill"] is True and handed["do_remote_decode"] is False
        assert len(handed["remote_block_ids"]) == -(-len(prompt) // BLOCK_SIZE)
        assert {"remote_engine_id", "remote_host", "remote_port", "remote_request_id"} <= set(handed)
    assert blocks_in_use(producer) == sum(len(p["remote_block_ids"]) for p in params)  # kept for the consumer

    decodes = consumer.generate(PROMPTS, [greedy(MAX_TOKENS, p) for p in params], use_tqdm=False)
    for prompt, output in zip(PROMPTS, decodes):
        assert output.outputs[0].token_ids == hf_greedy(folder, prompt)
        # computed here: the last prompt token only (its logits give the first token), as vLLM does
        assert [tokens for _, tokens in output.metrics.prefill_chunks] == [1]
        assert output.num_cached_tokens == len(prompt) - 1
    step_until_released(producer)
    assert blocks_in_use(producer) == 0 and blocks_in_use(consumer) == 0
    assert consumer.engine_core.scheduler.num_received_tokens == {}  # kept while a request runs, traced or not
    for llm in (producer, consumer):
        llm.engine_core.model_runner.connector.close()


def test_a_pull_that_cannot_complete_fails_its_request_by_name_and_frees_its_blocks(folder):
    producer = engine(folder, "ZmqConnector", "kv_producer", abort_request_timeout=0.5)
    consumer = engine(folder, "ZmqConnector", "kv_consumer", transfer_timeout=5)
    [prefill] = producer.generate([PROMPTS[0]], greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    params = prefill.kv_transfer_params
    # Nobody pulls: the producer frees the blocks after abort_request_timeout (vLLM's NIXL abort timeout).
    step_until_released(producer)
    assert blocks_in_use(producer) == 0
    # The blocks are gone there: the producer refuses the pull, and the request fails saying so.
    with pytest.raises(InvalidInputError, match="holds no K/V for request .*: freed, nobody having pulled them") as refused:
        consumer.generate([PROMPTS[0]], greedy(4, params), use_tqdm=False)
    assert refused.value.param == "kv_transfer_params"
    producer.engine_core.model_runner.connector.close()
    # The producer's engine is gone (its side channel closed): the connection fails, named.
    with pytest.raises(InvalidInputError, match=f"KV transfer from 127.0.0.1:{params['remote_port']} failed"):
        consumer.generate([PROMPTS[0]], greedy(4, params), use_tqdm=False)
    assert blocks_in_use(consumer) == 0 and not consumer.engine_core.scheduler.held
    consumer.engine_core.model_runner.connector.close()


@pytest.mark.parametrize(("config", "message"), [
    ({"kv_role": "kv_decoder"}, "kv_role must be one of"),
    ({"kv_role": "kv_both", "kv_connector": "NixlConnector"}, "kv_connector must be one of"),
    ({"kv_role": "kv_both", "kv_buffer_size": 1e9}, "unknown or unsupported field"),
    ({"kv_role": "kv_both", "kv_connector_extra_config": {"timeout": 3}}, "unknown field"),
    ({"kv_role": "kv_both", "kv_connector_extra_config": {"transfer_timeout": -1}}, "positive number"),
])
def test_bad_kv_transfer_configs_are_refused_naming_the_field(config, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_dict(config)


def test_kv_transfer_params_an_engine_cannot_serve_are_refused_naming_the_field(folder, pair):
    producer, consumer = pair
    with pytest.raises(InvalidInputError, match="do_remote_prefill needs a decode engine") as refused:
        producer.generate([PROMPTS[0]], greedy(2, {"do_remote_prefill": True}), use_tqdm=False)
    assert refused.value.param == "kv_transfer_params"
    consumer_params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                       "remote_request_id": "x", "remote_block_ids": [1, 2, 3], "remote_num_tokens": 99}
    with pytest.raises(InvalidInputError, match="for a prompt of 99 tokens"):
        consumer.generate([PROMPTS[0]], greedy(2, consumer_params), use_tqdm=False)
    with pytest.raises(InvalidInputError, match="kv_transfer_params needs an engine started with"):
        LLM(folder, num_kv_blocks=16).generate([PROMPTS[0]], greedy(2, {"do_remote_decode": True}), use_tqdm=False)


@pytest.mark.parametrize(("flags", "message"), [
    (["--prefill", "http://a:1"], "needs both --prefill URL ... and --decode URL"),
    (["--prefill", "http://a:1", "--decode", "http://b:1", "--backend", "http://c:1"], "take the place of --backend"),
    (["--prefill", "a:1", "--decode", "http://b:1"], "is not an http(s) URL"),
    (["--prefill", "http://a:1", "--decode", "http://a:1"], "the same URL twice"),
])
def test_the_routers_prefill_decode_flags_are_checked_naming_them(flags, message, capsys):
    from tinyserve.cli.main import main

    assert main(["router", *flags]) == 2
    assert message in capsys.readouterr().err


# ---- attacks: a client's own kv_transfer_params, peers that misbehave (real ZeroMQ peers) ----------------

SHARED_PREFIX = [9, 40, 41, 7, 300, 12, 5, 5, 6, 200, 31, 8, 70, 71, 72, 73]  # four full blocks
ATTACKED = [11, 400, 3, 3, 60, 61, 62, 9, 9, 100, 150, 2, 17, 18, 19, 20]  # a prompt no other test sends


@pytest.fixture(scope="module")
def pair(folder):
    """(producer, consumer): one prefill engine and one decode engine sharing the secret; the consumer
    gives a pull 4 s (transfer_timeout)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SECRET_ENV, SECRET)
        producer, consumer = engine(folder, "ZmqConnector", "kv_producer"), \
            engine(folder, "ZmqConnector", "kv_consumer", transfer_timeout=4)
    yield producer, consumer
    for llm in (producer, consumer):
        llm.engine_core.model_runner.connector.close()


@pytest.fixture(scope="module")
def fake_producer():
    """The port of a side channel that holds the secret and misbehaves (tests/fake_kv_producer.py)."""
    process = subprocess.Popen([sys.executable, "-m", "tests.fake_kv_producer"], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, SECRET_ENV: SECRET, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    yield int(process.stdout.readline())
    process.kill()
    process.wait(30)


def signed(prompt: list[int], port: int, remote_request_id: str) -> dict:
    """kv_transfer_params as a prefill engine holding the secret would hand them out, naming `port`."""
    params = {"do_remote_prefill": True, "remote_engine_id": "fake", "remote_host": "127.0.0.1",
              "remote_port": port, "remote_request_id": remote_request_id,
              "remote_block_ids": list(range(-(-len(prompt) // BLOCK_SIZE))), "remote_num_tokens": len(prompt),
              "remote_prompt_hash": prompt_hash(prompt)}
    return {**params, "remote_signature": sign_params(SECRET, params)}


def run_together(llm: LLM, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Queue every request at once on the engine and step until all have finished; request id -> its last
    EngineCoreOutput (an error included: LLM.generate would raise at the first)."""
    from tinyserve.frontend.input_processor import ProcessedPrompt

    core, finished = llm.engine_core, {}
    for request_id, (prompt, params) in requests.items():
        [request] = llm.llm_engine.make_requests(request_id, ProcessedPrompt(None, prompt), params)
        core.add_request(request)
    tokens = {request_id: [] for request_id in requests}
    deadline = time.monotonic() + patient(60)
    while len(finished) < len(requests):
        assert time.monotonic() < deadline, f"still running: {sorted(set(requests) - set(finished))}"
        for output in core.step().outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.finished:
                finished[output.request_id] = (output, tokens[output.request_id])
    return finished


def test_kv_transfer_params_no_peer_signed_are_refused_before_anything_connects(pair):
    """A client's own kv_transfer_params naming a host and port of its choosing (a fake producer, a port to
    probe): refused with the same answer whether a port is open or closed, and nothing connects to it."""
    producer, consumer = pair
    [prefill] = producer.generate([SHARED_PREFIX], greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    genuine = prefill.kv_transfer_params
    assert genuine["remote_signature"] == sign_params(SECRET, genuine)
    listening = socket.create_server(("127.0.0.1", 0))  # a port something listens on
    listening.setblocking(False)
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    unsigned = {k: v for k, v in genuine.items() if k != "remote_signature"}
    for forged in ({**genuine, "remote_port": listening.getsockname()[1]}, {**genuine, "remote_port": closed_port},
                   {**genuine, "remote_host": "10.255.255.1"}, unsigned, {**genuine, "remote_signature": "0" * 64}):
        with pytest.raises(InvalidInputError, match="remote_signature does not match") as refused:
            consumer.generate([SHARED_PREFIX], greedy(4, forged), use_tqdm=False)
        assert refused.value.param == "kv_transfer_params"
    with pytest.raises(BlockingIOError):  # the refusal came before any connection
        listening.accept()
    listening.close()
    # A peer's genuine parameters, for another prompt of the same length: refused too.
    with pytest.raises(InvalidInputError, match="computed another prompt's K/V"):
        consumer.generate([[*SHARED_PREFIX[:-1], 1]], greedy(4, genuine), use_tqdm=False)
    [decoded] = consumer.generate([SHARED_PREFIX], greedy(4, genuine), use_tqdm=False)  # they still serve
    assert decoded.num_cached_tokens == len(SHARED_PREFIX) - 1
    step_until_released(producer)


def test_an_engine_without_the_secret_neither_hands_out_nor_pulls_kv_naming_the_variable():
    from tinyserve.distributed.kv_transfer.params import check_kv_transfer_params

    config = KVTransferConfig("ZmqConnector", "kv_both", "engine")  # no shared_secret
    for params in ({"do_remote_decode": True}, signed(SHARED_PREFIX, 1, "r")):
        with pytest.raises(InvalidInputError, match=f"it has none: set {SECRET_ENV}"):
            check_kv_transfer_params(config, BLOCK_SIZE, SHARED_PREFIX, greedy(4, params))


def test_a_peer_serving_non_finite_or_misshapen_kv_fails_its_request_and_nothing_enters_the_prefix_cache(
        pair, fake_producer):
    """A producer holding the secret but serving garbage for a shared prompt: the request fails by name, and a
    later request sharing the prefix is computed here, right, from no cached block."""
    producer, consumer = pair
    for kind, message in (("nan", "K/V received for layer 0 hold non-finite values"),
                          ("short", "bytes for layer 0; 4 blocks of this engine's layout take")):
        with pytest.raises(InvalidInputError, match=message):
            consumer.generate([ATTACKED], greedy(4, signed(ATTACKED, fake_producer, f"{kind}-1")), use_tqdm=False)
        assert blocks_in_use(consumer) == 0
    victim = [*ATTACKED, 3, 4]
    [answer] = consumer.generate([victim], greedy(MAX_TOKENS, {}), use_tqdm=False)
    [expected] = producer.generate([victim], greedy(MAX_TOKENS, {}), use_tqdm=False)  # a plain engine, elsewhere
    assert answer.num_cached_tokens == 0 and answer.outputs[0].token_ids == expected.outputs[0].token_ids


def test_a_frame_over_a_layers_size_is_dropped_at_its_header_and_the_consumers_memory_stays_bounded(
        pair, fake_producer):
    producer, consumer = pair
    huge = 128 << 20
    me, peak, pulling = psutil.Process(), [], threading.Event()

    def sample() -> None:  # the consumer's memory while the pull runs (a frame read whole would show)
        while not pulling.is_set():
            peak.append(me.memory_info().rss)
            pulling.wait(0.005)

    before, sampler = me.memory_info().rss, threading.Thread(target=sample)
    sampler.start()
    try:
        with pytest.raises(InvalidInputError, match=r"sent a frame over the \d+ bytes a layer's blocks take"):
            consumer.generate([SHARED_PREFIX], greedy(4, signed(SHARED_PREFIX, fake_producer, f"huge-{huge}")),
                              use_tqdm=False)
    finally:
        pulling.set()
        sampler.join()
    assert max(peak) - before < huge // 4, f"the consumer grew by {(max(peak) - before) >> 20} MiB"
    assert blocks_in_use(consumer) == 0


def test_pulls_from_a_silent_peer_time_out_and_free_their_threads_for_a_real_pull(pair, fake_producer):
    """Four pulls from a peer that never answers hold every pull thread; each fails after transfer_timeout,
    named, and a real transfer queued behind them then lands and decodes."""
    producer, consumer = pair
    [prefill] = producer.generate([PROMPTS[1]], greedy(1, {"do_remote_decode": True}), use_tqdm=False)
    silent = {f"s{i}": (SHARED_PREFIX, greedy(4, signed(SHARED_PREFIX, fake_producer, f"silent-{i}")))
              for i in range(4)}
    finished = run_together(consumer, {**silent, "real": (PROMPTS[1], greedy(MAX_TOKENS, prefill.kv_transfer_params))})
    for request_id in silent:
        output, _ = finished[request_id]
        assert output.finish_reason == "abort" and output.error_param == "kv_transfer_params"
        assert f"KV transfer from 127.0.0.1:{fake_producer} failed: no answer within 4 s" in output.error
    output, tokens = finished["real"]
    [expected] = producer.generate([PROMPTS[1]], greedy(MAX_TOKENS, {}), use_tqdm=False)  # a plain engine
    assert output.error is None and tokens == expected.outputs[0].token_ids
    step_until_released(producer)
    assert blocks_in_use(consumer) == 0 and blocks_in_use(producer) == 0


# ---- the scheduler side alone: plain Python, the worker's reports written by hand -------------------------


def consumer_scheduler(num_blocks: int = 16):
    from tinyserve.distributed.kv_transfer.connector_scheduler import KVConnectorSchedulerSide
    from tinyserve.distributed.kv_transfer.scheduler import KVConnectorScheduler
    from tinyserve.engine.core.kv_cache_manager import KVCacheManager

    config = KVTransferConfig.from_dict({"kv_connector": "ZmqConnector", "kv_role": "kv_both"})
    connector = KVConnectorSchedulerSide(config, BLOCK_SIZE, side_channel=(config.kv_ip, config.kv_port))
    return KVConnectorScheduler(KVCacheManager(num_blocks, BLOCK_SIZE), max_num_batched_tokens=64, max_num_seqs=4,
                                max_model_len=128, connector=connector, transfers_ended=lambda: False)


def remote_request(request_id: str, prompt: list[int]):
    from tinyserve.engine.core.request import Request

    params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1, "remote_request_id": "p",
              "remote_block_ids": list(range(-(-len(prompt) // BLOCK_SIZE))), "remote_num_tokens": len(prompt)}
    return Request(request_id, prompt, greedy(8, params), eos_token_ids=[0], arrival_time=0.0)


def reported(**fields):
    from tinyserve.distributed.kv_transfer.metadata import KVConnectorOutput
    from tinyserve.engine.worker.model_runner import ModelRunnerOutput

    return ModelRunnerOutput({}, {}, kv_connector_output=KVConnectorOutput(**fields))


def test_a_request_waits_for_its_kv_then_computes_only_its_last_prompt_token():
    from tinyserve.engine.core.request import RequestStatus

    scheduler, prompt = consumer_scheduler(), PROMPTS[1]
    scheduler.add_request(request := remote_request("r", prompt))
    out = scheduler.schedule()
    [pull] = out.kv_connector_metadata.reqs_to_recv  # its blocks allocated, the pull asked for, nothing computed
    assert out.is_empty and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(pull.local_block_ids) == 4 and pull.remote_request_id == "p"
    assert scheduler.schedule().is_empty  # still arriving: passed over
    scheduler.update_from_output(scheduler.schedule(), reported(finished_recving=["r"]))
    [scheduled] = scheduler.schedule().scheduled_new_requests
    assert (scheduled.num_computed_tokens, scheduled.num_new_tokens) == (len(prompt) - 1, 1)
    assert scheduled.block_ids == pull.local_block_ids


def test_an_abort_while_the_kv_arrives_frees_the_blocks_only_once_the_pull_ends_and_a_failure_fails_by_name():
    scheduler = consumer_scheduler()
    scheduler.add_request(remote_request("a", PROMPTS[0]))
    scheduler.add_request(remote_request("b", PROMPTS[1]))
    scheduler.schedule()
    used = scheduler.kv.pool.num_used_blocks
    assert used == 3 + 4
    scheduler.abort_requests(["a"])  # its pull may still be writing into its blocks
    assert scheduler.kv.pool.num_used_blocks == used and "a" in scheduler.held
    [failed] = scheduler.update_from_output(scheduler.schedule(), reported(
        finished_recving=["a"], failed_recving={"b": "the KV transfer from 127.0.0.1:1 failed: it went away"}))
    assert failed.request_id == "b" and failed.finish_reason == "abort" and failed.error_param == "kv_transfer_params"
    assert "went away" in failed.error
    assert scheduler.kv.pool.num_used_blocks == 0 and not scheduler.held and not scheduler.has_unfinished_requests
