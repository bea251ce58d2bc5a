"""The KV cache manager: block tables per request, and the prefix cache on top of them.

A request's K/V live in a list of blocks, its block table:

    request tokens:  [t0 ... t15][t16 ... t31][t32 t33 t34 _ _ ...]
    block table:     [   7      ][    2      ][    9              ]   (any free blocks)

Prefix caching: every *full* block gets a BlockHash chained from its prefix.
When a new request arrives, its leading full blocks are looked up by hash; each
hit is a block whose K/V is already computed, so the request starts with
`num_computed_tokens = hits * block_size` and shares those blocks (ref_cnt > 1).
The first block chains from the request's `block_hash_root`: b"" for the base model, the
adapter's identity under a LoRA adapter (whose K/V differ for the same tokens). A block that
covers an image's placeholders chains from its parent and the image's content hash
(`Request.block_extra_key`): placeholder ids are the same for every image.
"""

from collections import defaultdict

from tinyserve.engine.core.block_pool import BlockHash, BlockPool, KVBlock
from tinyserve.engine.core.request import Request
from tinyserve.utils import cdiv

class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, *,
                 event_sink=None) -> None:
        """event_sink: told of every block cached or evicted (block_pool.py), or None."""
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching, event_sink)
        self.req_to_blocks: dict[str, list[KVBlock]] = defaultdict(list)
        self.req_to_hashes: dict[str, list[BlockHash]] = defaultdict(list)
        self.req_num_cached_blocks: dict[str, int] = defaultdict(int)
        # Cumulative prefix-cache counters, in tokens (vLLM's prefix_cache_queries/hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Leading blocks of `request` already in the prefix cache, and how many tokens they hold."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            # Prompt logprobs need the logits of every prompt position: none may be skipped (vLLM's rule).
            return [], 0
        # At least one token must still be computed: its logits give the next token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in self._block_hashes(request)[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: list[KVBlock] = (),
                       delay_cache_blocks: bool = False) -> bool:
        """Make room for `num_new_tokens` more tokens of `request`; False if the pool is too full.

        `new_computed_blocks` are prefix-cache hits found for a request scheduled for
        the first time: they join its block table ahead of any new block. `delay_cache_blocks`
        (vLLM's): the blocks' K/V will arrive from another engine, not from a step, so they are
        not offered to the prefix cache until then (distributed/kv_transfer/).
        """
        blocks = self.req_to_blocks[request.request_id]
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_new_blocks = self.blocks_needed(total_tokens) - len(blocks) - len(new_computed_blocks)
        # A hit sitting in the free queue stops being free once we take it.
        num_free_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return False
        if self.enable_prefix_caching and request.num_computed_tokens == 0 and not request.times.preemption_times:
            # Counted once per request, when it is admitted (not for every attempt that found
            # no room). As in vLLM, a preempted request coming back is left out: its hits are
            # mostly the blocks it just freed, which would inflate the hit rate.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(new_computed_blocks) * self.block_size
        self.pool.touch(list(new_computed_blocks))
        blocks.extend(new_computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.get_new_blocks(num_new_blocks))
        if self.enable_prefix_caching and not delay_cache_blocks:
            self._cache_full_blocks(request, total_tokens)
        return True

    def free(self, request: Request) -> None:
        """Release the request's blocks: on finish, abort or preemption.

        A block is registered in the prefix cache when a step is about to fill it. If the
        step's tokens are taken back (the request is preempted later in the same schedule,
        before the model ran), its K/V was never written: such blocks leave the cache here,
        so no later request can take them for a prefix hit.
        """
        blocks = self.req_to_blocks.pop(request.request_id, [])
        num_written = request.num_computed_tokens // self.block_size
        for block in blocks[num_written : self.req_num_cached_blocks.get(request.request_id, 0)]:
            self.pool.uncache(block)
        # Free the tail first so it is evicted first: the head of a prompt (a shared
        # system prompt, say) is the part most likely to be asked for again.
        self.pool.free_blocks(list(reversed(blocks)))
        self.req_to_hashes.pop(request.request_id, None)
        self.req_num_cached_blocks.pop(request.request_id, None)

    def free_tail(self, request: Request) -> list[int]:
        """Free the blocks past the request's computed tokens: those that only rejected speculative
        drafts reached (spec_decode/). Never prefix-cached: only blocks full of known tokens are.
        Returns the ids of the blocks freed, in table order (the step span records them)."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = self.blocks_needed(request.num_computed_tokens)
        if blocks is None or len(blocks) <= keep:
            return []
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free_blocks(list(reversed(tail)))
        return [block.block_id for block in tail]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The chained hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self.req_to_hashes[request.request_id]
        tokens, size = request.all_token_ids, self.block_size
        for i in range(len(hashes), request.num_tokens // size):
            parent = hashes[-1].value if hashes else request.block_hash_root
            extra = request.block_extra_key(i * size, (i + 1) * size)  # the images it covers, if any
            hashes.append(BlockHash(parent + extra, tuple(tokens[i * size : (i + 1) * size])))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register blocks that are full once this step has written `num_tokens` tokens.

        Their K/V is written during this very step, before any later step can read it
        through another request's block table.
        """
        blocks = self.req_to_blocks[request.request_id]
        hashes = self._block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(hashes))
        for i in range(self.req_num_cached_blocks[request.request_id], num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self.req_num_cached_blocks[request.request_id] = max(num_full, self.req_num_cached_blocks[request.request_id])
