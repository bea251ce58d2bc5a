"""Two loops of the CPU decode kernel written as LLVM IR: numba intrinsics (cpu_decode_attention.py).

numba compiles Python loops to LLVM IR, and LLVM vectorizes what it can prove safe. Two
loops of the decode kernel came out slow that way, and here we write their IR ourselves.
numba's `intrinsic` is what makes that possible: a function whose body is LLVM IR built
with llvmlite's IRBuilder, typed by numba and inlined into the kernel that calls it, as
if numba had compiled it. The kernel stays a Python loop nest; these are two calls in it.

- `add_weighted_rows`: the weighted sum of a block's value rows, its sums held in 16-wide
  registers across the rows (numba's loop kept them in memory, one multiply-add waiting on
  the last).
- `prefetch`: the CPU's prefetch hint (`llvm.prefetch`) for a block the kernel will read
  next; numba has no way to say it.

Both take whole arrays and element offsets into them, and compute addresses from the
array's first element: C-contiguous arrays only (numba refuses to compile a call with any
other layout). Measured figures are in the kernel's docstring and BENCHMARKS.md.
"""

from llvmlite import ir
from llvmlite.binding import llvm_version_info
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _array_data(context, builder, array_type, array):
    """The address of an array's first element, in the LLVM IR numba is building."""
    return cgutils.create_struct_proxy(array_type)(context, builder, value=array).data


def _as_intp(context, builder, signature, args):
    """Each integer argument as a machine-sized integer (numba types them int32 or int64 by where they came from)."""
    return [context.cast(builder, arg, kind, types.intp) if isinstance(kind, types.Integer) else arg
            for arg, kind in zip(args, signature.args)]


@intrinsic
def add_weighted_rows(typingctx, out, out_at, rows, rows_at, row_stride, weights, weights_at, count, width):
    """out[out_at:][:width] += sum over i < count of weights[weights_at + i] * rows[rows_at + i * row_stride:][:width].

    rows: the value cache, fp32 or bf16 bits (C-contiguous, as numpy sees it); width a multiple of 16.
    Written as LLVM IR (numba's `intrinsic`: we emit the instructions, numba inlines them into the
    kernel) because the loop numba compiles from Python keeps the sum in `out`, in memory, and
    goes through one row at a time with a single chain of multiply-adds: each waits for the last
    (4 cycles). Here the sum of 64 columns stays in four 16-wide registers across the rows, four
    independent chains, and is stored once. The additions happen in the same order (row by row).
    """
    if any(array.layout != "C" for array in (out, rows, weights)):
        return None  # the offsets count elements of C-contiguous arrays: anything else fails to compile
    sig = types.void(out, out_at, rows, rows_at, row_stride, weights, weights_at, count, width)
    bf16 = isinstance(rows.dtype, types.Integer)
    i32, f32x16 = ir.IntType(32), ir.VectorType(ir.FloatType(), 16)
    i16x16, i32x16 = ir.VectorType(ir.IntType(16), 16), ir.VectorType(ir.IntType(32), 16)

    def codegen(context, builder, signature, args):
        args = _as_intp(context, builder, signature, args)
        out_at, rows_at, row_stride, weights_at, count, width = args[1], args[3], args[4], args[6], args[7], args[8]
        out0 = builder.gep(_array_data(context, builder, signature.args[0], args[0]), [out_at])
        rows0 = builder.gep(_array_data(context, builder, signature.args[2], args[2]), [rows_at])
        weights0 = builder.gep(_array_data(context, builder, signature.args[5], args[5]), [weights_at])
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32x16, [f32x16] * 3), "llvm.fma.v16f32")

        def sixteen(offset):  # 16 elements of the rows, as fp32 (a bf16 is the top half of an fp32)
            address = builder.gep(rows0, [offset])
            if bf16:
                bits = builder.zext(builder.load(builder.bitcast(address, i16x16.as_pointer()), align=2), i32x16)
                return builder.bitcast(builder.shl(bits, ir.Constant(i32x16, [16] * 16)), f32x16)
            return builder.load(builder.bitcast(address, f32x16.as_pointer()), align=4)

        def columns(first, passes, registers):  # `passes` runs over 16 * registers columns each, from `first`
            sums = [cgutils.alloca_once(builder, f32x16) for _ in range(registers)]
            with cgutils.for_range(builder, passes) as each_pass:
                start = builder.add(first, builder.mul(each_pass.index, ir.Constant(width.type, 16 * registers)))
                targets = [builder.bitcast(builder.gep(out0, [builder.add(start, ir.Constant(width.type, 16 * k))]),
                                           f32x16.as_pointer()) for k in range(registers)]
                for total, target in zip(sums, targets):
                    builder.store(builder.load(target, align=4), total)
                with cgutils.for_range(builder, count) as row:
                    weight = builder.load(builder.gep(weights0, [row.index]))
                    weight = builder.insert_element(ir.Constant(f32x16, None), weight, ir.Constant(i32, 0))
                    weight = builder.shuffle_vector(weight, ir.Constant(f32x16, None), ir.Constant(i32x16, [0] * 16))
                    row_start = builder.add(builder.mul(row.index, row_stride), start)
                    for k, total in enumerate(sums):
                        values = sixteen(builder.add(row_start, ir.Constant(width.type, 16 * k)))
                        builder.store(builder.call(fma, [weight, values, builder.load(total)]), total)
                for total, target in zip(sums, targets):
                    builder.store(builder.load(total), target, align=4)

        fours = builder.udiv(width, ir.Constant(width.type, 64))
        columns(ir.Constant(width.type, 0), fours, 4)  # 64 columns a pass
        rest = builder.udiv(builder.urem(width, ir.Constant(width.type, 64)), ir.Constant(width.type, 16))
        columns(builder.mul(fours, ir.Constant(width.type, 64)), rest, 1)  # then 16 a pass
        return context.get_dummy_value()

    return sig, codegen


# llvm.prefetch takes a pointer, and LLVM names its overloads by pointer type: "p0" once pointers are opaque.
_PREFETCH = "llvm.prefetch.p0" if llvm_version_info[0] >= 17 else "llvm.prefetch.p0i8"


@intrinsic
def prefetch(typingctx, array, at, count):
    """Ask the CPU to start loading array[at : at + count] into its caches: a hint, with no result and no fault.

    A sequence's blocks lie anywhere in the cache, so the CPU cannot guess where the next one
    is, and each block read from memory waits for its first lines: the kernel names the next
    block while it works on this one (measured in cpu_decode_attention.py's docstring).
    """
    if array.layout != "C":
        return None
    sig = types.void(array, at, count)
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)

    def codegen(context, builder, signature, args):
        args = _as_intp(context, builder, signature, args)
        start = builder.bitcast(builder.gep(_array_data(context, builder, signature.args[0], args[0]), [args[1]]), i8p)
        hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                              _PREFETCH)
        nbytes = builder.mul(args[2], ir.Constant(args[2].type, signature.args[0].dtype.bitwidth // 8))
        line, zero = ir.Constant(nbytes.type, 64), ir.Constant(nbytes.type, 0)
        with cgutils.for_range_slice(builder, zero, nbytes, line) as (at, _):  # one 64-byte line at a time
            # a read (0), to be kept in every cache level (3), of data (1)
            flags = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]
            builder.call(hint, [builder.gep(start, [at]), *flags])
        return context.get_dummy_value()

    return sig, codegen
