"""The two kinds of Ray actor tinyserve starts: a tensor-parallel rank, and a data-parallel engine.

Each is a plain class made remote where it is started (so this module imports without Ray);
each runs one long call, `run` (named as the process it stands in for, so `ps` shows
`ray::tinyserve-engine-1`), for its whole life, which returns the exit status a process
would have: a rank's `run_worker` returns when rank 0 tells it to stop; an engine's
`serve_engine` when it is stopped or fails (1, after telling the front end why). Ray runs an
actor's calls in threads of its worker process, not in its main thread, so neither installs
signal handlers: `stop` (in a concurrency group of its own, so it runs beside `run`) asks
the engine to exit as SIGTERM asks a process, and Ray ends the actor with its owner.
"""

import os

CONTROL = "control"  # the concurrency group `stop` runs in, beside `run`
CONCURRENCY_GROUPS = {CONTROL: 1}


class _Actor:
    def __init__(self, title: str) -> None:
        self.title = title  # its `run` call carries it as its name: the process shows ray::<title>

    def where(self) -> tuple[int, str, str]:
        """This actor's process id, its node's address and its node's Ray id."""
        import ray

        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()


class RankActor(_Actor):
    """A tensor-parallel rank: tensor_parallel_workers.run_worker, until rank 0 sends its stop."""

    def run(self, target, kwargs: dict) -> int:
        return _exit_status(target, kwargs)

    def stop(self) -> None:
        pass  # rank 0 stops its ranks over their sockets; ray.kill ends one that does not


class EngineActor(_Actor):
    """A data-parallel engine: engine_core_proc.serve_engine, on the sockets the front end bound."""

    def __init__(self, title: str) -> None:
        super().__init__(title)
        self.proc = None
        self.stopping = False

    def run(self, proc_class, serve, proc_args: tuple, kwargs: dict) -> int:
        """serve(proc=proc_class(*proc_args), **kwargs): EngineCoreProc and serve_engine (ray_engines.py)."""
        self.proc = proc_class(*proc_args)
        if self.stopping:  # stopped before it started
            self.proc.close()
            return 0
        return _exit_status(serve, dict(proc=self.proc, **kwargs))

    def stop(self) -> None:
        self.stopping = True
        if self.proc is not None:
            self.proc.request_stop()


def _exit_status(target, kwargs: dict) -> int:
    try:
        target(**kwargs)
    except SystemExit as exit_:
        return 0 if exit_.code is None else exit_.code if isinstance(exit_.code, int) else 1
    return 0
