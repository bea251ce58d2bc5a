"""The GPU path, checked and measured on a machine with an NVIDIA GPU, in one run.

1. Kernels, natively: every case of tests/paged_batches.py's KERNEL_CASES
   (GQA ratio x head dim x block size x dtype) for the decode, prefill and KV-store
   kernels on the GPU, against the PyTorch reference on the CPU, same tolerances,
   outputs poisoned with NaN first.
2. Decode attention bandwidth: the paged decode kernel over a large batch, the bytes
   of K/V it must read divided by its time, beside the device's copy bandwidth
   measured the same way (a large tensor copy: bytes read + bytes written).
3. End to end: one model (random weights, built here), one workload, greedy with
   EOS ignored: transformers' static `generate` (bf16, sdpa), tinyserve with CUDA
   graphs, tinyserve --enforce-eager. Output tok/s, ratios, and how many requests
   generated the same tokens as transformers.

One table at the end; --append FILE adds it, with the device and the command, to
BENCHMARKS.md (or FILE). Without a GPU it says so and exits with status 2.

    python benchmarks/gpu_check.py [--append BENCHMARKS.md]
    python benchmarks/gpu_check.py --smoke      # the same code on the CPU, tiny sizes
                                               # (kernels through Triton's interpreter)

--smoke exists so the script itself is tested where there is no GPU: it runs every
part on tiny sizes on the CPU and prints the same table (whose numbers mean nothing).
"""

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined: before any import of them

import numpy as np  # noqa: E402
import torch  # noqa: E402

GPU_SHAPE_KWARGS = dict(vocab_size=8192, hidden_size=1024, num_layers=16, num_heads=16, num_kv_heads=4,
                        head_dim=64, intermediate_size=2816)  # ~0.2B parameters


@dataclass
class Row:
    part: str
    what: str
    result: str


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of fn() over repeats, after one warm-up."""
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# ---- 1. kernels ------------------------------------------------------------------------------


def batch_to(batch, device: torch.device):
    """A PagedBatch (tests/paged_batches.py) with every tensor moved to device."""
    meta = batch.metadata
    moved = replace(meta, slot_mapping=meta.slot_mapping.to(device), query_start_loc=meta.query_start_loc.to(device),
                    seq_lens=meta.seq_lens.to(device), block_tables=meta.block_tables.to(device))
    return replace(batch, query=batch.query.to(device), kv_cache=batch.kv_cache.to(device), metadata=moved)


def check_kernels(device: torch.device, smoke: bool) -> list[Row]:
    import tests.paged_batches as cases
    from tinyserve.kernels.triton_kv_store import store_kv

    params = [case.values for case in cases.KERNEL_CASES]
    if smoke:
        params = params[:2]
    failures, worst = [], 0.0
    for queries_per_kv, head_dim, block_size, dtype in params:
        tolerance = cases.TOLERANCE[dtype]
        checks = {
            "decode": ([5, block_size, 2 * block_size + 7, 700], [1, 1, 1, 1], cases.run_decode_kernel),
            "prefill": ([13, 30, 23, block_size + 9], [13, 11, 1, 9], cases.run_prefill_kernel),
        }
        for kernel, (seq_lens, query_lens, run) in checks.items():
            batch = cases.make_paged_batch(seq_lens, query_lens, seed=head_dim + block_size, head_dim=head_dim,
                                           queries_per_kv=queries_per_kv, block_size=block_size, dtype=dtype)
            got = run(batch_to(batch, device)).cpu()
            wants = cases.reference_attention(batch)
            error = (got.float() - wants.float()).abs().max().item()
            worst = max(worst, error / (tolerance["atol"] or 1))
            if not torch.allclose(got.float(), wants.float(), **tolerance):
                failures.append(f"{kernel} gqa{queries_per_kv} d{head_dim} bs{block_size} {dtype}: max error {error:.2e}")
        # KV store: every token to its slot, bit for bit.
        batch = cases.make_paged_batch([9, 33], [9, 1], seed=11, head_dim=head_dim, block_size=block_size,
                                       queries_per_kv=queries_per_kv, dtype=dtype)
        key, value = torch.randn(2, 10, batch.kv_cache.shape[3], head_dim).to(dtype).unbind(0)
        cache = batch.kv_cache.to(device)
        store_kv(key.to(device), value.to(device), cache, batch.metadata.slot_mapping.to(device))
        slots = cache.cpu().view(2, -1, batch.kv_cache.shape[3], head_dim)[:, batch.metadata.slot_mapping]
        if not (torch.equal(slots[0], key) and torch.equal(slots[1], value)):
            failures.append(f"store_kv d{head_dim} bs{block_size} {dtype}: a slot differs")
    rows = [Row("kernels", f"{len(params)} cases x decode, prefill, store_kv vs the PyTorch reference",
                "all equal" if not failures else f"{len(failures)} FAILED")]
    rows += [Row("kernels", "failed", failure) for failure in failures]
    rows.append(Row("kernels", "largest error / tolerance", f"{worst:.3f}"))
    return rows


# ---- 2. decode attention bandwidth ----------------------------------------------------------------


def decode_bandwidth(device: torch.device, smoke: bool) -> list[Row]:
    from tinyserve.kernels.triton_decode_attention import paged_decode_attention

    num_seqs, context, num_kv_heads, queries_per_kv, head_dim, block_size = \
        (4, 64, 2, 2, 64, 16) if smoke else (128, 4096, 8, 4, 128, 16)
    dtype = torch.float32 if smoke else torch.bfloat16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).int()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs, num_kv_heads * queries_per_kv, head_dim, device=device).to(dtype)
    out = torch.empty_like(query)
    seconds = timed(lambda: paged_decode_attention(out, query, kv_cache, block_tables, seq_lens, 0.1, context),
                    device, repeats=3 if smoke else 50)
    kv_bytes = kv_cache.numel() * kv_cache.element_size()  # every K and V element read once

    source = torch.empty(kv_bytes // 4 if smoke else 1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    copy_seconds = timed(lambda: target.copy_(source), device, repeats=3 if smoke else 20)
    copy_rate = 2 * source.numel() / copy_seconds  # read + write
    rate = kv_bytes / seconds
    shape = f"{num_seqs} seqs x {context} tokens, {num_kv_heads} KV heads x {queries_per_kv} of {head_dim}, {dtype}"
    return [
        Row("decode attention", shape, f"{seconds * 1e6:.0f} us, {rate / 1e9:.0f} GB/s of K/V read"),
        Row("decode attention", "device copy bandwidth (read + write)", f"{copy_rate / 1e9:.0f} GB/s"),
        Row("decode attention", "share of the copy bandwidth", f"{rate / copy_rate:.0%}"),
    ]


# ---- 3. end to end ----------------------------------------------------------------------------------


def end_to_end(device: torch.device, smoke: bool) -> list[Row]:
    import bench_models
    from transformers import GenerationConfig, LlamaForCausalLM

    from tinyserve import LLM, SamplingParams
    from tinyserve.models.tokenizer import SPECIAL_TOKENS

    shape = bench_models.QUICK if smoke else bench_models.Shape(**GPU_SHAPE_KWARGS)
    num_prompts, (low, high), new_tokens = (4, (8, 24), 8) if smoke else (256, (128, 512), 128)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="tinyserve-gpu-check-") as folder:
        num_params = bench_models.build_model(folder, shape, quick=smoke)
        pool = np.arange(len(SPECIAL_TOKENS), shape.vocab_size)
        prompts = [rng.choice(pool, size=n).tolist() for n in rng.integers(low, high + 1, size=num_prompts)]
        dtype = torch.float32 if smoke else torch.bfloat16

        model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        pad = model.generation_config.pad_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=pad, eos_token_id=model.generation_config.eos_token_id)
        results = {}

        def hf_run():
            with torch.no_grad():
                out = model.generate(input_ids, attention_mask=mask, generation_config=config)
            results["transformers static"] = [row[width:].tolist() for row in out]

        times = {"transformers static": timed(hf_run, device, repeats=1 if smoke else 3)}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()

        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        requests = [{"prompt_token_ids": p} for p in prompts]
        for name, eager in (("tinyserve (CUDA graphs)", False), ("tinyserve --enforce-eager", True)):
            llm = LLM(folder, dtype="float32" if smoke else "bfloat16", device=device.type, enforce_eager=eager,
                      enable_prefix_caching=False, attention_backend="triton",
                      **({"num_kv_blocks": 64} if smoke else {"gpu_memory_utilization": 0.5}))

            def run(llm=llm, name=name):
                outputs = llm.generate(requests, params, use_tqdm=False)
                results[name] = [list(o.outputs[0].token_ids) for o in outputs]

            times[name] = timed(run, device, repeats=1 if smoke else 3)
            del llm, run  # run holds the LLM too: free its KV cache before the next one sizes its own
            if device.type == "cuda":
                torch.cuda.empty_cache()

    output_tokens = num_prompts * new_tokens
    base = times["transformers static"]
    rows = [Row("end to end", f"model: {num_params / 1e6:.0f}M-parameter Llama, {dtype}; {num_prompts} prompts of "
                              f"{low}-{high} tokens, {new_tokens} new tokens each, greedy, EOS ignored", "")]
    for name, seconds in times.items():
        same = sum(a == b for a, b in zip(results[name], results["transformers static"]))
        rows.append(Row("end to end", name, f"{seconds:.2f} s, {output_tokens / seconds:,.0f} output tok/s, "
                                            f"{base / seconds:.2f}x transformers; same tokens {same}/{num_prompts}"))
    return rows


# ---- the table --------------------------------------------------------------------------------------


def describe_device(device: torch.device) -> str:
    import transformers
    import triton

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = f"{props.name}, {props.total_memory / (1 << 30):.0f} GiB, CUDA {torch.version.cuda}"
    else:
        name = "CPU (smoke run: kernels through Triton's interpreter; the numbers mean nothing)"
    return f"{name}; torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"


def table(rows: list[Row]) -> str:
    part_width = max(len(r.part) for r in rows)
    what_width = min(80, max(len(r.what) for r in rows))
    return "\n".join(f"{r.part:<{part_width}}  {r.what:<{what_width}}  {r.result}".rstrip() for r in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--append", metavar="FILE", nargs="?", const=str(REPO / "BENCHMARKS.md"), default=None,
                        help="append the table to FILE (default BENCHMARKS.md)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: tests this script, measures nothing")
    args = parser.parse_args(argv)
    if args.smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("gpu_check: no CUDA GPU on this machine (torch.cuda.is_available() is False); nothing was measured. "
              "--smoke runs the script's code on the CPU.", file=sys.stderr)
        return 2

    description = describe_device(device)
    print(f"device: {description}", flush=True)
    rows = []
    for part in (check_kernels, decode_bandwidth, end_to_end):
        started = time.perf_counter()
        rows += part(device, args.smoke)
        print(f"  {part.__name__} done in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    text = table(rows)
    print("\n" + text)
    if args.append:
        with open(args.append, "a", encoding="utf-8") as f:
            f.write(f"\n## GPU check (`benchmarks/gpu_check.py`)\n\nDevice: {description}, "
                    f"{time.strftime('%Y-%m-%d')}.\n\n```bash\npython benchmarks/gpu_check.py --append\n```\n\n"
                    f"```\n{text}\n```\n")
        print(f"\nappended to {args.append}")
    failed = any(r.part == "kernels" and r.what == "failed" for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
