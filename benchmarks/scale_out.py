"""One model served five ways on this machine: one engine, DP=2, TP=2, PP=2, and DP=2 over a headless node.

    .venv/bin/python benchmarks/scale_out.py [--rounds 3] [--num-prompts 64]

Each contender is a real `tinyserve serve` (and, for the last, a `--headless` node beside
it, talking over TCP on loopback), loaded by `tinyserve bench serve`'s own code: the same
random-token prompts, all sent at once, greedy, EOS ignored, so every contender does the
same work. The model is bench_models.py's ~27M-parameter Llama (8 heads, 4 KV heads:
TP=2 splits both), built once in a temporary folder. Contenders alternate within each
round and every server is fresh; the table prints each one's median output throughput,
its spread over the rounds ((max - min) / median) and its ratio to one engine, with the
load average before and after.

What to expect on a machine with few cores: the contenders all share the same cores. DP=2
runs two copies of the model, each on half of the cores; TP=2 runs one model split in
two, each half on half of the cores, and adds two all-reduces per layer through gloo.
Neither has more arithmetic to spend than one engine, so neither can be much faster here;
BENCHMARKS.md says what changes with a GPU per rank.
"""

import argparse
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import bench_models  # noqa: E402
from tinyserve.bench.serve import ServeConfig, benchmark_serve  # noqa: E402
from tinyserve.testing import ServerProcess, free_port  # noqa: E402

ENGINE = ["--num-kv-blocks", "2048", "--max-num-seqs", "64", "--max-num-batched-tokens", "2048"]


def contenders(port: int) -> dict[str, tuple[list[str], list[str] | None]]:
    """name -> (the server's flags, a headless node's flags or None)."""
    multi = ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-rpc-port", str(port)]
    return {
        "1 engine": ([], None),
        "DP=2 (two engines)": (["--data-parallel-size", "2"], None),
        "TP=2 (one engine, two ranks)": (["--tensor-parallel-size", "2"], None),
        "PP=2 (one engine, two stages)": (["--pipeline-parallel-size", "2"], None),
        "DP=2, rank 1 on a headless node": (multi, [*multi, "--data-parallel-start-rank", "1"]),
    }


def warm_up(url: str) -> None:
    """A few short requests at once, so that every engine (the balancer spreads them) has run its first
    forward pass, which pays for allocating and tuning kernels, before the measured run."""
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "ignore_eos": True}
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=120)
                      .raise_for_status(), range(4)))


def measure(model: str, flags: list[str], headless: list[str] | None, args) -> float:
    node, env = None, {}
    if headless is not None:
        # Each node sizes its thread pool for a machine of its own; sharing this one, they take half each,
        # as two local engines do, or their threads would fight over the same cores.
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // 2))}
        command = [sys.executable, "-m", "tinyserve.cli.main", "serve", model, "--headless", *ENGINE, *headless]
        node = subprocess.Popen(command, env=dict(os.environ, **env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
    server = ServerProcess(model, *ENGINE, *flags, startup_timeout=300, env=env)
    try:
        warm_up(server.url)
        config = ServeConfig(base_url=server.url, num_prompts=args.num_prompts, random_input_len=args.input_len,
                             random_output_len=args.output_len, random_range_ratio=0.5, ignore_eos=True,
                             disable_tqdm=True, seed=0)
        return benchmark_serve(config).metrics.output_throughput
    finally:
        server.stop()
        if node is not None:
            node.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--contenders", nargs="+", metavar="NAME", help="only these (default: all); "
                        "'1 engine' is always measured, as the baseline")
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload: checks the script, measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.num_prompts, args.input_len, args.output_len = 1, 8, 16, 8
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(Path(scratch) / "model")
        bench_models.build_model(model, bench_models.QUICK if args.quick else bench_models.FULL, quick=args.quick)
        results: dict[str, list[float]] = {}
        for round_number in range(args.rounds):
            for name, (flags, headless) in contenders(free_port()).items():
                if args.contenders and name != "1 engine" and not any(n in name for n in args.contenders):
                    continue
                value = measure(model, flags, headless, args)
                results.setdefault(name, []).append(value)
                print(f"round {round_number + 1}: {name:<34} {value:8.1f} output tok/s", flush=True)
    base = statistics.median(results["1 engine"])
    print(f"\n{'contender':<34}{'median tok/s':>14}{'spread':>9}{'vs 1 engine':>13}")
    for name, values in results.items():
        median = statistics.median(values)
        spread = (max(values) - min(values)) / median
        print(f"{name:<34}{median:>14.1f}{spread:>8.0%}{median / base:>12.2f}×")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
