"""The KV connector's two halves, in one process: a prefill engine (kv_producer) and a decode engine
(kv_consumer), each an offline LLM, hand a prompt's K/V over as vLLM's disaggregated prefill does.

The decode engine's greedy tokens equal transformers' own; it computes one prompt token (the last,
to sample from, as vLLM recomputes it) and receives the rest; a pull that cannot complete fails its
request, named, and no KV block stays held on either side. The scheduler side alone, with the worker's
reports written by hand: WAITING_FOR_REMOTE_KVS, an abort mid-pull, a failed pull. tests/test_kv_transfer_server.py
runs the same through `tinyserve serve` and the router's P/D mode.
"""

import time

import pytest

from tests.hf_reference import MAX_TOKENS, hf_greedy
from tests.patience import patient
from tests.required_tools import missing
from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tinyserve import LLM, SamplingParams
from tinyserve.distributed.kv_transfer.config import KVTransferConfig, default_connector
from tinyserve.errors import InvalidInputError

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 61, 7, 12, 33], [300, 2, 2, 140, 9, 77, 18, 4, 4, 4, 51, 6, 90, 13, 27, 8]]
CONNECTORS = ["ZmqConnector", "MooncakeConnector"]


def needs_loadable(connector: str) -> None:
    """Mooncake's transfer engine needs its wheel (the [pd] extra) and the system's libibverbs1 (.ci/run)."""
    if connector == "MooncakeConnector" and default_connector() != "MooncakeConnector":
        missing("Mooncake's transfer engine does not load here (pip install -e '.[pd]'; Debian: libibverbs1)")


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


def test_kv_transfer_params_an_engine_cannot_serve_are_refused_naming_the_field(folder):
    producer = engine(folder, "ZmqConnector", "kv_producer")
    with pytest.raises(InvalidInputError, match="do_remote_prefill needs a decode engine") as refused:
        producer.generate([PROMPTS[0]], greedy(2, {"do_remote_prefill": True}), use_tqdm=False)
    assert refused.value.param == "kv_transfer_params"
    consumer_params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
                       "remote_request_id": "x", "remote_block_ids": [1, 2, 3], "remote_num_tokens": 99}
    consumer = engine(folder, "ZmqConnector", "kv_consumer")
    with pytest.raises(InvalidInputError, match="for a prompt of 99 tokens"):
        consumer.generate([PROMPTS[0]], greedy(2, consumer_params), use_tqdm=False)
    with pytest.raises(InvalidInputError, match="kv_transfer_params needs an engine started with"):
        LLM(folder, num_kv_blocks=16).generate([PROMPTS[0]], greedy(2, {"do_remote_decode": True}), use_tqdm=False)
    for llm in (producer, consumer):
        llm.engine_core.model_runner.connector.close()


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


# ---- the scheduler side alone: plain Python, the worker's reports written by hand -------------------------


def consumer_scheduler(num_blocks: int = 16):
    from tinyserve.distributed.kv_transfer.connector_scheduler import KVConnectorSchedulerSide
    from tinyserve.distributed.kv_transfer.scheduler import KVConnectorScheduler
    from tinyserve.engine.core.kv_cache_manager import KVCacheManager

    config = KVTransferConfig.from_dict({"kv_connector": "ZmqConnector", "kv_role": "kv_both"})
    return KVConnectorScheduler(KVCacheManager(num_blocks, BLOCK_SIZE), max_num_batched_tokens=64, max_num_seqs=4,
                                max_model_len=128, connector=KVConnectorSchedulerSide(config, BLOCK_SIZE))


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
