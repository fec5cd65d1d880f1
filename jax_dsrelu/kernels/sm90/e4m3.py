"""What the sm90 quantizing passes share: the recipe's constants as float32 values
(`quantization.blockwise.scales_from_amax`), the input types they read, their access width,
a block's maximum and its scale, a value's quotient by the scale, and the conversion of
float32 to e4m3 in CuTe DSL."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

VECTOR_BYTES = 16  # bytes per global load and store
RECIPROCAL = float(np.float32(1.0 / 448.0))  # 1 / e4m3's largest finite value, rounded to float32
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)
FLOAT32_MAX = float(np.finfo(np.float32).max)
# The 16- and 32-bit inputs a pass reads, by NumPy dtype.
ELEMENT_TYPES = {np.dtype("bfloat16"): cutlass.BFloat16, np.dtype(np.float16): cutlass.Float16,
                 np.dtype(np.float32): cutlass.Float32}


@dsl_user_op
def e4m3x2(low: Float32, high: Float32, *, loc=None, ip=None) -> cutlass.Uint16:
    """Two float32 values as e4m3 bytes, low in the low byte: round to nearest even,
    saturated, NaN kept (PTX puts its first source in the high byte)."""
    packed = llvm.inline_asm(T.i16(), [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)],
                             "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f", has_side_effects=False,
                             is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return cutlass.Uint16(packed)


@cute.jit
def fold_magnitude(amax: Float32, special: cutlass.Int32, value: Float32):
    """(amax, special) with `value` seen: |value|'s maximum over the finite values, and 1
    in special once a NaN or an infinity has been."""
    if cute.math.absf(value) <= Float32(FLOAT32_MAX):  # False for NaN and infinities
        amax = cute.arch.fmax(amax, cute.math.absf(value))
    else:
        special = cutlass.Int32(1)
    return amax, special


@cute.jit
def across_lanes(amax: Float32, special: cutlass.Int32, lanes: cutlass.Constexpr[int]):
    """(amax, special) over each run of `lanes` neighbouring lanes (a power of two), by
    butterfly shuffles: every lane of the warp takes part; a maximum is exact in any order."""
    for bit in cutlass.range_constexpr(lanes.bit_length() - 1):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << bit))
        special = special | cute.arch.shuffle_sync_bfly(special, offset=1 << bit)
    return amax, special


@cute.jit
def recipe_scale(amax: Float32, special: cutlass.Int32) -> Float32:
    """The recipe's scale of a block (`blockwise.scales_from_amax`): amax / 448 by one
    product, at least float32's smallest normal; 1 where amax is 0; NaN where the block
    held a NaN or an infinity."""
    scale = Float32(1.0)
    if amax > Float32(0.0):
        scale = cute.arch.fmax(amax * Float32(RECIPROCAL), Float32(SMALLEST_NORMAL))
    if special != 0:
        scale = Float32(float("nan"))
    return scale


@dsl_user_op
def quotient(value: Float32, scale: Float32, *, loc=None, ip=None) -> Float32:
    """value / scale as IEEE's division rounds it (div.rn.f32), with zero kept out of the
    division: a zero value divides its sign's 1 instead and takes that quotient times 0,
    the same signed zero as the division's for a finite scale (a scale is positive, at
    least float32's smallest normal) and NaN for a NaN one. Why: div.rn.f32 takes a
    subroutine (its slow path) for a zero dividend, as for any operand or quotient outside
    the normal range; dh and act are about half zeros (relu), and the zeros past an
    operand's edge are divided too. One asm statement, since LLVM sees that the division's
    result is used only where the value is not zero and hands it the value itself; the
    value is not read after the division, so that no more registers live across its
    subroutine (multiplying the value by the scale there made ptxas spill in the weights'
    pass)."""
    result = llvm.inline_asm(
        T.f32(), [Float32(value).ir_value(loc=loc, ip=ip), Float32(scale).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred zero;\n.reg .b32 one;\n.reg .f32 dividend, divided, product;\n"
        "setp.eq.f32 zero, $1, 0f00000000;\n"
        "or.b32 one, $1, 0x3F800000;\n"
        "selp.f32 dividend, one, $1, zero;\n"
        "div.rn.f32 divided, dividend, $2;\n"
        "mul.rn.f32 product, divided, 0f00000000;\n"
        "selp.f32 $0, product, divided, zero;\n}",
        "=f,f,f", has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Float32(result)
