"""prefix-aware: send a request where the longest prefix of its prompt is already in the KV cache.

For each live backend, the policy counts how many leading blocks of the request's prompt
(prefix_hashes.py) the backend holds, by its KV cache events (kv_index.py), or was sent by
this router a moment ago (pending): the backend with the most takes the request, ties to the
least loaded. A match of less than MIN_MATCH_SHARE of the prompt's blocks is not followed
(the request goes to the least loaded): otherwise the first block or two that every prompt
shares (a chat template's header, a common instruction) would draw every request to the
backend that served the first, and pile them there (SGLang's cache-aware router has the same
rule, its cache_threshold, 0.5 by default). Pending hashes matter for a new prefix: its first request's blocks reach the
index only once that request's prefill has run, and until then the requests that share the
prefix would scatter over the backends, each computing it again. A pending hash leaves when
the backend's BlockStored for it arrives, or after PENDING_S (a request that failed, or whose
blocks were evicted before the events said so).
"""

import asyncio
import logging
import re
import time

import httpx

from tinyserve.lifecycle import schema
from tinyserve.router.backends import Backend
from tinyserve.router.defaults import DEFAULT_KV_INDEX_MAX_BLOCKS, MAX_BACKEND_ANSWER_BYTES
from tinyserve.router.kv_index import KVIndex
from tinyserve.router.policies import Choice, RoutedRequest, least_loaded
from tinyserve.router.prefix_hashes import PromptHasher
from tinyserve.router.proxy import AnswerTooLarge, read_bounded

PENDING_S = 30.0
MIN_MATCH_SHARE = 0.5
DEFAULT_BLOCK_SIZE = 16  # the engine's default, when no backend says otherwise
# vLLM's cache_config_info gauge on /metrics (any prefix: vllm:, tinyserve:), whose labels hold the block size
_CACHE_CONFIG = re.compile(r'^\w+:cache_config_info\{[^}]*\bblock_size="(\d+)"', re.MULTILINE)

logger = logging.getLogger("tinyserve.router")


class PrefixAware:
    name = "prefix-aware"

    def __init__(self, backends: list[Backend], index: KVIndex, hasher: PromptHasher) -> None:
        self.backends = backends
        self.index = index
        self.hasher = hasher
        self.pending: list[dict[int, float]] = [{} for _ in backends]  # per backend: hash → when it expires
        index.listeners.append(self._stored)

    @classmethod
    def from_flags(cls, backends: list[Backend], endpoints: list[str], model: str, block_size: int,
                   max_blocks: int = DEFAULT_KV_INDEX_MAX_BLOCKS) -> "PrefixAware":
        return cls(backends, KVIndex(endpoints, max_blocks), PromptHasher(model, block_size))

    async def start(self) -> None:
        await self.index.start()
        if self.hasher.block_size is None:  # no --block-size: the backends say theirs
            self.hasher.block_size = await backends_block_size([b.url for b in self.backends])

    async def stop(self) -> None:
        await self.index.stop()

    async def choose(self, request: RoutedRequest, backends: list[Backend]) -> Choice:
        token_ids = await asyncio.to_thread(self.hasher.token_ids, request.path, request.body)  # off the loop
        hashes = self.hasher.block_hashes(token_ids) if token_ids else []
        request.facts["hashes"] = hashes
        now = time.monotonic()
        matched = {b.index: self._leading(b.index, hashes, now) for b in backends}
        best = max(matched.values(), key=lambda m: m[1])[1] if matched else 0
        if best == 0 or best < MIN_MATCH_SHARE * len(hashes):
            choice = least_loaded(backends, f"the longest match is {best} of {len(hashes)} prompt blocks: ")
        else:
            choice = least_loaded([b for b in backends if matched[b.index][1] == best],
                                  f"holds {best} of {len(hashes)} prompt blocks; ")
        cached, held_or_pending = matched[choice.backend.index]
        choice.attributes = {schema.ROUTER_PROMPT_BLOCKS: len(hashes), schema.ROUTER_CACHED_BLOCKS: cached,
                             schema.ROUTER_PENDING_BLOCKS: held_or_pending - cached}
        return choice

    def forwarded(self, request: RoutedRequest, choice: Choice) -> None:
        expires = time.monotonic() + PENDING_S
        pending = self.pending[choice.backend.index]
        held = self.index.held[choice.backend.index]
        pending.update((h, expires) for h in request.facts.get("hashes", ()) if h not in held)

    def _leading(self, backend: int, hashes: list[int], now: float) -> tuple[int, int]:
        """(leading blocks the backend holds by its events, leading blocks it holds or was sent)."""
        held, pending = self.index.held[backend], self.pending[backend]
        cached = 0
        while cached < len(hashes) and hashes[cached] in held:
            cached += 1
        both = cached
        while both < len(hashes) and (hashes[both] in held or pending.get(hashes[both], 0.0) > now):
            both += 1
        return cached, both

    def _stored(self, backend: int, event) -> None:
        """The index applied a BlockStored: its blocks are held now, no longer pending."""
        pending = self.pending[backend]
        for block_hash in event.block_hashes:
            pending.pop(block_hash, None)
        if len(pending) > 10_000:  # expired ones pile up only where events never come; drop them
            now = time.monotonic()
            for block_hash in [h for h, expires in pending.items() if expires <= now]:
                del pending[block_hash]


def block_size_in_metrics(text: str) -> int | None:
    """The block size a server's /metrics reports (vLLM's cache_config_info), or None."""
    match = _CACHE_CONFIG.search(text)
    return int(match.group(1)) if match else None


async def backends_block_size(urls: list[str]) -> int:
    """The KV block size the backends report on /metrics (read up to MAX_BACKEND_ANSWER_BYTES);
    DEFAULT_BLOCK_SIZE, with a warning, if none does."""
    sizes = {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        for url in urls:
            try:
                async with client.stream("GET", f"{url}/metrics") as answer:
                    text = await read_bounded(answer, MAX_BACKEND_ANSWER_BYTES, f"{url}/metrics")
                sizes[url] = block_size_in_metrics(text.decode(errors="replace"))
            except (httpx.HTTPError, AnswerTooLarge):
                sizes[url] = None
    known = {size for size in sizes.values() if size is not None}
    if len(known) > 1:
        logger.warning("the backends' KV block sizes differ (%s): prefix hashes use the first's; pass --block-size",
                       sizes)
    if not known:
        logger.warning("no backend reported its KV block size on /metrics: %d assumed (--block-size sets it)",
                       DEFAULT_BLOCK_SIZE)
        return DEFAULT_BLOCK_SIZE
    return next(size for size in sizes.values() if size is not None)
