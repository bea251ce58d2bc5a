"""The events' wire format: vLLM's (vllm/distributed/kv_events.py), field for field.

Encoded with msgspec's msgpack: structs as arrays (array_like), each event tagged with its
class name, so that a subscriber written for vLLM (its docs' kv_events_subscriber.py)
decodes ours with its own copy of these types:

    KVEventBatch  [ts, [event, ...], data_parallel_rank?]
    BlockStored   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    BlockRemoved  ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared ["AllBlocksCleared"]

Block hashes, as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): the low 64
bits of the block's hash as an unsigned int. Ours is the SHA-256 chain of engine/core/block_pool.py
(BlockHash.value), so a router may recompute a prompt's hashes itself (router/prefix_hashes.py) and
rely on equal ints meaning equal prefixes up to a 64-bit collision: good for routing, which only
costs a cache miss when wrong; the engine itself matches on the whole digest and the tokens.
"""

import msgspec

MEDIUM = "CPU"  # where the blocks live: this engine's pool (vLLM says "GPU" for its device memory)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; the tag is the class's name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]  # consecutive blocks of one prefix, each chaining from the one before
    parent_block_hash: int | None  # the block before the first; None at a prompt's start
    token_ids: list[int]  # every block's tokens, in order
    block_size: int
    lora_id: int | None  # the adapter's lora_int_id, whose blocks chain from its own root
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_block_hash(digest: bytes) -> int:
    """A block's hash as the events carry it: the low 64 bits of the digest, big-endian (vLLM's rule)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)
