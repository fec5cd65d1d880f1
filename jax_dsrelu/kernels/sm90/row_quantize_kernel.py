"""Activation rows quantized for the FP8 GEMMs' A operands, for Hopper (sm_90a), in CuTe DSL:
`quantization.blockwise.quantize_blockwise` of x (m, k) at the recipe's activation blocks,
1 x 128 along each row, in one pass over x.

Math, with x (m, k) bfloat16, float16 or float32 and B_r,j the columns [128 j, 128 j + 128)
of row r (partial at the far edge):

    amax[r, j]   = max |value| over B_r,j's finite values, 0 where there are none
    scales[r, j] = the recipe's scale of amax (`quantization.blockwise`: amax / 448 by a
                   product, at least float32's smallest normal, 1 where amax is 0, NaN
                   where the block holds a NaN or an infinity)
    values[r, c] = e4m3(x[r, c] / scales[r, c // 128])  (round to nearest even, saturated
                   to +-448; NaN where the scale is)

With prob (m,) (the squared-ReLU form, `RowQuantizeRequest.prob_dtype`), x is a
pre-activation h and each value is first formed in float32 as the forward's activation,

    value[r, c] = relu(x[r, c])**2 * prob[r]   ((r * r) * prob; relu a select that keeps NaN)

so that act is quantized from float32 without being written out first.

This is `quantize_blockwise`'s values and scales (of `squared_relu(h, prob)` in the second
form) byte for byte, but for the sign of a
NaN, where XLA divides as IEEE asks (XLA:CPU); XLA:GPU's division (div.full.f32) can put a
quotient an ulp off, and a value a step of e4m3 away (`quantization.blockwise`). XLA's
quantizer reads x twice (the maxima, then the values), and in the squared-ReLU form
XLA writes the float32 activation first; this pass reads x once and writes each output
once: 2 + 1 bytes an element (and a scale per 128) for 16-bit rows.

Half a warp takes one block: each of its 16 threads loads 8 neighbouring elements (16
bytes of bf16, so a warp reads 512 neighbouring bytes: two blocks), keeps them in
registers, and takes their maximum; four butterfly shuffles within the half give the
block's (a maximum is exact in any order). Each thread then divides its 8 values by the
scale, converts them in pairs and stores 8 bytes; its half's first thread stores the
scale. Every output byte is written once, by one thread: the same bits on every run. A
CTA of 256 threads takes 16 neighbouring blocks in row-major order; the grid covers every
block of x, and a thread past the last block or past k loads zeros and stores nothing
(it still takes part in the shuffles, which every lane of a warp must reach).

The division is IEEE's (div.rn.f32, zero kept out of it: `e4m3.quotient`), the conversion
`cvt.rn.satfinite.e4m3x2.f32` (`e4m3.py`).

Constraints (`row_quantize.cannot_quantize_rows` refuses the rest): k a positive multiple
of 16, so that every row starts aligned for the 16-byte loads and 8-byte stores; m > 0
(the caller makes an empty x's outputs without a launch).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from jax_dsrelu.kernels.operands import M, KernelOperand
from jax_dsrelu.kernels.sm90 import e4m3

BLOCK = 128  # elements of a block along a row
PIECE = 8  # elements a thread takes: 8 e4m3 bytes, one 8-byte store
LANES = BLOCK // PIECE  # threads of a block (half a warp)
THREADS = 256
BLOCKS_PER_CTA = THREADS // LANES
_E4M3 = np.dtype("float8_e4m3fn")
_F32 = np.dtype(np.float32)


class RowQuantizeSm90:
    """The pass for one static configuration: the rows' width k and their dtype."""

    prob_dtype = None  # the squared-ReLU form's prob (`SquaredReluRowQuantizeSm90`)

    def __init__(self, k: int, dtype):
        dtype = np.dtype(dtype)
        if dtype not in e4m3.ELEMENT_TYPES:
            raise TypeError(f"the row quantizer takes bfloat16, float16 or float32 rows, got {dtype.name}")
        self.k, self.dtype = k, dtype
        self.element = e4m3.ELEMENT_TYPES[dtype]
        self.per_load = min(PIECE, e4m3.VECTOR_BYTES // dtype.itemsize)  # elements of a load (16 bytes at most)
        self.blocks_per_row = -(-k // BLOCK)

    def operands(self) -> list[KernelOperand]:
        """x (m, k), values (m, k) e4m3, scales (m, ceil(k / 128)) float32."""
        return [
            KernelOperand("x", "input", self.dtype, (M, self.k)),
            KernelOperand("values", "output", _E4M3, (M, self.k)),
            KernelOperand("scales", "output", _F32, (M, self.blocks_per_row)),
        ]

    def _grid(self, x: cute.Tensor):
        blocks = cute.size(x, mode=[0]) * self.blocks_per_row
        return [(blocks + BLOCKS_PER_CTA - 1) // BLOCKS_PER_CTA, 1, 1]

    @cute.jit
    def __call__(self, stream: cuda.CUstream, x: cute.Tensor, values: cute.Tensor, scales: cute.Tensor):
        # x again in prob's place: the plain pass never reads prob (a constant of the build).
        self.kernel(x, x, values, scales).launch(grid=self._grid(x), block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, prob: cute.Tensor, values: cute.Tensor, scales: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        block = cta * BLOCKS_PER_CTA + tidx // LANES
        row = block // self.blocks_per_row
        column_block = block % self.blocks_per_row
        column = column_block * BLOCK + (tidx % LANES) * PIECE
        inside = row < cute.size(x, mode=[0]) and column < self.k

        # The thread's 8 elements, widened, and their maximum.
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.element,
                                   num_bits_per_copy=8 * self.per_load * self.dtype.itemsize)
        loaded = cute.make_rmem_tensor(cute.make_layout(PIECE), self.element)
        loaded_loads = cute.logical_divide(loaded, self.per_load)
        x_loads = cute.logical_divide(x, (None, self.per_load))
        loaded.fill(0)
        if inside:
            for v in cutlass.range_constexpr(PIECE // self.per_load):
                cute.copy(load, x_loads[row, (None, column // self.per_load + v)], loaded_loads[None, v])
        widened = cute.make_rmem_tensor(cute.make_layout(PIECE), Float32)
        row_prob = Float32(0.0)
        if cutlass.const_expr(self.prob_dtype is not None):
            if inside:
                row_prob = prob[row].to(Float32)
        amax = Float32(0.0)
        special = Int32(0)
        for i in cutlass.range_constexpr(PIECE):
            value = loaded[i].to(Float32)
            if cutlass.const_expr(self.prob_dtype is not None):
                if value < Float32(0.0):  # relu as a select: NaN stays NaN
                    value = Float32(0.0)
                value = value * value * row_prob
            widened[i] = value
            amax, special = e4m3.fold_magnitude(amax, special, value)
        # The block's maximum: butterflies over offsets 1 to 8 stay within a half warp.
        amax, special = e4m3.across_lanes(amax, special, LANES)
        scale = e4m3.recipe_scale(amax, special)

        # The thread's values as 8 bytes; the half's first thread the scale.
        packed = cute.make_rmem_tensor(cute.make_layout(PIECE // 2), cutlass.Uint16)
        for i in cutlass.range_constexpr(PIECE // 2):
            packed[i] = e4m3.e4m3x2(e4m3.quotient(widened[2 * i], scale), e4m3.quotient(widened[2 * i + 1], scale))
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Uint8, num_bits_per_copy=8 * PIECE)
        value_pieces = cute.logical_divide(cute.recast_tensor(values, cutlass.Uint8), (None, PIECE))
        if inside:
            cute.copy(store, cute.recast_tensor(packed, cutlass.Uint8), value_pieces[row, (None, column // PIECE)])
            if tidx % LANES == 0:
                scales[row, column_block] = scale


class SquaredReluRowQuantizeSm90(RowQuantizeSm90):
    """The squared-ReLU form: x a pre-activation h (m, k), prob (m,) in prob_dtype, and the
    rows quantized relu(h)**2 * prob, formed in float32."""

    def __init__(self, k: int, dtype, prob_dtype):
        super().__init__(k, dtype)
        prob_dtype = np.dtype(prob_dtype)
        if prob_dtype not in e4m3.ELEMENT_TYPES:
            raise TypeError(f"the row quantizer takes bfloat16, float16 or float32 prob, got {prob_dtype.name}")
        self.prob_dtype = prob_dtype

    def operands(self) -> list[KernelOperand]:
        """x (m, k), prob (m,), values (m, k) e4m3, scales (m, ceil(k / 128)) float32."""
        x, values, scales = super().operands()
        return [x, KernelOperand("prob", "input", self.prob_dtype, (M,)), values, scales]

    @cute.jit
    def __call__(self, stream: cuda.CUstream, x: cute.Tensor, prob: cute.Tensor, values: cute.Tensor,
                 scales: cute.Tensor):
        self.kernel(x, prob, values, scales).launch(grid=self._grid(x), block=[THREADS, 1, 1], stream=stream)
