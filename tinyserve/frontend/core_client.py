"""The API process's handle on its engine processes (stages ④ and ⑦ from the client side).

`MPClient`, the EngineClient (engine_client.py) for engines in their own processes, starts
one engine process per data-parallel rank (engine_procs.py starts and stops them;
engine_core_proc.py is what runs in them), sends each request to one of them (dp_client.py
picks which), and hands back whatever the engines produce, one EngineCoreOutputs at a time,
to AsyncLLM's output loop. The socket layout is drawn in ipc.py. Its engines' indices start
at start_index (messages and answers carry them); its lists of sockets and processes go by
position. With multi_node, the positions from multi_node.size_local on run on headless
nodes: their sockets are bound on TCP at the head's address, and remote_engines.py lets the
nodes in and watches them. One of several API processes (--api-server-count) has an
APIServerClient (api_server_client.py), which starts no engine.

It also watches the engines: the event loop watches each process's sentinel (a file
descriptor readable the moment the process exits), so a crash is noticed at once; a
headless node's rank is reported by remote_engines.py; one alive that stops stepping, by
engine_watchdog.py. A dead engine loses only what it
held: `get_outputs` raises one EngineRankDeadError naming the rank and its engine request
ids, the caller fails those alone and goes on with the live ranks; the load balancer never
picks the rank again, and the log says how many requests were lost where. With no engine
left the client is dead: `get_outputs` raises EngineDeadError, `add_request` fails fast.
(vLLM's MPClient makes any engine's death the whole client's; here only the last one's: no
collective op joins DP ranks, so a live rank's requests run to completion, and
--keep-alive-on-engine-death serves on the ranks left.)
The module is over 300 lines because start-up, sending, receiving and a death share sockets and one in-flight table.
"""

import asyncio
import atexit
import itertools
import logging
import shutil

import msgspec
import zmq
import zmq.asyncio

from tinyserve.assemble import build_engine_core as build  # what each engine process builds its engine with
from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.frontend.dp_client import DPLoadBalancer, check_engine_range, data_parallel_engine_indices
from tinyserve.frontend.engine_client import ClientLiveness, EngineDeadError, EngineRankDeadError, EngineStartupError
from tinyserve.frontend.engine_watchdog import EngineWatchdog
from tinyserve.engine.engine_procs import EngineProcesses
from tinyserve.frontend.remote_engines import MultiNode, RemoteEngines
from tinyserve.models.fingerprint import manifest_fingerprint
from tinyserve.wire.ipc import (
    OUTPUT_TYPES,
    UTILITY_METHODS,
    EngineCoreAbort,
    EngineInputKind,
    EngineOutputKind,
    MessageDecoder,
    UtilityCall,
    bind_address,
    bound_endpoint,
    make_ipc_dir,
)
from tinyserve.wire.messages import EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0  # loading a model onto a GPU can take a while
TRANSPORTS = ("ipc", "tcp")


class MPClient(ClientLiveness):
    client_index = 0  # stamped on what it sends; one of several API processes: api_server_client.py

    def __init__(self, args: EngineArgs, model_info: ModelInfo, data_parallel_size: int = 1, start_index: int = 0,
                 ipc_dir: str | None = None, transport: str = "ipc", startup_timeout: float = STARTUP_TIMEOUT_S,
                 multi_node: MultiNode | None = None) -> None:
        """data_parallel_size: how many engines in all; start_index: the engine index of the first
        (with --data-parallel-rank R, the one engine is engine R).
        ipc_dir: where to create the private socket directory (default: the system temp dir).
        multi_node: engines [multi_node.size_local, data_parallel_size) are served by headless nodes.
        """
        check_engine_range(data_parallel_size, start_index)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if multi_node is not None:
            multi_node.check(data_parallel_size, start_index)
            transport = "tcp"  # the other nodes must reach every socket
        self.multi_node = multi_node
        self.bind_host = None if multi_node is None else multi_node.address  # TCP: where engines reach us
        self.remote: RemoteEngines | None = None
        self.model_info = model_info
        self.data_parallel_size = data_parallel_size
        self.start_index = start_index
        self.transport = transport
        self.startup_timeout = startup_timeout
        self.in_flight: dict[str, int] = {}  # request id -> index of the engine that has it
        self.dead_error: EngineDeadError | None = None  # set once no engine is left
        self.dead_engines: dict[int, str] = {}  # engine index -> how it died and what was lost, in order
        self.num_kv_blocks: list[int] = []  # per engine, from the handshakes
        self.max_model_len = model_info.max_model_len
        self.load_balancer = DPLoadBalancer(data_parallel_size)
        self.watchdog = EngineWatchdog(args.engine_iteration_timeout_s, start_index)  # engines that stop stepping
        self._ipc_parent = ipc_dir
        self._ipc_dir: str | None = None
        self.num_local_engines = data_parallel_size if multi_node is None else multi_node.size_local
        self._engines = EngineProcesses(args, model_info, self.num_local_engines, start_index, make_engine_core=build)
        self._context: zmq.asyncio.Context | None = None
        self._input_sockets: list[zmq.Socket] = []
        self._output_socket: zmq.asyncio.Socket | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self.last_sent_bytes: int | None = None  # the size of the latest message sent
        self._decoder = MessageDecoder(EngineOutputKind, OUTPUT_TYPES)
        self._outputs: asyncio.Queue = asyncio.Queue()  # EngineCoreOutputs, then an EngineDeadError last
        self._utility_calls: dict[int, tuple[int, asyncio.Future]] = {}  # call id -> (engine index, its answer)
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._output_task: asyncio.Task | None = None
        self._launched = False
        self._closed = False

    @classmethod
    def for_engines(cls, args: EngineArgs, model_info: ModelInfo, data_parallel_size: int = 1,
                    data_parallel_rank: int | None = None, multi_node: MultiNode | None = None) -> "MPClient":
        """The client of a front end for data_parallel_size engines, or for rank data_parallel_rank of them alone."""
        indices = data_parallel_engine_indices(data_parallel_size, data_parallel_rank, in_process=False)
        return cls(args, model_info, data_parallel_size=len(indices), start_index=indices.start, multi_node=multi_node)

    # ---- start-up --------------------------------------------------------------

    def launch(self) -> None:
        """Bind the sockets and spawn this machine's engines, without waiting for them; start() waits.

        `tinyserve serve` calls it before it imports its API modules and loads the tokenizer,
        so that the engines import torch and load their model meanwhile (on the 2-core test
        machine it answered /health after 12.3 s instead of 13.3, medians of four); start()
        calls it if nobody has.
        """
        if self._launched:
            return
        self._launched = True
        atexit.register(self.shutdown)
        try:
            # pyzmq's asyncio sockets take their event loop when first used: they may be made before it runs.
            self._context = zmq.asyncio.Context()
            if self.transport == "ipc":
                self._ipc_dir = self._make_ipc_dir()
            self._output_socket = self._context.socket(zmq.PULL)
            self._bind(self._output_socket, "output")
            for index in range(self.data_parallel_size):
                # A plain socket, not an asyncio one: a NOBLOCK send succeeds or fails at once (see _send).
                socket = zmq.Socket(self._context, zmq.PUSH)
                socket.setsockopt(zmq.SNDHWM, 0)
                self._bind(socket, f"input-{index}")
                self._input_sockets.append(socket)
            input_addresses = [bound_endpoint(s) for s in self._input_sockets]
            self._engines.start(input_addresses[:self.num_local_engines], bound_endpoint(self._output_socket))
        except BaseException:
            self.shutdown()
            raise

    def _make_ipc_dir(self) -> str:
        return make_ipc_dir(self._ipc_parent)

    def _bind(self, socket: zmq.Socket, name: str) -> None:
        socket.bind(bind_address(self.transport, self._ipc_dir, name, self.bind_host))

    async def start(self) -> None:
        """Spawn the engines (unless launch() has), let headless nodes in, wait until every engine is ready."""
        self._loop = asyncio.get_running_loop()
        self.launch()
        try:
            if self.multi_node is not None:  # its tasks need the running loop
                self.remote = RemoteEngines(self._context, self.multi_node, self.data_parallel_size,
                                            manifest_fingerprint(self.model_info.path),
                                            [bound_endpoint(s) for s in self._input_sockets],
                                            bound_endpoint(self._output_socket), self._mark_dead)
                self.remote.start()
            await asyncio.wait_for(self._wait_for_handshakes(), self.startup_timeout)
        except BaseException as error:
            self.shutdown()
            if isinstance(error, asyncio.TimeoutError):
                missing = ""
                if self.remote is not None and self.remote.missing_ranks:
                    missing = (f"; no headless node came for ranks {self.remote.missing_ranks} "
                               f"(they connect to {self.remote.endpoint})")
                raise EngineStartupError(
                    f"engines did not report ready within startup_timeout={self.startup_timeout}s{missing}"
                ) from None
            raise
        for index, process in enumerate(self._engines.processes):
            self._loop.add_reader(process.sentinel, self._on_engine_exit, index)
        self._output_task = asyncio.create_task(self._output_loop(), name="engine-outputs")
        self.watchdog.start(self.in_flight, lambda: self._engines.processes, self._mark_dead)

    async def _wait_for_handshakes(self) -> None:
        ready = {}
        while len(ready) < self.data_parallel_size:
            while await self._output_socket.poll(timeout=100):
                try:
                    kind, message = self._decoder.decode(await self._output_socket.recv_multipart())
                except ValueError as error:
                    logger.warning("dropped a malformed message from an engine: %s", error)
                    continue
                if kind is EngineOutputKind.READY:
                    ready[message.engine_index - self.start_index] = message
                elif kind is EngineOutputKind.FAILED:
                    raise EngineStartupError(f"engine {message.engine_index} failed to start: {message.error}")
            if self.dead_engines:  # a headless node lost before all were ready
                raise EngineStartupError(next(iter(self.dead_engines.values())))
            for index in range(self.num_local_engines):
                if index not in ready and self._engines.has_exited(index):
                    if await self._output_socket.poll(timeout=200):
                        continue  # its last words are still on the way: read them first
                    raise EngineStartupError(
                        f"engine {self.start_index + index} exited during start-up ({self._engines.exit_reason(index)}) "
                        "without reporting an error; see its log above"
                    )
        self.num_kv_blocks = [ready[i].num_kv_blocks for i in range(self.data_parallel_size)]
        self._engines.on_ready([ready[i].pid for i in range(self.num_local_engines)])
        self.max_model_len = min(r.max_model_len for r in ready.values())
        logger.info("%d engine(s) ready: KV blocks %s", self.data_parallel_size, self.num_kv_blocks)

    # ---- requests ----------------------------------------------------------------

    async def add_request(self, request: EngineCoreRequest) -> int:
        """Send a request to the least loaded live engine; returns that engine's index."""
        self._check_alive()
        request.client_index = self.client_index  # the engine answers this client alone
        position = self.load_balancer.send_to_least_loaded(
            lambda p: self._send(self.start_index + p, EngineInputKind.ADD, request))
        index = self.start_index + position
        self.in_flight[request.request_id] = index
        self.load_balancer.on_request_sent(position)
        return index

    async def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests on the engines that own them; ids that already finished are ignored."""
        self._check_alive()
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            index = self.in_flight.pop(request_id, None)
            if index is not None:
                by_engine.setdefault(index, []).append(request_id)
        for index, ids in by_engine.items():
            self._send(index, EngineInputKind.ABORT, EngineCoreAbort(ids))

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next EngineCoreOutputs from any engine; raises EngineRankDeadError once for each rank that dies
        while another lives (the next call goes on), EngineDeadError once none is left (and on every call after)."""
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            if not isinstance(item, EngineRankDeadError):
                self._outputs.put_nowait(item)  # every later call raises too
            raise item
        return item

    async def call_utility(self, method: str, *args, engine_index: int = 0):
        """Run one of ipc.UTILITY_METHODS on an engine, between two of its steps."""
        if method not in UTILITY_METHODS:
            raise ValueError(f"method must be one of {sorted(UTILITY_METHODS)}, got {method!r}")
        first, end = self.start_index, self.start_index + self.data_parallel_size
        if not first <= engine_index < end:
            raise ValueError(f"engine_index must be in [{first}, {end}), got {engine_index}")
        self._check_alive()
        if engine_index in self.dead_engines:
            raise EngineDeadError(self.dead_engines[engine_index])
        call_id = next(self._call_ids)
        future = self._loop.create_future()
        self._utility_calls[call_id] = (engine_index, future)
        try:
            self._send(engine_index, EngineInputKind.UTILITY, UtilityCall(call_id, method, [*args], self.client_index))
            reply = await future
        finally:
            self._utility_calls.pop(call_id, None)
        if reply.error is not None:
            raise RuntimeError(f"{method} on engine {engine_index} failed: {reply.error}")
        return msgspec.msgpack.decode(reply.result, type=UTILITY_METHODS[method])

    def _send(self, index: int, kind: EngineInputKind, message) -> None:
        # With no high-water mark a send never blocks while the engine is
        # connected; "would block" therefore means the engine's end is gone.
        try:
            frames = [kind.value, self._encoder.encode(message)]
            self._input_sockets[index - self.start_index].send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError(f"engine {index} is not connected") from None
        self.last_sent_bytes = len(frames[1])  # the message's size, for the ipc.send span

    # ---- what comes back ---------------------------------------------------------

    async def _output_loop(self) -> None:
        while True:
            frames = await self._output_socket.recv_multipart()
            try:
                kind, message = self._decoder.decode(frames)
            except ValueError as error:
                logger.warning("dropped a malformed message from an engine: %s", error)
                continue
            if kind in (EngineOutputKind.OUTPUTS, EngineOutputKind.HEARTBEAT):
                self.watchdog.heard(message.engine_index)
            if kind is EngineOutputKind.OUTPUTS:
                self._on_outputs(message)
            elif kind is EngineOutputKind.UTILITY_RESULT:
                _, future = self._utility_calls.get(message.call_id, (None, None))
                if future is not None and not future.done():
                    future.set_result(message)
            elif kind is EngineOutputKind.FAILED:
                self._mark_dead(message.engine_index, message.error)

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        if self.dead_error is not None or outputs.engine_index in self.dead_engines:
            return  # the caller has been told; these requests are failed already
        position = outputs.engine_index - self.start_index
        if not 0 <= position < self.data_parallel_size:
            logger.warning("dropped outputs from unknown engine %d", outputs.engine_index)
            return
        for output in outputs.outputs:
            if output.finished:
                self.in_flight.pop(output.request_id, None)
        if outputs.scheduler_stats is not None:
            self.load_balancer.on_stats(position, outputs.scheduler_stats)
        self._outputs.put_nowait(outputs)

    def _on_engine_exit(self, position: int) -> None:
        self._loop.remove_reader(self._engines.processes[position].sentinel)
        reason = self._engines.exit_reason(position)
        self._mark_dead(self.start_index + position, f"process {self._engines.pids[position]} exited ({reason})")

    def _mark_dead(self, index: int, reason: str) -> None:
        """Engine `index` is gone (its process exited, it reported a failure, or its node was lost):
        fail what it held, and only that while another engine lives. Called once or more per engine."""
        if self.dead_error is not None or self._closed or index in self.dead_engines:
            return
        position = index - self.start_index
        lost = [request_id for request_id, owner in self.in_flight.items() if owner == index]
        for request_id in lost:
            del self.in_flight[request_id]
        self.load_balancer.mark_dead(position)
        where = "" if position < self.num_local_engines else " (on a headless node)"
        message = f"engine {index}{where} died: {reason}; {len(lost)} in-flight request(s) lost"
        live = [self.start_index + p for p in range(self.data_parallel_size) if p not in self.load_balancer.dead]
        if not live:
            if self.dead_engines:
                message += "; no engine is left"
            self.dead_engines[index] = message
            self.dead_error = EngineDeadError(message)
            logger.error("%s", self.dead_error)
            self._fail_waiters(self.dead_error)
            self._engines.terminate()
            return
        message += f" on it; the {len(self.in_flight)} on engine(s) {live} go on"
        self.dead_engines[index] = message
        error = EngineRankDeadError(message, index, lost)
        logger.error("%s", error)
        for engine_index, future in self._utility_calls.values():
            if engine_index == index and not future.done():
                future.set_exception(error)
        if position < self.num_local_engines:  # one that reported a failure may still be running
            process = self._engines.processes[position]
            if process.exitcode is None:
                process.terminate()
        self._outputs.put_nowait(error)

    def _fail_waiters(self, error: EngineDeadError) -> None:
        for _, future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
        self._outputs.put_nowait(error)

    # ---- state and shutdown ----------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and not self._closed and bool(self._engines.processes)

    @property
    def engine_pids(self) -> list[int]:
        return self._engines.pids

    def shutdown(self) -> None:
        """Stop every engine, close the sockets, remove the socket directory. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        loop_open = self._loop is not None and not self._loop.is_closed()
        if loop_open:
            if self.dead_error is None:
                self._fail_waiters(EngineDeadError("the engine client was shut down"))
            for process in self._engines.processes:
                self._loop.remove_reader(process.sentinel)
            if self._output_task is not None:
                self._output_task.cancel()
            self.watchdog.stop()
        if self.remote is not None:
            self.remote.shutdown()
        self._engines.stop()
        for socket in [*self._input_sockets, self._output_socket]:
            if socket is not None:
                socket.close(linger=0)
        if self._context is not None:
            self._context.term()
        if self._ipc_dir is not None and self._ipc_parent != self._ipc_dir:  # not one another process made
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

