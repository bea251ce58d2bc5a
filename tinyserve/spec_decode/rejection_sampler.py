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

Sampled requests: rejection sampling with one-token drafts (q = 1 at the draft: n-gram
drafts, and the draft model's argmax, as vLLM v1's drafters propose). The target draws its
own token t_j from p_j, by the sampler's exponential race, and d_j+1 is accepted if t_j is
d_j+1; else t_j is emitted and the rest dropped. So d is accepted with probability p(d) =
min(1, p(d)/q(d)), and when it is not, the token comes from p without d, renormalized: the
residual max(p - q, 0) of rejection sampling (Leviathan et al.; vLLM's RejectionSampler). Each
emitted token is distributed exactly as p:

    P(emit t) = p(d)·[t = d] + (1 - p(d))·p(t)/(1 - p(d))·[t ≠ d] = p(t)

Drawn this way, the token at each position does not depend on the draft at all, only on the
random numbers: a seeded request draws one exponential vector per position from its own
generator, in order, and none for positions after a rejection. It gets the very tokens it gets
without speculation, whatever was drafted, and whatever batch it ran in.
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


class RejectionSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, states: list[CachedRequestState],
                 drafts: list[list[int]]) -> tuple[list[list[int]], list[list[TokenLogprobs] | None]]:
        """logits: for each request in turn, len(drafts[i]) + 1 rows (after its newest token, after each
        draft). Returns each request's emitted tokens (accepted drafts + one) and their logprobs."""
        sampler = self.sampler
        row_states, first_rows = [], []
        for state, request_drafts in zip(states, drafts):
            sampler._request_generator(state)  # made once, on the worker's own state, before copies share it
            first_rows.append(len(row_states))
            row_states += [as_if_sampled(state, request_drafts[:j]) for j in range(len(request_drafts) + 1)]
        processed = sampler.process_logits(logits, row_states)
        emitted = []
        for state, first, request_drafts in zip(states, first_rows, drafts):
            rows = processed[first : first + len(request_drafts) + 1]
            emitted.append(self._verify(rows, request_drafts, state))
        raw_logprobs, logprobs = None, []
        for state, first, tokens in zip(states, first_rows, emitted):
            num_top = state.sampling_params.logprobs
            if num_top is None:
                logprobs.append(None)
                continue
            if raw_logprobs is None:
                raw_logprobs = torch.log_softmax(logits, dim=-1)  # reported before any processing, as sample's
            asked = state.sampling_params.logprob_token_ids
            logprobs.append([top_logprobs(raw_logprobs[first + j], token, num_top, asked)
                             for j, token in enumerate(tokens)])
        return emitted, logprobs

    def _verify(self, rows: torch.Tensor, drafts: list[int], state: CachedRequestState) -> list[int]:
        """The accepted drafts, then the target's own token at the first position it disagrees (or after
        the last draft). rows: the processed logits after the newest token and after each draft."""
        params = state.sampling_params
        if params.is_greedy:
            targets = rows.argmax(dim=-1).tolist()
        else:
            probs = self.sampler._probs(rows, [params] * len(rows))
            generator = state.generator or self.sampler.generator
            targets = []
            for j in range(len(rows)):  # one draw per position, in order, none after a rejection
                q = torch.empty_like(probs[j]).exponential_(generator=generator)
                targets.append(int((probs[j] / q).argmax()))
                if j == len(drafts) or targets[j] != drafts[j]:
                    break
        for j, draft in enumerate(drafts):
            if targets[j] != draft:
                return [*drafts[:j], targets[j]]
        return [*drafts, targets[len(drafts)]]
