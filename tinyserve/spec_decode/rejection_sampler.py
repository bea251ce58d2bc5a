"""Verification: which drafts the target keeps, so that the tokens are exactly the target's.

One target forward pass computes logits at the newest token and after each draft:

    fed:      x      d1     d2     d3          (x: the newest known token; d: drafts)
    logits:   p0     p1     p2     p3          p_j: the target's distribution after x, d1..dj
    propose ─► verify (this module) ─► accept d1 d2, reject d3 ─► emit d1 d2 + one token of p2's

Each row is processed as the sampler would process it had the drafts before it been
sampled already (penalties, min_tokens, bad words see them): row j is sampled "as if"
the output so far ended with d1..dj.

Greedy requests: accept d_j+1 while it equals the argmax of p_j; at the first mismatch emit
that argmax instead; if all agree, emit one more token from the last row (the "bonus").
The tokens equal those of decoding one token at a time, exactly.

Sampled requests: rejection sampling (Leviathan et al., Chen et al.; vLLM's RejectionSampler).
Drafts here are single tokens (q = 1 at the draft: n-gram drafts, and the draft model's
argmax, as vLLM v1's drafters propose), so d is accepted with probability min(1, p(d)/q(d))
= p(d); rejected, a token is drawn from the residual max(p - q, 0) normalized: p without d.
The emitted token at each position is then distributed exactly as p, whatever the draft:

    P(emit t) = p(d)·[t = d] + (1 - p(d))·p(t)/(1 - p(d))·[t ≠ d] = p(t)

A seeded request draws its uniforms and residual samples from its own generator
(reproducible run to run); others from the sampler's shared one.
"""

import dataclasses

import torch

from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.sampler import Sampler, top_logprobs
from tinyserve.wire.messages import TokenLogprobs


def as_if_sampled(state: CachedRequestState, drafts: list[int]) -> CachedRequestState:
    """The request as the sampler would see it after sampling `drafts` (its generator shared)."""
    if not drafts:
        return state
    return dataclasses.replace(state, output_token_ids=state.output_token_ids + drafts,
                               allowed_token_ids_mask=state.allowed_token_ids_mask)


def accept_or_resample(probs: torch.Tensor, draft: int, generator: torch.Generator) -> int | None:
    """One position of rejection sampling with a one-token draft: None if `draft` is accepted,
    else a token from the residual distribution (p with the draft removed, renormalized)."""
    u = torch.rand((), generator=generator, device=probs.device)
    if u < probs[draft]:
        return None
    residual = probs.clone()
    residual[draft] = 0.0
    if residual.sum() <= 0:  # p was all on the draft: it is always accepted (u < 1)
        return draft
    q = torch.empty_like(residual).exponential_(generator=generator)
    return int((residual / q).argmax())


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, states: list[CachedRequestState],
                 drafts: list[list[int]]) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """logits: for each request in turn, len(drafts[i]) + 1 rows (after its newest token, after each
        draft). Returns each request's emitted tokens (accepted drafts + one) and their logprobs."""
        sampler = self.sampler
        for state in states:
            sampler._request_generator(state)  # made once, on the worker's own state, before copies share it
        first_rows, row = [], 0
        for request_drafts in drafts:
            first_rows.append(row)
            row += len(request_drafts) + 1
        # The row after the last draft: sampled exactly as the plain sampler would (a request without
        # drafts gets the very token it would get without speculation).
        last_rows = [first + len(d) for first, d in zip(first_rows, drafts)]
        last_states = [as_if_sampled(s, d) for s, d in zip(states, drafts)]
        last_tokens, _ = sampler.sample(logits[last_rows], last_states)
        # The draft rows, processed as the sampler would, each as if the drafts before it were sampled.
        draft_rows, draft_states = [], []
        for state, first, request_drafts in zip(states, first_rows, drafts):
            for j in range(len(request_drafts)):
                draft_rows.append(first + j)
                draft_states.append(as_if_sampled(state, request_drafts[:j]))
        processed = sampler.process_logits(logits[draft_rows], draft_states) if draft_rows else None
        emitted, position = [], 0
        for state, request_drafts, last_token in zip(states, drafts, last_tokens):
            params = state.sampling_params
            tokens = None
            if request_drafts:
                rows = processed[position : position + len(request_drafts)]
                position += len(request_drafts)
                tokens = self._verify(rows, request_drafts, state)
            emitted.append(tokens if tokens is not None else [*request_drafts, last_token])
        raw_logprobs = None
        logprobs = []
        for state, first, tokens in zip(states, first_rows, emitted):
            num_top = state.sampling_params.logprobs
            if num_top is None:
                logprobs.append(None)
                continue
            if raw_logprobs is None:
                raw_logprobs = torch.log_softmax(logits, dim=-1)
            logprobs.append([top_logprobs(raw_logprobs[first + j], token, num_top) for j, token in enumerate(tokens)])
        return emitted, logprobs

    def _verify(self, rows: torch.Tensor, drafts: list[int], state: CachedRequestState) -> list[int] | None:
        """The emitted tokens if a draft is rejected (the accepted ones, then the replacement); None if all
        are accepted (the caller adds the bonus token)."""
        params = state.sampling_params
        if params.is_greedy:
            targets = rows.argmax(dim=-1).tolist()
            for j, (draft, target) in enumerate(zip(drafts, targets)):
                if draft != target:
                    return [*drafts[:j], target]
            return None
        probs = self.sampler._probs(rows, [params] * len(drafts))
        generator = state.generator or self.sampler.generator
        for j, draft in enumerate(drafts):
            replacement = accept_or_resample(probs[j], draft, generator)
            if replacement is not None:
                return [*drafts[:j], replacement]
        return None
