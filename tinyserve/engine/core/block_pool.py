"""The pool of KV-cache blocks: who holds each block, which are free, which are cached.

The KV cache of every layer is one preallocated tensor cut into `num_blocks`
blocks of `block_size` token slots. This module never touches that tensor; it
only does the bookkeeping of block ids:

    ref_cnt > 0          the block is in some running request's block table
    ref_cnt == 0         the block is in the free queue; if it still carries a
                         block hash, its contents stay valid and a later request
                         with the same prefix can take it back (a prefix-cache hit)

    free queue (LRU):  front ─► [oldest freed] ... [most recently freed] ◄─ back
    New blocks are taken from the front, so the cached blocks freed longest ago are
    the first to lose their hash (evicted) and be overwritten.

An event sink (`event_sink`, None unless KV cache events are on: tinyserve/kv_events/)
hears of each block that gets a hash, each that loses it, and a reset that clears them all.
"""

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Identity of a full block: the hash of everything before it plus its own tokens.

    Chaining the parent's hash means equal blocks only match when the whole prefix
    before them is equal too, which is exactly when their K/V are equal. The token
    ids are kept in the key, so two different blocks never collide; the prefix is
    known only by its hash, which is SHA-256 (as vLLM's default) rather than
    Python's hash(): 64 bits that are not made to resist a prompt crafted to
    collide with another user's prefix, and so read or plant its K/V.
    """

    parent_hash: bytes
    token_ids: tuple[int, ...]

    @property
    def value(self) -> bytes:
        """The hash the next block chains from: SHA-256 of the parent's and these token ids."""
        return hashlib.sha256(self.parent_hash + array("q", self.token_ids).tobytes()).digest()


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, event_sink=None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        # Told block_stored(hash), block_removed(hash), all_cleared(): KV cache events' recorder, given at
        # assembly (tinyserve/kv_events/); None: nobody listens.
        self.event_sink = event_sink

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the front of the free queue, evicting their cached contents."""
        if count > self.num_free_blocks:
            raise RuntimeError(f"asked for {count} KV blocks, only {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference to prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        """Drop one reference to each block, in the order given (first freed = first evicted)."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Remember that `block` holds the full block `block_hash`, for later requests."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached_blocks:  # the same contents already cached elsewhere
            return
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if self.event_sink is not None:
            self.event_sink.block_stored(block_hash)

    def uncache(self, block: KVBlock) -> None:
        """Forget what `block` was registered as holding (its K/V was never written)."""
        self._evict(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; only possible when no request holds a block."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block, announce=False)
        if self.event_sink is not None:
            self.event_sink.all_cleared()
        return True

    def _evict(self, block: KVBlock, announce: bool = True) -> None:
        if block.block_hash is not None:
            if announce and self.event_sink is not None:
                self.event_sink.block_removed(block.block_hash)
            del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def check_integrity(self) -> None:
        """Every block is either referenced or free, never both; cached hashes point back."""
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            if (block.ref_cnt == 0) != in_free or block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id}: ref_cnt={block.ref_cnt}, in free queue={in_free}")
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cached block {block.block_id} has a stale hash")
