"""StructuredOutputManager: the grammars of constrained requests, kept beside the scheduler.

A request with `sampling_params.structured_outputs` goes through these steps, as in vLLM v1:

    add_request   the constraint is compiled in this manager's threads (once per distinct
                  constraint: the compiled grammar is cached, GRAMMAR_CACHE_BYTES at most,
                  least recently used out first), never in the engine loop;
                  request.grammar is a Future of the request's own matcher
    schedule      the scheduler leaves a request in the waiting queue until its grammar is ready;
                  one not ready within compile_timeout seconds of its arrival fails with an error naming the limit
    bitmask       after scheduling, one row per constrained request that samples this step:
                  the token ids its grammar allows next (SchedulerOutput.grammar_bitmask)
    sample        the sampler sets every other token's logit to -inf
    update        the sampled token advances the request's grammar (Request.append_output_token)

With a reasoning parser (tinyserve/reasoning/) and a prompt that leaves the reasoning open, the
front end sends the reasoning's end token with the request (Request.reasoning_end), and the
grammar starts after it, as vLLM's does: until the model samples </think> the request gets no
bitmask row (or one that masks only the tokens that would end the reasoning implicitly) and
its tokens do not advance the grammar; the token after </think> is the grammar's first.

The grammar's state lives with the scheduler's Request, not in the worker, and follows the
output tokens only: a preempted request keeps its tokens and its grammar, and is recomputed
from them; prefill chunks that sample nothing get no bitmask row.

Compiles take the threads in turn: at most COMPILE_THREADS compiles that some request still
waits for run at once, the others queue. A compile cannot be stopped half-way (the library's
code holds the thread), so one whose requests all went (their clients left, or the deadline
passed) is let finish, off the count: the next queued compile starts beside it, and a small
schema behind two abandoned huge ones is not kept waiting. At most MAX_ORPHANED_COMPILES
such run at once (the executor's extra threads); past that, new compiles queue behind them.
A queued compile nobody waits for any more is dropped before it starts.

The library that compiles constraints and computes the masks is the backend's
(tinyserve/structured_output/: what it does for us is told there).
"""

import concurrent.futures
import hashlib
import logging
import sys
import threading
import time
from collections import OrderedDict, deque

import torch

from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.structured_output import compile_deadline_error, get_backend_module

logger = logging.getLogger("tinyserve.engine")
COMPILE_THREADS = 2  # vLLM uses about half the cores; compiles are rare and a core is the engine loop's
MAX_ORPHANED_COMPILES = 2  # compiles nobody waits for any more, let finish beside the COMPILE_THREADS
# A request whose grammar is not ready this many seconds after it arrived fails with an error naming the
# limit (--structured-outputs-compile-timeout); the largest schemas the front end admits (5,000 properties)
# can take longer still (optional properties cost most); vLLM has a proposal of the same kind (5 s).
COMPILE_TIMEOUT_S = 30.0  # EngineArgs.structured_outputs_compile_timeout
# The compiled grammars kept for later requests, in bytes (vLLM keeps xgrammar's to 512 MB, VLLM_XGRAMMAR_CACHE_MB):
# the least recently used go first, so distinct schemas without end cannot grow the engine without end.
GRAMMAR_CACHE_BYTES = 512 << 20


def cache_key(params) -> tuple[str, str]:
    """(kind, a digest of the constraint): the cache keeps 32 bytes of each constraint's text, not the text."""
    return params.kind, hashlib.sha256(params.spec.encode()).hexdigest()


def compiled_size(compiled) -> int:
    """The bytes a compiled grammar holds: xgrammar says (memory_size_bytes); llguidance's is its grammar text."""
    size = getattr(compiled, "memory_size_bytes", None)
    if size is not None:
        return int(size)
    return len(compiled) if isinstance(compiled, (str, bytes)) else sys.getsizeof(compiled)


def _masked_this_step(request: Request) -> bool:
    """Whether the request's next token gets a bitmask row: it has a grammar, and its reasoning (a reasoning
    parser's, Request.reasoning_end) has ended or has tokens masked while it lasts (vLLM's should-apply check)."""
    if request.grammar is None:
        return False
    return request.reasoning_ended or bool(request.reasoning_end.masked_token_ids)


def _set_bits(bitmask: torch.Tensor, row: int, token_ids, allowed: bool) -> None:
    """Allow (set) or forbid (clear) these tokens' bits in one row of int32 words: bit 31 is the sign."""
    for token_id in token_ids:
        bit = 1 << (token_id % 32)
        word = bit if bit < 2**31 else -(2**31)
        if allowed:
            bitmask[row, token_id // 32] |= word
        else:
            bitmask[row, token_id // 32] &= ~word


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer_path, vocab_size: int, eos_token_ids: list[int],
                 cache_limit_bytes: int = GRAMMAR_CACHE_BYTES, compile_timeout: float = COMPILE_TIMEOUT_S) -> None:
        """compile_timeout: seconds a request may wait for its grammar (0: no limit)."""
        self.backend_name = backend
        self.backend = get_backend_module(backend)
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's: logits rows are this wide, the tokenizer's may be fewer
        self.eos_token_ids = eos_token_ids
        self._compiler = None  # built by the first compile: reading the vocabulary costs a moment
        self._compiler_lock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS + MAX_ORPHANED_COMPILES,
                                                              thread_name_prefix="tinyserve-grammar")
        self.compile_timeout = compile_timeout
        # Compiles not started yet, in order (key, params, Future); the keys of those running that
        # some request waits for (the others run on, orphaned, off the count)
        self._queue: deque[tuple[tuple[str, str], object, concurrent.futures.Future]] = deque()
        self._running: set[tuple[str, str]] = set()
        # cache_key -> the compiled grammar's Future, least recently used first; the done ones' sizes, their total
        self._compiled: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self._sizes: dict[tuple[str, str], int] = {}
        self.cache_bytes = 0
        self.cache_limit_bytes = cache_limit_bytes
        # Compile threads account sizes, the engine loop looks up; reentrant: a cancel runs _account at once
        self._cache_lock = threading.RLock()
        self._pending: dict[str, tuple[Request, tuple[str, str]]] = {}  # requests whose grammar is not ready yet

    # ---- requests --------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Start compiling the request's grammar (or take it from the cache); request.grammar is its Future."""
        params = request.sampling_params.structured_outputs
        key = cache_key(params)
        with self._cache_lock:
            compiled = self._compiled.get(key)
            cache_hit = compiled is not None
            if cache_hit:
                self._compiled.move_to_end(key)
            else:
                compiled = self._compiled[key] = concurrent.futures.Future()
                self._queue.append((key, params, compiled))
                self._start_compiles()
        if not cache_hit:
            compiled.add_done_callback(lambda done: self._account(key, done))
        times = request.times
        times.structured_output_start, times.structured_output_cache_hit = time.time(), cache_hit
        grammar = concurrent.futures.Future()

        def make_matcher(done: concurrent.futures.Future) -> None:  # in a compile thread, or here when cached
            if grammar.done():
                return  # failed meanwhile: the deadline passed, or the request went
            try:
                result: tuple = (self._matcher(done.result()), None)
            except BaseException as error:  # CancelledError too: the compile was dropped
                result = (None, error)
            try:
                grammar.set_exception(result[1]) if result[1] is not None else grammar.set_result(result[0])
            except concurrent.futures.InvalidStateError:
                return  # the engine loop failed it at the same moment
            times.structured_output_end = time.time()

        request.grammar = grammar
        self._pending[request.request_id] = request, key
        compiled.add_done_callback(make_matcher)

    def _account(self, key: tuple[str, str], done: concurrent.futures.Future) -> None:
        """A compile ended (in its thread): count its bytes, then drop the least recently used grammars
        that are done while the cache is over its limit (a failed or cancelled compile is not kept)."""
        with self._cache_lock:
            if self._compiled.get(key) is not done:
                return  # dropped meanwhile
            if done.cancelled() or done.exception() is not None:
                del self._compiled[key]
                return
            self._sizes[key] = compiled_size(done.result())
            self.cache_bytes += self._sizes[key]
            for old in list(self._compiled):
                if self.cache_bytes <= self.cache_limit_bytes or old == key:
                    break
                if old in self._sizes:
                    del self._compiled[old]
                    self.cache_bytes -= self._sizes.pop(old)

    def failed_request_ids(self) -> dict[str, str]:
        """Requests whose grammar could not be made, each with why: the library refused the constraint
        (the front end checks first, so: rarely), or it was not ready within compile_timeout. Forgotten here.

        A request that finished (aborted: its client went away) or failed while its grammar was still
        compiling takes that compile with it, unless another waiting request needs the same grammar."""
        failed: dict[str, str] = {}
        abandoned = set()
        now = time.time()
        for request_id, (request, key) in list(self._pending.items()):
            grammar = request.grammar
            # The deadline counts from the request's arrival at the front end, which checked the constraint first
            # (seconds, for a schema of thousands of properties): the client's whole wait is what it bounds.
            if (not request.is_finished and not grammar.done() and self.compile_timeout
                    and now - request.arrival_time > self.compile_timeout):
                try:
                    grammar.set_exception(compile_deadline_error(self.compile_timeout))
                except concurrent.futures.InvalidStateError:
                    pass  # ready at the last moment
            if request.is_finished or grammar.done():
                del self._pending[request_id]
                if request.is_finished and not grammar.done() or not request.is_finished and grammar.exception():
                    abandoned.add(key)
                if not request.is_finished and grammar.exception() is not None:
                    logger.error("request %s: %s", request_id, grammar.exception())
                    failed[request_id] = str(grammar.exception())
        wanted = {key for _, key in self._pending.values()}
        if abandoned - wanted:
            self._let_go(abandoned - wanted)
        return failed

    def _let_go(self, keys: set[tuple[str, str]]) -> None:
        """No request waits for these compiles any more: drop the queued ones; the running ones run on, off
        the count of COMPILE_THREADS, so the next queued compile starts now."""
        with self._cache_lock:
            for key in keys:
                compiled = self._compiled.get(key)
                if compiled is not None and compiled.cancel():  # only a compile not yet started can be
                    self._compiled.pop(key, None)
                self._running.discard(key)
            self._start_compiles()

    def _start_compiles(self) -> None:
        """Start queued compiles while fewer than COMPILE_THREADS that are waited for run (under _cache_lock)."""
        while self._queue and len(self._running) < COMPILE_THREADS:
            key, params, compiled = self._queue.popleft()
            if compiled.set_running_or_notify_cancel():  # False: cancelled while queued
                self._running.add(key)
                self.executor.submit(self._compile, key, params, compiled)

    def wait_for_a_grammar(self, timeout: float) -> None:
        """Block until one pending grammar is ready (or `timeout`): the engine has nothing else to do."""
        futures = [request.grammar for request, _ in self._pending.values()]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    # ---- each step ------------------------------------------------------------

    def grammar_bitmask(self, scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """Fill the step's bitmask: a row for each constrained request that samples a token this step.

        Row i belongs to scheduler_output.structured_output_request_ids[i]; a row holds
        ceil(vocab_size / 32) int32 words, bit j of word w standing for token id 32 * w + j.
        """
        rows = [s.request_id for s in scheduler_output.scheduled
                if s.samples_token and _masked_this_step(requests[s.request_id])]
        if not rows:
            return
        start = time.perf_counter()
        bitmask = torch.zeros((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        for row, request_id in enumerate(rows):
            request = requests[request_id]
            grammar = request.grammar.result()
            if not request.reasoning_ended:  # still reasoning: every token but the implicit ends
                bitmask[row] = -1
                _set_bits(bitmask, row, request.reasoning_end.masked_token_ids, allowed=False)
            elif grammar.is_terminated:  # nothing may follow but the end: EOS (the request stops on it)
                _set_bits(bitmask, row, self.eos_token_ids, allowed=True)
            else:
                grammar.fill_bitmask(bitmask, row)
        scheduler_output.structured_output_request_ids = rows
        scheduler_output.grammar_bitmask = bitmask.numpy().tobytes()
        scheduler_output.grammar_bitmask_time = time.perf_counter() - start

    # ---- compiling (in the threads) -------------------------------------------------

    def _compile(self, key: tuple[str, str], params, compiled: concurrent.futures.Future) -> None:
        try:
            result = self.compiler.compile(params)
        except BaseException as error:
            compiled.set_exception(error)
        else:
            compiled.set_result(result)
        finally:
            with self._cache_lock:
                self._running.discard(key)
                self._start_compiles()

    def _matcher(self, compiled):
        return self.compiler.matcher(compiled)

    @property
    def compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                from tinyserve.models.tokenizer import load_tokenizer

                self._compiler = self.backend.Compiler(load_tokenizer(self.tokenizer_path), self.vocab_size,
                                                       self.eos_token_ids)
        return self._compiler

    def shutdown(self) -> None:
        with self._cache_lock:
            for _, _, compiled in self._queue:
                compiled.cancel()
            self._queue.clear()
        self.executor.shutdown(wait=False, cancel_futures=True)
