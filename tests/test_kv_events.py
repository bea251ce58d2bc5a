"""KV cache events from the block pool, without a process: what vLLM's subscribers are told, and when.

The pool's event sink is the recorder (kv_events/recorder.py); each drain is what one step
publishes. The wire format and a real publisher are checked end to end in tests/test_router.py.
"""

import hashlib

import msgspec
import pytest

from tinyserve.engine.core.kv_cache_manager import KVCacheManager
from tinyserve.engine.core.request import Request
from tinyserve.kv_events.config import KVEventsConfig, offset_endpoint_port
from tinyserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tinyserve.kv_events.recorder import KVEventRecorder
from tinyserve.lora.request import LoRARequest
from tinyserve.sampling_params import SamplingParams

BLOCK = 4


def chained(token_ids: list[int], root: bytes = b"") -> list[int]:
    """SHA-256 over the parent's digest and each block's ids as little-endian int64s; the low 64 bits, big-endian."""
    out, parent = [], root
    for start in range(0, len(token_ids) - BLOCK + 1, BLOCK):
        block = token_ids[start:start + BLOCK]
        parent = hashlib.sha256(parent + b"".join(t.to_bytes(8, "little", signed=True) for t in block)).digest()
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def make(num_blocks: int) -> tuple[KVCacheManager, KVEventRecorder]:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BLOCK)
    kv.pool.event_sink = recorder = KVEventRecorder(BLOCK, "CPU")
    return kv, recorder


def run(kv: KVCacheManager, request_id: str, prompt: list[int], lora=None) -> Request:
    request = Request(request_id, prompt, SamplingParams(max_tokens=1), eos_token_ids=[], arrival_time=0.0,
                      lora_request=lora)
    blocks, cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - cached, blocks)
    request.num_computed_tokens = request.num_tokens
    kv.free(request)
    return request


def test_a_prompts_full_blocks_are_one_stored_event_chained_from_none():
    kv, recorder = make(8)
    prompt = list(range(100, 110))  # two full blocks and two tokens more
    run(kv, "a", prompt)
    assert recorder.drain() == [BlockStored(chained(prompt), None, prompt[:8], BLOCK, None, "CPU")]
    assert recorder.drain() == []  # drained once
    run(kv, "b", prompt + [7, 7])  # the same two blocks (a hit, nothing new), then a third
    [third] = recorder.drain()
    assert third.block_hashes == chained(prompt + [7, 7])[2:] and third.parent_block_hash == chained(prompt)[1]
    assert third.token_ids == (prompt + [7, 7])[8:12]


def test_eviction_is_a_removed_event_and_a_reset_clears_all_without_one_per_block():
    kv, recorder = make(3)
    first = list(range(8))
    run(kv, "a", first)
    recorder.drain()
    run(kv, "b", list(range(50, 62)))  # three blocks: the pool's every block, so both of first's go
    events = recorder.drain()
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(chained(first))
    assert isinstance(events[0], BlockRemoved) and isinstance(events[-1], BlockStored)  # in the order they happened
    assert kv.reset_prefix_cache()
    assert recorder.drain() == [AllBlocksCleared()]


def test_an_adapters_first_block_names_it_and_chains_from_its_own_root():
    kv, recorder = make(4)
    lora = LoRARequest("sql", 3, "/adapters/sql")
    prompt = list(range(20, 28))
    run(kv, "a", prompt, lora)
    [event] = recorder.drain()
    root = b"lora\x003\x00sql\x00/adapters/sql"
    assert event.lora_id == 3 and event.parent_block_hash is None
    assert event.block_hashes == chained(prompt, root) != chained(prompt)


def test_the_batch_encodes_as_arrays_tagged_by_class_name_as_vllm_sends_it():
    batch = KVEventBatch(ts=1.5, events=[BlockStored([1, 2], None, [5] * 8, BLOCK, None, "CPU"),
                                         BlockRemoved([1], "CPU"), AllBlocksCleared()], data_parallel_rank=1)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == [
        1.5, [["BlockStored", [1, 2], None, [5] * 8, BLOCK, None, "CPU"], ["BlockRemoved", [1], "CPU"],
              ["AllBlocksCleared"]], 1]


def test_the_config_takes_vllms_fields_and_names_a_bad_one():
    config = KVEventsConfig.from_any('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}')
    assert config.publishes and config.endpoint == "tcp://*:5557"
    for bad, named in [({"enable_kv_cache_events": True, "endpoint_url": "x"}, "endpoint_url"),
                       ({"publisher": "kafka"}, "publisher"), ({"hwm": 0}, "hwm"),
                       ({"endpoint": "http://x:1"}, "endpoint")]:
        with pytest.raises(ValueError, match=named):
            KVEventsConfig.from_dict(bad)
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"


def test_an_offline_llm_publishes_its_events_on_its_topic_and_a_reset_clears_them():
    """LLM(kv_events_config=...) takes the engine argument as the server does; the engine runs in this process."""
    import zmq

    from tests import shared_server
    from tests.server_checks import wait_until
    from tinyserve import LLM, SamplingParams
    from tinyserve.testing import free_port

    port = free_port()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
    llm = LLM(shared_server.model_folder(), num_kv_blocks=16, kv_events_config={
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}", "topic": "kv"})
    received = []
    decoder = msgspec.msgpack.Decoder(KVEventBatch)

    def published(prompt: list[int]):
        llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
        while sub.poll(200):
            topic, _, payload = sub.recv_multipart()
            received.append((topic, decoder.decode(payload)))
        return received

    try:
        wait_until(lambda: published(list(range(30, 30 + 2 * 16))), 30, "a batch arrives (the subscription joined)")
        assert all(topic == b"kv" for topic, _ in received)
        llm.engine_core.reset_prefix_cache()
        received.clear()
        wait_until(lambda: any(isinstance(e, AllBlocksCleared) for _, b in published([5] * 17) for e in b.events),
                   30, "the reset is published after the next step")
    finally:
        llm.shutdown()
        sub.close(linger=0)


def test_the_replay_socket_resends_the_batches_a_subscriber_missed_then_the_end_marker():
    """vLLM's replay protocol on its ROUTER socket: a client sends the first sequence it wants (8 bytes, big-endian)
    and gets each kept batch from there as [sequence, payload], then [-1, b""]. One request, several replies: the
    client is a DEALER (a REQ socket keeps only the first reply), framing as a REQ would, with an empty delimiter."""
    import zmq

    from tinyserve.kv_events.publisher import ZmqEventPublisher
    from tinyserve.testing import free_port

    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                 endpoint=f"tcp://*:{pub_port}",
                                                 replay_endpoint=f"tcp://*:{replay_port}"))
    replay = zmq.Context.instance().socket(zmq.DEALER)
    try:
        for n in range(3):
            publisher.publish(KVEventBatch(float(n), [BlockRemoved([n], "CPU")]))
        replay.connect(f"tcp://127.0.0.1:{replay_port}")
        got = []
        for _ in range(50):  # until the publisher's thread has sent (and kept) all three
            replay.send_multipart([b"", (1).to_bytes(8, "big")])
            got = []
            while True:
                assert replay.poll(5000)
                empty, sequence, payload = replay.recv_multipart()
                assert empty == b""
                if not payload:
                    assert int.from_bytes(sequence, "big", signed=True) == -1
                    break
                got.append((int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload, type=KVEventBatch)))
            if len(got) == 2:
                break
        assert [(seq, batch.events[0].block_hashes) for seq, batch in got] == [(1, [1]), (2, [2])]
    finally:
        replay.close(linger=0)
        publisher.shutdown()


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets that listen on `port` (any process), from /proc/net/tcp and tcp6."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add({"0100007F": "127.0.0.1", "00000000": "0.0.0.0"}.get(address, address))
    return found


def test_a_wildcard_endpoint_binds_bind_host_and_loopback_by_default():
    from tinyserve.kv_events.config import bound_endpoint, with_server_host

    assert bound_endpoint("tcp://*:5557", None) == "tcp://127.0.0.1:5557"
    assert bound_endpoint("tcp://*:5557", "10.1.2.3") == "tcp://10.1.2.3:5557"
    assert bound_endpoint("tcp://*:5557", "::1") == "tcp://[::1]:5557"
    for every in ("0.0.0.0", "*", "::"):
        assert bound_endpoint("tcp://*:5557", every) == "tcp://*:5557"
    assert bound_endpoint("tcp://10.0.0.9:5557", None) == "tcp://10.0.0.9:5557"  # connected to, as it is
    assert bound_endpoint("ipc:///tmp/kv", None) == "ipc:///tmp/kv"
    assert with_server_host({"endpoint": "tcp://*:1"}, "0.0.0.0")["bind_host"] == "0.0.0.0"
    assert with_server_host({"bind_host": "127.0.0.1"}, "0.0.0.0")["bind_host"] == "127.0.0.1"
    with pytest.raises(ValueError, match="bind_host"):
        KVEventsConfig.from_dict({"bind_host": 5})


@pytest.mark.server
def test_a_servers_event_sockets_listen_on_its_host_not_on_every_interface():
    """The events carry every prompt's token ids: with the default `tcp://*:5557` a subscriber anywhere on the
    network rebuilt other users' prompts while HTTP listened on 127.0.0.1 (hardening-4, Medium 8). Both
    sockets (events and replay) now listen where HTTP does, and a subscriber on loopback still gets the events."""
    import json

    import httpx
    import zmq

    from tests import shared_server
    from tests.server_checks import wait_until
    from tinyserve.testing import ServerProcess, free_port

    pub_port, replay_port = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": "kv"}
    server = ServerProcess(shared_server.model_folder(), "--kv-events-config", json.dumps(config),
                           "--served-model-name", "tiny")
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        assert listening_addresses(pub_port) == {"127.0.0.1"}, listening_addresses(pub_port)
        assert listening_addresses(replay_port) == {"127.0.0.1"}, listening_addresses(replay_port)
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "kv")

        def stored() -> bool:
            body = {"model": "tiny", "prompt": list(range(40, 80)), "max_tokens": 1}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
            return bool(sub.poll(500))

        wait_until(stored, 30, "a subscriber on loopback receives the events")
    finally:
        sub.close(linger=0)
        server.stop()
