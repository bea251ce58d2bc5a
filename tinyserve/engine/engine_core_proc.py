"""Stages ⑤–⑦ in a process of their own: the engine's busy loop and its two I/O threads.

    input thread    socket ─► decode ─► input_queue          (stage ④ arrives)
    main thread     drain input_queue ─► step() ─► output_queue
    output thread   output_queue ─► encode ─► socket          (stage ⑦ leaves)

The main thread never touches a socket: it only hands Python objects over two queues. With
several API processes (--api-server-count) the input socket connects to each one's input and the
output thread holds one socket per API process, sending each its own requests' outputs
(client_outputs.py). Decoding the next requests and encoding the last step's tokens happen on the
I/O threads, while torch (which releases the GIL inside its kernels) runs the next forward pass on
the main thread. When no request is unfinished, the main thread blocks on the input queue instead
of spinning: an idle engine costs no CPU. A busy one that has sent nothing for ENGINE_HEARTBEAT_S
(a grammar compiling) sends a heartbeat, so the front end's watchdog (frontend/engine_watchdog.py)
can read its silence as a stall.

The process is started by `MPClient` (core_client.py) with the spawn method: a fresh interpreter,
because forking a process that holds torch's thread pools and ZeroMQ's I/O threads is unsafe. It
answers to its parent only: it exits when its parent dies (even by SIGKILL), ignores SIGINT (Ctrl-C
in a terminal reaches the whole process group; the parent decides) and exits cleanly on SIGTERM.

The module is over 300 lines because the process's three threads, its signals and
its handshake only make sense together.
"""

import atexit
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import msgspec
import setproctitle
import torch
import zmq

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.engine.client_outputs import BACKLOG_RETRY_S, ClientOutputs, ClientSockets
from tinyserve.engine.engine_core import EngineCore
from tinyserve.wire.ipc import (
    ENGINE_HEARTBEAT_S,
    INPUT_TYPES,
    UTILITY_METHODS,
    EngineCoreAbort,
    EngineFailed,
    EngineHeartbeat,
    EngineInputKind,
    EngineOutputKind,
    EngineReady,
    MessageDecoder,
    UtilityCall,
    UtilityResult,
    error_output,
    outputs_message,
)
from tinyserve.wire.messages import EngineCoreOutput, EngineCoreRequest
from tinyserve.lifecycle import schema
from tinyserve.lifecycle.tracing import setup_tracing, shutdown_tracing

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5  # how often the watchdog checks that the parent is alive
INPUT_CONNECT_TIMEOUT_S = 30.0  # the client binds before it starts us: over TCP to another node this is ample
OUTPUT_LINGER_MS = 2000  # on exit, how long queued messages may still take to leave
_STOP = object()  # put on the output queue to end the output thread
_WAKE = object()  # put on the input queue when a signal arrives
_EXIT = object()  # put on the input queue by request_stop(): the engine exits as on SIGTERM


def run_engine_core(
    args: EngineArgs,
    engine_index: int,
    input_address: str | list[str],
    output_address: str | list[str],
    parent_pid: int,
    make_engine_core,
    model_info: ModelInfo | None = None,
    num_threads: int | None = None,
) -> None:
    """Entry point of an engine process: build the engine, say ready, serve until told to stop.

    make_engine_core(args, engine_index, model_info, wake_loop=...): the EngineCore with its layers (the one
    assembly point, tinyserve/assemble.py's build_engine_core, handed down by whoever starts the process).
    num_threads caps torch's CPU threads, so that engines sharing a machine's
    cores do not fight over them. A list of addresses: one per API process
    (--api-server-count), in client index order.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watchdog", daemon=True).start()
    proc = EngineCoreProc(engine_index, input_address, output_address)
    # The process that feeds it requests, for worker/cpu_threads.py: its parent, the API process (with
    # --api-server-count, or on a headless node, the process that started the engines).
    proc.feeder_pid = parent_pid
    proc.wake_on_signals()
    serve_engine(proc, args, make_engine_core, model_info, num_threads)


def serve_engine(proc: "EngineCoreProc", args: EngineArgs, make_engine_core, model_info: ModelInfo | None = None,
                 num_threads: int | None = None) -> None:
    """The engine's life, in a process of its own or in a Ray actor (distributed/ray_engines.py, which
    stops it with proc.request_stop() where a process gets SIGTERM)."""
    setproctitle.setproctitle(f"tinyserve-engine-{proc.engine_index}")
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s engine-{proc.engine_index} %(levelname)s %(name)s: %(message)s"
    )
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    _start_tracing(args, proc.engine_index)
    try:
        proc.run(args, make_engine_core, model_info)
    finally:
        # Spans first (they are built from what already happened), then the sockets.
        if getattr(proc, "engine_core", None) is not None:
            proc.engine_core.shutdown()
        shutdown_tracing()
        proc.close()


def _as_list(address: str | list[str]) -> list[str]:
    return [address] if isinstance(address, str) else list(address)


def _start_tracing(args: EngineArgs, engine_index: int) -> None:
    """This engine's own tracer: engine-<i>.jsonl in the run folder and/or the OTLP endpoint."""
    trace_file = None
    if args.trace_run_dir is not None:
        trace_file = Path(args.trace_run_dir) / schema.engine_trace_file(engine_index)
    setup_tracing(schema.engine_service_name(engine_index), trace_file, args.otlp_endpoint,
                  max_bytes=args.trace_max_bytes,
                  resource={schema.RESOURCE_DP_RANK: engine_index, schema.RESOURCE_TP_RANK: 0})


_built = threading.Event()  # set once the engine is built: SIGTERM then exits through the `finally` blocks


def _exit_on_sigterm(signum, frame) -> None:
    # In the main thread, in a step or just woken from the input queue (wake_on_signals); the `finally` blocks
    # close the sockets on the way out. While the engine is built there is nothing to flush, and a SystemExit
    # could land in a C library's callback (numba's cache, compiling), which would print and swallow it.
    if not _built.is_set():
        os._exit(0)
    raise SystemExit(0)


def _watch_parent(parent_pid: int) -> None:
    # When the parent dies the engine is re-parented; nothing could ever send it another request, so it
    # goes. (PR_SET_PDEATHSIG would fire when the parent *thread* that started us exits: not the same thing.)
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            logger.warning("parent process %d is gone; engine exiting", parent_pid)
            os._exit(1)


class EngineCoreProc:
    def __init__(self, engine_index: int, input_addresses: str | list[str], output_addresses: str | list[str]) -> None:
        """One input and one output address per client (API process), in client index order (one: a string)."""
        input_addresses, output_addresses = _as_list(input_addresses), _as_list(output_addresses)
        if len(input_addresses) != len(output_addresses):
            raise ValueError(f"one input and one output address per client: got {len(input_addresses)} "
                             f"and {len(output_addresses)}")
        self.engine_index = engine_index
        self.input_addresses = input_addresses
        self.clients = ClientOutputs(len(output_addresses))
        self.engine_core: EngineCore | None = None
        self.feeder_pid: int | None = None  # the process that sends it requests, where it is this one's parent
        self.context = zmq.Context()
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        # The output thread starts first: it carries the handshake, or the start-up error if the model fails.
        self.output_thread = threading.Thread(
            target=self._output_loop, args=(output_addresses,), name="engine-output", daemon=True
        )
        self.output_thread.start()
        self.input_thread = threading.Thread(target=self._input_loop, name="engine-input", daemon=True)
        self.input_connected = threading.Event()
        self._blocks_reported = 0  # KV blocks in use, as the front end last heard: a step that frees some is sent
        self._last_sent = time.monotonic()  # when the main thread last queued a message (ENGINE_HEARTBEAT_S)

    def wake_on_signals(self) -> None:
        """Make a signal wake the main thread even while it waits on the input queue.

        CPython runs a Python signal handler only in the main thread, the next time that thread runs
        Python code; but the kernel may deliver SIGTERM to any thread (one of torch's or ZeroMQ's), and
        then an idle engine would sleep on. The C half of the handler also writes to the wake-up fd, so
        a thread reading it puts a message on the input queue: the main thread wakes and runs the handler.
        """
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd)

        def forward() -> None:
            while os.read(read_fd, 1):
                self.input_queue.put((_WAKE, None))

        threading.Thread(target=forward, name="signal-wakeup", daemon=True).start()

    def request_stop(self) -> None:
        """From another thread: exit after the current step, as on SIGTERM (spans flushed, sockets closed)."""
        self.input_queue.put((_EXIT, None))

    def run(self, args: EngineArgs, make_engine_core, model_info: ModelInfo | None) -> None:
        try:
            # wake_loop: work that ended outside a step (a KV transfer) wakes the idle loop to free or admit.
            self.engine_core = make_engine_core(args, self.engine_index, model_info,
                                                wake_loop=lambda: self.input_queue.put((_WAKE, None)))
        except Exception:
            self._fail("EngineCore() raised")
        # What start-up allocated (model, tokenizer, libraries) lives as long as this process: out of the
        # collector's sight, as in vLLM's engine process, or every full collection walks it again (~200 ms
        # mid-step). Here, not in EngineCore: an offline LLM's engine, frozen, could never be freed.
        gc.collect()
        gc.freeze()
        atexit.register(gc.unfreeze)  # let the interpreter's last collection free them at exit
        _built.set()
        if self.feeder_pid is not None and self.engine_core.thread_governor is not None:
            self.engine_core.thread_governor.watch_feeder(self.feeder_pid)
        self.input_thread.start()
        # READY only once the client can send to us: a request sent to a socket with no peer yet would be
        # refused (core_client._send), and over TCP the connection is not made the moment connect() returns.
        if not self.input_connected.wait(INPUT_CONNECT_TIMEOUT_S):
            try:
                raise ConnectionError(f"no connection to all of {self.input_addresses} after "
                                      f"{INPUT_CONNECT_TIMEOUT_S:.0f} s")
            except ConnectionError:
                self._fail("the input socket did not connect")
        self._send(
            EngineOutputKind.READY,
            EngineReady(
                engine_index=self.engine_index,
                pid=os.getpid(),
                num_kv_blocks=self.engine_core.num_kv_blocks,
                max_model_len=self.engine_core.model_info.max_model_len,
            ),
        )
        try:
            self.run_busy_loop()
        except Exception:
            self._fail("the busy loop raised")

    def run_busy_loop(self) -> None:
        while True:
            self._process_input_queue()
            if self.engine_core.has_requests:
                outputs = self.engine_core.step_fn()  # None: a batch sent down the pipeline, no outputs yet
                if outputs is not None and self._worth_sending(outputs):
                    self._send(EngineOutputKind.OUTPUTS, outputs)
                elif time.monotonic() - self._last_sent > ENGINE_HEARTBEAT_S:  # the front end's watchdog hears it
                    self._send(EngineOutputKind.HEARTBEAT, EngineHeartbeat(self.engine_index))

    def _worth_sending(self, outputs) -> bool:
        """A step's outputs go to the front end if they carry tokens or finishes, if the step scheduled work,
        or if it freed blocks (a KV transfer's: the front end's gauges must see it). An empty step that only
        told the worker which requests finished has nothing to say."""
        freed = outputs.scheduler_stats.num_kv_blocks_used < self._blocks_reported
        return bool(outputs.outputs) or not self.engine_core.last_scheduler_output.is_empty or freed

    def _process_input_queue(self) -> None:
        """Handle every message that has arrived; wait for one only if there is nothing to step."""
        block = not self.engine_core.has_requests
        while True:
            try:
                kind, message = self.input_queue.get(block=block)
            except queue.Empty:
                return
            self._handle(kind, message)
            block = False

    def _handle(self, kind: EngineInputKind, message) -> None:
        if kind is _WAKE:
            return  # the signal handler runs now, in this thread
        if kind is _EXIT:
            raise SystemExit(0)
        if kind is EngineInputKind.ADD:
            self._add_request(message)
        elif kind is EngineInputKind.ABORT:
            self._abort_requests(message)
        else:
            self._call_utility(message)

    def _add_request(self, request: EngineCoreRequest) -> None:
        if not self.clients.knows(request):
            logger.warning("dropped request %s from unknown client %d", request.request_id, request.client_index)
            return
        try:
            self.engine_core.check_request(request)
            self.engine_core.add_request(request)
        except ValueError as error:
            # The request must not hang: it finishes at once, carrying the reason.
            self._send_outputs([error_output(request.request_id, str(error), getattr(error, "param", None))])

    def _abort_requests(self, abort: EngineCoreAbort) -> None:
        outputs = self.engine_core.abort_requests(abort.request_ids)
        if outputs:
            self._send_outputs(outputs)

    def _call_utility(self, call: UtilityCall) -> None:
        if call.method not in UTILITY_METHODS:
            known = sorted(UTILITY_METHODS)
            reply = UtilityResult(call.call_id, error=f"unknown utility method {call.method!r}; known: {known}")
        else:
            try:
                result = self.engine_core.call_utility(call.method, *call.args)
                reply = UtilityResult(call.call_id, result=msgspec.Raw(msgspec.msgpack.encode(result)))
            except Exception as error:
                reply = UtilityResult(call.call_id, error=f"{type(error).__name__}: {error}")
        self._send(EngineOutputKind.UTILITY_RESULT, reply, client=call.client_index)

    def _send(self, kind: EngineOutputKind, message, client: int | None = None) -> None:
        """Queue a message for the output thread: to `client`, or OUTPUTS cut by client, or to every client."""
        if kind is EngineOutputKind.OUTPUTS and message.scheduler_stats is not None:
            self._blocks_reported = message.scheduler_stats.num_kv_blocks_used
        self._last_sent = time.monotonic()
        self.output_queue.put((kind, message, client))

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        """Outputs made outside a step (aborts, refusals), with fresh stats for the load balancer."""
        message = outputs_message(self.engine_index, outputs, self.engine_core.get_stats())
        self._send(EngineOutputKind.OUTPUTS, message)

    def _fail(self, what: str) -> None:
        """Tell the client why this engine is about to die, then exit with status 1.

        Called inside an `except` block: the error first, its traceback after.
        """
        logger.exception(what)
        error = sys.exc_info()[1]
        summary = f"{what}: {type(error).__name__}: {error}"
        self._send(EngineOutputKind.FAILED, EngineFailed(self.engine_index, f"{summary}\n{traceback.format_exc()}"))
        raise SystemExit(1)

    # ---- the I/O threads -------------------------------------------------------

    def _input_loop(self) -> None:
        socket = self.context.socket(zmq.PULL)
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        for address in self.input_addresses:  # one PULL, fair-queued over every API process's input
            socket.connect(address)
        deadline = time.monotonic() + INPUT_CONNECT_TIMEOUT_S
        connected = 0
        while connected < len(self.input_addresses) and monitor.poll(max(0, deadline - time.monotonic()) * 1000):
            monitor.recv_multipart()  # one handshake event
            connected += 1
        if connected == len(self.input_addresses):
            self.input_connected.set()
        socket.disable_monitor()
        monitor.close(linger=0)
        decoder = MessageDecoder(EngineInputKind, INPUT_TYPES)
        try:
            while True:
                frames = socket.recv_multipart()
                try:
                    self.input_queue.put(decoder.decode(frames))
                except ValueError as error:
                    logger.warning("dropped a malformed message: %s", error)
        except zmq.ContextTerminated:
            pass  # close() is ending the process
        finally:
            socket.close(linger=0)

    def _output_loop(self, addresses: list[str]) -> None:
        sockets = ClientSockets(self.context, addresses)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                try:
                    item = self.output_queue.get(timeout=BACKLOG_RETRY_S if sockets.backlogged else None)
                except queue.Empty:
                    sockets.flush()
                    continue
                if item is _STOP:
                    break
                kind, message, client = item
                if kind is EngineOutputKind.OUTPUTS:
                    for index, share in self.clients.split(message):
                        sockets.send(index, [kind.value, encoder.encode(share)])
                    continue
                frames = [kind.value, encoder.encode(message)]
                for index in range(len(addresses)) if client is None else [client]:
                    sockets.send(index, frames)
            sockets.flush()
        finally:
            sockets.close(OUTPUT_LINGER_MS)

    def close(self) -> None:
        """Flush the output queue, then stop both I/O threads."""
        self.output_queue.put(_STOP)
        self.output_thread.join(timeout=OUTPUT_LINGER_MS / 1000 + 1)
        if not self.output_thread.is_alive():
            # term() wakes the input thread's recv with ContextTerminated; it
            # closes its socket and term() returns.
            self.context.term()
