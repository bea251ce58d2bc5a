"""The sampler, checked against vLLM's v1 sampler on small hand-made logits.

Every expected token, value or kept set below is worked out by hand from vLLM's
definitions, never by calling the code under test a second time:

- vllm/v1/sample/sampler.py (Sampler docstring and forward/sample): raw logprobs
  first; then the argmax-changing logits processors (min_tokens, logit_bias); then
  penalties (repetition, frequency, presence); greedy argmax, or temperature, then
  the argmax-invariant processors (min_p), then top-k/top-p, then the random draw.
- vllm/model_executor/layers/utils.py apply_penalties (repetition over prompt and
  output; frequency and presence over the output only).
- vllm/v1/sample/ops/topk_topp_sampler.py apply_top_k_top_p_pytorch / apply_top_k_only.
- vllm/v1/sample/logits_processor/builtin.py (MinP, LogitBias, MinTokens processors).

Random draws use fixed seeds and enough samples that the tolerances are many
standard deviations wide; where vLLM gives a token probability exactly 0, the test
asserts it is never drawn.
"""

import math
from collections import Counter

import pytest
import torch

from tinyserve.engine.worker.request_state import CachedRequestState
from tinyserve.engine.worker.sampler import Sampler, apply_penalties, apply_top_k_top_p, inverse_cdf_sample
from tinyserve.sampling_params import SamplingParams

CPU = torch.device("cpu")
EOS = 7


def make_request(prompt=(20, 21), output=(), request_id="r", eos=(EOS,), **params):
    """The worker's state of a request with these tokens so far, as the sampler sees it."""
    params.setdefault("max_tokens", 32)
    return CachedRequestState(request_id, list(prompt), SamplingParams(**params), eos_token_ids=list(eos),
                              output_token_ids=list(output))


def logits_of(*values):
    return torch.tensor([list(values)], dtype=torch.float32)


def sample_one(values, request, sampler=None):
    sampler = sampler or Sampler(CPU)
    token_ids, _ = sampler.sample(logits_of(*values), [request])
    return token_ids[0]


def draw(values, request, n, seed=0):
    """n independent draws for one request: n rows of the same logits in one batch."""
    logits = torch.tensor([list(values)], dtype=torch.float32).expand(n, -1).contiguous()
    token_ids, _ = Sampler(CPU, seed=seed).sample(logits, [request] * n)
    return Counter(token_ids)


def kept(values, **params):
    """The tokens apply_top_k_top_p leaves finite for one row."""
    out = apply_top_k_top_p(logits_of(*values), [SamplingParams(**params)])
    return set(torch.isfinite(out[0]).nonzero().flatten().tolist())


def log_softmax(values):
    m = max(values)
    log_z = m + math.log(sum(math.exp(v - m) for v in values))
    return [v - log_z for v in values]


def softmax(values):
    return [math.exp(v) for v in log_softmax(values)]


# ---------------------------------------------------------------- greedy


def test_greedy_picks_the_argmax_every_time():
    values = [0.0, 0.1, 0.05, 0.3, 0.29, 0.2, 0.0, 0.1]  # nearly flat: random sampling would wander
    sampler = Sampler(CPU)
    for temperature in (0.0, 1e-6):  # below vLLM's _SAMPLING_EPS = 1e-5 is greedy
        request = make_request(temperature=temperature, top_k=5, top_p=0.9, min_p=0.5)
        assert {sample_one(values, request, sampler) for _ in range(50)} == {3}


def test_greedy_takes_the_first_of_equal_maxima_and_a_nan_as_the_largest_as_argmax_does():
    inf, nan = math.inf, math.nan
    rows = [[0.5, 2.0, 1.0, 2.0], [-inf, -inf, -inf, -inf], [1.0, inf, 3.0, inf], [1.0, nan, 3.0, nan],
            [nan, nan, nan, nan], [1.0, 1.0, 1.0, 1.0]]
    token_ids, _ = Sampler(CPU).sample(torch.tensor(rows), [make_request(temperature=0.0)] * len(rows))
    assert token_ids == [1, 0, 1, 1, 0, 0]  # torch.argmax's answers, worked out by hand


def test_each_row_of_a_batch_uses_its_own_params():
    values = [1.0, 3.0, 2.0, 0.0, 0.5, -1.0, 0.0, 2.5]
    logits = torch.tensor([values] * 4, dtype=torch.float32)
    requests = [
        make_request(request_id="greedy", temperature=0.0),
        make_request(request_id="bias", temperature=0.0, logit_bias={5: 5.0}),  # -1 + 5 = 4 > 3
        make_request(request_id="min_tokens", temperature=0.0, min_tokens=2, stop_token_ids=[1]),  # EOS=7 too
        make_request(request_id="top_k_1", temperature=1.0, top_k=1),
    ]
    for _ in range(20):
        token_ids, _ = Sampler(CPU).sample(logits, requests)
        assert token_ids == [1, 5, 2, 1]


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output_tokens():
    row = torch.tensor([2.0, -1.0, 3.0, 0.5, -0.5, 1.0, 4.0, -2.0])
    request = make_request(prompt=[0, 1, 1, 1], output=[3, 4], repetition_penalty=2.0)
    apply_penalties(row, request)
    # tokens 0, 1 (prompt; 1 three times, still penalised once) and 3, 4 (output); 2, 5, 6, 7 untouched
    assert row.tolist() == [1.0, -2.0, 3.0, 0.25, -1.0, 1.0, 4.0, -2.0]


def test_repetition_penalty_changes_the_greedy_choice():
    values = [2.0, 0.0, 0.0, 0.0, 0.0, 1.5, 0.0, 0.0]
    assert sample_one(values, make_request(prompt=[0], temperature=0.0)) == 0
    assert sample_one(values, make_request(prompt=[0], temperature=0.0, repetition_penalty=2.0)) == 5  # 2/2 = 1 < 1.5
    assert sample_one(values, make_request(prompt=[1], output=[0], temperature=0.0, repetition_penalty=2.0)) == 5


def test_frequency_penalty_subtracts_penalty_times_output_count_and_ignores_the_prompt():
    row = torch.zeros(8)
    request = make_request(prompt=[1, 1, 1, 2], output=[2, 3, 3, 3], frequency_penalty=0.5)
    apply_penalties(row, request)
    assert row.tolist() == [0.0, 0.0, -0.5, -1.5, 0.0, 0.0, 0.0, 0.0]


def test_presence_penalty_subtracts_once_per_token_in_the_output_and_ignores_the_prompt():
    row = torch.zeros(8)
    request = make_request(prompt=[1, 1, 1, 2], output=[2, 3, 3, 3], presence_penalty=0.75)
    apply_penalties(row, request)
    assert row.tolist() == [0.0, 0.0, -0.75, -0.75, 0.0, 0.0, 0.0, 0.0]


def test_negative_frequency_and_presence_penalties_encourage_repeats():
    row = torch.zeros(8)
    request = make_request(prompt=[1], output=[4, 4], frequency_penalty=-0.5, presence_penalty=-0.25)
    apply_penalties(row, request)
    assert row.tolist() == [0.0, 0.0, 0.0, 0.0, 1.25, 0.0, 0.0, 0.0]


def test_penalties_apply_repetition_first_then_frequency_then_presence():
    row = torch.tensor([0.0, 0.0, 0.0, 3.0, -1.0, 0.0, 0.0, 0.0])
    request = make_request(prompt=[1], output=[3, 3, 4], repetition_penalty=1.5,
                           frequency_penalty=0.25, presence_penalty=0.5)
    apply_penalties(row, request)
    # token 3: 3 / 1.5 = 2, - 0.25 * 2 = 1.5, - 0.5 = 1.0   (subtracting first would give 4/3)
    # token 4: -1 * 1.5 = -1.5, - 0.25 = -1.75, - 0.5 = -2.25
    # token 1: prompt only, logit 0: repetition leaves 0 unchanged
    assert row.tolist() == [0.0, 0.0, 0.0, 1.0, -2.25, 0.0, 0.0, 0.0]


# ---------------------------------------------------------------- logit_bias


def test_logit_bias_is_added_to_the_logit():
    values = [1.0, 2.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert sample_one(values, make_request(temperature=0.0, logit_bias={2: 1.625})) == 2  # 2.125 > 2
    assert sample_one(values, make_request(temperature=0.0, logit_bias={2: 1.375})) == 1  # 1.875 < 2
    assert sample_one(values, make_request(temperature=0.0, logit_bias={1: -100.0, 0: -0.75})) == 2
    # and for random sampling: -100 makes a token practically impossible
    counts = draw([0.0] * 8, make_request(logit_bias={3: -100.0, 5: -100.0}), n=4000)
    assert set(counts) == {0, 1, 2, 4, 6, 7}


def test_logit_bias_is_applied_before_repetition_penalty_as_in_vllm_v1():
    """vLLM v1 runs the logit_bias processor (non-argmax-invariant) before penalties:
    token 0 (in the prompt): (1.0 + 1.0) / 2 = 1.0 < token 1's 1.2, so greedy picks 1.
    Penalty first would give 1.0 / 2 + 1.0 = 1.5 and pick 0."""
    values = [1.0, 1.2, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    request = make_request(prompt=[0], temperature=0.0, repetition_penalty=2.0, logit_bias={0: 1.0})
    assert sample_one(values, request) == 1


# ---------------------------------------------------------------- min_tokens


def test_min_tokens_makes_eos_and_stop_token_ids_impossible_until_reached():
    values = [0.0, 0.0, 1.0, 0.0, 0.0, 9.0, 0.0, 10.0]  # EOS=7 best, stop token 5 next
    for generated in range(3):
        request = make_request(output=[2] * generated, temperature=0.0, min_tokens=3, stop_token_ids=[5])
        assert sample_one(values, request) == 2
        counts = draw(values, make_request(output=[2] * generated, min_tokens=3, stop_token_ids=[5]), n=500)
        assert not {5, 7} & set(counts)
    request = make_request(output=[2, 2, 2], temperature=0.0, min_tokens=3, stop_token_ids=[5])
    assert sample_one(values, request) == 7
    request = make_request(output=[2, 2, 2], temperature=0.0, min_tokens=3, stop_token_ids=[5], logit_bias={7: -2.0})
    assert sample_one(values, request) == 5


def test_min_tokens_masks_every_eos_id():
    values = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 9.0, 10.0]
    request = make_request(eos=(6, 7), temperature=0.0, min_tokens=1)
    assert sample_one(values, request) == 2


def test_min_tokens_masks_eos_even_with_ignore_eos_as_in_vllm():
    """vLLM's SamplingParams.update_from_generation_config adds the model's EOS to
    _all_stop_token_ids unconditionally ("to support min_tokens processing"), and the
    MinTokens processor masks all_stop_token_ids, so ignore_eos does not unmask EOS."""
    values = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 10.0]
    request = make_request(temperature=0.0, min_tokens=2, ignore_eos=True)
    assert sample_one(values, request) == 2


# ---------------------------------------------------------------- temperature


def test_temperature_sampling_follows_softmax_of_the_scaled_logits():
    values = [0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 1.5]
    n = 20000
    counts = draw(values, make_request(temperature=2.0), n=n, seed=1234)
    expected = softmax([v / 2.0 for v in values])
    # at temperature 1 token 3 would have p=0.53 instead of 0.32: far outside the tolerance
    for token, p in enumerate(expected):
        assert abs(counts[token] / n - p) < 0.02, (token, counts[token] / n, p)


def test_low_temperature_concentrates_on_the_argmax():
    values = [0.0, 1.0, 2.0, 3.0, -1.0, -2.0, 0.5, 1.5]
    n = 2000
    counts = draw(values, make_request(temperature=0.05), n=n)
    # p(token 2) = exp(-1 / 0.05) ~ 2e-9 ; every other token is smaller still
    assert counts == Counter({3: n})


# ---------------------------------------------------------------- top-k


def test_top_k_keeps_the_k_largest_logits():
    values = [1.0, 5.0, 3.0, 4.0, 2.0, 0.0, -1.0, 4.5]
    assert kept(values, top_k=1) == {1}
    assert kept(values, top_k=3) == {1, 7, 3}
    assert kept(values, top_k=5) == {1, 7, 3, 2, 4}
    counts = draw([1.8, 2.0, 1.7, 2.1, 1.9, 1.6, 2.05, 1.5], make_request(top_k=3), n=3000)
    assert set(counts) == {3, 6, 1}


@pytest.mark.parametrize("top_k", [-1, 0, 8, 100])
def test_top_k_minus_one_zero_or_at_least_vocab_means_no_limit(top_k):
    values = [1.0, 5.0, 3.0, 4.0, 2.0, 0.0, -1.0, 4.5]
    assert kept(values, top_k=top_k) == set(range(8))
    counts = draw([0.0, 0.1, 0.2, 0.0, 0.1, 0.2, 0.0, 0.1], make_request(top_k=top_k), n=4000)
    assert set(counts) == set(range(8))


def test_top_k_keeps_every_token_tied_with_the_kth_largest_logit():
    """vLLM masks `logits < kth largest value` (apply_top_k_top_p_pytorch and
    apply_top_k_only), so tokens tied with the k-th logit all stay in."""
    values = [3.0, 2.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert kept(values, top_k=2) == {0, 1, 2}


# ---------------------------------------------------------------- top-p


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p():
    values = [math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]  # sorted: 1 (.5), 3 (.3), 2 (.15), 0 (.05)
    assert kept(values, top_p=0.4) == {1}  # .5 crosses .4: it stays
    assert kept(values, top_p=0.6) == {1, 3}  # .5 + .3 = .8 crosses .6
    assert kept(values, top_p=0.85) == {1, 3, 2}  # .8 < .85 <= .95
    assert kept(values, top_p=0.97) == {0, 1, 2, 3}
    assert kept(values, top_p=1.0) == {0, 1, 2, 3}
    counts = draw(values, make_request(top_p=0.6), n=2000)
    assert set(counts) == {1, 3}


def test_top_p_rows_of_a_batch_use_their_own_p():
    values = [math.log(p) for p in (0.05, 0.5, 0.15, 0.3)]
    logits = torch.tensor([values] * 3, dtype=torch.float32)
    out = apply_top_k_top_p(logits, [SamplingParams(top_p=0.4), SamplingParams(top_p=1.0), SamplingParams(top_p=0.6)])
    assert torch.isfinite(out).tolist() == [
        [False, True, False, False],
        [True, True, True, True],
        [False, True, False, True],
    ]


def test_top_p_stops_once_the_mass_exactly_reaches_p():
    """8 equal logits: each probability is exactly 1/8. The smallest set whose mass
    reaches 0.5 has 4 tokens; vLLM masks `cumsum(ascending) <= 1 - p`, which keeps
    exactly 4 (and 2 for p=0.25). Which of the tied tokens survive is arbitrary."""
    assert len(kept([0.0] * 8, top_p=0.5)) == 4
    assert len(kept([0.0] * 8, top_p=0.25)) == 2


def test_top_p_is_applied_to_the_probabilities_renormalised_after_top_k():
    values = [math.log(p) for p in (0.4, 0.35, 0.25)]
    # after top-k=2: .4/.75 = .533 >= .5, so only token 0 stays; on the raw probs (.4 < .5) token 1 would stay too
    assert kept(values, top_k=2, top_p=0.5) == {0}
    counts = draw(values, make_request(top_k=2, top_p=0.5), n=1000)
    assert counts == Counter({0: 1000})


def test_top_p_sees_the_temperature_scaled_distribution():
    values = [math.log(p) for p in (0.6, 0.4)]
    # temperature 0.5 squares the ratio: .36/.52 = .69 >= .65, so token 1 is dropped;
    # at temperature 1 (.6 < .65) it stays
    counts = draw(values, make_request(temperature=0.5, top_p=0.65), n=1000)
    assert counts == Counter({0: 1000})
    counts = draw(values, make_request(temperature=1.0, top_p=0.65), n=1000)
    assert set(counts) == {0, 1}


# ---------------------------------------------------------------- min-p


def test_min_p_drops_tokens_below_min_p_times_the_max_probability():
    values = [math.log(p) for p in (0.12, 0.5, 0.08, 0.3)]
    counts = draw(values, make_request(min_p=0.2), n=3000)  # threshold .1: drops .08
    assert set(counts) == {0, 1, 3}
    counts = draw(values, make_request(min_p=0.5), n=3000)  # threshold .25: keeps .5 and .3
    assert set(counts) == {1, 3}
    counts = draw(values, make_request(min_p=1.0), n=1000)
    assert counts == Counter({1: 1000})


def test_min_p_sees_the_temperature_scaled_distribution():
    values = [math.log(p) for p in (0.5, 0.15, 0.35)]
    # token 1 / max = .3 >= .2 at temperature 1; at temperature .5 the ratio is .09 < .2
    counts = draw(values, make_request(min_p=0.2, temperature=1.0), n=3000)
    assert set(counts) == {0, 1, 2}
    counts = draw(values, make_request(min_p=0.2, temperature=0.5), n=3000)
    assert set(counts) == {0, 2}


def test_min_p_is_applied_before_top_p_as_in_vllm_v1():
    """vLLM v1 applies min_p (an argmax-invariant logits processor) right after
    temperature and before top-k/top-p. Probabilities: token 0 = .5, token 1 = .3,
    twenty tokens of .01. min_p=.1 drops the .01 tokens (< .05); top-p then sees
    0 = .625, 1 = .375 and with p=.6 keeps token 0 alone. (Top-p first would keep
    {0, 1} from the raw .5/.3 and sample token 1 about 37% of the time.)"""
    values = [math.log(p) for p in [0.5, 0.3] + [0.01] * 20]
    counts = draw(values, make_request(min_p=0.1, top_p=0.6), n=500)
    assert counts == Counter({0: 500})


# ---------------------------------------------------------------- seeds


def test_a_seeded_request_gets_the_same_tokens_whatever_shares_its_batch():
    values = [0.0, 0.2, 0.1, 0.3, 0.0, 0.25, 0.15, 0.05, 0.1, 0.0, 0.2, 0.3, 0.1, 0.05, 0.0, 0.2]
    steps = 30

    def run(sampler, batch):
        row = next(i for i, r in enumerate(batch) if r.request_id == "seeded")
        logits = torch.tensor([values] * len(batch), dtype=torch.float32)
        return [sampler.sample(logits, batch)[0][row] for _ in range(steps)]

    alone = run(Sampler(CPU, seed=0), [make_request(request_id="seeded", seed=1234)])
    crowded = run(Sampler(CPU, seed=99), [
        make_request(request_id="other", temperature=0.7),
        make_request(request_id="greedy", temperature=0.0),
        make_request(request_id="seeded", seed=1234),
        make_request(request_id="another-seed", seed=5, top_k=4),
    ])
    assert alone == crowded
    assert len(set(alone)) > 3  # really random, not a constant


def test_two_requests_with_the_same_seed_get_the_same_tokens_and_another_seed_differs():
    values = [0.0, 0.2, 0.1, 0.3, 0.0, 0.25, 0.15, 0.05, 0.1, 0.0, 0.2, 0.3, 0.1, 0.05, 0.0, 0.2]
    logits = torch.tensor([values] * 3, dtype=torch.float32)
    batch = [make_request(request_id="a", seed=7), make_request(request_id="b", seed=7),
             make_request(request_id="c", seed=8)]
    sampler = Sampler(CPU)
    rows = [sampler.sample(logits, batch)[0] for _ in range(30)]
    a, b, c = zip(*rows)
    assert a == b
    assert a != c


def test_unseeded_requests_differ_between_draws():
    values = [0.0] * 16
    sampler = Sampler(CPU)
    tokens = [sample_one(values, make_request(), sampler) for _ in range(30)]
    assert len(set(tokens)) > 3


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_the_raw_logits_before_penalties_bias_and_temperature():
    values = [3.0, 2.0, 1.0, 0.0, -1.0, 0.5, -2.0, 1.5]
    raw = log_softmax(values)
    request = make_request(prompt=[0], temperature=0.0, logprobs=2, logit_bias={2: 50.0},
                           repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=1.0)
    token_ids, logprobs = Sampler(CPU).sample(logits_of(*values), [request])
    assert token_ids == [2]
    (lp,) = logprobs
    assert lp.token_ids == [2, 0, 1]  # sampled first, then the top 2 of the raw logits
    assert lp.ranks == [4, 1, 2]  # 3.0, 2.0 and 1.5 are larger than 1.0
    assert lp.logprobs == pytest.approx([raw[2], raw[0], raw[1]], abs=1e-5)


def test_logprobs_ignore_the_temperature_of_random_sampling():
    values = [3.0, 2.0, 1.0, 0.0, -1.0, 0.5, -2.0, 1.5]
    raw = log_softmax(values)
    order = sorted(range(8), key=lambda t: -values[t])
    request = make_request(temperature=3.0, logprobs=3)
    logits = torch.tensor([values] * 200, dtype=torch.float32)
    token_ids, logprobs = Sampler(CPU).sample(logits, [request] * 200)
    assert len(set(token_ids)) > 3
    for token, lp in zip(token_ids, logprobs):
        assert lp.token_ids == [token] + order[:3]
        assert lp.ranks == [order.index(token) + 1, 1, 2, 3]
        assert lp.logprobs == pytest.approx([raw[token]] + [raw[t] for t in order[:3]], abs=1e-5)


def test_zero_logprobs_gives_only_the_sampled_token_and_none_gives_nothing():
    values = [0.0, 2.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    logits = torch.tensor([values] * 2, dtype=torch.float32)
    batch = [make_request(request_id="a", temperature=0.0, logprobs=0), make_request(request_id="b", temperature=0.0)]
    token_ids, logprobs = Sampler(CPU).sample(logits, batch)
    assert token_ids == [1, 1]
    assert logprobs[0].token_ids == [1]
    assert logprobs[0].ranks == [1]
    assert logprobs[0].logprobs == pytest.approx([log_softmax(values)[1]], abs=1e-5)
    assert logprobs[1] is None


def test_unseeded_rows_draw_by_inverse_cdf_and_never_a_token_of_probability_zero():
    probs = torch.tensor([[0.2, 0.0, 0.5, 0.3, 0.0]] * 5)
    # cumulative 0.2 0.2 0.7 1.0 1.0: u picks the first token whose running sum passes u
    uniforms = torch.tensor([0.0, 0.19, 0.2, 0.69, 1 - 2 ** -24])
    assert inverse_cdf_sample(probs, uniforms).tolist() == [0, 0, 2, 2, 3]
    # a row that does not sum to one is drawn in proportion to its entries
    assert inverse_cdf_sample(torch.tensor([[0.0, 2.0, 2.0]]), torch.tensor([0.5])).tolist() == [2]


def test_a_row_driven_to_nan_still_gets_a_token_id_of_the_vocabulary():
    """A repetition penalty of 5e-324 (valid: above zero) divides logits to infinity: softmax gives NaN.
    The engine must still answer with a token, seeded or not, rather than index past the vocabulary."""
    values = [3.0, 1.0, 2.0, -1.0]
    for seed in (None, 7):
        request = make_request(prompt=(0, 1, 2), repetition_penalty=5e-324, temperature=1.0, seed=seed)
        token = sample_one(values, request)
        assert 0 <= token < len(values)
    assert inverse_cdf_sample(torch.full((1, 4), float("nan")), torch.tensor([0.5])).tolist() == [3]
