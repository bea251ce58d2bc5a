"""How much of a decode step is spent outside the model, at 64 running requests.

Outside the model: Scheduler.schedule, ModelRunner.update_states (the worker's own
request state brought up to date from the SchedulerOutput) and prepare_inputs (flattening
the batch, slot mapping, block tables), and Scheduler.update_from_output. The engine's
own step timestamps give schedule and update; the runner's two are timed around the calls. The
model is bench_models.py's 27M-parameter Llama (random weights), in fp32 or bf16 (whose
shorter steps make the same overhead a larger share).

    python benchmarks/step_overhead.py [--requests 64] [--max-tokens 40] [--dtype bfloat16]
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_models.py, beside this file

import torch
from bench_models import FULL, build_model

from tinyserve import LLM, SamplingParams
from tinyserve.frontend.input_processor import ProcessedPrompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        build_model(folder, FULL, quick=False)
        llm = LLM(folder, num_kv_blocks=4096, dtype=args.dtype)
    core, runner = llm.engine_core, llm.engine_core.model_runner
    prepare_times = []

    def timed(method):
        def call(scheduler_output):
            start = time.perf_counter()
            result = method(scheduler_output)
            prepare_times.append(time.perf_counter() - start)
            return result
        return call

    runner.update_states, runner.prepare_inputs = timed(runner.update_states), timed(runner.prepare_inputs)
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for i in range(args.requests):
        prompt = ProcessedPrompt(None, torch.randint(3, FULL.vocab_size, (64,), generator=generator).tolist())
        for request in llm.llm_engine.make_requests(f"r{i}", prompt, params):
            core.add_request(request)
    outside, steps = [], []
    while core.has_unfinished_requests:
        prepare_times.clear()
        core.step()
        times, out = core.last_step_times, core.last_scheduler_output
        if out.num_prefill_requests == 0 and len(out.scheduled) == args.requests:
            schedule = times.scheduled - times.start
            update = times.end - times.executed
            outside.append(schedule + sum(prepare_times) + update)
            steps.append(times.end - times.start)
    share = statistics.median(o / s for o, s in zip(outside, steps))
    print(f"{args.dtype}: decode steps at {args.requests} running: {len(steps)}; median step {statistics.median(steps) * 1e3:.1f} ms; "
          f"schedule + input preparation + update = {statistics.median(outside) * 1e3:.2f} ms = {share:.1%} of the step")


if __name__ == "__main__":
    main()
