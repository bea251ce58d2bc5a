"""Decode attention on the CPU, reading the paged KV cache where it lies: a numba kernel.

One query token per sequence, against every key and value the sequence has cached:

    for each sequence s (in parallel, one per thread at a time):
        scores[h, g, t] = q[s, h, g] . K[t, h] * scale     for t < seq_lens[s]  (block by block)
        weights[h, g]   = softmax(scores[h, g])             (a row per query head)
        out[s, h, g]    = sum_t weights[h, g, t] * V[t, h]  (block by block)

where token t of sequence s sits in block block_tables[s][t // block_size] at offset
t % block_size, h is a KV head and g one of the query heads that share it (grouped-query
attention: each key and value is read once for all of them).

Why a kernel of our own. PyTorch has no attention over a paged cache, so the reference
backend (torch_attention.py) first copies each sequence's blocks into one padded batch
(an index_select) and then runs SDPA's flash kernel over the copy: the keys and values go
through memory three times (read, write, read again), and every sequence is padded to the
longest of its length group. This kernel reads each key and value once, from its block.
Measured in the engine (the 27M-parameter benchmark model, fp32, 32 decodes of 16-320
tokens, the 2-core AMD EPYC of BENCHMARKS.md): 5.8 ms of attention a decode step against
12.5 ms for the gather and SDPA; compare.py's workload A in 3.5-3.6 s instead of 4.0-4.3.

What numba does for us: it compiles this Python loop nest, on first use, to machine code
through LLVM, for the CPU it runs on; `fastmath` lets LLVM reorder the sums of the dot
products, which is what turns them into 8-wide vector multiply-adds. `prange` splits the
sequences across a team of threads (numba's OpenMP or TBB layer; the engine sets the
team's size to torch's thread count each step). Its on-disk cache keeps the machine code
(beside this file, else in ~/.cache/numba, or wherever NUMBA_CACHE_DIR says; with nowhere
writable it compiles in every process): compiling takes ~3 s per KV-cache dtype, loading
it back ~0.3 s. `why_unusable` runs the kernel once when the engine picks its backend, so
a machine where numba cannot start its threads gets the reference backend instead.

Where its time goes, and the three places the loops are written for the machine (measured on
the 2-core Intel Xeon of BENCHMARKS.md, 64 sequences of 128-192 tokens, 4 KV heads of 64,
bf16 cache, one thread: 1.35 ms a layer before, 0.98 after; 0.72 and 0.52 on two threads):
- The softmax keeps each query head's scores in one contiguous row, so its three passes are
  vector loops, and exponentiates with `_exp` (cpu_elementwise.py), which LLVM vectorizes:
  numba's np.exp is a call per element. It had been a quarter of the kernel.
- The weighted sum of the values is `add_weighted_rows` (cpu_ir.py), LLVM IR of our own: numba's loop
  kept the sum in memory and made each multiply-add wait for the one before it.
- The next block is prefetched (`prefetch`, cpu_ir.py) while the kernel works on this one: a
  sequence's blocks lie anywhere in the cache, so the CPU cannot guess where the next one is.
  With each of eight layers' caches read in turn, as a step reads them, a bf16 layer took
  1.2-1.3 ms without it and 0.9-1.0 with it (two threads).
The score dot products stay numba's loop: an IR version with wider sums, or with the CPU's
bf16 dot-product instruction, measured within 5 % of it.

The cache's dtype. Keys and values are widened to fp32 one element at a time as they are
read (`widen`): fp32 as is, bf16 by shifting its 16 bits into the top of an fp32 (a bf16 is
the top half of one), fp16 and the fp8 formats through a table of what each bit pattern
means (numpy has no bf16 or fp8, and numba no fp16 arithmetic, so those arrive as their
raw bits). The sums are in fp32 whatever the cache holds, like SDPA's flash kernel.
"""

import functools
import os

import numba
import numpy as np
import torch
from numba import prange, types
from numba.extending import overload

from tinyserve.kernels.cpu_elementwise import _NO_REASSOC, _exp
from tinyserve.kernels.cpu_ir import add_weighted_rows, prefetch

# A layer whose threads several Python threads may launch at once (two engines in one process):
# OpenMP or TBB. numba's third, "workqueue", aborts the process on a concurrent launch.
if "NUMBA_THREADING_LAYER" not in os.environ:  # a user's own choice stands
    numba.config.THREADING_LAYER = "threadsafe"


def widen(code, table):
    """The fp32 value of one cache element, in plain Python; inside the kernel numba compiles `_widen`'s version."""
    if isinstance(code, np.floating):  # an fp32 cache
        return np.float32(code)
    if table is None:  # bf16, as its bits: they are the top half of the fp32
        return np.array(np.uint32(code) << np.uint32(16), dtype=np.uint32).view(np.float32)[()]
    return table[code]  # fp16 or fp8, as bits: a table of their values


@overload(widen, inline="always")
def _widen(code, table):
    if isinstance(code, types.Float):  # an fp32 cache
        return lambda code, table: code
    if isinstance(table, types.NoneType):  # bf16, as its bits: they are the top half of the fp32
        return lambda code, table: np.uint32(np.uint32(code) << np.uint32(16)).view(np.float32)
    return lambda code, table: table[code]  # fp16 or fp8, as bits: a table of their values


@numba.njit(fastmath=True)
def _largest(row):
    largest = row[0]
    for t in range(1, row.shape[0]):
        largest = max(largest, row[t])
    return largest


@numba.njit(fastmath=_NO_REASSOC)  # _exp's two-part ln 2 must not be regrouped
def _exponentiate(row, largest):
    for t in range(row.shape[0]):
        row[t] = _exp(row[t] - largest)


@numba.njit(fastmath=True)
def _normalise(row):
    total = np.float32(0.0)
    for t in range(row.shape[0]):
        total += row[t]
    for t in range(row.shape[0]):
        row[t] /= total


# fastmath: LLVM may reorder sums (vector multiply-adds) and assume no NaN or infinity; keys,
# values and scores are finite (an fp8_e5m2 cache could hold an infinity: its result is undefined).
@numba.njit(parallel=True, fastmath=True)
def _paged_decode(query, k_cache, v_cache, table, block_tables, seq_lens, scale, out):
    """query/out [n, Hkv, G, D] fp32; k_cache/v_cache [num_blocks, block_size, Hkv, D] (codes), C-contiguous."""
    num_seqs, num_kv_heads, group, head_dim = query.shape
    block_size = k_cache.shape[1]
    for s in prange(num_seqs):
        seq_len = seq_lens[s]
        num_blocks = (seq_len + block_size - 1) // block_size
        q = query[s]
        scores = np.empty((num_kv_heads, group, seq_len), dtype=np.float32)  # a row per query head
        # 1. Scores, one block of keys at a time (each block read front to back, once), the next one on its way.
        block_elements = block_size * num_kv_heads * head_dim
        for b in range(num_blocks):
            if b + 1 < num_blocks:
                prefetch(k_cache, block_tables[s, b + 1] * block_elements, block_elements)
            else:  # the values' first block
                prefetch(v_cache, block_tables[s, 0] * block_elements, block_elements)
            keys = k_cache[block_tables[s, b]]
            for i in range(min(block_size, seq_len - b * block_size)):
                for h in range(num_kv_heads):
                    for g in range(group):
                        dot = np.float32(0.0)
                        for d in range(head_dim):
                            dot += q[h, g, d] * widen(keys[i, h, d], table)
                        scores[h, g, b * block_size + i] = dot * scale
        # 2. Softmax over the sequence, per query head: subtract the largest score, exponentiate, normalise.
        for h in range(num_kv_heads):
            for g in range(group):
                row = scores[h, g]
                _exponentiate(row, _largest(row))
                _normalise(row)
        # 3. The weighted sum of the values, one block at a time.
        o = out[s]
        o[:] = 0.0
        for b in range(num_blocks):
            block = block_tables[s, b]
            count = min(block_size, seq_len - b * block_size)
            if b + 1 < num_blocks:
                prefetch(v_cache, block_tables[s, b + 1] * block_elements, block_elements)
            elif s + 1 < num_seqs:  # the next sequence's first keys (this thread's next, mostly)
                prefetch(k_cache, block_tables[s + 1, 0] * block_elements, block_elements)
            if table is None and head_dim % 16 == 0:  # fp32 or bf16: sixteen columns at a time, in registers
                for h in range(num_kv_heads):
                    for g in range(group):
                        add_weighted_rows(out, ((s * num_kv_heads + h) * group + g) * head_dim,
                                           v_cache, (block * block_size * num_kv_heads + h) * head_dim,
                                           num_kv_heads * head_dim, scores, (h * group + g) * seq_len + b * block_size,
                                           count, head_dim)
            else:
                values = v_cache[block]
                for i in range(count):
                    for h in range(num_kv_heads):
                        for g in range(group):
                            weight = scores[h, g, b * block_size + i]
                            for d in range(head_dim):
                                o[h, g, d] += weight * widen(values[i, h, d], table)


try:
    _paged_decode.enable_caching()
except RuntimeError:  # no writable cache folder: compile in each process instead
    pass


@functools.cache
def _bits_and_table(dtype: torch.dtype) -> tuple[torch.dtype, np.ndarray]:
    """The integer dtype a cache of `dtype` is read as, and the fp32 value of each of its bit patterns."""
    bits = torch.uint8 if dtype.itemsize == 1 else torch.int16
    patterns = torch.arange(1 << (8 * dtype.itemsize), dtype=torch.int32).to(bits)
    return bits, patterns.view(dtype).float().numpy()


def _codes(cache: torch.Tensor) -> tuple[np.ndarray, np.ndarray | None]:
    """The cache as numpy sees it, and the table `widen` reads its bits through (None: none needed)."""
    if cache.dtype == torch.float32:
        return cache.numpy(), None
    if cache.dtype == torch.bfloat16:
        return cache.view(torch.int16).numpy().view(np.uint16), None
    bits, table = _bits_and_table(cache.dtype)  # fp16 and the fp8 formats
    codes = cache.view(bits).numpy()
    return (codes if bits == torch.uint8 else codes.view(np.uint16)), table


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: np.ndarray,
                           seq_lens: np.ndarray, scale: float) -> torch.Tensor:
    """query [n, H, D] (one token per sequence) -> [n, H, D] fp32.

    kv_cache [2, num_blocks, block_size, Hkv, D] in any KV-cache dtype; block_tables
    [n, max_blocks] and seq_lens [n], int32 numpy arrays (the step's, made once for all layers).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[-2]
    rows = query.float().reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim).contiguous()
    out = torch.empty_like(rows)
    kv_cache = kv_cache.contiguous()  # as the engine allocates it (a no-op): the kernel's offsets assume it
    k_codes, table = _codes(kv_cache[0])
    v_codes, _ = _codes(kv_cache[1])
    _paged_decode(rows.numpy(), k_codes, v_codes, table, block_tables, seq_lens, np.float32(scale), out.numpy())
    return out.view(num_seqs, num_heads, head_dim)


def set_num_threads(threads: int) -> None:
    """The kernel's team size (torch's, each step: the engine's thread governor moves it)."""
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


@functools.cache
def why_unusable() -> str | None:
    """None once the kernel has run here (compiled or loaded, its threads started); else what stopped it.

    numba's OpenMP layer needs the system's libgomp (its TBB layer, the tbb package):
    a slim container may have neither.
    """
    threads = torch.get_num_threads()
    try:
        warm_up((torch.float32,))
    except Exception as error:  # noqa: BLE001 - any failure means: use the reference instead
        return f"{type(error).__name__}: {error}"
    finally:  # starting numba's OpenMP layer sets the process's thread count to all the cores: torch's goes back
        torch.set_num_threads(threads)
    return None


def warm_up(kv_cache_dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)) -> None:
    """Compile (or load from the disk cache) the kernel for these caches' dtypes: the defaults are its four
    signatures (fp32, bf16 as bits, fp16 and fp8 as bits through a table). Starts numba's threads."""
    for dtype in kv_cache_dtypes:
        cache = torch.zeros(2, 1, 16, 1, 8).to(dtype)
        paged_decode_attention(torch.zeros(1, 1, 8), cache, np.zeros((1, 1), np.int32), np.ones(1, np.int32), 1.0)
