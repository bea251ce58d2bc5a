"""Seeded random workloads for the property tests (a helper module, not tests).

    case = draw_case(seed, probe)      # engine settings and requests, all drawn from one seed
    print(case.describe())             # what a failure report prints: enough to replay it

Engine settings come from stress ranges: a KV pool just big enough for the largest
request (so requests preempt one another), a token budget of 8 to 32 per step (so
prompts are chunked), 1 to 8 seats, block size 4, 8 or 16, prefix caching on or off,
FCFS or priority scheduling.

Requests: prompts of token ids whose lengths sit on block boundaries (block_size - 1,
block_size, block_size + 1, multiples) or anywhere up to three blocks, some behind a
shared prefix (prefix-cache hits, whole prompts equal), a few as text, some as the
next turn of another (its prompt and the model's answer, arriving later); greedy,
seeded-sampled and unseeded-sampled requests with temperature, top-k, top-p, min-p,
penalties, logit bias, n = 1 to 3, min_tokens, logprobs and prompt logprobs; random
priorities, arrivals a few steps late, and aborts at random moments.

With `pictures` (an image-text model), about half the requests carry one or two images instead,
and the encoder's budget and cache are one or two images, or the defaults.

Stop strings and stop token ids must be able to fire, so they are taken from what the
model writes: `probe` (a roomy LLM on the same model) runs every request first, and a
stop string is a piece of that text, a stop token one of those ids. Unseeded requests,
whose output is not reproducible, get stops drawn blindly.
"""

import random
from dataclasses import dataclass, field

import msgspec

from tinyserve import LLM, SamplingParams
from tinyserve.models.corpus import zen_of_python
from tinyserve.utils import cdiv

BLOCK_SIZES = (4, 8, 16)
TOKEN_BUDGETS = (8, 9, 12, 16, 16, 32)
MAX_PROMPT_TOKENS = 64


@dataclass
class PlannedRequest:
    request_id: str
    prompt: str | list[int]  # text, or token ids
    num_prompt_tokens: int
    params: SamplingParams
    prefix_group: int | None = None  # requests of one group share a leading run of tokens
    follows: str | None = None  # the request whose prompt and output this one's prompt continues
    priority: int = 0
    arrival: int = 0  # LLM: added before this engine step; AsyncLLM: sent after arrival × 2 ms
    # When to abort it (None: never). LLM: this many steps after its arrival. AsyncLLM: after this
    # many deltas ("abort": engine.abort; "leave": the reader closes the stream), or after this
    # many × 3 ms from another task ("abort-later").
    abort_after: int | None = None
    abort_style: str = "abort"
    images: list = field(default_factory=list)  # PIL images for the prompt's <image> markers (an image-text model)

    @property
    def reproducible(self) -> bool:
        """Greedy or seeded: its output must not depend on the batch it runs in."""
        return self.params.is_greedy or self.params.seed is not None

    @property
    def prompt_input(self) -> str | dict:
        if self.images:
            return {"prompt": self.prompt, "multi_modal_data": {"image": list(self.images)}}
        return self.prompt if isinstance(self.prompt, str) else {"prompt_token_ids": self.prompt}

    @property
    def max_num_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens


@dataclass
class Case:
    seed: int
    engine_args: dict
    requests: list[PlannedRequest]

    def describe(self) -> str:
        lines = [f"random case seed={self.seed} (replay: TINYSERVE_PROPERTY_SEEDS={self.seed})",
                 f"  engine_args={self.engine_args}"]
        for r in self.requests:
            prompt = repr(r.prompt) if isinstance(r.prompt, str) else f"{r.num_prompt_tokens} ids"
            group = "" if r.prefix_group is None else f" prefix_group={r.prefix_group}"
            group += "" if r.follows is None else f" follows={r.follows}"
            abort = "" if r.abort_after is None else f" abort={r.abort_style}@{r.abort_after}"
            abort += "" if not r.images else f" images={[f'{i.size[0]}x{i.size[1]}' for i in r.images]}"
            lines.append(f"  {r.request_id}: prompt={prompt}{group} priority={r.priority} arrival={r.arrival}{abort}"
                         f" params={changed_fields(r.params)}")
        return "\n".join(lines)


def changed_fields(params: SamplingParams) -> dict:
    """The SamplingParams fields that differ from their defaults (its readable replay form)."""
    default = SamplingParams()
    return {name: value for name, value in msgspec.structs.asdict(params).items() if value != getattr(default, name)}


def draw_case(seed: int, probe: LLM, pictures: list | None = None) -> Case:
    """pictures: for an image-text model, images some prompts carry (add_images), with the encoder's budget and
    cache size drawn from stress ranges too; the other draws are those of the same seed without them."""
    rng = random.Random(seed)
    vocab_size = probe.model_info.vocab_size
    block_size = rng.choice(BLOCK_SIZES)
    prefixes = [random_ids(rng, rng.choice(boundary_lengths(block_size)), vocab_size) for _ in range(2)]
    requests = []
    for index in range(rng.randint(3, 8)):
        prompt, group = draw_prompt(rng, block_size, prefixes, vocab_size)
        requests.append(draw_request(rng, f"r{index}", prompt, probe))
        requests[-1].prefix_group = group
    add_next_turns(rng, requests, probe)
    add_stops(rng, requests, probe)
    image_rng = random.Random(seed + 1_000_003)  # the draws without images stay those of the seed
    if pictures:
        add_images(image_rng, requests, probe, pictures)
    largest = max(cdiv(r.max_num_tokens, block_size) for r in requests)
    engine_args = {
        "block_size": block_size,
        "num_kv_blocks": largest + rng.choice((0, 0, 1, 3)),
        "max_num_batched_tokens": rng.choice(TOKEN_BUDGETS),
        "max_num_seqs": rng.randint(1, 8),
        "enable_prefix_caching": rng.random() < 0.7,
        "scheduling_policy": rng.choice(("fcfs", "priority", "priority")),
    }
    if pictures:  # budgets of one or two images a step, caches of one or two images, or the defaults
        rows = max(len(probe.input_processor.tokenize_prompt({"prompt": "<image>", "multi_modal_data": {
            "image": pictures[0]}}).prompt_token_ids), 1)
        engine_args["max_num_encoder_input_tokens"] = image_rng.choice((rows, 2 * rows, None))
        engine_args["encoder_cache_size"] = image_rng.choice((rows, 2 * rows, None))
    if engine_args["scheduling_policy"] == "fcfs":  # a priority is refused unless the policy is "priority"
        for request in requests:
            request.priority = 0
    return Case(seed, engine_args, requests)


def draw_request(rng: random.Random, request_id: str, prompt: str | list[int], probe: LLM) -> PlannedRequest:
    num_prompt_tokens = len(probe.input_processor.tokenize_prompt(prompt).prompt_token_ids)
    abort_after = rng.choice((0, 1, rng.randint(2, 24))) if rng.random() < 0.25 else None
    return PlannedRequest(
        request_id, prompt, num_prompt_tokens, draw_params(rng, probe.model_info.vocab_size),
        priority=rng.randint(-1, 3), arrival=rng.choice((0, 0, rng.randint(1, 12), rng.randint(1, 40))),
        abort_after=abort_after, abort_style=rng.choice(("abort", "leave", "abort-later")),
    )


def add_next_turns(rng: random.Random, requests: list[PlannedRequest], probe: LLM) -> None:
    """Give some requests a next turn, arriving later: their prompt, what the model answered, a few ids more.

    Its leading blocks are the earlier request's prompt and output, so it can hit in the
    prefix cache blocks that the earlier request's decode steps filled.
    """
    outputs = probe.generate([r.prompt_input for r in requests], [r.params for r in requests], use_tqdm=False)
    vocab_size = probe.model_info.vocab_size
    for request, output in zip(list(requests), outputs):
        if not request.reproducible or rng.random() > 0.4:
            continue
        answer = rng.choice(output.outputs).token_ids
        prompt = (probe.input_processor.tokenize_prompt(request.prompt).prompt_token_ids
                  + answer[:rng.randint(1, len(answer))] + random_ids(rng, rng.randint(0, 3), vocab_size))
        turn = draw_request(rng, f"r{len(requests)}", prompt[:MAX_PROMPT_TOKENS], probe)
        turn.follows, turn.arrival = request.request_id, request.arrival + rng.randint(1, 16)
        requests.append(turn)


def add_images(rng: random.Random, requests: list[PlannedRequest], probe: LLM, pictures: list) -> None:
    """About half the requests that follow no other become text with one or two <image> markers, their images
    drawn from `pictures` (so the same image comes back: prefix-cache and encoder-cache hits)."""
    lines = zen_of_python()[1:]
    first = next(r for r in requests if r.follows is None)  # at least one carries images
    for request in requests:
        if request.follows is not None or (request is not first and rng.random() > 0.5):
            continue
        markers = " <image>" * rng.choice((1, 1, 2))
        request.prompt = rng.choice(lines)[:rng.randint(0, 30)] + markers + " " + rng.choice(lines)[:rng.randint(0, 30)]
        request.images = [rng.choice(pictures) for _ in range(markers.count("<image>"))]
        request.num_prompt_tokens = len(probe.input_processor.tokenize_prompt(request.prompt_input).prompt_token_ids)


def boundary_lengths(block_size: int) -> list[int]:
    """Prompt lengths where block-table mistakes show: either side of a block's end, and a few others."""
    edges = [k * block_size + d for k in (1, 2, 3) for d in (-1, 0, 1)]
    return [n for n in edges + [1, 2] if 1 <= n <= 3 * block_size + 1]


def random_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(count)]


def draw_prompt(rng: random.Random, block_size: int, prefixes: list[list[int]],
                vocab_size: int) -> tuple[str | list[int], int | None]:
    """A text prompt, ids alone, or ids behind one of the shared prefixes (possibly nothing more)."""
    if rng.random() < 0.15:
        return rng.choice(zen_of_python()[1:]), None
    length = rng.choice(boundary_lengths(block_size) + [rng.randint(1, 3 * block_size)])
    if rng.random() < 0.5:
        group = rng.randrange(len(prefixes))
        length = rng.choice((0, length))
        return (prefixes[group] + random_ids(rng, length, vocab_size))[:MAX_PROMPT_TOKENS], group
    return random_ids(rng, length, vocab_size), None


def draw_params(rng: random.Random, vocab_size: int) -> SamplingParams:
    kind = rng.choices(("greedy", "seeded", "unseeded"), weights=(4, 4, 1))[0]
    max_tokens = rng.randint(1, 24)
    fields = {"max_tokens": max_tokens, "n": rng.choice((1, 1, 1, 2, 3)), "ignore_eos": rng.random() < 0.5}
    if kind == "greedy":
        fields["temperature"] = rng.choice((0.0, 0.0, 1e-6))
    else:
        fields["temperature"] = round(rng.uniform(0.3, 1.5), 2)
        if kind == "seeded":
            fields["seed"] = rng.choice((rng.randrange(-2**63, 2**63), rng.randrange(1000), 2**63 - 1))
        if rng.random() < 0.3:
            fields["top_k"] = rng.choice((1, 2, 5, 40, 1000))
        if rng.random() < 0.3:
            fields["top_p"] = round(rng.uniform(0.3, 0.95), 2)
        if rng.random() < 0.2:
            fields["min_p"] = round(rng.uniform(0.01, 0.3), 2)
    if rng.random() < 0.25:
        fields["presence_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.25:
        fields["frequency_penalty"] = round(rng.uniform(-1, 1), 2)
    if rng.random() < 0.25:
        fields["repetition_penalty"] = round(rng.uniform(0.7, 1.6), 2)
    if rng.random() < 0.1:
        fields["logit_bias"] = {rng.randrange(vocab_size): round(rng.uniform(-8, 8), 1) for _ in range(2)}
    if rng.random() < 0.3:
        fields["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.3:
        fields["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.15:
        fields["prompt_logprobs"] = rng.randint(0, 3)
    return SamplingParams(**fields)


def add_stops(rng: random.Random, requests: list[PlannedRequest], probe: LLM) -> None:
    """Give some requests stop strings and stop token ids that occur in what they generate."""
    outputs = probe.generate([r.prompt_input for r in requests], [r.params for r in requests], use_tqdm=False)
    vocab_size = probe.model_info.vocab_size
    for request, output in zip(requests, outputs):
        completion = rng.choice(output.outputs)
        stop, stop_token_ids = [], []
        if rng.random() < 0.4:
            if request.reproducible:
                text = completion.text.replace("\ufffd", "")
                start = rng.randrange(len(text) + 1)
                piece = text[start:start + rng.randint(1, 3)]
                stop = [piece] if piece else []
            else:
                stop = [rng.choice(("e", " ", "\n", "th", "ing"))]
        if rng.random() < 0.3:
            ids = completion.token_ids if request.reproducible else random_ids(rng, 1, vocab_size)
            stop_token_ids = [rng.choice(ids)]
        if stop or stop_token_ids:
            request.params = SamplingParams(**{
                **msgspec.structs.asdict(request.params),
                "stop": stop or None,
                "stop_token_ids": stop_token_ids or None,
                "include_stop_str_in_output": bool(stop) and rng.random() < 0.3,
            })
