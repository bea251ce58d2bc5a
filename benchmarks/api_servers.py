"""One API process against two (`--api-server-count 2`), where the front end is the bottleneck.

    .venv/bin/python benchmarks/api_servers.py [--rounds 3] [--num-prompts 256] [--profile 20]

Each contender is a real `tinyserve serve` with two engines (--data-parallel-size 2) of
bench_models.py's smallest Llama, whose forward pass is cheap enough that the API side
(parsing, tokenizing, detokenizing every token and framing every SSE chunk of every
stream) is most of the work: short prompts, many streams at once, 128 seats an engine.
The load is `tinyserve bench serve`'s own code (every request at once, greedy, EOS
ignored), so both contenders do the same work. Contenders alternate within each round
and every server is fresh; the table prints each one's median output throughput, its
spread and its ratio to one API process, with the load average before and after.

--profile S runs py-spy (`py-spy record --idle --nonblocking`, S seconds) on the single API
process of a saturated server and prints where its CPU time goes, by our own functions
and by the libraries below them.

What to expect on a machine with few cores: every process shares the same cores, the
benchmark's client (one Python event loop reading every stream) included. A second API
process only helps when the first is saturated and a core is idle for the second.
"""

import argparse
import collections
import concurrent.futures
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import bench_models  # noqa: E402
from tinyserve.bench.serve import ServeConfig, benchmark_serve  # noqa: E402
from tinyserve.testing import ServerProcess  # noqa: E402

ENGINE = ["--num-kv-blocks", "4096", "--max-num-seqs", "128", "--max-num-batched-tokens", "4096",
          "--data-parallel-size", "2", "--max-waiting-requests", "4096"]
CONTENDERS = {"1 API process": [], "2 API processes": ["--api-server-count", "2"]}


def warm_up(url: str) -> None:
    body = {"prompt": [1, 2, 3, 4], "max_tokens": 4, "ignore_eos": True}
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=120)
                      .raise_for_status(), range(4)))


def api_pids(server: ServerProcess) -> list[int]:
    """The processes that serve HTTP: the server itself, or its tinyserve-api-<i> children."""
    children = [p.pid for p in psutil.Process(server.process.pid).children() if p.name().startswith("tinyserve-api")]
    return children or [server.process.pid]


def measure(model: str, flags: list[str], args, profile_s: float = 0) -> tuple[float, dict]:
    server = ServerProcess(model, *ENGINE, *flags, startup_timeout=300)
    try:
        warm_up(server.url)
        config = ServeConfig(base_url=server.url, num_prompts=args.num_prompts, random_input_len=args.input_len,
                             random_output_len=args.output_len, random_range_ratio=0.5, ignore_eos=True,
                             disable_tqdm=True, seed=0)
        cpu = {pid: psutil.Process(pid).cpu_times() for pid in api_pids(server)}
        profile = None
        if profile_s:
            profile = threading.Thread(target=py_spy, args=(api_pids(server)[0], profile_s))
            profile.start()
        throughput = benchmark_serve(config).metrics.output_throughput
        if profile is not None:
            profile.join()
        used = {pid: sum(psutil.Process(pid).cpu_times()[:2]) - sum(before[:2]) for pid, before in cpu.items()}
        return throughput, used
    finally:
        server.stop()


def py_spy(pid: int, seconds: float) -> None:
    """Where one API process's CPU time goes: py-spy's raw samples, folded by our functions and by library."""
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        subprocess.run([str(Path(sys.executable).parent / "py-spy"), "record", "--idle", "--nonblocking",
                        "--duration", str(int(seconds)), "--format", "raw", "--full-filenames", "--output", out.name,
                        "--pid", str(pid)],
                       check=True, capture_output=True)
        samples = [line.rsplit(" ", 1) for line in Path(out.name).read_text().splitlines() if line.strip()]
    busy, libraries = collections.Counter(), collections.Counter()
    total = idle = 0
    for stack, count in samples:
        frames = stack.split(";")
        if not any("_run_once" in frame for frame in frames):
            continue  # not the event loop's thread (render threads, the tracer's exporter, ...)
        count = int(count)
        total += count
        if "select (selectors.py" in frames[-1] or "poll (" in frames[-1]:
            idle += count  # the loop waiting for something to do
            continue
        busy[_where(frames)] += count
        libraries[_library(frames[-1])] += count
    working = total - idle
    print(f"py-spy, the event loop of API process {pid}: {total} samples, {working / total:.0%} busy")
    print("  by the innermost tinyserve function on the stack:")
    for where, count in busy.most_common(14):
        print(f"  {count / working:6.1%}  {where}")
    print("  by where the sampled line itself was (a library, the standard library's module, or tinyserve):")
    for library, count in libraries.most_common(12):
        print(f"  {count / working:6.1%}  {library}")


def _library(frame: str) -> str:
    """`f (file.py:12)` → the package of file.py: a site-packages one, tinyserve/<sub>, or a stdlib module."""
    path = frame.rsplit("(", 1)[-1].split(":")[0]
    if "site-packages/" in path:
        return path.split("site-packages/")[1].split("/")[0]
    if "tinyserve/" in path:
        return "tinyserve/" + "/".join(path.split("tinyserve/")[-1].split("/")[:-1] or ["."])
    return "python: " + path.rsplit("/", 1)[-1]


def _where(frames: list[str]) -> str:
    """The innermost tinyserve function of a stack, and the library (if any) it was in below it."""
    ours = [f for f in frames if "tinyserve/" in f]
    library = next((f.split("(")[1].split("/site-packages/")[-1].split("/")[0] for f in reversed(frames)
                    if "site-packages/" in f), None)
    name = ours[-1].split(" (")[0] if ours else "(outside tinyserve: " + frames[-1].split(" (")[0] + ")"
    return f"{name}" + (f"  [in {library}]" if library and ours else "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--profile", type=float, default=0, help="py-spy the one API process for this many seconds")
    parser.add_argument("--quick", action="store_true", help="a tiny workload: checks the script, measures nothing")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.num_prompts, args.output_len = 1, 16, 8
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        model = str(Path(scratch) / "model")
        bench_models.build_model(model, bench_models.QUICK, quick=True)
        if args.profile:
            measure(model, CONTENDERS["1 API process"], args, profile_s=args.profile)
        results: dict[str, list[float]] = {}
        for round_number in range(args.rounds):
            for name, flags in CONTENDERS.items():
                value, cpu = measure(model, flags, args)
                results.setdefault(name, []).append(value)
                seconds = " + ".join(f"{s:.1f}" for s in cpu.values())
                print(f"round {round_number + 1}: {name:<18} {value:8.1f} output tok/s  (API CPU s: {seconds})",
                      flush=True)
    if not results:
        return 0
    base = statistics.median(results["1 API process"])
    print(f"\n{'contender':<18}{'median tok/s':>14}{'spread':>9}{'vs 1':>8}")
    for name, values in results.items():
        median = statistics.median(values)
        print(f"{name:<18}{median:>14.1f}{(max(values) - min(values)) / median:>8.0%}{median / base:>7.2f}×")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
