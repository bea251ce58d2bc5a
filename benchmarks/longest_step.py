"""How long one engine step can legitimately take: what --engine-iteration-timeout must allow.

The engine watchdog (tinyserve/frontend/engine_watchdog.py) fails an engine that holds
requests and sends nothing for --engine-iteration-timeout seconds. A busy engine sends
something at least once a step, so the bound must be longer than the longest step: a
prefill filling the whole --max-num-batched-tokens budget (2,048 by default). This times
that step, with the engine's own clock (StepTimes: scheduled to outputs made), on
random-weight Llamas of a few sizes, and the matmul parameters of each, since a prefill
step's time grows with them (and with the tokens) almost in proportion:

    bench   bench_models.py's ~27M model (8 layers, hidden 512)
    0.5b    Qwen2.5-0.5B's body (24 layers, hidden 896, 14 heads over 2 KV heads of 64,
            SwiGLU 4864) with an 8,192-id vocabulary: ~360M parameters in its matmuls

Each model: one short request to warm up, then --repeats times two requests of half
--max-num-batched-tokens prompt tokens each and one new token: one step of the whole budget. Printed: the
slowest and the median of those steps, and seconds per billion matmul parameters, the
figure to scale to a larger model.

    python benchmarks/longest_step.py [--models bench 0.5b] [--repeats 3]
"""

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace

from bench_models import FULL, MAX_NUM_BATCHED_TOKENS, build_model

from tinyserve import LLM, SamplingParams

SHAPES = {"bench": FULL, "0.5b": replace(FULL, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                                            head_dim=64, intermediate_size=4864)}


def time_steps(folder: str, tokens: int, repeats: int) -> list[float]:
    llm = LLM(folder, max_num_batched_tokens=tokens, max_model_len=tokens // 2 + 16, enable_prefix_caching=False,
              num_kv_blocks=tokens // 8 + 8)
    try:
        one = SamplingParams(max_tokens=1, temperature=0.0)
        llm.generate([{"prompt_token_ids": [5] * 16}], one, use_tqdm=False)  # warm up
        recorder, steps = llm.engine_core.recorder, []
        observe = recorder.observe

        def keep_full_steps(record, outputs, done) -> None:  # every step's clock, as the engine kept it
            observe(record, outputs, done)
            if record.scheduler_output.total_num_scheduled_tokens == tokens:
                steps.append(recorder.last_step_times.end - recorder.last_step_times.start)

        recorder.observe = keep_full_steps
        for i in range(repeats):
            halves = [[(7 + i + j + k) % 8000 + 100 for j in range(tokens // 2)] for k in range(2)]
            llm.generate([{"prompt_token_ids": half} for half in halves], one, use_tqdm=False)  # one step, both
        assert len(steps) == repeats, steps
        return steps
    finally:
        llm.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"one prefill step of {args.tokens} tokens, {args.repeats} times per model, fp32; {os.cpu_count()} CPUs, "
          f"load average {load} (1, 5, 15 min) at the start")
    for name in args.models:
        shape = SHAPES[name]
        with tempfile.TemporaryDirectory() as folder:
            build_model(folder, shape, quick=False)
            started = time.monotonic()
            steps = time_steps(folder, args.tokens, args.repeats)
        billions = shape.body_matmul_params / 1e9
        print(f"{name}: {shape.body_matmul_params / 1e6:.0f}M matmul parameters; step slowest {max(steps):.2f} s, "
              f"median {statistics.median(steps):.2f} s; {max(steps) / billions:.0f} s per billion "
              f"(run {time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
