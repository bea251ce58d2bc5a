"""The worker's adapters: which are resident in the model's slots, which are loaded, which are read.

    a request arrives (check_request) ──► read from its PEFT folder and checked whole (peft_format.py),
                                           or the request is refused alone, a 400 naming the adapter
    loaded: at most max_cpu_loras adapters' weights (LRU); those of running requests are never let go
    admitted (admit, an admission gate) ──► its adapter loaded: kept since arrival, or read again if it was
                                           let go meanwhile; one that cannot be read any more fails that
                                           request alone, named (failed_requests, at the next step)
    resident: in one of max_loras slots of every LoRALinear (LRU among those the batch does not use)

Before each forward pass the model runner hands its input hook the batch (`prepare_batch`):
every adapter the batch uses is made resident, from the weights in memory (a running request's
adapter is always loaded: the forward pass never reads a disk, and never fails on an adapter),
evicting the least recently used ones the batch does not need. The scheduler admits no request
whose adapter would make more than max_loras adapters run at once (scheduling.py), so a batch
always fits in the slots, and the adapters kept for running requests never exceed max_cpu_loras.
Then the token rows of each slot are set as the LoRALinear layers' groups.

An adapter unloaded at run time (remove_lora) is let go at once, or, while requests run under it,
once they are done; a waiting one reads it again (or fails alone, if its folder is gone too).
"""

import logging
from collections import OrderedDict

import torch

from tinyserve.errors import InvalidInputError
from tinyserve.lora.layers import LoRABatch, wrap_model
from tinyserve.lora.peft_format import PeftAdapter, load_peft_adapter
from tinyserve.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None,
                 running_adapters=lambda: set()) -> None:
        """running_adapters(): the ids of the adapters running requests use (the scheduler's), never let go."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.model_config = model.config.to_dict()
        self.batch = LoRABatch()
        self.targets = wrap_model(model, self.batch, max_loras)
        parameter = next(model.parameters())
        self.dtype, self.device = parameter.dtype, parameter.device
        if self.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # a packed model's weights
            self.dtype = torch.float32
        self.loaded: OrderedDict[int, PeftAdapter] = OrderedDict()  # lora_int_id -> weights, LRU first
        self.resident: OrderedDict[int, int] = OrderedDict()  # lora_int_id -> slot, LRU first
        self.num_loads = 0  # adapters read from disk, for tests and the step span
        self.batch_adapters: list[str] = []  # the names of the adapters of the latest batch
        self.running_adapters = running_adapters
        self.removed: set[int] = set()  # unloaded at run time while requests ran under them: let go once idle
        self.failed: dict[str, str] = {}  # request id -> why its adapter could not be read again (admit)

    # ---- the model runner's input hook ----------------------------------------------------

    def prepare_batch(self, scheduled_requests, states) -> None:
        """Make the batch's adapters resident and group its token rows by slot."""
        slot_rows: dict[int, list[int]] = {}
        names, needed, start = [], {}, 0
        for scheduled, state in zip(scheduled_requests, states):
            lora_request = getattr(state, "lora_request", None)
            end = start + scheduled.num_new_tokens
            if lora_request is not None:
                needed[lora_request.lora_int_id] = lora_request
                slot = self._make_resident(lora_request, needed)
                slot_rows.setdefault(slot, []).extend(range(start, end))
                if lora_request.lora_name not in names:
                    names.append(lora_request.lora_name)
            start = end
        self.batch.groups = [
            (slot, None if len(rows) == start else torch.tensor(rows, dtype=torch.int64, device=self.device))
            for slot, rows in slot_rows.items()
        ]
        self.batch_adapters = names
        if self.removed:  # adapters unloaded at run time whose last requests have finished
            self._evict_loaded()

    # ---- the engine's request check ---------------------------------------------------------

    def check_request(self, request) -> None:
        """Read a request's adapter as the request arrives (then kept loaded, LRU): one whose folder is gone or
        broken since the front end checked it refuses that request with a 400, instead of failing a step."""
        lora_request = request.lora_request
        if lora_request is None:
            return
        try:
            self._load(lora_request)
        except Exception as error:  # an OSError, a bad safetensors file, a config that changed: all refuse it
            raise InvalidInputError(_cannot_load(lora_request, error), "model") from None

    # ---- the scheduler's admission gate, and the requests it failed -------------------------------

    def admit(self, request, scheduler) -> bool:
        """May `request` start now, as far as its adapter's weights go? Loaded: yes. Let go since it arrived
        (max_cpu_loras, or unloaded): read again now; if that fails, no, and the request is failed alone."""
        lora_request = request.lora_request
        if lora_request is None or request.request_id in self.failed:
            return lora_request is None
        try:
            self._load(lora_request)
        except Exception as error:  # its folder deleted after an unload, say
            self.failed[request.request_id] = _cannot_load(lora_request, error)
            logger.warning("%s", self.failed[request.request_id])
            return False
        return True

    def failed_requests(self) -> dict[str, tuple[str, str]]:
        """The requests admit() failed since the last call: {request id: (error, error_param)}, for the engine
        to end (EngineHooks.failed_requests)."""
        failed, self.failed = self.failed, {}
        return {request_id: (message, "model") for request_id, message in failed.items()}

    # ---- residency ----------------------------------------------------------------------------

    def _make_resident(self, lora_request: LoRARequest, needed: dict[int, LoRARequest]) -> int:
        lora_id = lora_request.lora_int_id
        if lora_id in self.resident:
            self.resident.move_to_end(lora_id)
            return self.resident[lora_id]
        adapter = self.loaded.get(lora_id)
        if adapter is None:  # admit() loaded it and running requests' adapters are kept: never here
            raise RuntimeError(f"LoRA adapter {lora_request.lora_name!r} of a running request is not loaded")
        self.loaded.move_to_end(lora_id)
        used = set(self.resident.values())
        free = [slot for slot in range(self.max_loras) if slot not in used]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.resident if i not in needed), None)
            if victim is None:  # the scheduler's gate keeps this from happening
                raise RuntimeError(f"a batch uses more than max_loras={self.max_loras} adapters")
            slot = self.resident.pop(victim)
        for wrapped, weights in self._slot_weights(adapter):
            wrapped.set_slot(slot, weights, adapter.scaling)
        self.resident[lora_id] = slot
        return slot

    def _slot_weights(self, adapter: PeftAdapter) -> list:
        """(LoRALinear, the (A, B) of each of its sub-projections, None where not adapted) for every one."""
        per_module: dict[int, tuple] = {}
        for (layer, target), (wrapped, index) in self.targets.items():
            entry = per_module.setdefault(id(wrapped), (wrapped, [None] * len(wrapped.slices)))
            entry[1][index] = adapter.weights.get((layer, target))
        return list(per_module.values())

    def _load(self, lora_request: LoRARequest) -> PeftAdapter:
        lora_id = lora_request.lora_int_id
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)
            return self.loaded[lora_id]
        adapter = load_peft_adapter(lora_request.lora_path, lora_request.lora_name, self.model_config,
                                    self.max_lora_rank, self.dtype)
        adapter.weights = {key: (a.to(self.device), b.to(self.device)) for key, (a, b) in adapter.weights.items()}
        self.num_loads += 1
        logger.info("loaded LoRA adapter %r (id %d, rank %d) from %s", lora_request.lora_name, lora_id,
                    adapter.rank, lora_request.lora_path)
        self.loaded[lora_id] = adapter
        self._evict_loaded()
        return adapter

    def _evict_loaded(self) -> None:
        """At most max_cpu_loras adapters loaded, however many requests wait: the least recently used of those no
        running request uses go (with their slot), and those unloaded at run time as soon as none does.
        Running requests use at most max_loras <= max_cpu_loras adapters, so the bound always holds."""
        running = self.running_adapters()
        for lora_id in [i for i in self.removed if i not in running]:
            self._let_go(lora_id)
        while len(self.loaded) > self.max_cpu_loras:
            evicted = next((i for i in self.loaded if i not in running), None)
            if evicted is None:
                return
            self._let_go(evicted)

    def _let_go(self, lora_id: int) -> bool:
        """Forget an adapter's weights and free its slot; False if neither was held."""
        self.removed.discard(lora_id)
        held = self.loaded.pop(lora_id, None) is not None
        slot = self.resident.pop(lora_id, None)
        if slot is not None:
            for wrapped, _ in self.targets.values():
                wrapped.clear_slot(slot)
        return held or slot is not None

    def remove_lora(self, lora_id: int) -> bool:
        """An adapter unloaded at run time: its weights and slot let go, once no running request uses them (those
        finish under it); False if it was not held."""
        if lora_id in self.running_adapters():
            self.removed.add(lora_id)
            return True
        return self._let_go(lora_id)

    def list_loras(self) -> list[int]:
        return list(self.loaded)


def _cannot_load(lora_request: LoRARequest, error: Exception) -> str:
    return f"LoRA adapter {lora_request.lora_name!r} cannot be loaded from {lora_request.lora_path}: {error}"
