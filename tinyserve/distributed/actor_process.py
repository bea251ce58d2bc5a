"""A Ray actor seen as the child process it stands in for: `exitcode`, `sentinel`, `join`, `kill`.

The engine's code watches its children through engine/child_process.py's `ChildProcess`:
`exitcode` (None while running), a `sentinel` file descriptor an event loop can wait on,
`join`, `terminate`, `kill`, `pid`. An actor serving an engine or a rank runs one long call,
`run`, for its whole life; `ActorProcess` holds that call's result and gives it the same
face. A thread waits on the result (Ray's own wait, no polling): when the call returns (the
engine stopped, exit status 0 or 1) or fails because the actor died (killed, its node lost),
`exitcode` is set and the sentinel, a pipe, becomes readable. So MPClient's event loop, the
tensor-parallel watchdog and the start-up checks treat an actor exactly as a process.

`terminate()` asks the actor to stop, as SIGTERM asks a process (it flushes its spans and
returns); `kill()` is `ray.kill`, as SIGKILL. `pid` is the actor's process id when it runs on
this machine's node, None elsewhere (it would name another machine's process).
"""

import contextlib
import os
import threading
import weakref

from tinyserve.distributed.actors import CONTROL

DIED = -1  # exitcode of an actor that died rather than returned (killed, its node lost)


class ActorProcess:
    def __init__(self, actor, name: str, where_ref, run_ref) -> None:
        """actor: a RankActor or an EngineActor (actors.py); where_ref, run_ref: its `where` call, then its `run`."""
        import ray

        self.actor = actor
        self.name = name
        self.here = ray.util.get_node_ip_address()
        self.pid: int | None = None  # once the actor runs, if on this machine's node
        self.actor_pid: int | None = None  # once the actor runs, wherever it does
        self.node_ip: str | None = None
        self.node_id: str | None = None  # the Ray node it runs on
        self.exitcode: int | None = None
        self.reason: str | None = None  # how it ended, once it has
        self._where = where_ref
        self._run_ref = run_ref
        self._ended = threading.Event()
        self.sentinel, self._write_end = os.pipe()
        weakref.finalize(self, os.close, self.sentinel)
        threading.Thread(target=self._wait, name=f"{name}-watch", daemon=True).start()

    def _wait(self) -> None:
        import ray

        try:
            self.actor_pid, self.node_ip, self.node_id = ray.get(self._where)
            self.pid = self.actor_pid if self.node_ip == self.here else None
            code = ray.get(self._run_ref)
            self.exitcode, self.reason = int(code or 0), f"exit code {int(code or 0)}"
        except ray.exceptions.RayActorError as error:  # the actor is gone: killed, its node lost
            self.exitcode, self.reason = DIED, f"Ray actor {self.name} died ({died_detail(error)})"
        except Exception as error:  # `run` raised: as a process's uncaught exception, status 1
            self.exitcode, self.reason = 1, f"exit code 1 (Ray actor {self.name} raised {type(error).__name__})"
        self._ended.set()
        with contextlib.suppress(OSError):
            os.close(self._write_end)  # the sentinel reads EOF

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def terminate(self) -> None:
        """Ask the actor to stop (its `stop` method), as SIGTERM asks a process."""
        if self.is_alive():
            with contextlib.suppress(Exception):
                self.actor.stop.options(concurrency_group=CONTROL).remote()

    def kill(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.actor)


def died_detail(error: Exception) -> str:
    """The line of Ray's long message that says how the actor's worker ended."""
    text = str(error)
    for marker in ("Worker exit detail: ", "The actor died because "):
        if marker in text:
            detail = text.split(marker, 1)[1].split("\n", 1)[0]
            for advice in (" Some common causes", " There are some potential"):  # Ray's guesses, not facts
                detail = detail.split(advice, 1)[0]
            return detail.strip()[:300]
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"
