"""Part 4 of benchmarks/gpu_check.py: tensor parallelism on CUDA, where torch.distributed uses NCCL.

tests/test_tensor_parallel.py runs the tensor-parallel code on the CPU over gloo; this part
runs the same code on the GPU. The model is part 3's (random weights, built here), every
engine runs eagerly (the tensor-parallel path records no CUDA graphs) and traced:

    TP=1, no process group       the plain path: the reference for tokens and throughput
    TP=1, a one-rank group       EngineArgs.force_tensor_parallel: join_group(0, 1, ...) and the
                                 RowParallelLinear layers that all-reduce, over a group of one.
                                 The sum over one rank is that rank's tensor, so its tokens
                                 must be the plain path's, bit for bit
    one all_reduce alone         of a decode step's activations over that group, CUDA events
    TP=2 (two GPUs or more)      ranks on cuda:0 and cuda:1: throughput against TP=1, and
                                 tokens as alike as bf16 allows (the partial sums add up in
                                 another order, and near-ties of random weights flip)
    fp32 parity                  TP=2 against transformers, a few prompts in fp32: every
                                 sequence must match

Each rank's time of a step comes from its execute span (decode steps, the median): its
forward pass, and its time inside all_reduce calls. Over NCCL that is the host's time to
enqueue the collective, not the GPU's (the host does not wait for it; gloo does), which is
why one all-reduce is also timed alone. On a machine with one GPU, TP=2 is a "skipped" row.
--smoke runs all of it on the CPU over gloo, TP=2 as two processes.
"""

import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from statistics import median

import numpy as np
import torch

import bench_models
from gpu_check_common import Row, device_seconds, guarded, timer_name
from gpu_check_end_to_end import GPU_SHAPE, free, hf_generate, likeness, tinyserve_generate, wall_seconds

PART = "tensor parallel"
PLAIN = "TP=1, no process group"


@dataclass
class Run:
    """What one engine did: the tokens of each prompt, the seconds of one generate, its traced steps."""

    tokens: list[list[int]]
    seconds: float
    steps: list


def run_engine(folder: str, trace_dir: str, prompts: list[list[int]], new_tokens: int, dtype: str,
               device: torch.device, repeats: int, num_kv_blocks: int, size: int, force: bool,
               while_up=None) -> Run:
    """Start an engine of `size` ranks (force: the tensor-parallel path at size 1), generate, shut it down.

    while_up(llm) runs before the shutdown, while the engine's process group is there."""
    from tinyserve import LLM
    from tinyserve.lifecycle.tracing import shutdown_tracing
    from tinyserve.trace_reading import load_run

    try:
        llm = LLM(folder, dtype=dtype, device=device.type, enforce_eager=True, enable_prefix_caching=False,
                  attention_backend="triton", block_size=bench_models.BLOCK_SIZE, num_kv_blocks=num_kv_blocks,
                  tensor_parallel_size=size, force_tensor_parallel=force, trace_dir=trace_dir)
        try:
            tokens = tinyserve_generate(llm, prompts, new_tokens)
            seconds = wall_seconds(partial(tinyserve_generate, llm, prompts, new_tokens), device, repeats)
            if while_up is not None:
                while_up(llm)
        finally:
            llm.shutdown()  # the process group goes, so that the next engine can form its own
    finally:
        shutdown_tracing()  # each engine traces into its own run folder
    run_dir = llm.trace_run_dir
    del llm
    free(device)
    return Run(tokens, seconds, load_run(run_dir).steps)


def rank_times(steps) -> str:
    """Each rank's median execute and all_reduce time over the decode steps (every step if none)."""
    traced = [s for s in steps if s.ranks]
    if not traced:
        raise RuntimeError("the trace has no per-rank times (no tinyserve.execute span with tinyserve.tp.rank)")
    decode = [s for s in traced if s.num_prefill_requests == 0]
    which = f"{len(decode)} decode steps" if decode else f"{len(traced)} steps"
    ranks = {}
    for step in decode or traced:
        for rank in step.ranks:
            ranks.setdefault((rank["rank"], rank["device"]), []).append(rank)
    per_rank = [f"rank {rank} ({device}): execute {median(r['execute_s'] for r in times) * 1e3:.2f} ms, "
                f"all_reduce {median(r['all_reduce_s'] for r in times) * 1e3:.2f} ms"
                for (rank, device), times in sorted(ranks.items())]
    return "; ".join(per_rank) + f" (median of {which})"


def throughput(run: Run, output_tokens: int, base: Run | None) -> str:
    versus = f", {base.seconds / run.seconds:.2f}x the plain path's" if base is not None else ""
    return f"{run.seconds:.2f} s, {output_tokens / run.seconds:,.0f} output tok/s{versus}"


def tensor_parallel(device: torch.device, smoke: bool) -> list[Row]:
    from tinyserve.models.tokenizer import SPECIAL_TOKENS

    shape = bench_models.QUICK if smoke else GPU_SHAPE
    num_prompts, (low, high), new_tokens = (2, (8, 24), 4) if smoke else (64, (64, 256), 64)
    repeats = 1 if smoke else 2
    dtype = "float32" if smoke else "bfloat16"
    backend = "nccl" if device.type == "cuda" else "gloo"
    rng = np.random.default_rng(1)
    pool = np.arange(len(SPECIAL_TOKENS), shape.vocab_size)
    prompts = [rng.choice(pool, size=n).tolist() for n in rng.integers(low, high + 1, size=num_prompts)]
    num_kv_blocks = num_prompts * -(-(high + new_tokens) // bench_models.BLOCK_SIZE)  # every prompt at once
    output_tokens = num_prompts * new_tokens
    runs: dict[str, Run] = {}
    with tempfile.TemporaryDirectory(prefix="tinyserve-gpu-check-tp-") as scratch:
        folder, traces = str(Path(scratch) / "model"), str(Path(scratch) / "traces")
        num_params = bench_models.build_model(folder, shape, quick=smoke)
        rows = [Row(PART, f"model: {num_params / 1e6:.0f}M-parameter Llama, {dtype}; {num_prompts} prompts of "
                          f"{low}-{high} tokens, exactly {new_tokens} new tokens each, greedy; every engine eager "
                          "and traced", "")]

        def run(name: str, size: int, force: bool, must_match: bool = False, while_up=None) -> list[Row]:
            """One contender's rows: its throughput and tokens against the plain path's, its ranks' times."""
            runs[name] = run_engine(folder, traces, prompts, new_tokens, dtype, device, repeats, num_kv_blocks,
                                    size, force, while_up)
            rows = [compared(name, runs, output_tokens, must_match)]
            if size > 1 or force:
                what = f"{name}: per rank, per step"
                rows += guarded(PART, what, lambda: [Row(PART, what, rank_times(runs[name].steps))])
            return rows

        one_rank, two = f"TP=1, a one-rank {backend} group", f"TP=2 over {backend}"
        alone = []  # one all_reduce, timed while the one-rank group is there

        def time_all_reduce(llm) -> None:
            alone.extend(guarded(PART, "one all_reduce alone", lambda: [all_reduce_row(
                device, smoke, num_prompts, shape.hidden_size, llm.model_info.torch_dtype)]))

        rows += guarded(PART, PLAIN, lambda: run(PLAIN, 1, False))
        rows += guarded(PART, one_rank, lambda: run(one_rank, 1, True, must_match=True, while_up=time_all_reduce))
        rows += alone
        if device.type == "cuda" and torch.cuda.device_count() < 2:
            return rows + [Row(PART, "TP=2 and its fp32 parity", "skipped: 1 CUDA device here, TP=2 needs 2")]
        rows += guarded(PART, two, lambda: run(two, 2, False))
        rows += guarded(PART, "fp32 parity", lambda: fp32_parity(folder, traces, prompts, new_tokens, device,
                                                                  num_kv_blocks))
    return rows


def compared(name: str, runs: dict[str, Run], output_tokens: int, must_match: bool) -> Row:
    """A contender's throughput against the plain path's, and how alike their tokens are."""
    run, base = runs[name], runs.get(PLAIN) if name != PLAIN else None
    if base is None:
        return Row(PART, name, throughput(run, output_tokens, None))
    verdict = "FAILED: not the plain path's tokens; " if must_match and run.tokens != base.tokens else ""
    return Row(PART, name, f"{verdict}{throughput(run, output_tokens, base)}; against it: "
                           f"{likeness(run.tokens, base.tokens)}")


def all_reduce_row(device: torch.device, smoke: bool, num_seqs: int, hidden_size: int, dtype: torch.dtype) -> Row:
    """One all_reduce of a decode step's activations over the engine's one-rank group, timed alone."""
    import torch.distributed as dist

    activations = torch.randn(num_seqs, hidden_size, dtype=dtype, device=device)
    seconds = device_seconds(lambda: dist.all_reduce(activations), device, smoke)
    dtype_name = str(dtype).removeprefix("torch.")
    what = f"one all_reduce alone over the one-rank group: {num_seqs} x {hidden_size} {dtype_name}"
    return Row(PART, what, f"{seconds * 1e6:.1f} us ({timer_name(device)}); a decode step makes two a layer")


def fp32_parity(folder: str, traces: str, prompts: list[list[int]], new_tokens: int, device: torch.device,
                num_kv_blocks: int) -> list[Row]:
    """A few prompts in fp32, TP=2 against transformers: with no bf16 rounding, every sequence should match."""
    few = prompts[:8]
    _, wants = hf_generate(folder, few, new_tokens, torch.float32, device, repeats=0)
    got = run_engine(folder, traces, few, new_tokens, "float32", device, 0, num_kv_blocks, 2, False).tokens
    same = sum(a == b for a, b in zip(got, wants))
    verdict = "" if same == len(few) else "FAILED: "
    return [Row(PART, "fp32 parity: TP=2 against transformers", f"{verdict}{likeness(got, wants)}")]
