"""The engine's compiled grammars: one compile per distinct constraint, kept within a byte limit."""

import concurrent.futures
import time

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tests.tiny_tokenizer import TINY_VOCAB_SIZE
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.structured_output import StructuredOutputManager, cache_key
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams


def constrained(i: int) -> Request:
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"}}, "required": [f"field_{i}"]}
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    return Request(f"r{i}", [5, 6], params, [2], time.time())


def test_the_cache_keeps_the_most_recent_grammars_within_its_byte_limit_and_no_constraint_text():
    manager = StructuredOutputManager("xgrammar", tiny_model_with_tokenizer("llama"), TINY_VOCAB_SIZE, [2])
    first = constrained(0)
    manager.add_request(first)
    one = first.grammar.result(timeout=60) and manager.cache_bytes  # the bytes of one such grammar
    assert one > 0
    manager.cache_limit_bytes = 5 * one + one // 2  # room for five
    requests = [constrained(i) for i in range(1, 40)]
    for request in requests:
        manager.add_request(request)
        request.grammar.result(timeout=60)  # each compiled, the oldest dropped as the limit says
    assert manager.cache_bytes <= manager.cache_limit_bytes and len(manager._compiled) == 5
    assert all(len(key[1]) == 64 for key in manager._compiled)  # a digest, however long the schema
    assert cache_key(requests[-1].sampling_params.structured_outputs) in manager._compiled  # the newest kept
    assert cache_key(first.sampling_params.structured_outputs) not in manager._compiled  # the oldest gone
    again = constrained(39)
    manager.add_request(again)
    assert again.times.structured_output_cache_hit  # a recent one is still a hit
    manager.shutdown()


def test_a_compile_still_waiting_for_a_thread_goes_when_its_only_request_is_aborted():
    manager = StructuredOutputManager("xgrammar", tiny_model_with_tokenizer("llama"), TINY_VOCAB_SIZE, [2])
    blocker = concurrent.futures.Future()
    for _ in range(2):  # both compile threads busy until the test lets them go
        manager.executor.submit(blocker.result)
    waiting = constrained(7)
    manager.add_request(waiting)
    key = cache_key(waiting.sampling_params.structured_outputs)
    assert key in manager._compiled
    waiting.status = RequestStatus.FINISHED_ABORTED  # its client went away
    assert manager.failed_request_ids() == []
    assert key not in manager._compiled  # cancelled before it took a thread
    blocker.set_result(None)
    manager.shutdown()
