"""What the process boundary costs: IPC time per engine step, beside the step itself.

Every step the engine process encodes one EngineCoreOutputs, ZeroMQ carries it to the
API process, and the client decodes it. This measures that cost two ways:

1. Directly, in one process: msgspec encode, ZeroMQ PUSH → PULL (ipc:// and tcp://),
   msgspec decode, for the message a decode step of `--batch` running requests
   produces (one new token each; with top-5 logprobs; all finishing, with timings).
2. End to end: the median time per decode step of the same batch, stepped by an
   EngineCore in this process and by an engine process behind MPClient. The
   difference is what the boundary adds; it can be near zero, because the engine's
   output thread encodes and sends while the main thread runs the next step.

The model is the built-in one unless --model names a checkpoint; every request runs to
--max-tokens (EOS ignored), so what the weights say does not change the work.

    python benchmarks/ipc_cost.py [--batch 64] [--max-tokens 32] [--model PATH] [--torch-threads 1]
"""

import argparse
import asyncio
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec
import torch
import zmq

from tinyserve.config import EngineArgs, ModelInfo
from tinyserve.assemble import build_engine_core
from tinyserve.frontend.core_client import MPClient
from tinyserve.wire.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    RequestTimes,
    SchedulerStats,
    TokenLogprobs,
)
from tinyserve.sampling_params import SamplingParams

PROMPT_LEN = 16
MESSAGES_PER_CASE = 2000


# ---- 1. the message alone ------------------------------------------------------------


def step_message(batch: int, logprobs: int = 0, finished: bool = False) -> EngineCoreOutputs:
    now = time.time()
    outputs = []
    for i in range(batch):
        output = EngineCoreOutput(request_id=f"cmpl-{i:032x}", new_token_ids=[1000 + i])
        if logprobs:
            output.new_logprobs = [
                TokenLogprobs(list(range(logprobs + 1)), [-0.5] * (logprobs + 1), list(range(1, logprobs + 2)))
            ]
        if finished:
            output.finish_reason = "length"
            output.times = RequestTimes(now, now, now, now, now, token_times=[now] * 64, prefill_chunks=[(now, 16)])
        outputs.append(output)
    return EngineCoreOutputs(0, now, outputs, SchedulerStats(num_running_reqs=batch, step_id=7))


def measure_message(message: EngineCoreOutputs, transport: str) -> dict:
    context = zmq.Context()
    receiver = context.socket(zmq.PULL)
    with tempfile.TemporaryDirectory() as ipc_dir:
        receiver.bind(f"ipc://{ipc_dir}/bench" if transport == "ipc" else "tcp://127.0.0.1:*")
        sender = context.socket(zmq.PUSH)
        sender.connect(receiver.getsockopt(zmq.LAST_ENDPOINT).decode())
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(EngineCoreOutputs)
        times = {"encode": [], "transport": [], "decode": []}
        for _ in range(MESSAGES_PER_CASE):
            t0 = time.perf_counter()
            payload = encoder.encode(message)
            t1 = time.perf_counter()
            sender.send_multipart([b"O", payload])
            _, received = receiver.recv_multipart()
            t2 = time.perf_counter()
            decoder.decode(received)
            t3 = time.perf_counter()
            times["encode"].append(t1 - t0)
            times["transport"].append(t2 - t1)
            times["decode"].append(t3 - t2)
        sender.close(linger=0)
        receiver.close(linger=0)
    context.term()
    result = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    result["bytes"] = len(payload)
    result["total"] = result["encode"] + result["transport"] + result["decode"]
    return result


# ---- 2. the step, with and without the boundary ---------------------------------------------


def requests(batch: int, max_tokens: int, eos: list[int]) -> list[EngineCoreRequest]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (PROMPT_LEN,), generator=generator).tolist() for _ in range(batch)]
    return [EngineCoreRequest(f"r{i}", prompt, params, eos, time.time()) for i, prompt in enumerate(prompts)]


def inprocess_step_times(args: EngineArgs, info: ModelInfo, batch: int, max_tokens: int) -> list[float]:
    engine = build_engine_core(args, model_info=info)
    for request in requests(batch, max_tokens, info.eos_token_ids):
        engine.add_request(request)
    times = []
    while engine.has_unfinished_requests:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[1:-1]  # decode steps only: the first is the prefill, the last frees everything


async def engine_process_step_times(args: EngineArgs, info: ModelInfo, batch: int, max_tokens: int) -> list[float]:
    client = MPClient(args, info)
    await client.start()
    try:
        for request in requests(batch, max_tokens, info.eos_token_ids):
            await client.add_request(request)
        arrivals = []
        while client.in_flight:
            await client.get_outputs()
            arrivals.append(time.perf_counter())
    finally:
        client.shutdown()
    intervals = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return intervals[:-1]  # between decode steps, as above


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="running requests per step")
    parser.add_argument("--max-tokens", type=int, default=32, help="decode steps to time")
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the default model's shape, random)")
    parser.add_argument("--torch-threads", type=int, default=1, help="CPU threads, here and in the engine process")
    options = parser.parse_args()
    # The same on both sides of the comparison; one thread keeps a shared CPU from
    # turning the step time into noise. The engine process reads the variable when
    # its torch starts.
    torch.set_num_threads(options.torch_threads)
    os.environ["OMP_NUM_THREADS"] = str(options.torch_threads)

    print(f"IPC cost of one step's EngineCoreOutputs, {options.batch} running requests (median of {MESSAGES_PER_CASE})")
    print(f"{'message':34} {'transport':>9} {'bytes':>7} {'encode':>8} {'zmq':>8} {'decode':>8} {'total':>9}")
    cases = {
        "1 new token each": step_message(options.batch),
        "1 token + top-5 logprobs each": step_message(options.batch, logprobs=5),
        "all finishing, with timings": step_message(options.batch, finished=True),
    }
    direct = {}
    for name, message in cases.items():
        for transport in ("ipc", "tcp"):
            r = measure_message(message, transport)
            direct[(name, transport)] = r
            print(
                f"{name:34} {transport:>9} {r['bytes']:7d} {r['encode']:6.1f}us {r['transport']:6.1f}us "
                f"{r['decode']:6.1f}us {r['total']:7.1f}us"
            )

    args = EngineArgs(model=options.model, max_num_seqs=max(options.batch, 1))
    info = ModelInfo.from_args(args)
    inproc = statistics.median(inprocess_step_times(args, info, options.batch, options.max_tokens))
    multiproc = statistics.median(asyncio.run(engine_process_step_times(args, info, options.batch, options.max_tokens)))

    ipc_per_step = direct[("1 new token each", "ipc")]["total"] / 1e6
    print(f"\nDecode step, {options.batch} requests, model {options.model or 'built-in'}, "
          f"torch threads: {options.torch_threads}")
    print(f"  in-process EngineCore.step        {inproc * 1e3:8.2f} ms")
    print(f"  engine process via MPClient       {multiproc * 1e3:8.2f} ms   (time between outputs at the client)")
    print(f"  difference                        {(multiproc - inproc) * 1e3:8.2f} ms   "
          f"({(multiproc - inproc) / inproc:+.1%} of a step)")
    print(
        f"  direct IPC cost (ipc://, 1 token)  {ipc_per_step * 1e3:8.3f} ms   ({ipc_per_step / inproc:.2%} of a step)"
    )


if __name__ == "__main__":  # required: the engine process is spawned, and re-imports this file
    main()
