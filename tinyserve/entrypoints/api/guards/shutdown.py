"""Graceful shutdown on SIGTERM (or Ctrl-C): drain, abort what is left, stop the engines.

    SIGTERM
      │ uvicorn closes the listening socket (new connections are refused) and
      │ the idle keep-alive connections; active ones may finish their response
      │ AsyncLLM.start_draining(): a request that still gets in is answered 503
      │ in-flight requests go on, up to --shutdown-timeout seconds
      │ AsyncLLM.abort_all(): those left finish with finish_reason "abort"; each
      │ stream still sends its last event, each JSON body is still written
      │ (ABORT_GRACE_S later, uvicorn cancels any handler still running)
      │ lifespan shutdown (server.py): the engines stop, each flushing its spans,
      │ then this process flushes its own; the socket directory is removed
      ▼ multiprocessing's resource tracker, the last child, is stopped and reaped

SIGTERM while the engines start (a model loading, a head waiting for its headless nodes) stops
them and exits 0 at once: uvicorn would look at the signal only once the app had started.

uvicorn on its own would wait for open connections for ever, or cut them at a
timeout without a final event; the drain and the abort are what this adds.

An engine that dies (killed, crashed) takes the server down with it, as in
vLLM, rather than leaving a server that answers 503 for ever:

    engine process exits
      │ its sentinel fires: every request it held fails at once (a 503, or an
      │ error event as a stream's last), /health turns 503
      │ the next tick (0.1 s) sees AsyncLLM.errored: the same shutdown as above,
      │ with ENGINE_DEATH_GRACE_S for the responses to send their last bytes
      ▼ the process exits with ENGINE_DEATH_EXIT_CODE, for a supervisor to restart it

With data parallel, a rank that dies (its process, or a headless node's rank)
fails only the requests it held; the other ranks' requests run on. The server
still exits with ENGINE_DEATH_EXIT_CODE, but as on SIGTERM: the live ranks'
requests get --shutdown-timeout seconds to finish, the rest end with
finish_reason "abort". vLLM has no such case (any engine's death is the whole
client's, every request fails at once); failing requests that would finish would
only cost their clients a retry, and the supervisor waits no longer than a
SIGTERM of its own would make it wait. Once no engine is left it is the single
engine's case above.

--keep-alive-on-engine-death keeps the server up instead (vLLM's
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH): with ranks left, new requests go to them and
/health stays 200 (its body says which engines died); with none left, it answers
503 until someone stops it, as vLLM does.
"""

import asyncio
import contextlib
import logging
import signal
import threading
from multiprocessing import resource_tracker

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from tinyserve.frontend.async_llm import AsyncLLM
from tinyserve.lifecycle.tracing import shutdown_tracing

logger = logging.getLogger("tinyserve.api")

ABORT_GRACE_S = 5.0  # after the abort, how long responses get to send their last bytes
ENGINE_DEATH_GRACE_S = 2.0  # after an engine died: its requests are failed already, only bytes are left to send
ENGINE_DEATH_EXIT_CODE = 1
_POLL_S = 0.05


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with AsyncLLM's drain and abort in its shutdown."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, shutdown_timeout: float,
                 keep_alive_on_engine_death: bool = False) -> None:
        if shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {shutdown_timeout}")
        config.timeout_graceful_shutdown = shutdown_timeout + ABORT_GRACE_S
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.keep_alive_on_engine_death = keep_alive_on_engine_death
        self.stopped_for_engine_death = False
        self.stopped_during_startup = False

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, less raising the signal again once the shutdown is done: the drain is what
        SIGINT and SIGTERM ask for, so the process then exits with exit_code (0 after a clean
        drain), not killed by the signal, and Ctrl-C ends without a KeyboardInterrupt traceback."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        original_handlers = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original_handlers.items():
                signal.signal(sig, handler)

    @property
    def exit_code(self) -> int:
        """What the process should exit with once `run` returns."""
        if self.stopped_for_engine_death:
            return ENGINE_DEATH_EXIT_CODE
        return 0 if self.started or self.stopped_during_startup else 1

    async def startup(self, sockets=None) -> None:
        """uvicorn's, once the engines are up; a SIGTERM (or Ctrl-C) while they start stops them and the server.

        uvicorn looks at its signals only after the app's start-up, and the engines' start can take
        minutes (a model loading) or for ever (a head waiting for a headless node that never comes):
        so they are started here first, watching for the signal. The lifespan's own engine.start()
        then returns at once, or raises the start's error, as before.
        """
        starting = asyncio.ensure_future(self.engine.start())
        while not starting.done() and not self.should_exit:
            await asyncio.wait([starting], timeout=_POLL_S)
        if not starting.done():
            logger.info("stopping during start-up: the engines are stopped")
            self.stopped_during_startup = True
            self.engine.shutdown()  # the start under way is cancelled; its engines and sockets are closed
            await asyncio.wait([starting])
            shutdown_tracing()
            _stop_resource_tracker()
            return
        if not starting.cancelled():
            starting.exception()  # seen here; the lifespan's start raises it again
        await super().startup(sockets)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's tick (every 0.1 s); an engine's death asks for the shutdown.

        With no engine left, only bytes remain to send (ENGINE_DEATH_GRACE_S). With a data-parallel
        rank left, its requests drain as on SIGTERM (the graceful timeout stays shutdown_timeout's).
        """
        dead = self.engine.errored or bool(self.engine.dead_engines)
        if dead and not self.keep_alive_on_engine_death and not self.should_exit:
            self.stopped_for_engine_death = True
            if self.engine.errored:
                logger.error("an engine died: stopping the server (--keep-alive-on-engine-death keeps it up)")
                self.config.timeout_graceful_shutdown = ENGINE_DEATH_GRACE_S
            else:
                logger.error("an engine died: stopping the server once the requests on engine(s) %s finish "
                             "(--keep-alive-on-engine-death keeps it up)", self.engine.live_engine_indices)
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        self.engine.start_draining()
        logger.info("draining %d in-flight request(s) for up to %.0f s", self.engine.num_unfinished_requests,
                    self.shutdown_timeout)
        aborter = asyncio.create_task(self._abort_at_deadline(), name="tinyserve-abort-at-deadline")
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()
        _stop_resource_tracker()

    async def _abort_at_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.engine.num_unfinished_requests and loop.time() < deadline:
            await asyncio.sleep(_POLL_S)
        if self.engine.num_unfinished_requests:
            aborted = await self.engine.abort_all()
            logger.warning("shutdown timeout (%.0f s) reached: aborted %d request(s)", self.shutdown_timeout, aborted)


def _stop_resource_tracker() -> None:
    # Starting a process with "spawn" also starts this helper. It would exit on
    # its own once we are gone, but as an orphan, a zombie until init reaps it.
    # Python has no public call to stop it earlier; _stop() closes its pipe and
    # waits for it (and does nothing if it never started).
    resource_tracker._resource_tracker._stop()
