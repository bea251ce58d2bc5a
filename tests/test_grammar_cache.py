"""The engine's compiled grammars: one compile per distinct constraint, kept within a byte limit; a deadline
on each request's wait, and compiles nobody waits for any more do not hold the others up."""

import json
import threading
import time

from tests.tiny_checkpoints import tiny_model_with_tokenizer
from tests.tiny_tokenizer import TINY_VOCAB_SIZE
from tinyserve.engine.core.request import Request, RequestStatus
from tinyserve.engine.structured_output import StructuredOutputManager, cache_key
from tinyserve.sampling_params import SamplingParams, StructuredOutputsParams
from tinyserve.structured_output import GrammarError


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


class StuckCompiler:
    """A compiler whose compiles of constraints named "slow..." run until the test lets them go."""

    def __init__(self, real) -> None:
        self.real = real
        self.release = threading.Event()
        self.started = []

    def compile(self, params):
        name = next(iter(json.loads(params.spec)["properties"]))
        self.started.append(name)
        if name.startswith("slow"):
            self.release.wait(120)
        return self.real.compile(params)

    def matcher(self, compiled):
        return self.real.matcher(compiled)


def constrained_named(name: str) -> Request:
    schema = {"type": "object", "properties": {name: {"type": "integer"}}, "required": [name]}
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))
    return Request(name, [5, 6], params, [2], time.time())


def stuck_manager(compile_timeout: float) -> tuple[StructuredOutputManager, StuckCompiler]:
    manager = StructuredOutputManager("xgrammar", tiny_model_with_tokenizer("llama"), TINY_VOCAB_SIZE, [2],
                                      compile_timeout=compile_timeout)
    compiler = manager._compiler = StuckCompiler(manager.compiler)
    return manager, compiler


def both_threads_stuck() -> tuple[StructuredOutputManager, StuckCompiler, list[Request]]:
    """A manager without a deadline whose two compile threads both run a compile that will not end until
    the test sets compiler.release; the two requests waiting for them."""
    manager, compiler = stuck_manager(compile_timeout=0)
    stuck = [constrained_named(f"slow_{i}") for i in range(2)]
    for request in stuck:
        manager.add_request(request)
    wait_until(lambda: len(compiler.started) == 2)
    return manager, compiler, stuck


def wait_until(condition, bound: float = 60.0):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.02)
    raise AssertionError("the condition did not hold in time")


def test_a_request_whose_grammar_misses_the_deadline_fails_naming_the_limit_and_its_flag():
    manager, compiler = stuck_manager(compile_timeout=0.5)
    slow = constrained_named("slow_0")
    manager.add_request(slow)
    failed = wait_until(manager.failed_request_ids)
    assert list(failed) == ["slow_0"]
    assert "not compiled within 0.5 s" in failed["slow_0"] and "--structured-outputs-compile-timeout" in failed["slow_0"]
    assert isinstance(slow.grammar.exception(), GrammarError)
    compiler.release.set()  # the compile, let finish, still fills the cache for the next such request
    key = cache_key(slow.sampling_params.structured_outputs)
    wait_until(lambda: key in manager._sizes)
    manager.shutdown()


def test_abandoned_compiles_leave_the_count_so_a_small_one_after_two_stuck_ones_is_ready_at_once():
    manager, compiler, stuck = both_threads_stuck()  # no deadline: the clients leave
    small = constrained_named("small")
    manager.add_request(small)
    assert not small.grammar.done() and compiler.started == ["slow_0", "slow_1"]  # queued behind them
    for request in stuck:
        request.status = RequestStatus.FINISHED_ABORTED
    assert manager.failed_request_ids() == {}
    assert small.grammar.result(timeout=60) is not None  # compiled while the two stuck ones still run
    assert not compiler.release.is_set() and compiler.started[-1] == "small"
    compiler.release.set()
    manager.shutdown()


def test_a_compile_shared_by_a_live_request_is_not_abandoned():
    manager, compiler = stuck_manager(compile_timeout=0)
    gone, staying = constrained_named("slow_shared"), constrained_named("slow_shared")
    staying.request_id = "staying"
    for request in (gone, staying):
        manager.add_request(request)
    gone.status = RequestStatus.FINISHED_ABORTED
    manager.failed_request_ids()
    assert cache_key(staying.sampling_params.structured_outputs) in manager._running
    compiler.release.set()
    assert staying.grammar.result(timeout=60) is not None
    manager.shutdown()


def test_a_compile_still_waiting_for_a_thread_goes_when_its_only_request_is_aborted():
    manager, compiler, stuck = both_threads_stuck()
    waiting = constrained_named("queued")
    manager.add_request(waiting)
    key = cache_key(waiting.sampling_params.structured_outputs)
    assert key in manager._compiled
    waiting.status = RequestStatus.FINISHED_ABORTED  # its client went away
    assert manager.failed_request_ids() == {}
    assert key not in manager._compiled  # cancelled before it took a thread
    compiler.release.set()
    for request in stuck:
        request.grammar.result(timeout=60)
    assert "queued" not in compiler.started  # never compiled
    manager.shutdown()
