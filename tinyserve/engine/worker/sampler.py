"""The sampler: turn the last position's logits of each sequence into the next token.

The order of operations follows vLLM's (v1) sampler:

    raw logits ─► grammar bitmask (structured outputs): tokens the grammar forbids get -inf
        ├─► logprobs reported to the user (before any further processing)
        │
        ├─► allowed_token_ids, bad_words: the tokens a request forbids get -inf (token_filters.py)
        ├─► min_tokens: stop tokens (EOS included) masked until enough tokens were generated
        ├─► logit_bias: added to the chosen tokens' logits
        ├─► penalties (repetition on prompt+output; presence/frequency on output)
        ├─► greedy rows: argmax — done
        └─► temperature ─► min-p ─► top-k ─► top-p ─► sample

Two exact ways to draw from p, one for each kind of row:

- A request with a seed uses the "exponential race", as vLLM does: argmax(p / q) with
  q ~ Exp(1) per token picks token i with probability p_i. Its q comes from its own
  generator, so its tokens do not depend on which other requests share the batch (and a
  recorded trace's seeded request replays to the same tokens).
- The other rows share the sampler's generator and draw one uniform u each: the token
  is the first whose cumulative probability passes u (the inverse CDF, what
  torch.multinomial does). One number a row instead of one per vocabulary entry: on a
  served step of 64 rows over an 8,192-id vocabulary the exponentials cost ~13 % of the
  engine's time on a CPU (vLLM's CPU sampler compiles that draw with torch.compile).

Each row's request is the worker's own CachedRequestState (request_state.py): its
sampling params, prompt and the output tokens sampled before this step.
"""

import torch

from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.token_filters import apply_token_filters
from tinyserve.wire.messages import TokenLogprobs


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # shared by unseeded requests

    def sample(self, logits: torch.Tensor, requests: list[CachedRequestState],
               grammar_bitmask: bytes | None = None,
               grammar_rows: list[int] = ()) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(requests), vocab] float32, one row per request that samples this step;
        grammar_bitmask row i constrains logits row grammar_rows[i]."""
        if grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, grammar_bitmask, grammar_rows)
        params = [r.sampling_params for r in requests]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = self.process_logits(logits, requests)
        sampled = first_argmax(logits)
        random_rows = [row for row, p in enumerate(params) if not p.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            probs = self._probs(logits[rows], [params[row] for row in random_rows])
            generators = [self._request_generator(requests[row]) for row in random_rows]
            drawn = torch.empty(len(random_rows), dtype=torch.long, device=logits.device)
            seeded = [i for i, generator in enumerate(generators) if generator is not None]
            unseeded = [i for i, generator in enumerate(generators) if generator is None]
            if seeded:
                index = torch.tensor(seeded, device=logits.device)
                seeded_probs = probs[index]
                q = torch.empty_like(seeded_probs)
                for row, i in enumerate(seeded):
                    q[row].exponential_(generator=generators[i])
                drawn[index] = first_argmax(seeded_probs / q)
            if unseeded:
                index = torch.tensor(unseeded, device=logits.device)
                uniforms = torch.rand(len(unseeded), generator=self.generator, device=logits.device)
                drawn[index] = inverse_cdf_sample(probs[index], uniforms)
            sampled[rows] = drawn

        token_ids = sampled.tolist()
        logprobs = [
            top_logprobs(raw_logprobs[row], token_ids[row], p.logprobs, p.logprob_token_ids)
            if p.logprobs is not None else None
            for row, p in enumerate(params)
        ]
        return token_ids, logprobs

    @staticmethod
    def process_logits(logits: torch.Tensor, requests: list[CachedRequestState]) -> torch.Tensor:
        """A copy of the logits with each request's filters, min_tokens, logit_bias and penalties applied."""
        logits = logits.clone()
        for row, request in enumerate(requests):
            p = request.sampling_params
            apply_token_filters(logits[row], request)
            if request.num_output_tokens < p.min_tokens:
                logits[row, list(request.min_tokens_stop_ids)] = float("-inf")
            if p.logit_bias:
                bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[row, list(p.logit_bias)] += bias
            if p.has_penalties:
                apply_penalties(logits[row], request)
        return logits

    def _probs(self, logits: torch.Tensor, params) -> torch.Tensor:
        temperature = torch.tensor([p.temperature for p in params], device=logits.device)
        logits = logits / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            # On the whole (temperature-scaled) distribution, before top-k and top-p.
            probs = torch.softmax(logits, dim=-1)
            min_p = torch.tensor([p.min_p for p in params], device=logits.device)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1 for p in params):
            logits = apply_top_k_top_p(logits, params)
        return torch.softmax(logits, dim=-1)

    def _request_generator(self, request: CachedRequestState) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None:
            return None
        if request.generator is None:
            request.generator = torch.Generator(device=self.device).manual_seed(seed)
        return request.generator


def first_argmax(values: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension: the first of equal maxima, a NaN counted as the largest.

    torch's `max` gives argmax's indices, and on a CPU in a third of the time: its argmax
    is a scalar loop ([64, 8192] fp32 on 2 threads: 125 us against 387).
    """
    return values.max(dim=-1).indices


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """For each row, the first token whose cumulative probability passes uniforms[row] times the row's total.

        probs  0.2  0.0  0.5  0.3     u = 0.6: cumulative 0.2 0.2 0.7 1.0, target 0.6 -> token 2

    A token of probability 0 adds nothing to the running sum, so it never is the first to
    pass the target. u < 1, but u times the total may round up to the total: the target is
    kept just below it, so the last token of positive probability is the furthest one drawn.
    A row of NaNs (logits driven to infinity, e.g. by a repetition penalty of 5e-324) passes
    no target: it gets the last token id, a token all the same, as the exponential race
    gives such a row one.
    """
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).flatten().clamp_(max=probs.shape[-1] - 1)


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: bytes, rows: list[int]) -> torch.Tensor:
    """-inf for every token a grammar forbids. Bit j of word w of a bitmask row is token 32 * w + j:

        word 0 = 0b...0110   tokens 1 and 2 allowed, 0 and 3..31 forbidden

    bitmask: len(rows) rows of int32 words, as raw bytes (SchedulerOutput.grammar_bitmask).
    """
    words = torch.frombuffer(bytearray(bitmask), dtype=torch.int32).view(len(rows), -1).to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words[:, :, None] >> shifts) & 1).bool().flatten(1)[:, : logits.shape[-1]]
    index = torch.tensor(list(rows), device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, request: CachedRequestState) -> None:
    """In place, on one row. Repetition sees prompt and output; presence/frequency only output."""
    params = request.sampling_params
    vocab_size = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = set(request.prompt_token_ids).union(request.output_token_ids)
        seen = torch.tensor(sorted(seen), device=logits.device, dtype=torch.long)
        seen = seen[seen < vocab_size]
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if request.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        output = torch.tensor(request.output_token_ids, device=logits.device, dtype=torch.long)
        counts = torch.bincount(output, minlength=vocab_size)[:vocab_size].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus with -inf (vLLM's algorithm).

    Sorted ascending, so the tokens to drop come first. Top-k drops logits below the k-th
    largest (tokens tied with it stay). Top-p drops the least likely tokens while their
    summed probability stays within 1 - p: what is left is the smallest set whose mass
    reaches p, and the most likely token always stays.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab_size = logits.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params],
                         device=logits.device)
    kth_largest = sorted_logits.gather(-1, (vocab_size - top_k)[:, None])
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    mass_from_bottom = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = mass_from_bottom <= 1 - top_p[:, None]
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def top_logprobs(logprobs: torch.Tensor, sampled_token: int, num_top: int,
                 asked: list[int] | None = None) -> TokenLogprobs:
    """The sampled token's logprob and rank, followed by the num_top most likely tokens, or with `asked`
    (vLLM's logprob_token_ids) by exactly those tokens, in the order asked, each with its own rank.

    The rank counts the tokens at least as likely as the sampled one (vLLM's rule: a tie
    ranks the sampled token last among equals).
    """
    sampled_logprob = logprobs[sampled_token]
    rank = int((logprobs >= sampled_logprob).sum())
    token_ids, values, ranks = [sampled_token], [float(sampled_logprob)], [rank]
    if asked:
        index = torch.tensor(asked, device=logprobs.device)
        chosen = logprobs[index]
        ranks += (logprobs[None, :] >= chosen[:, None]).sum(dim=-1).tolist()
        return TokenLogprobs(token_ids=token_ids + list(asked), logprobs=values + chosen.tolist(), ranks=ranks)
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top)
        token_ids += top_ids.tolist()
        values += top_values.tolist()
        ranks += list(range(1, num_top + 1))
    return TokenLogprobs(token_ids=token_ids, logprobs=values, ranks=ranks)
