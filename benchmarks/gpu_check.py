"""The GPU path, checked and measured on a machine with an NVIDIA GPU, in one run that cannot lose its results.

    1. kernels      decode and prefill attention (the fp32 path and the half-precision one)
                    and the KV store, every case against the PyTorch reference
                    (gpu_check_kernels.py)
    2. speed        decode attention's share of the device's copy bandwidth, prefill's
                    TFLOP/s, both variants side by side (gpu_check_kernels.py)
    3. end to end   transformers against tinyserve with CUDA graphs and --enforce-eager,
                    DecodeGraphs.run alone, an fp32 parity pass (gpu_check_end_to_end.py)
    4. tensor       the tensor-parallel path over NCCL: a one-rank group against the plain path
       parallel     (tokens bit for bit), one all-reduce timed alone, and with two GPUs TP=2
                    against TP=1, each rank's time per step, fp32 parity with transformers
                    (gpu_check_tensor_parallel.py)

What keeps the results:

- Before anything runs, every package tinyserve needs and every module of the run is
  imported; what is missing ends the run at once, in one message naming it all.
- Each part prints its rows and writes them to --out DIR as soon as it ends, one file a
  part (1-kernels.jsonl, ...: one JSON row per line), so a run that dies later keeps them.
- A case that fails becomes a FAILED row, and the run goes on to the next.

The run is planned for about six minutes on one GPU (a minute more with two; an H200 took
2.5): each part's estimate is printed before it starts, and --smoke (the same code on the
CPU at tiny sizes, the kernels through Triton's interpreter, tensor parallelism over gloo:
it tests this script and measures nothing) prints the same plan.
Without a GPU and without --smoke it says so and exits with status 2.

    python benchmarks/gpu_check.py --out DIR [--append BENCHMARKS.md] [--parts 3,4]
    python benchmarks/gpu_check.py --smoke --out DIR
"""

import argparse
import importlib
import importlib.metadata
import json
import os
import re
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before any import of them

# The modules of the run itself (what they import in turn is imported with them), beyond the
# distributions tinyserve depends on (pyproject.toml), which are looked up first.
RUN_MODULES = ("torch", "triton", "gpu_check_common", "gpu_check_kernels", "gpu_check_end_to_end",
               "gpu_check_tensor_parallel", "tinyserve.entrypoints.llm", "tinyserve.engine.engine_core")

# What a GPU run of each part costs, roughly: Triton compiles each kernel specialization once
# (~1.5 s), triton.testing.do_bench times a call for ~0.15 s, and part 3 is dominated by two
# engine starts (profiling, ~33 CUDA-graph captures, compiling) and 4 generates per contender;
# part 4 by two eager engine starts and 3 small generates each (on two GPUs, two more starts
# of two ranks each, ~25 s apiece: a process that imports torch and joins NCCL).
COMPILE_SECONDS, BENCH_SECONDS = 1.5, 0.15


def missing_requirements() -> list[str]:
    """The distributions of pyproject.toml's dependencies that this Python does not have."""
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    names = [re.match(r"[A-Za-z0-9_.-]+", entry).group(0) for entry in re.findall(r'"([^"]+)"', block)]
    missing = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def check_imports() -> str | None:
    """None when everything the run needs imports; else the one message that says what is missing."""
    problems = [f"not installed: {', '.join(missing)}"] if (missing := missing_requirements()) else []
    for module in RUN_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as error:
            problems.append(f"import {module}: {type(error).__name__}: {error}")
    if not problems:
        return None
    return ("gpu_check: cannot start, nothing was run.\n  " + "\n  ".join(problems) +
            "\nInstall what is missing; on a machine without internet, see README.md, "
            "'Installing on an offline GPU server'.")


def plan() -> list[tuple[str, object, float]]:
    """(name, function, estimated seconds of a GPU run) of each part, in order; --smoke runs fewer cases."""
    import gpu_check_end_to_end
    import gpu_check_kernels
    import gpu_check_tensor_parallel

    import tests.paged_batches as cases

    params = cases.KERNEL_CASES  # the GPU run's, whatever this run is
    timings = sum(len(gpu_check_kernels.variants(kernel, dtype)) for *_, dtype in params
                  for kernel in ("decode", "prefill"))
    kernels = gpu_check_kernels.specializations(params) * COMPILE_SECONDS + timings * BENCH_SECONDS
    speed = 5 * COMPILE_SECONDS + 5 * BENCH_SECONDS + 10  # + filling 2 GiB of K/V and a 1 GiB copy
    end_to_end = 20 + 3 * 45 + 30  # model and tokenizer; 3 contenders (start + 4 generates at each batch size); fp32 parity
    tensor_parallel = 15 + 2 * 15  # model and tokenizer; 2 eager engines (start + 3 generates)
    return [("kernels", gpu_check_kernels.check_kernels, kernels),
            ("speed", gpu_check_kernels.kernel_speed, speed),
            ("end to end", gpu_check_end_to_end.end_to_end, end_to_end),
            ("tensor parallel", gpu_check_tensor_parallel.tensor_parallel, tensor_parallel)]


def write_rows(path: Path, rows) -> None:
    """All of a part's rows at once: written beside, then renamed, so a file is never half there."""
    partial = path.with_suffix(".partial")
    partial.write_text("".join(json.dumps(vars(row)) + "\n" for row in rows), encoding="utf-8")
    partial.replace(path)


def describe_device(device) -> str:
    import torch
    import transformers
    import triton

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name}, {props.total_memory / (1 << 30):.0f} GiB, CUDA {torch.version.cuda}"
    else:
        name = "CPU (smoke run: kernels through Triton's interpreter; the numbers mean nothing)"
    return f"{name}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"


def table(rows) -> str:
    part_width = max(len(r.part) for r in rows)
    what_width = min(80, max(len(r.what) for r in rows))
    return "\n".join(f"{r.part:<{part_width}}  {r.what:<{what_width}}  {r.result}".rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", metavar="DIR", default=f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}",
                        help="folder for one file of rows per part (default: gpu-check-DATE-TIME)")
    parser.add_argument("--append", metavar="FILE", nargs="?", const=str(REPO / "BENCHMARKS.md"), default=None,
                        help="append the table to FILE (default BENCHMARKS.md)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on the CPU: tests this script, measures nothing")
    parser.add_argument("--parts", metavar="N,N", default=None,
                        help="run only these parts (numbers, as the plan prints them): a rerun of what failed")
    args = parser.parse_args(argv)
    if (problem := check_imports()) is not None:
        print(problem, file=sys.stderr)
        return 2

    import torch
    from gpu_check_common import guarded

    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was measured. "
              "--smoke runs the script's code on the CPU.", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    description = describe_device(device)
    print(f"device: {description}\nrows go to {out}/", flush=True)
    chosen = {int(n) for n in args.parts.split(",")} if args.parts else None
    parts = [(number, *part) for number, part in enumerate(plan(), 1) if chosen is None or number in chosen]
    for number, name, _, estimate in parts:
        print(f"  part {number}, {name}: about {estimate:.0f} s on one GPU", flush=True)
    print(f"  in all about {sum(estimate for *_, estimate in parts) / 60:.1f} minutes", flush=True)

    rows = []
    for number, name, part, _ in parts:
        started = time.perf_counter()
        part_rows = guarded(name, "the whole part", lambda part=part: part(device, args.smoke))
        write_rows(out / f"{number}-{name.replace(' ', '-')}.jsonl", part_rows)
        print(f"\n{table(part_rows)}\n  part {number} done in {time.perf_counter() - started:.0f} s", flush=True)
        rows += part_rows
    text = table(rows)
    print("\n" + text)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(f"\n## GPU check (`benchmarks/gpu_check.py`)\n\nDevice: {description}, "
                    f"{time.strftime('%Y-%m-%d')}.\n\n```bash\npython benchmarks/gpu_check.py --append\n```\n\n"
                    f"```\n{text}\n```\n")
        print(f"\nappended to {args.append}")
    return 1 if any(row.failed for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
