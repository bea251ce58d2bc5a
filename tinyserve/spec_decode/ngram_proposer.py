"""The n-gram proposer (vLLM's "ngram", prompt lookup): drafts copied from the request's own tokens.

Look for the request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min)
earlier in its prompt and output; the tokens that followed that earlier occurrence are the
drafts. No model, no K/V: a text that repeats itself (code, quotes, a list) drafts well.

    tokens:  The cat sat on the mat . The cat sat on  ?
                 └─────┬──────┘                └──┬──┘ suffix n=3 "cat sat on", seen before at 1
                   earlier occurrence, followed by "the mat ."
    propose ─► drafts [the, mat, .]  (at most num_speculative_tokens)
    verify  ─► one target pass over [on, the, mat, .]: 4 positions, 4 sets of logits
    accept  ─► the target's own tokens agree with "the mat", not with "."  → the, mat, + the target's token
"""


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose_one(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        """The drafts after `token_ids`: the tokens after the first earlier occurrence of its longest
        matching suffix (vLLM's choice); [] if no suffix of at least prompt_lookup_min tokens recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        length = len(token_ids)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = token_ids[length - n:]
            first = suffix[0]
            for start in range(length - n):  # occurrences ending before the suffix itself starts... or overlapping it
                if token_ids[start] == first and token_ids[start:start + n] == suffix:
                    return token_ids[start + n:start + n + k]
        return []

    def propose(self, states, max_drafts: dict[str, int]) -> dict[str, list[int]]:
        """Drafts for each request state (the worker's CachedRequestState): prompt and output so far."""
        drafts = {}
        for state in states:
            proposed = self.propose_one(state.prompt_token_ids + state.output_token_ids, max_drafts[state.request_id])
            if proposed:
                drafts[state.request_id] = proposed
        return drafts

    def update_states(self, scheduler_output) -> None:
        """Nothing kept between steps."""

    def warm_up(self) -> None:
        """Nothing to warm."""
