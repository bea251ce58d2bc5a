"""KVEventRecorder: the block pool's event sink, and the events a step made.

While a step runs, the pool calls `block_stored`, `block_removed` and `all_cleared`; each
appends one tuple and nothing more (the step's cost). After the step, `drain()` turns
them into vLLM's events: hashes to the ints the wire carries, and the blocks one request
stored in a row, each chaining from the one before, into one BlockStored (as vLLM sends
a request's newly full blocks together).
"""

from tinyserve.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, external_block_hash

_LORA_ROOT = b"lora\x00"  # engine/core/request.py's Request.block_hash_root: b"lora\0<id>\0<name>\0<path>"


class KVEventRecorder:
    def __init__(self, block_size: int, medium: str) -> None:
        self.block_size = block_size
        self.medium = medium
        self._pending: list[tuple] = []

    # ---- the sink (engine/core/block_pool.py calls these) ----------------------------

    def block_stored(self, block_hash) -> None:
        self._pending.append(("stored", block_hash))

    def block_removed(self, block_hash) -> None:
        self._pending.append(("removed", block_hash))

    def all_cleared(self) -> None:
        self._pending.append(("cleared", None))

    # ---- after the step ------------------------------------------------------------

    def drain(self) -> list:
        """The events since the last drain, in order, as vLLM's structs."""
        pending, self._pending = self._pending, []
        events: list = []
        last_value = None  # the digest of the last block of events[-1], when it is a BlockStored
        for kind, block_hash in pending:
            if kind == "stored":
                value = block_hash.value
                if events and isinstance(events[-1], BlockStored) and block_hash.parent_hash == last_value:
                    events[-1].block_hashes.append(external_block_hash(value))
                    events[-1].token_ids.extend(block_hash.token_ids)
                else:
                    events.append(self._stored(block_hash, value))
                last_value = value
            elif kind == "removed":
                removed = external_block_hash(block_hash.value)
                if events and isinstance(events[-1], BlockRemoved):
                    events[-1].block_hashes.append(removed)
                else:
                    events.append(BlockRemoved([removed], self.medium))
            else:
                events.append(AllBlocksCleared())
        return events

    def _stored(self, block_hash, value: bytes) -> BlockStored:
        parent, lora_id = block_hash.parent_hash, None
        if parent == b"":
            parent_hash = None  # the first block of a prompt under the base model
        elif parent.startswith(_LORA_ROOT):
            parent_hash, lora_id = None, int(parent.split(b"\x00")[1])  # the first under an adapter
        else:
            parent_hash = external_block_hash(parent)
        return BlockStored([external_block_hash(value)], parent_hash, list(block_hash.token_ids), self.block_size,
                           lora_id, self.medium)
