"""The front end's side of LoRA: adapters checked before any request names them, and the server's names.

`LoRAChecker` is what the input processor asks about a request's LoRARequest: LoRA must be
enabled, and the adapter must be one this engine can serve (peft_format.py: its config,
its rank against max_lora_rank, its shapes against the base model's). An adapter is read
and checked once per (id, path); an engine then loads it without surprises.

`LoRARegistry` is the server's table of adapters by name (vLLM's OpenAIServingModels):
those of --lora-modules, and those loaded or unloaded at run time. Each name gets a
lora_int_id of its own, never reused, so an adapter loaded again under a name it had
before is a new adapter to the engine (its own slot, its own prefix-cache blocks). The
API processes of one server (--api-server-count N) share one table, in a file.
"""

import contextlib
import fcntl
import json
import os
import pathlib

from tinyserve.errors import InvalidInputError
from tinyserve.lora.peft_format import LoRAConfigError, load_peft_adapter
from tinyserve.lora_request import LoRARequest

# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter, and tinyserve's own name for it.
RUNTIME_UPDATING_ENV = ("TINYSERVE_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating_allowed(environ=os.environ) -> bool:
    """Whether either variable is set to true (1, true, yes: vLLM reads "True")."""
    return any(environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in RUNTIME_UPDATING_ENV)


class LoRAChecker:
    def __init__(self, model_path: pathlib.Path, *, enable_lora: bool, max_lora_rank: int) -> None:
        self.model_path = pathlib.Path(model_path)
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self._checked: set[tuple[int, str, str]] = set()
        self._model_config: dict | None = None

    @classmethod
    def from_engine_args(cls, model_path, args) -> "LoRAChecker":
        return cls(model_path, enable_lora=args.enable_lora, max_lora_rank=args.max_lora_rank)

    def check(self, lora_request: LoRARequest | None, param: str = "lora_request") -> None:
        """Raise InvalidInputError (naming `param`) if this engine cannot run the request's adapter."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise InvalidInputError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}", param)
        if not self.enable_lora:
            raise InvalidInputError(f"LoRA adapter {lora_request.lora_name!r} asked for, but LoRA is not enabled "
                                    "(enable_lora=True, --enable-lora)", param)
        key = (lora_request.lora_int_id, lora_request.lora_name, lora_request.lora_path)
        if key in self._checked:
            return
        try:
            load_peft_adapter(lora_request.lora_path, lora_request.lora_name, self.model_config, self.max_lora_rank)
        except LoRAConfigError as error:
            raise InvalidInputError(str(error), param) from None
        self._checked.add(key)

    @property
    def model_config(self) -> dict:
        if self._model_config is None:
            self._model_config = json.loads((self.model_path / "config.json").read_text())
        return self._model_config


class LoRARegistry:
    """Adapters by name, for the server: `model` in a request picks one.

    shared_file: where the API processes of one server (--api-server-count N) keep the table together, so
    that every one of them agrees on each name and its lora_int_id, and lists the same /v1/models. Each
    had a table and an id counter of its own: one id named different adapters in two processes, and the
    engine, which knows an adapter by its id, ran a tenant's request under another's (hardening-4, High 3).
    Changes are made under an exclusive lock (flock) of the file's lock file and written whole by an
    atomic rename; a lookup reads the file again only when it has changed (its inode, size or mtime).
    """

    def __init__(self, checker: LoRAChecker, base_model_name: str, shared_file: str | os.PathLike | None = None
                 ) -> None:
        self.checker = checker
        self.base_model_name = base_model_name
        self.shared_file = pathlib.Path(shared_file) if shared_file is not None else None
        self._adapters: dict[str, LoRARequest] = {}
        self._next_id = 1
        self._seen: tuple | None = None  # the shared file's (inode, size, mtime) as last read

    @property
    def adapters(self) -> dict[str, LoRARequest]:
        """name -> LoRARequest, in the order they were added (a copy)."""
        self._refresh()
        return dict(self._adapters)

    def add(self, name: str, path: str, *, exist_ok: bool = False) -> LoRARequest:
        """Check and register an adapter; raises InvalidInputError naming the problem.

        exist_ok: an adapter of this name and path already there is the one returned (--lora-modules, which
        every API process of a server adds as it starts)."""
        if not isinstance(name, str) or not name:
            raise InvalidInputError("lora_name must not be empty", "lora_name")
        if name == self.base_model_name:
            raise InvalidInputError(f"{name!r} is the base model's name", "lora_name")
        path = str(pathlib.Path(path).expanduser())
        with self._changing():
            existing = self._adapters.get(name)
            if existing is not None:
                if exist_ok and existing.lora_path == path:
                    return existing
                raise InvalidInputError(f"the LoRA adapter {name!r} is already loaded", "lora_name")
            lora_request = LoRARequest(name, self._next_id, path, base_model_name=self.base_model_name)
            self.checker.check(lora_request, param="lora_path")
            self._next_id += 1
            self._adapters[name] = lora_request
        return lora_request

    def remove(self, name: str) -> LoRARequest:
        """Unregister an adapter; KeyError if no adapter has this name (any more)."""
        with self._changing():
            if name not in self._adapters:
                raise KeyError(name)
            return self._adapters.pop(name)

    def get(self, name: str) -> LoRARequest | None:
        self._refresh()
        return self._adapters.get(name)

    # ---- the table shared by a server's API processes -------------------------------------------

    @contextlib.contextmanager
    def _changing(self):
        """The table read fresh and held while the body changes it, then written (nothing is written if the
        body raises). Without a shared file: this process's own table."""
        if self.shared_file is None:
            yield
            return
        with open(self.shared_file.with_name(self.shared_file.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
            self._refresh()
            yield
            state = {"next_id": self._next_id,
                     "adapters": [[r.lora_name, r.lora_int_id, r.lora_path] for r in self._adapters.values()]}
            partial = self.shared_file.with_name(f"{self.shared_file.name}.{os.getpid()}.tmp")
            partial.write_text(json.dumps(state))
            os.replace(partial, self.shared_file)
            self._seen = None  # read back at the next lookup

    def _refresh(self) -> None:
        if self.shared_file is None:
            return
        try:
            stat = os.stat(self.shared_file)
        except FileNotFoundError:
            return  # nothing added yet by any process
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen == self._seen:
            return
        state = json.loads(self.shared_file.read_text())
        self._next_id = state["next_id"]
        self._adapters = {name: LoRARequest(name, lora_id, path, base_model_name=self.base_model_name)
                          for name, lora_id, path in state["adapters"]}
        self._seen = seen


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """--lora-modules entries, as vLLM takes them: name=path, or JSON {"name": ..., "path": ...}."""
    modules = []
    for value in values:
        value = value.strip()
        if value.startswith("{"):
            try:
                spec = json.loads(value)
                modules.append((spec["name"], spec["path"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value!r}: a JSON entry needs \"name\" and \"path\"") from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value!r}: expected name=path")
        modules.append((name, path))
    return modules
