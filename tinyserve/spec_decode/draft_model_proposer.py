"""The draft-model proposer (vLLM's "draft_model"): a small model sharing the target's vocabulary
guesses the next tokens, one forward pass per draft, greedily.

The draft keeps its own paged KV cache: its own pool of blocks and its own block table per
request, managed here in the worker (the scheduler's blocks are the target's). Each step,
after the target verified, it catches up on the tokens it has not seen, then guesses:

    request tokens:  p0 ... p9 a b c            (a b c: accepted this step, c the target's own)
    draft K/V:       p0 ... p9 | a b c          pass 1 feeds the tokens it has not seen → d1
                                      d1        pass 2 → d2
                                         d2     pass 3 → d3
    propose ─► drafts [d1, d2, d3] ─► verify (one target pass) ─► accept a prefix

The K/V written for d1, d2 is not trusted later: the next catch-up starts after c, and any
accepted draft is fed again (at most num_speculative_tokens + 1 tokens per pass 1). Drafts are
the draft's argmax, as vLLM v1's drafters propose: a one-token draft distribution, which the
rejection sampler (rejection_sampler.py) needs for sampled requests.
"""

import torch

from tinyserve.kernels.metadata import AttentionMetadata
from tinyserve.utils import cdiv


class DraftModelProposer:
    def __init__(self, model, num_speculative_tokens: int, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.block_size = block_size
        self.device = device
        shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)]
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 handed out first
        self.block_ids: dict[str, list[int]] = {}  # the draft's block table of each request
        self.num_computed: dict[str, int] = {}  # leading tokens whose draft K/V is trusted

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def update_states(self, scheduler_output) -> None:
        """Finished and preempted requests give their draft blocks back (a preempted one starts over)."""
        for request_id in (*scheduler_output.finished_request_ids, *scheduler_output.preempted_request_ids):
            self._release(request_id)
        for new in scheduler_output.scheduled_new_requests:  # resumed after a preemption: recomputed from 0
            self._release(new.request_id)

    def _release(self, request_id: str) -> None:
        self.free_blocks += reversed(self.block_ids.pop(request_id, []))
        self.num_computed.pop(request_id, None)

    def _reserve(self, request_id: str, num_tokens: int) -> bool:
        blocks = self.block_ids.setdefault(request_id, [])
        needed = cdiv(num_tokens, self.block_size) - len(blocks)
        if needed > len(self.free_blocks):
            return False
        for _ in range(needed):
            blocks.append(self.free_blocks.pop())
        return True

    @torch.inference_mode()
    def propose(self, states, max_drafts: dict[str, int]) -> dict[str, list[int]]:
        """Up to max_drafts[id] drafts after each request's known tokens (its worker state)."""
        batch = []  # (request_id, token ids, first position fed)
        for state in states:
            num = max_drafts[state.request_id]
            tokens = state.prompt_token_ids + state.output_token_ids
            if num <= 0 or not self._reserve(state.request_id, len(tokens) + num - 1):
                continue
            start = min(self.num_computed.get(state.request_id, 0), len(tokens) - 1)
            batch.append((state.request_id, tokens[start:], start, num))
        if not batch:
            return {}
        drafts = {request_id: [] for request_id, *_ in batch}
        feeds = [(request_id, fed, start) for request_id, fed, start, _ in batch]
        for round_ in range(max(num for *_, num in batch)):
            next_tokens = self._forward(feeds)
            for (request_id, fed, start), token in zip(feeds, next_tokens):
                drafts[request_id].append(token)
            if round_ == 0:
                for request_id, fed, start in feeds:
                    self.num_computed[request_id] = start + len(fed)  # the known tokens, all fed now
            wanted = {request_id: num for request_id, _, _, num in batch}
            feeds = [(request_id, [drafts[request_id][-1]], start + len(fed))
                     for request_id, fed, start in feeds if len(drafts[request_id]) < wanted[request_id]]
            if not feeds:
                break
        return drafts

    def _forward(self, feeds: list[tuple[str, list[int], int]]) -> list[int]:
        """One draft pass: each request's tokens at their positions; the argmax after each one's last."""
        bs = self.block_size
        input_ids, positions, slots, query_lens, seq_lens, last = [], [], [], [], [], []
        for request_id, tokens, start in feeds:
            blocks = self.block_ids[request_id]
            end = start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slots += [blocks[pos // bs] * bs + pos % bs for pos in range(start, end)]
            query_lens.append(len(tokens))
            seq_lens.append(end)
            last.append(len(input_ids) - 1)
        max_blocks = max(len(self.block_ids[request_id]) for request_id, *_ in feeds)
        tables = torch.zeros((len(feeds), max_blocks), dtype=torch.int32)
        for i, (request_id, *_) in enumerate(feeds):
            blocks = self.block_ids[request_id]
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        metadata = AttentionMetadata.from_lengths(query_lens, seq_lens, tables.to(self.device),
                                                  torch.tensor(slots, dtype=torch.int64))
        hidden = self.model(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                            self.kv_caches, metadata)
        logits = self.model.compute_logits(hidden[torch.tensor(last, device=self.device)])
        return logits.argmax(dim=-1).tolist()

    def warm_up(self) -> None:
        """One dummy pass (block 0 is free until a request takes it)."""
        self.block_ids["warm-up"] = [0]
        self._forward([("warm-up", [0] * min(self.block_size, 4), 0)])
        del self.block_ids["warm-up"]
