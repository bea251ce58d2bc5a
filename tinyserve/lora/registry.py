"""The front end's side of LoRA: adapters checked before any request names them, and the server's names.

`LoRAChecker` is what the input processor asks about a request's LoRARequest: LoRA must be
enabled, and the adapter must be one this engine can serve (peft_format.py: its config,
its rank against max_lora_rank, its shapes against the base model's). An adapter is read
and checked once per (id, path); an engine then loads it without surprises.

`LoRARegistry` is the server's table of adapters by name (vLLM's OpenAIServingModels):
those of --lora-modules, and those loaded or unloaded at run time. Each name gets a
lora_int_id of its own, never reused, so an adapter loaded again under a name it had
before is a new adapter to the engine (its own slot, its own prefix-cache blocks).
"""

import json
import os
import pathlib

from tinyserve.errors import InvalidInputError
from tinyserve.lora.peft_format import LoRAConfigError, load_peft_adapter
from tinyserve.lora.request import LoRARequest

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
    """Adapters by name, for the server: `model` in a request picks one."""

    def __init__(self, checker: LoRAChecker, base_model_name: str) -> None:
        self.checker = checker
        self.base_model_name = base_model_name
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def add(self, name: str, path: str) -> LoRARequest:
        """Check and register an adapter; raises InvalidInputError naming the problem."""
        if not name:
            raise InvalidInputError("lora_name must not be empty", "lora_name")
        if name in self.adapters:
            raise InvalidInputError(f"the LoRA adapter {name!r} is already loaded", "lora_name")
        if name == self.base_model_name:
            raise InvalidInputError(f"{name!r} is the base model's name", "lora_name")
        lora_request = LoRARequest(name, self._next_id, str(pathlib.Path(path).expanduser()),
                                   base_model_name=self.base_model_name)
        self.checker.check(lora_request, param="lora_path")
        self._next_id += 1
        self.adapters[name] = lora_request
        return lora_request

    def remove(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            raise KeyError(name)
        return self.adapters.pop(name)

    def get(self, name: str) -> LoRARequest | None:
        return self.adapters.get(name)


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
