"""Parts 1 and 2 of benchmarks/gpu_check.py: the attention kernels checked, then timed, each variant beside the other.

Each kernel has the path an fp32 cache takes (K/V upcast, IEEE fp32 dots, prefill on 4
warps: the only path before the half-precision one existed, hence "before") and the one
the backend picks for the case's dtype on a GPU ("now": for bf16/fp16, operands in that
dtype with fp32 accumulation; the prefill on 8 warps for every dtype):

    1. kernels     every case of tests/paged_batches.py's KERNEL_CASES: decode and prefill
                   in both variants against the PyTorch reference (on the CPU, outputs
                   poisoned with NaN first), error in units of the dtype's tolerance, and
                   the time of each; the KV store bit for bit.
    2. speed       decode attention over a large batch, the K/V bytes it must read over its
                   time, beside the device's copy bandwidth; prefill's TFLOP/s.
"""

from dataclasses import replace
from functools import partial

import torch

import tests.paged_batches as cases
from gpu_check_common import Row, device_seconds, guarded, relative_error
from tinyserve.kernels.triton_decode_attention import default_num_splits, paged_decode_attention
from tinyserve.kernels.triton_kv_store import store_kv
from tinyserve.kernels.triton_prefill_attention import paged_prefill_attention

NUM_KV_SPLITS = default_num_splits(2048)  # as the backend of a 2048-token model: several splits


def variants(kernel: str, dtype: torch.dtype) -> dict[str, dict]:
    """The launch options of each variant of kernel ("decode" or "prefill"), by label: before, then now."""
    half = str(dtype).removeprefix("torch.")
    if kernel == "decode":  # the same fp32 path for an fp32 cache: once
        before = {"before (fp32 dot)": dict(fp32_dot=True)}
        return before if dtype == torch.float32 else before | {f"now ({half} dot)": dict(fp32_dot=False)}
    before = {"before (fp32 dot, 4 warps)": dict(fp32_dot=True, num_warps=4)}
    if dtype == torch.float32:
        return before | {"now (fp32 dot, 8 warps)": dict(fp32_dot=True, num_warps=8)}
    return before | {f"now ({half} dot, 8 warps)": dict(fp32_dot=False, num_warps=8)}


def specializations(params: list[tuple]) -> int:
    """How many kernels Triton compiles for part 1: one per distinct set of constexprs (and dtypes)."""
    seen = set()
    for queries_per_kv, head_dim, block_size, dtype in params:
        seen.add(("store_kv", head_dim, dtype))
        seen.add(("reduce", head_dim, dtype))
        seen.update(("decode", queries_per_kv, head_dim, block_size, dtype, tuple(options.values()))
                    for options in variants("decode", dtype).values())
        seen.update(("prefill", queries_per_kv, head_dim, block_size, dtype, tuple(options.values()))
                    for options in variants("prefill", dtype).values())
    return len(seen)


def batch_to(batch, device: torch.device):
    """A PagedBatch (tests/paged_batches.py) with every tensor moved to device."""
    meta = batch.metadata
    moved = replace(meta, slot_mapping=meta.slot_mapping.to(device), query_start_loc=meta.query_start_loc.to(device),
                    seq_lens=meta.seq_lens.to(device), block_tables=meta.block_tables.to(device))
    return replace(batch, query=batch.query.to(device), kv_cache=batch.kv_cache.to(device), metadata=moved)


# ---- 1. kernels against the reference ------------------------------------------------------------


def check_kernels(device: torch.device, smoke: bool) -> list[Row]:
    params = cases.KERNEL_CASES[:1] if smoke else cases.KERNEL_CASES
    rows = []
    for case in params:
        rows += guarded("kernels", cases.case_id(case), lambda case=case: check_case(case, device, smoke))
    failed = [row for row in rows if row.failed]
    summary = "all within tolerance" if not failed else f"{len(failed)} FAILED"
    return [Row("kernels", f"{len(params)} cases x decode, prefill (both variants), store_kv", summary)] + rows


def check_case(case: tuple, device: torch.device, smoke: bool) -> list[Row]:
    queries_per_kv, head_dim, block_size, dtype = case
    tolerance = cases.TOLERANCE[dtype]
    longest = 3 * block_size + 1 if smoke else 700  # the interpreter takes a second per 700-token decode
    shapes = {"decode": ([5, block_size, 2 * block_size + 7, longest], [1, 1, 1, 1]),
              "prefill": ([13, 30, 23, block_size + 9], [13, 11, 1, 9])}
    rows = []
    for kernel, (seq_lens, query_lens) in shapes.items():
        batch = cases.make_paged_batch(seq_lens, query_lens, seed=head_dim + block_size, head_dim=head_dim,
                                       queries_per_kv=queries_per_kv, block_size=block_size, dtype=dtype)
        wants = cases.reference_attention(batch)
        on_device = batch_to(batch, device)
        results = []
        for label, options in variants(kernel, dtype).items():
            if kernel == "decode":
                run = partial(cases.run_decode_kernel, on_device, num_splits=NUM_KV_SPLITS, **options)
            else:
                run = partial(cases.run_prefill_kernel, on_device, **options)
            error = relative_error(run(), wants, **tolerance)
            seconds = device_seconds(run, device, smoke)
            verdict = "" if error <= 1 else "FAILED: "
            results.append((verdict, f"{label}: error {error:.2f} x tolerance, {seconds * 1e6:.0f} us"))
        failed = any(verdict for verdict, _ in results)
        rows.append(Row("kernels", f"{kernel} {cases.case_id(case)}",
                        ("FAILED: " if failed else "") + "; ".join(text for _, text in results)))
    rows.append(check_store(case, device))
    return rows


def check_store(case: tuple, device: torch.device) -> Row:
    """Every token's K/V to its slot, bit for bit."""
    queries_per_kv, head_dim, block_size, dtype = case
    batch = cases.make_paged_batch([9, 33], [9, 1], seed=11, head_dim=head_dim, block_size=block_size,
                                   queries_per_kv=queries_per_kv, dtype=dtype)
    key, value = torch.randn(2, 10, batch.kv_cache.shape[3], head_dim).to(dtype).unbind(0)
    cache = batch.kv_cache.to(device)
    store_kv(key.to(device), value.to(device), cache, batch.metadata.slot_mapping.to(device))
    slots = cache.cpu().view(2, -1, batch.kv_cache.shape[3], head_dim)[:, batch.metadata.slot_mapping]
    equal = torch.equal(slots[0], key) and torch.equal(slots[1], value)
    return Row("kernels", f"store_kv {cases.case_id(case)}", "bit for bit" if equal else "FAILED: a slot differs")


# ---- 2. speed --------------------------------------------------------------------------------------


def kernel_speed(device: torch.device, smoke: bool) -> list[Row]:
    return (guarded("speed", "decode attention", lambda: decode_speed(device, smoke))
            + guarded("speed", "prefill attention", lambda: prefill_speed(device, smoke)))


COPY_BYTES = 1 << 30  # a 1 GiB tensor copied: well past every cache


def copy_rate(device: torch.device, smoke: bool) -> float:
    """The device's copy bandwidth: bytes read + written per second."""
    source = torch.empty(COPY_BYTES >> 10 if smoke else COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return 2 * source.numel() / device_seconds(lambda: target.copy_(source), device, smoke)


def decode_speed(device: torch.device, smoke: bool) -> list[Row]:
    num_seqs, context, num_kv_heads, queries_per_kv, head_dim, block_size = \
        (4, 64, 2, 2, 64, 16) if smoke else (128, 4096, 8, 4, 128, 16)
    dtype = torch.float32 if smoke else torch.bfloat16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    block_tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq).int()
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    query = torch.randn(num_seqs, num_kv_heads * queries_per_kv, head_dim, device=device).to(dtype)
    kv_bytes = kv_cache.numel() * kv_cache.element_size()  # every K and V element read once
    num_splits = default_num_splits(context)
    rows = [Row("speed", f"decode: {num_seqs} seqs x {context} tokens, {num_kv_heads} KV heads x {queries_per_kv} "
                         f"of {head_dim}, {dtype}, split-K in {num_splits}", "")]
    copy = copy_rate(device, smoke)
    rows.append(Row("speed", "device copy bandwidth (read + write)", f"{copy / 1e9:.0f} GB/s"))
    outputs = {}
    for label, options in variants("decode", dtype).items():
        out = torch.empty_like(query)
        seconds = device_seconds(lambda out=out, options=options: paged_decode_attention(
            out, query, kv_cache, block_tables, seq_lens, head_dim**-0.5, num_splits, **options), device, smoke)
        outputs[label] = out
        rate = kv_bytes / seconds
        rows.append(Row("speed", f"decode {label}", f"{seconds * 1e6:.0f} us, {rate / 1e9:.0f} GB/s of K/V, "
                                                    f"{rate / copy:.0%} of the copy bandwidth"))
    if len(outputs) == 2:
        (before, first), (now, second) = outputs.items()
        error = relative_error(second, first, **cases.TOLERANCE[dtype])
        rows.append(Row("speed", f"decode: {now} against {before}", f"error {error:.2f} x the {dtype} tolerance"))
    return rows


def prefill_speed(device: torch.device, smoke: bool) -> list[Row]:
    num_seqs, prompt, num_kv_heads, queries_per_kv, head_dim, block_size = \
        (2, 32, 1, 2, 64, 16) if smoke else (8, 2048, 8, 4, 128, 16)
    dtype = torch.float32 if smoke else torch.bfloat16
    batch = cases.make_paged_batch([prompt] * num_seqs, [prompt] * num_seqs, seed=1, num_kv_heads=num_kv_heads,
                                   queries_per_kv=queries_per_kv, head_dim=head_dim, block_size=block_size,
                                   dtype=dtype)
    batch = batch_to(batch, device)
    meta, num_heads = batch.metadata, num_kv_heads * queries_per_kv
    flops = num_seqs * num_heads * 2 * 2 * head_dim * prompt * (prompt + 1) / 2  # causal: QK^T and PV
    rows = [Row("speed", f"prefill: {num_seqs} prompts of {prompt} tokens, {num_heads} heads over {num_kv_heads} "
                         f"of {head_dim}, {dtype}", "")]
    for label, options in variants("prefill", dtype).items():
        out = torch.empty_like(batch.query)
        seconds = device_seconds(lambda out=out, options=options: paged_prefill_attention(
            out, batch.query, batch.kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, batch.scale,
            meta.max_query_len, **options), device, smoke)
        rows.append(Row("speed", f"prefill {label}", f"{seconds * 1e3:.2f} ms, {flops / seconds / 1e12:.1f} TFLOP/s"))
    return rows
