"""How steady is each contender's throughput from one fresh process to the next?

    python benchmarks/stability.py [--runs 5] [--contenders "tinyserve,transformers static"] [--contend K] [--quick]

The model and workload are compare.py's (bench_models.py: the ~27M-parameter Llama with
random weights, 32 prompts of 16–256 tokens, 64 new tokens each, greedy, EOS ignored).
Each run is a fresh interpreter: it loads its contender, runs the workload once to warm
up, then times it once (the one number it reports). Contenders alternate run by run, so
a slow minute of the machine falls on all of them. Printed: every run, then per
contender the median and the spread, (max - min) / median.

--contend K runs every contender beside K busy processes (background.py, as compare.py's
--contend). "tinyserve 2 threads" is tinyserve with the thread count fixed at two
(--cpu-threads 2): what it did before it gave up threads on a busy machine.

"tinyserve second LLM" builds an LLM, runs it, shuts it down, builds a second one in
the same process and times that one: two LLMs one after another should run alike.

Each run also reports what its timed run cost the process (minor page faults, involuntary
context switches, CPU seconds per wall second) and, for tinyserve, how many times the
thread governor (engine/worker/cpu_threads.py) changed the thread count during it: a
thread given up on a quiet machine is a slow run that is the engine's own.

Each run also times a fixed probe just before and just after its timed run: the same
fp32 matmuls (and bf16 ones on a CPU with bf16 instructions), small enough to stay in the
cache, so their time moves only with the speed the machine gives this process at that
moment (its clock, a neighbour on the same core). The summary prints the probe's own
spread over all runs and each contender's spread with every run scaled by its probe ("at
probe speed"): a spread the probe explains is the machine's; one it does not is the
contender's own.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CONTENDERS = ("transformers static", "tinyserve", "transformers static bf16", "tinyserve bf16",
              "tinyserve second LLM", "tinyserve 2 threads")


def child(name: str, folder: str, quick: bool) -> None:
    """One run in this fresh process: warm up once, time once, print the result as JSON."""
    import bench_models
    import compare

    workload = bench_models.make_workloads(bench_models.QUICK if quick else bench_models.FULL, quick)[0]
    blocks = bench_models.num_kv_blocks_for([workload])
    governor = None
    if name.startswith("tinyserve"):
        if name == "tinyserve second LLM":
            first = bench_models.make_llm(folder, blocks)
            bench_models.tinyserve_generate(first, workload)
            first.shutdown()
            del first
        llm = bench_models.make_llm(folder, blocks, dtype="bfloat16" if "bf16" in name.split() else "float32",
                                    cpu_threads=2 if name == "tinyserve 2 threads" else None)
        governor = llm.llm_engine.client.engine_core.thread_governor  # None with the count fixed
        run = lambda workload: bench_models.tinyserve_generate(llm, workload)  # noqa: E731
    else:
        run = compare.make_runner(name, folder, blocks, trace_dir="")
    run(workload)
    probe_before = machine_probe()
    changes_before = len(governor.changes) if governor is not None else 0
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    outputs = run(workload)
    seconds = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    probe_after = machine_probe()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(json.dumps({"tokens_per_s": sum(len(o) for o in outputs) / seconds,
                      "minor_faults": after.ru_minflt - before.ru_minflt,
                      "involuntary_switches": after.ru_nivcsw - before.ru_nivcsw,
                      "cpu_per_wall": cpu / seconds,
                      "thread_changes": len(governor.changes) - changes_before if governor is not None else 0,
                      "probe_s": (probe_before + probe_after) / 2}), flush=True)


def machine_probe(repeats: int = 25) -> float:
    """Seconds for a fixed set of cache-resident matmuls ([512 x 512] @ [512 x 2752]), best of three.

    fp32 and bf16 where the CPU has bf16 matmul instructions (AVX-512 BF16 or AMX); fp32 alone
    on one without, where this bf16 matmul is emulated, ~50x slower than the fp32 one (20 s
    a probe on a 2-core AMD EPYC), longer than the run it measures.
    """
    import torch

    from tinyserve.kernels.cpu_bf16 import cpu_has_bf16_matmuls

    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 512, generator=generator), torch.randn(512, 2752, generator=generator)
    pairs = [(a.bfloat16(), b.bfloat16()), (a, b)] if cpu_has_bf16_matmuls() else [(a, b)]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(repeats):
            for x, y in pairs:
                torch.mm(x, y)
        best = min(best, time.perf_counter() - start)
    return best


def one_run(name: str, folder: str, quick: bool) -> dict:
    """tokens_per_s, and what the timed run cost the process: minor page faults, involuntary
    context switches (the kernel took a core away), CPU seconds per wall second (2.0: both
    cores busy throughout, spinning included)."""
    command = [sys.executable, __file__, "--child", name, "--model", folder, *(["--quick"] if quick else [])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of: {', '.join(CONTENDERS)}")
    parser.add_argument("--quick", action="store_true", help="a tiny model and workload: checks the script only")
    parser.add_argument("--contend", type=int, default=0, metavar="K", help="beside K busy processes (default 0)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.model, args.quick)
        return 0
    names = [name.strip() for name in args.contenders.split(",")]
    unknown = [name for name in names if name not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    if args.contend < 0:
        parser.error(f"--contend must be 0 or more, got {args.contend}")
    import background
    import bench_models

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results: dict[str, list[float]] = {name: [] for name in names}
    probes: dict[str, list[float]] = {name: [] for name in names}
    print(f"contention: {args.contend} busy background processes", flush=True)
    with tempfile.TemporaryDirectory() as scratch, background.busy_processes(args.contend):
        folder = str(Path(scratch) / "model")
        bench_models.build_model(folder, bench_models.QUICK if args.quick else bench_models.FULL, args.quick)
        for number in range(args.runs):
            for name in names[number % len(names):] + names[:number % len(names)]:  # who goes first rotates
                run = one_run(name, folder, args.quick)
                results[name].append(run["tokens_per_s"])
                probes[name].append(run["probe_s"])
                print(f"run {number + 1}: {name:<26} {run['tokens_per_s']:8.1f} tok/s, {run['minor_faults']:7d} "
                      f"minor faults, {run['involuntary_switches']:5d} involuntary switches, "
                      f"{run['cpu_per_wall']:.2f} CPU s / s, {run['thread_changes']} thread changes, "
                      f"probe {run['probe_s'] * 1e3:.0f} ms", flush=True)
    print(f"\n{'contender':<26}{'runs (tok/s)':<44}{'median':>8}{'spread':>8}{'at probe speed':>16}")
    for name, values in results.items():
        median = statistics.median(values)
        runs = ", ".join(f"{v:.0f}" for v in values)
        scaled = [v * p for v, p in zip(values, probes[name])]  # tokens per probe-time: the machine's speed taken out
        print(f"{name:<26}{runs:<44}{median:>8.0f}{spread(values):>8.0%}{spread(scaled):>16.0%}")
    every_probe = [p for values in probes.values() for p in values]
    print(f"machine probe: {min(every_probe) * 1e3:.0f}-{max(every_probe) * 1e3:.0f} ms over all runs "
          f"(spread {spread(every_probe):.0%})")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
