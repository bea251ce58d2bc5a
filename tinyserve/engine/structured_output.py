"""StructuredOutputManager: the grammars of constrained requests, kept beside the scheduler.

A request with `sampling_params.structured_outputs` goes through these steps, as in vLLM v1:

    add_request   the constraint is compiled in this manager's threads (once per distinct
                  constraint: the compiled grammar is cached, GRAMMAR_CACHE_BYTES at most,
                  least recently used out first), never in the engine loop;
                  request.grammar is a Future of the request's own matcher
    schedule      the scheduler leaves a request in the waiting queue until its grammar is ready
    bitmask       after scheduling, one row per constrained request that samples this step:
                  the token ids its grammar allows next (SchedulerOutput.grammar_bitmask)
    sample        the sampler sets every other token's logit to -inf
    update        the sampled token advances the request's grammar (Request.append_output_token)

The grammar's state lives with the scheduler's Request, not in the worker, and follows the
output tokens only: a preempted request keeps its tokens and its grammar, and is recomputed
from them; prefill chunks that sample nothing get no bitmask row.

The library that compiles constraints and computes the masks is the backend's
(tinyserve/structured_output/: what it does for us is told there).
"""

import concurrent.futures
import hashlib
import logging
import sys
import threading
import time
from collections import OrderedDict

import torch

from tinyserve.engine.core.request import Request
from tinyserve.engine.core.scheduler_output import SchedulerOutput
from tinyserve.structured_output import get_backend_module

logger = logging.getLogger("tinyserve.engine")
COMPILE_THREADS = 2  # vLLM uses about half the cores; compiles are rare and a core is the engine loop's
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


class StructuredOutputManager:
    def __init__(self, backend: str, tokenizer_path, vocab_size: int, eos_token_ids: list[int],
                 cache_limit_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.backend_name = backend
        self.backend = get_backend_module(backend)
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size  # the model's: logits rows are this wide, the tokenizer's may be fewer
        self.eos_token_ids = eos_token_ids
        self._compiler = None  # built by the first compile: reading the vocabulary costs a moment
        self._compiler_lock = threading.Lock()
        self.executor = concurrent.futures.ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="tinyserve-grammar")
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
                compiled = self._compiled[key] = self.executor.submit(self._compile, params)
        if not cache_hit:
            compiled.add_done_callback(lambda done: self._account(key, done))
        times = request.times
        times.structured_output_start, times.structured_output_cache_hit = time.time(), cache_hit
        grammar = concurrent.futures.Future()

        def make_matcher(done: concurrent.futures.Future) -> None:  # in a compile thread, or here when cached
            try:
                grammar.set_result(self._matcher(done.result()))
            except Exception as error:
                grammar.set_exception(error)
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

    def failed_request_ids(self) -> list[str]:
        """Requests whose grammar could not be compiled (the front end checks first, so: rarely); forgotten here.

        A request that finished (aborted: its client went away) while its grammar was still waiting for a
        compile thread takes that compile with it, unless another waiting request needs the same grammar."""
        failed, abandoned = [], set()
        for request_id, (request, key) in list(self._pending.items()):
            if request.is_finished or request.grammar.done():
                del self._pending[request_id]
                if request.is_finished and not request.grammar.done():
                    abandoned.add(key)
                if not request.is_finished and request.grammar.exception() is not None:
                    logger.error("request %s: %s", request_id, request.grammar.exception())
                    failed.append(request_id)
        wanted = {key for _, key in self._pending.values()}
        with self._cache_lock:
            for key in abandoned - wanted:
                compiled = self._compiled.get(key)
                if compiled is not None and compiled.cancel():  # only a compile not yet started can be
                    self._compiled.pop(key, None)
        return failed

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
                if s.samples_token and requests[s.request_id].grammar is not None]
        if not rows:
            return
        start = time.perf_counter()
        bitmask = torch.zeros((len(rows), (self.vocab_size + 31) // 32), dtype=torch.int32)
        for row, request_id in enumerate(rows):
            grammar = requests[request_id].grammar.result()
            if grammar.is_terminated:  # nothing may follow but the end: EOS (the request stops on it)
                for token_id in self.eos_token_ids:
                    bit = 1 << (token_id % 32)
                    bitmask[row, token_id // 32] |= bit if bit < 2**31 else -(2**31)  # int32: bit 31 is the sign
                continue
            grammar.fill_bitmask(bitmask, row)
        scheduler_output.structured_output_request_ids = rows
        scheduler_output.grammar_bitmask = bitmask.numpy().tobytes()
        scheduler_output.grammar_bitmask_time = time.perf_counter() - start

    # ---- compiling (in the threads) -------------------------------------------------

    def _compile(self, params):
        return self.compiler.compile(params)

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
        self.executor.shutdown(wait=False, cancel_futures=True)
