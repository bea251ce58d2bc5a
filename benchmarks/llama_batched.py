"""tinyserve beside llama.cpp's own batched loop, llama-batched-bench, on one machine, in one run.

    python benchmarks/llama_batched.py [--repeats 5] [--sequences 32] [--prompt-len P] [--new-tokens 64]

compare.py's llama.cpp contenders are its HTTP server; llama-batched-bench (llama.cpp's
tools/batched-bench) is its engine with nothing around it: it prefills all the sequences
together (in batches of -b 2048 tokens), then runs decode steps over all of them at once,
random token ids in and logits out, no HTTP, no tokenizer, no sampling. It is the fastest
llama.cpp runs a batch, and takes prompts of one length only. So here everyone runs
"workload U": S prompts of P tokens each (P, by default, the mean prompt length of
compare.py's workload A), N new tokens each, greedy, end-of-sequence ignored, on compare.py's
checkpoint (bench_models.py), the same weights everywhere.

The same work on both sides: tinyserve's prefill yields each sequence's first new token and
N - 1 decode steps the rest; llama-batched-bench runs -ntg N - 1 decode steps after its
prefill. Both are reported as S * N generated tokens over the whole time, prefill included
(llama.cpp's T column; tinyserve's `LLM.generate` call, detokenizing included); llama.cpp's
decode phase alone (its S_TG) is printed beside it.

Contenders, each with its KV cache in the weights' dtype:
    tinyserve, tinyserve bf16          LLM.generate, one process each, warmed up once
    llama.cpp f32, llama.cpp bf16      llama-batched-bench, flash attention at llama.cpp's
                                       default ("auto": on where the CPU backend supports it)
    ... flash attn off                 the same with -fa off (faster in f32 on some CPUs)
Every llama.cpp run is a fresh process (it loads the ~100 MB GGUF in well under a second,
outside the time it reports); its threads are the threads torch uses here. Rounds interleave
all contenders, rotating who goes first; medians and spreads, (max - min) / median, over the
rounds. The first run builds llama.cpp (benchmarks/llama_cpp.py: minutes, once).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_models  # noqa: E402
import compare  # noqa: E402
import llama_cpp  # noqa: E402
from stability import spread  # noqa: E402

TINYSERVE = ("tinyserve", "tinyserve bf16")
LLAMA = {  # name -> (weights and KV dtype, flash attention)
    "llama.cpp f32": ("f32", "auto"),
    "llama.cpp f32, flash attn off": ("f32", "off"),
    "llama.cpp bf16": ("bf16", "auto"),
    "llama.cpp bf16, flash attn off": ("bf16", "off"),
}


def uniform_workload(shape, sequences: int, prompt_len: int, new_tokens: int, seed: int = 0) -> bench_models.Workload:
    rng = np.random.default_rng(seed)
    pool = np.asarray(bench_models.vocabulary_pool(shape.vocab_size, range(len(bench_models.SPECIAL_TOKENS))))
    prompts = [pool[rng.integers(0, len(pool), size=prompt_len)].tolist() for _ in range(sequences)]
    return bench_models.Workload("U", prompts, [new_tokens] * sequences)


def batched_bench(binary: Path, gguf: Path, kv_type: str, flash_attn: str, sequences: int, prompt_len: int,
                  new_tokens: int, threads: int) -> dict:
    """One llama-batched-bench run of the workload; its JSON line (t, t_pp, t_tg, speed_tg, ...)."""
    context = 256 * -(-sequences * (prompt_len + new_tokens) // 256)
    command = [str(binary), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
               "-npp", str(prompt_len), "-ntg", str(new_tokens - 1), "-npl", str(sequences),
               "-t", str(threads), "-tb", str(threads), "-ctk", kv_type, "-ctv", kv_type, "-fa", flash_attn,
               "--output-format", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=None, help="default: workload A's mean prompt length")
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.repeats < 1 or args.sequences < 1 or args.new_tokens < 2:
        parser.error("--repeats and --sequences must be at least 1, --new-tokens at least 2")
    shape = bench_models.FULL
    workload_a = bench_models.make_workloads(shape, False)[0]
    prompt_len = args.prompt_len or round(workload_a.prompt_tokens / len(workload_a.prompts))
    workload = uniform_workload(shape, args.sequences, prompt_len, args.new_tokens)
    threads = torch.get_num_threads()
    binary = llama_cpp.build()
    bench = binary.parent / "llama-batched-bench"
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(f"workload U: {args.sequences} prompts of {prompt_len} tokens, {args.new_tokens} new tokens each; "
          f"greedy, EOS ignored; {threads} threads; llama.cpp {llama_cpp.version(binary)}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in (*TINYSERVE, *LLAMA)}
    decode_speed: dict[str, list[float]] = {name: [] for name in LLAMA}
    with tempfile.TemporaryDirectory() as scratch:
        folder = str(Path(scratch) / "model")
        bench_models.build_model(folder, shape, False)
        ggufs = {dtype: llama_cpp.convert(folder, Path(scratch) / f"model-{dtype}.gguf", dtype)
                 for dtype in ("f32", "bf16")}
        blocks = bench_models.num_kv_blocks_for([workload])
        with compare.contender_processes(TINYSERVE, folder, blocks, "") as run:
            for name in TINYSERVE:  # warm-up
                run(name, workload)
            names = list(times)
            for repeat in range(args.repeats):
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    if name in TINYSERVE:
                        seconds, outputs = run(name, workload)
                        assert sum(len(o) for o in outputs) == args.sequences * args.new_tokens
                    else:
                        kv_type, flash_attn = LLAMA[name]
                        result = batched_bench(bench, ggufs[kv_type], kv_type, flash_attn, args.sequences, prompt_len,
                                               args.new_tokens, threads)
                        seconds = result["t"]
                        decode_speed[name].append(result["speed_tg"])
                    times[name].append(seconds)
                    print(f"  round {repeat + 1}: {name:<32} {seconds:.2f}s", file=sys.stderr, flush=True)
    generated = args.sequences * args.new_tokens
    print(f"\n{'contender':<32}{'KV':>5}{'median s':>10}{'spread':>8}{'best s':>8}{'output tok/s':>14}"
          f"{'  decode phase tok/s':>21}")
    for name, values in times.items():
        kv = LLAMA[name][0] if name in LLAMA else ("bf16" if name.endswith("bf16") else "f32")
        decode = f"{statistics.median(decode_speed[name]):>21.0f}" if name in LLAMA else f"{'':>21}"
        print(f"{name:<32}{kv:>5}{statistics.median(values):>10.2f}{spread(values):>8.1%}{min(values):>8.2f}"
              f"{generated / statistics.median(values):>14.1f}{decode}")
    for dtype, ours in (("f32", "tinyserve"), ("bf16", "tinyserve bf16")):
        for name in (n for n in LLAMA if LLAMA[n][0] == dtype):
            ratio = statistics.median(times[name]) / statistics.median(times[ours])
            paired = statistics.median(a / b for a, b in zip(times[name], times[ours]))
            print(f"{ours} / {name}: {ratio:.2f}x (medians), {paired:.2f}x (median of the rounds' ratios)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
