"""What tracing costs offline: one traced `LLM`, its tracing switched off and on between runs.

compare.py times a traced and an untraced engine in two processes among seven
contenders. On a shared two-core machine that cannot tell 1 % from 4 %: single runs
vary by ±5 %, and one process can be a few per cent slower than an identical one for its
whole life (where its memory landed), which no number of rounds averages out. So here
one process holds one `LLM(trace_dir=...)` and runs the same workload with tracing off
and on in turn (who goes first alternating), and each run is cut in two:

    generate() ─┬─ before the engine loop: render, tokenize, request spans
                ├─ the engine loop: steps (recording timestamps; spans built only when flushed)
                └─ after it: build the engine spans, export everything, flush

Reported per workload and dtype: the medians of each run's total and engine-loop time,
the median time outside the loop, the median of the per-round ratios traced / untraced,
and the throughput lost, 1 - untraced / traced. Model and workloads are bench_models.py's.

    python benchmarks/tracing_cost.py [--repeats 8] [--quick]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_models.py and roofline.py, beside this file

from bench_models import (  # noqa: E402
    FULL, QUICK, build_model, make_llm, make_workloads, num_kv_blocks_for, tinyserve_generate,
)
from roofline import describe_machine  # noqa: E402

from tinyserve.lifecycle import tracing  # noqa: E402


class Switchable:
    """A traced LLM whose tracing can be turned off and on again.

    Tracing is a process-wide setting chosen when the LLM starts; it has two switches,
    both flipped here: the process's tracer provider (request spans check it) and the
    engine's span builder (step and engine-side request spans).
    """

    def __init__(self, llm) -> None:
        self.llm, self.provider, self.builder = llm, tracing._provider, llm.engine_core.span_builder
        self.loop_seconds = 0.0
        run_engine = llm._run_engine

        def timed_run_engine(*args, **kwargs):
            start = time.perf_counter()
            try:
                return run_engine(*args, **kwargs)
            finally:
                self.loop_seconds = time.perf_counter() - start

        llm._run_engine = timed_run_engine

    def switch(self, on: bool) -> None:
        tracing._provider = self.provider if on else None
        self.llm.engine_core.recorder.span_builder = self.builder if on else None

    def run(self, workload, traced: bool) -> tuple[float, float, list[list[int]]]:
        """(total seconds, engine-loop seconds, outputs) of one generate()."""
        self.switch(traced)
        start = time.perf_counter()
        outputs = tinyserve_generate(self.llm, workload)
        return time.perf_counter() - start, self.loop_seconds, outputs


def measure(folder: str, dtype: str, workloads, repeats: int, num_kv_blocks: int, trace_dir: str) -> list[str]:
    llm = make_llm(folder, num_kv_blocks, trace_dir=trace_dir, dtype=dtype)
    engine = Switchable(llm)
    rows = []
    for workload in workloads:
        engine.run(workload, traced=True)  # warm-up, both ways
        engine.run(workload, traced=False)
        runs = {True: [], False: []}
        for repeat in range(repeats):
            for traced in ((True, False) if repeat % 2 else (False, True)):
                runs[traced].append(engine.run(workload, traced))
        plain, traced = runs[False], runs[True]
        ratio = statistics.median(t[0] / p[0] for p, t in zip(plain, traced))
        same = sum(a == b for a, b in zip(plain[-1][2], traced[-1][2]))
        total = [statistics.median(r[0] for r in side) for side in (plain, traced)]
        loop = [statistics.median(r[1] for r in side) for side in (plain, traced)]
        outside = [statistics.median(r[0] - r[1] for r in side) * 1e3 for side in (plain, traced)]
        rows.append(f"{workload.name:<9} {dtype:<9} {total[0]:>10.3f} {total[1]:>9.3f} {loop[0]:>10.3f} {loop[1]:>9.3f} "
                    f"{outside[0]:>9.1f} {outside[1]:>8.1f} {ratio:>15.3f} {1 - 1 / ratio:>16.1%} "
                    f"{same:>6}/{len(plain[-1][2])}")
    engine.switch(True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None, help="rounds, each run off and on (default 8; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="bench_models.py's tiny model and workloads: a smoke test")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 8)
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    shape = QUICK if args.quick else FULL
    print(f"machine: {describe_machine()}")
    with tempfile.TemporaryDirectory(prefix="tinyserve-tracing-cost-") as tmp:
        folder = os.path.join(tmp, "model")
        build_model(folder, shape, args.quick)
        workloads = make_workloads(shape, args.quick)
        num_kv_blocks = num_kv_blocks_for(workloads)
        rows = []
        for dtype in ("float32", "bfloat16"):
            rows += measure(folder, dtype, workloads, repeats, num_kv_blocks, os.path.join(tmp, f"traces-{dtype}"))
            tracing.shutdown_tracing()  # the next LLM sets up its own run folder

    print(f"\n{repeats} rounds; seconds are medians; ratio = traced / untraced total time in the same round\n")
    print(f"{'workload':<9} {'dtype':<9} {'total off':>10} {'total on':>9} {'loop off':>10} {'loop on':>9} "
          f"{'rest off':>9} {'rest on':>8} {'ratio (median)':>15} {'throughput lost':>16} {'same tokens':>12}")
    print("\n".join(rows))
    print("(rest: milliseconds of generate() outside the engine loop)")
    print(f"\nat the end: load average {' / '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
