"""`tinyserve bench serve`: put load on a running OpenAI-compatible server, as vLLM's `bench serve`.

    1. ask the server for its model (/v1/models) and find its tokenizer (vocabulary.py)
    2. draw the random dataset: token-id prompts for /v1/completions, their decoded text
       as one user message for /v1/chat/completions
    3. send one test request, so a wrong URL or model fails at once with the server's words
    4. send every request, streamed, at its arrival time, at most max_concurrency in flight:

           request rate inf   all at once
           request rate λ     gaps drawn from a gamma distribution of shape b (the
                              burstiness) and scale 1/(λ·b): the mean gap is 1/λ whatever
                              b is; b = 1 is a Poisson process, b < 1 burstier, b > 1
                              more regular

    5. compute the metrics (metrics.py) over the run, print vLLM's table, save the JSON

Each request is timed chunk by chunk in request_funcs.py.
"""

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from datetime import datetime

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from tinyserve.bench.datasets import SampleRequest, as_text_prompts, check_dataset_args, random_requests
from tinyserve.bench.metrics import (
    BenchmarkMetrics,
    calculate_metrics,
    format_metrics,
    metrics_json,
    parse_goodput,
    parse_metric_percentiles,
    parse_percentile_metrics,
)
from tinyserve.bench.request_funcs import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ENDPOINTS,
    RequestFuncInput,
    RequestFuncOutput,
    send_request,
)
from tinyserve.bench.vocabulary import resolve_vocabulary


@dataclass(slots=True)
class ServeConfig:
    base_url: str  # the server's root, e.g. http://127.0.0.1:8000 (the endpoint adds /v1/...)
    endpoint: str = COMPLETIONS
    model: str | None = None  # None: the first model the server lists
    tokenizer: str | None = None
    num_prompts: int = 1000
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    goodput: list[str] = field(default_factory=list)  # "ttft:MS", "tpot:MS", "e2el:MS"
    percentile_metrics: str = "ttft,tpot,itl"
    metric_percentiles: str = "99"
    seed: int = 0
    api_key: str | None = None
    disable_tqdm: bool = False

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        check_dataset_args(self.num_prompts, self.random_input_len, self.random_output_len, self.random_range_ratio)
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (or inf), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise ValueError(f"burstiness must be a positive number, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        parse_goodput(self.goodput)
        parse_percentile_metrics(self.percentile_metrics)
        parse_metric_percentiles(self.metric_percentiles)

    @property
    def root_url(self) -> str:
        url = self.base_url.rstrip("/")
        return url.removesuffix("/v1")  # the endpoint carries /v1 already

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(slots=True)
class ServeResult:
    config: ServeConfig
    model: str
    tokenizer_source: str
    requests: list[RequestFuncInput]
    outputs: list[RequestFuncOutput]
    metrics: BenchmarkMetrics

    def format(self) -> str:
        return format_metrics(self.metrics, parse_percentile_metrics(self.config.percentile_metrics),
                              self.config.max_concurrency, self.config.request_rate)

    def to_json(self) -> dict:
        c = self.config
        return {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if c.endpoint == CHAT_COMPLETIONS else "openai",
            "base_url": c.root_url,
            "endpoint": c.endpoint,
            "model_id": self.model,
            "tokenizer": self.tokenizer_source,
            "num_prompts": c.num_prompts,
            "random_input_len": c.random_input_len,
            "random_output_len": c.random_output_len,
            "random_range_ratio": c.random_range_ratio,
            "request_rate": "inf" if math.isinf(c.request_rate) else c.request_rate,
            "burstiness": c.burstiness,
            "max_concurrency": c.max_concurrency,
            "ignore_eos": c.ignore_eos,
            "temperature": c.temperature,
            "seed": c.seed,
            "goodput": {name: slo * 1000 for name, slo in parse_goodput(c.goodput).items()} or None,
            **metrics_json(self.metrics),
            "input_lens": [o.prompt_len for o in self.outputs],
            "output_lens": [o.output_tokens for o in self.outputs],
            "ttfts": [o.ttft for o in self.outputs],
            "e2els": [o.latency for o in self.outputs],
            "itls": [o.itl for o in self.outputs],
            "generated_texts": [o.generated_text for o in self.outputs],
            "errors": [o.error for o in self.outputs],
        }

    def default_filename(self) -> str:
        rate = "inf" if math.isinf(self.config.request_rate) else f"{self.config.request_rate:g}"
        model = self.model.rstrip("/").split("/")[-1]
        return f"openai-{rate}qps-{model}-{datetime.now().strftime('%Y%m%d-%H%M%S')}.json"


def server_models(client: httpx.Client, root_url: str) -> list[dict]:
    try:
        response = client.get(f"{root_url}/v1/models")
    except httpx.HTTPError as error:
        raise ValueError(f"cannot reach the server at {root_url}: {error}") from None
    if response.status_code != 200:
        raise ValueError(f"{root_url}/v1/models answered {response.status_code}: {response.text[:200]}")
    return response.json().get("data", [])


def build_inputs(config: ServeConfig, client: httpx.Client) -> tuple[str, str, list[RequestFuncInput]]:
    """The model name, where its tokenizer came from, and the requests to send."""
    models = server_models(client, config.root_url)
    model = config.model or (models[0]["id"] if models else None)
    if model is None:
        raise ValueError(f"{config.root_url}/v1/models lists no model; pass --model")
    root = next((m.get("root") for m in models if m.get("id") == model), None)
    vocabulary = resolve_vocabulary(client, config.root_url, model, config.tokenizer, root, config.seed)
    samples: list[SampleRequest] = random_requests(
        config.num_prompts, config.random_input_len, config.random_output_len, config.random_range_ratio,
        vocabulary.token_pool, config.seed)
    if config.endpoint == CHAT_COMPLETIONS:
        samples = as_text_prompts(samples, vocabulary.decode, vocabulary.encode)
    inputs = [RequestFuncInput(config.endpoint, model, s.prompt, s.prompt_len, s.expected_output_len,
                               config.temperature, config.ignore_eos) for s in samples]
    return model, vocabulary.source, inputs


async def arrivals(inputs: list[RequestFuncInput], request_rate: float, burstiness: float, seed: int):
    """Yield each request at its arrival time (the first at once)."""
    rng = np.random.default_rng(seed)
    for request in inputs:
        yield request
        if not math.isinf(request_rate):
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness)))


async def run_requests(config: ServeConfig, inputs: list[RequestFuncInput]) -> tuple[list[RequestFuncOutput], float]:
    """Send the test request, then the whole load; the outputs in input order and the duration."""
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=config.max_concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=config.headers) as client:
        test = await send_request(client, config.root_url, inputs[0])
        if not test.success:
            raise ValueError(f"the test request failed, check the arguments: {test.error}")
        slots = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
        progress = tqdm(total=len(inputs), disable=config.disable_tqdm, desc="bench serve", unit="req")

        async def send(request: RequestFuncInput) -> RequestFuncOutput:
            if slots is None:
                output = await send_request(client, config.root_url, request)
            else:
                async with slots:
                    output = await send_request(client, config.root_url, request)
            progress.update()
            return output

        start = time.perf_counter()
        tasks = [asyncio.create_task(send(request))
                 async for request in arrivals(inputs, config.request_rate, config.burstiness, config.seed)]
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        progress.close()
    return list(outputs), duration


def describe_load(config: ServeConfig) -> str:
    process = " (Poisson process)" if config.burstiness == 1 else ""
    return "\n".join([f"Traffic request rate: {config.request_rate}",
                      f"Burstiness factor: {config.burstiness}{process}",
                      f"Maximum request concurrency: {config.max_concurrency}"])


def benchmark_serve(config: ServeConfig) -> ServeResult:
    config.validate()
    with httpx.Client(timeout=60, headers=config.headers) as client:
        model, tokenizer_source, inputs = build_inputs(config, client)
    outputs, duration = asyncio.run(run_requests(config, inputs))
    metrics = calculate_metrics(outputs, duration, parse_metric_percentiles(config.metric_percentiles),
                                parse_goodput(config.goodput))
    return ServeResult(config, model, tokenizer_source, inputs, outputs, metrics)


def save_result(result: ServeResult, path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result.to_json(), f, indent=2, ensure_ascii=False)
