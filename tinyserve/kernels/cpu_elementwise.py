"""The elementwise steps between a layer's matmuls, fused, on the CPU: three numba kernels.

Each decoder layer does, besides its four matmuls and attention:

    h = h + attention_out;  x = rms_norm(h) * w        (twice a layer: before attention, before the MLP)
    q, k = rope(q), rope(k)                            (x * cos + rotate_half(x) * sin, models/rope.py)
    y = silu(gate) * up                                (SwiGLU, between gate_up_proj and down_proj)

In PyTorch that is five ops (an add, the fused rms_norm, which is itself pow, mean,
rsqrt and two muls on a CPU, a silu over a strided half of gate_up, a mul), each a pass
over the rows through memory and, at decode sizes, each mostly the cost of launching it.
Here each line is one pass: `add_rms_norm` writes the new residual stream and its
normalized copy from one read of each input; `silu_and_mul` reads gate and up once and
writes their product. Measured with torch 2.13 on the 2-core AMD EPYC of BENCHMARKS.md
(fp32, hidden 512, intermediate 1376): at 2,048 rows, 0.25-0.35 against 0.85 ms for the add
and norm, 0.9 against 2.2-2.7 ms for silu and mul; at 32 rows (a decode step), 9-12 against
31 us and 16 against 37 us.

What numba does for us: as for the decode attention kernel (cpu_decode_attention.py), it
compiles these loops through LLVM for this CPU and caches the machine code on disk;
`prange` spreads the rows over its threads (their number follows torch's, set each step
by the CPU backend).

The numbers. The sums of squares are added in another order than torch's (vector lanes,
`fastmath`), so a normalized row differs from F.rms_norm's by a rounding or two (~1e-7
relative). The exponential is computed here, as Cephes' expf does (2^n times a degree-5
polynomial of the remainder, to ~1 ulp), because LLVM turns a call of the C library's
expf into one call per element, while this vectorizes: 8 at a time. Its constants must not
be regrouped, so `silu_and_mul` leaves out fastmath's reassociation.

bf16. A bf16 model rounds between the steps, as transformers' ops do: silu(gate) is rounded
to bf16 before the product with up, x + residual before its norm, the normalized x before
the product with the weight. The bf16 kernels keep every one of those roundings (`_to_bf16`:
round to nearest even, what torch does) and compute between them in fp32, as torch does; so
they give torch's bits, except where an fp32 result sits within a rounding of a bf16 halfway
point (the exponential, or the sum of squares added in another order): then a bf16 step
(two, rarely, for the norm: the normalized value's step carried through the weight's product).
They read and write bf16 as its raw 16 bits (numpy has no bf16). Measured on the 2-core
Intel Xeon with AMX of BENCHMARKS.md (where a bf16 matmul is fast, so the ops around it are
not): at 2,048 rows, 0.30 against 1.16 ms for the add and norm and 0.89 against 1.28 ms for
silu and mul; at 32 rows, 21 against 31 us and 21 against 22 us.

RoPE. `rotate` reads q and k where the qkv projection left them, the front of each row, and
writes them rotated: one pass where torch makes four (two products, the roll, the sum), each
product rounded before the sum as torch rounds it, so the bits are RotaryEmbedding.rotate's in
fp32 and bf16 alike. On the same Xeon, q and k of 12 heads of 64: at 2,048 rows 0.41 against
1.2 ms in bf16 and 0.38 against 1.7 ms in fp32; at 64 rows 32 against 70 us and 16 against 52.
Its loops take each half of a head as a slice: indexed as base + half + j, the same loop ran
5x slower, unvectorized.
fp16 keeps the PyTorch ops (which are also the reference here: `--attention-backend torch`
uses them).
"""

import numba
import numpy as np
import torch
from numba import prange

# fastmath without "reassoc", "nnan" or "ninf": LLVM may contract a*b+c into one multiply-add,
# but not regroup sums, which would undo the two-part ln 2 of `_exp` below, nor assume away the
# infinity e^x is past x = 88.7 (silu(x) is then -0 for x below -88.7, as torch has it).
_NO_REASSOC = {"nsz", "arcp", "contract", "afn"}


@numba.njit(inline="always", fastmath=_NO_REASSOC)
def _exp(x):
    """e^x in fp32 as Cephes' expf: x = n ln2 + r (|r| <= ln2 / 2), e^x = 2^n e^r, e^r by a polynomial."""
    x = min(max(x, np.float32(-86.0)), np.float32(89.0))  # e^-86 ~ 4e-38 stands for anything smaller
    n = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)  # ln 2 in two parts: r stays exact
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    e_r = p * r * r + r + np.float32(1.0)
    # 2^(n - 1) from its exponent bits, times 2: e^x up to fp32's largest (n = 128 with e^r < 1), then infinity.
    half_two_n = np.uint32(np.uint32(np.int32(n) + np.int32(126)) << np.uint32(23)).view(np.float32)
    return e_r * half_two_n * np.float32(2.0)


@numba.njit(parallel=True, fastmath=_NO_REASSOC)
def _silu_and_mul(gate_up, out):
    """gate_up [T, 2W] ([gate | up] by columns) -> out [T, W] = silu(gate) * up = gate / (1 + e^-gate) * up."""
    num_rows, width = out.shape
    for t in prange(num_rows):
        for j in range(width):
            gate = gate_up[t, j]
            out[t, j] = gate / (np.float32(1.0) + _exp(-gate)) * gate_up[t, width + j]


@numba.njit(parallel=True, fastmath=True)
def _add_rms_norm(x, residual, weight, eps, normed, new_residual):
    """new_residual = x + residual; normed = new_residual / sqrt(mean(new_residual^2) + eps) * weight, by rows."""
    num_rows, hidden = x.shape
    for t in prange(num_rows):
        squares = np.float32(0.0)
        for j in range(hidden):
            total = x[t, j] + residual[t, j]
            new_residual[t, j] = total
            squares += total * total
        inverse_rms = np.float32(1.0) / np.sqrt(squares / np.float32(hidden) + eps)
        for j in range(hidden):
            normed[t, j] = new_residual[t, j] * inverse_rms * weight[j]


@numba.njit(inline="always")
def _from_bf16(bits):
    """The fp32 value of a bf16 given as its 16 bits: they are the top half of the fp32."""
    return np.uint32(np.uint32(bits) << np.uint32(16)).view(np.float32)


@numba.njit(inline="always")
def _to_bf16(x):
    """x rounded to the nearest bf16, ties to even, as its 16 bits: torch's rounding, a NaN its one NaN."""
    if x != x:
        return np.uint16(0x7FC0)
    bits = np.float32(x).view(np.uint32)
    return np.uint16((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


# Neither "arcp" nor "afn": a division and a square root must round as torch's do.
@numba.njit(parallel=True, fastmath={"nsz", "contract"})
def _silu_and_mul_bf16(gate_up, out):
    """As _silu_and_mul, on bf16 bits: out = bf16(bf16(silu(gate)) * up), as transformers rounds."""
    num_rows, width = out.shape
    for t in prange(num_rows):
        for j in range(width):
            gate = _from_bf16(gate_up[t, j])
            silu = _to_bf16(gate / (np.float32(1.0) + _exp(-gate)))
            out[t, j] = _to_bf16(_from_bf16(silu) * _from_bf16(gate_up[t, width + j]))


# "reassoc" for the sum of squares (vector lanes), as _add_rms_norm's.
@numba.njit(parallel=True, fastmath={"reassoc", "nsz", "contract"})
def _add_rms_norm_bf16(x, residual, weight, eps, normed, new_residual):
    """As _add_rms_norm, on bf16 bits, with transformers' roundings:
    new_residual = bf16(x + residual); normed = bf16(weight * bf16(new_residual / rms(new_residual)))."""
    num_rows, hidden = x.shape
    for t in prange(num_rows):
        squares = np.float32(0.0)
        for j in range(hidden):
            total = _to_bf16(_from_bf16(x[t, j]) + _from_bf16(residual[t, j]))
            new_residual[t, j] = total
            value = _from_bf16(total)
            squares += value * value
        inverse_rms = np.float32(1.0) / np.sqrt(squares / np.float32(hidden) + eps)
        for j in range(hidden):
            unit = _to_bf16(_from_bf16(new_residual[t, j]) * inverse_rms)
            normed[t, j] = _to_bf16(_from_bf16(weight[j]) * _from_bf16(unit))


@numba.njit(inline="always")
def _halves(array, t, h, head_dim):
    """Head h of row t of array, as its two halves: slices, where plain indices (base + half + j) would
    have numba check each index and keep LLVM from vectorizing the loop over them (5x at 2,048 rows)."""
    start, half = h * head_dim, head_dim // 2
    return array[t, start:start + half], array[t, start + half:start + head_dim]


# No fastmath "contract": torch rounds each product before the sum, and so must these.
@numba.njit(parallel=True, fastmath={"nsz"})
def _rotate(rows, num_heads, head_dim, cos, signed_sin, out):
    """out[t, h] = x * cos[t] + [x2 | x1] * signed_sin[t] for x = [x1 | x2], head h of rows[t] (h < num_heads)."""
    for t in prange(rows.shape[0]):
        (cos1, cos2), (sin1, sin2) = _halves(cos, t, 0, head_dim), _halves(signed_sin, t, 0, head_dim)
        for h in range(num_heads):
            (x1, x2), (out1, out2) = _halves(rows, t, h, head_dim), _halves(out, t, h, head_dim)
            for j in range(head_dim // 2):
                out1[j] = x1[j] * cos1[j] + x2[j] * sin1[j]
                out2[j] = x2[j] * cos2[j] + x1[j] * sin2[j]


@numba.njit(parallel=True, fastmath={"nsz"})
def _rotate_bf16(rows, num_heads, head_dim, cos, signed_sin, out):
    """As _rotate, on bf16 bits, rounding as torch's three bf16 ops do: each product, then their sum."""
    for t in prange(rows.shape[0]):
        (cos1, cos2), (sin1, sin2) = _halves(cos, t, 0, head_dim), _halves(signed_sin, t, 0, head_dim)
        for h in range(num_heads):
            (x1, x2), (out1, out2) = _halves(rows, t, h, head_dim), _halves(out, t, h, head_dim)
            for j in range(head_dim // 2):
                a, b = _from_bf16(x1[j]), _from_bf16(x2[j])
                out1[j] = _to_bf16(_from_bf16(_to_bf16(a * _from_bf16(cos1[j])))
                                   + _from_bf16(_to_bf16(b * _from_bf16(sin1[j]))))
                out2[j] = _to_bf16(_from_bf16(_to_bf16(b * _from_bf16(cos2[j])))
                                   + _from_bf16(_to_bf16(a * _from_bf16(sin2[j]))))


for _kernel in (_silu_and_mul, _add_rms_norm, _silu_and_mul_bf16, _add_rms_norm_bf16, _rotate, _rotate_bf16):
    try:
        _kernel.enable_caching()
    except RuntimeError:  # no writable cache folder: compile in each process instead
        pass


def fusable(*tensors: torch.Tensor) -> bool:
    """Whether these kernels take the tensors: contiguous, on the CPU, all fp32 or all bf16."""
    return (len({t.dtype for t in tensors}) == 1 and tensors[0].dtype in (torch.float32, torch.bfloat16)
            and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors))


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy sees it: fp32 as is, bf16 as its raw 16 bits."""
    tensor = tensor.detach()
    return tensor.view(torch.int16).numpy().view(np.uint16) if tensor.dtype == torch.bfloat16 else tensor.numpy()


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2W] -> [T, W]: silu of the first half of each row times its second half (fusable tensors only)."""
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    kernel = _silu_and_mul_bf16 if gate_up.dtype == torch.bfloat16 else _silu_and_mul
    kernel(_numpy(gate_up), _numpy(out))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) for [T, hidden] x and residual (fusable tensors only)."""
    normed, new_residual = torch.empty_like(x), torch.empty_like(x)
    kernel = _add_rms_norm_bf16 if x.dtype == torch.bfloat16 else _add_rms_norm
    kernel(_numpy(x), _numpy(residual), _numpy(weight), np.float32(eps), _numpy(normed), _numpy(new_residual))
    return normed, new_residual


def rotate(cos_sin: tuple[torch.Tensor, torch.Tensor], rows: torch.Tensor, num_heads: int,
           head_dim: int) -> torch.Tensor:
    """RotaryEmbedding.rotate of the first num_heads heads of each row of rows [T, W]: [T, num_heads, head_dim].

    cos_sin: RotaryEmbedding.lookup's, [T, 1, head_dim] each (fusable tensors only, all of them).
    """
    num_tokens = rows.shape[0]
    cos, signed_sin = (table.reshape(num_tokens, head_dim) for table in cos_sin)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=rows.dtype)
    kernel = _rotate_bf16 if rows.dtype == torch.bfloat16 else _rotate
    kernel(_numpy(rows), num_heads, head_dim, _numpy(cos), _numpy(signed_sin), _numpy(out).reshape(num_tokens, -1))
    return out


def warm_up() -> None:
    """Compile (or load from the disk cache) the kernels now, not in the first step that needs them."""
    for dtype in (torch.float32, torch.bfloat16):
        silu_and_mul(torch.zeros(1, 2, dtype=dtype))
        add_rms_norm(torch.zeros(1, 1, dtype=dtype), torch.zeros(1, 1, dtype=dtype), torch.ones(1, dtype=dtype), 1e-6)
        cos_sin = (torch.ones(1, 1, 2, dtype=dtype), torch.zeros(1, 1, 2, dtype=dtype))
        rotate(cos_sin, torch.ones(1, 2, dtype=dtype), 1, 2)
