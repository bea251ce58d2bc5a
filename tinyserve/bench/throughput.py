"""`tinyserve bench throughput`: offline throughput of the engine, as vLLM's `bench throughput`.

One `LLM` in this process gets every prompt of the random dataset at once; the clock
runs around `LLM.generate` only (loading the model and drawing prompts are outside it),
so the scheduler is free to batch as it likes and the figure is the engine's best rate:

    requests/s        = requests / elapsed
    output tokens/s   = generated tokens / elapsed
    total tokens/s    = (prompt tokens + generated tokens) / elapsed

Sampling is vLLM's: temperature 1.0, top_p 1.0, and end-of-sequence ignored so each
request generates exactly its output length.
"""

import time
from dataclasses import asdict, dataclass, fields

from tinyserve.bench.datasets import SampleRequest, check_dataset_args, random_requests, vocabulary_pool
from tinyserve.config import EngineArgs
from tinyserve.sampling_params import SamplingParams


@dataclass(slots=True)
class ThroughputConfig:
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 1.0

    def validate(self) -> None:
        check_dataset_args(self.num_prompts, self.input_len, self.output_len, self.range_ratio)
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")


@dataclass(slots=True)
class ThroughputResult:
    num_requests: int
    elapsed_time: float  # seconds inside LLM.generate
    total_prompt_tokens: int
    total_output_tokens: int

    @property
    def total_num_tokens(self) -> int:
        return self.total_prompt_tokens + self.total_output_tokens

    @property
    def requests_per_second(self) -> float:
        return self.num_requests / self.elapsed_time

    @property
    def tokens_per_second(self) -> float:
        return self.total_num_tokens / self.elapsed_time

    @property
    def output_tokens_per_second(self) -> float:
        return self.total_output_tokens / self.elapsed_time

    def format(self) -> str:
        return "\n".join([
            f"Throughput: {self.requests_per_second:.2f} requests/s, {self.tokens_per_second:.2f} total tokens/s, "
            f"{self.output_tokens_per_second:.2f} output tokens/s",
            f"Total num prompt tokens:  {self.total_prompt_tokens}",
            f"Total num output tokens:  {self.total_output_tokens}",
            f"Elapsed time: {self.elapsed_time:.2f} s",
        ])

    def to_json(self, config: ThroughputConfig, engine_args: EngineArgs) -> dict:
        return {
            "elapsed_time": self.elapsed_time,
            "num_requests": self.num_requests,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "total_num_tokens": self.total_num_tokens,
            "requests_per_second": self.requests_per_second,
            "tokens_per_second": self.tokens_per_second,
            "output_tokens_per_second": self.output_tokens_per_second,
            "config": asdict(config),
            "engine_args": asdict(engine_args),
        }


def sample_requests(llm, config: ThroughputConfig) -> list[SampleRequest]:
    """The random dataset over this model's vocabulary (ids both the model and the tokenizer know)."""
    tokenizer = llm.get_tokenizer()
    vocab_size = min(llm.model_info.vocab_size, len(tokenizer))
    pool = vocabulary_pool(vocab_size, tokenizer.all_special_ids)
    return random_requests(config.num_prompts, config.input_len, config.output_len, config.range_ratio, pool,
                           config.seed)


def run_throughput(llm, requests: list[SampleRequest], config: ThroughputConfig,
                   use_tqdm: bool = True) -> ThroughputResult:
    params = [SamplingParams(n=1, temperature=config.temperature, top_p=1.0, ignore_eos=config.ignore_eos,
                             max_tokens=r.expected_output_len) for r in requests]
    prompts = [{"prompt_token_ids": r.prompt} for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    return ThroughputResult(
        num_requests=len(outputs),
        elapsed_time=elapsed,
        total_prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
        total_output_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
    )


def benchmark_throughput(config: ThroughputConfig, engine_args: EngineArgs,
                         use_tqdm: bool = True) -> ThroughputResult:
    """Load the model, draw the prompts, and time one generate call over all of them."""
    from tinyserve.entrypoints.llm import LLM

    config.validate()
    others = {f.name: getattr(engine_args, f.name) for f in fields(engine_args) if f.name != "model"}
    llm = LLM(engine_args.model, **others)
    return run_throughput(llm, sample_requests(llm, config), config, use_tqdm)
