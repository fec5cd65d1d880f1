"""The FP8 weight gradients' operands quantized straight into their K-major copies, for
Hopper (sm_90a), in CuTe DSL: `quantization.ragged.quantize_ragged_rows` and the K-major
copy (`k_major_copy_kernel.py`) in one pass over a 16- or 32-bit operand.

Math, with x (m, n) bfloat16, float16 or float32, first_rows (G + 1,) the first row of
each group of `quantization.ragged` (`ragged.group_first_rows`), rows_g =
min(first_rows[g + 1], m) - first_rows[g] and X_g = x[first_rows[g] : first_rows[g] + rows_g]:

    amax[g, c]   = max over i < rows_g of |X_g[i, c]| where finite, else 0
    scales[g, c] = the recipe's scale of amax (`quantization.blockwise`: amax / 448 by a
                   product, at least float32's smallest normal, 1 where amax is 0, NaN
                   where X_g[:, c] holds a NaN or an infinity)
    k_major[c, g, i] = e4m3(X_g[i, c] / scales[g, c])   for i < rows_g (round to nearest
                   even, saturated to +-448; NaN where the scale is)
                       0                                 for the other i < 128

which is `quantize_ragged_rows`' scales and the copy of its values into the padded
layout, byte for byte but for the sign of a NaN (an e4m3 NaN is 0x7F or 0xFF alike),
where XLA divides as IEEE asks (XLA:CPU); XLA:GPU's float32 division (div.full.f32) can
put a quotient an ulp off, and a value a step of e4m3 away (`quantization.blockwise`).
A CTA of 128 threads takes one group and one 128-byte line of its rows (64 columns of a
16-bit operand, 32 of float32), and moves them in whole lines both ways. First,
neighbouring threads load one row's line (eight 16-byte loads, all of a thread's issued
before the first is used; zeros past the group's rows and past n) and store it as it is
into a shared tile. After a barrier, eight neighbouring threads take one column, 16 rows
each: each widens its values to float32 and takes their maximum, the eight's by warp
shuffles (a maximum is exact in any order); then each quantizes its 16 rows and stores
their 16 bytes (one 16-byte store, the eight together a 128-byte line), and the first of
them the scale. Every output byte is written once, by one thread: the same bits on every
run.

The tile holds the operand's own bytes, 128 rows of 128 (16 KB, as the copy kernel's: a
widened float32 tile took twice that and held an SM to half the CTAs), with row r's
16-byte slot c kept at c ^ (r // 16): a warp's reads in the second phase (four
neighbouring columns, one slot, in eight row ranges r // 16 = 0 .. 7) then fall on eight
distinct slots' banks, one wavefront, and its stores in the first (four rows' 512 bytes)
on four wavefronts, the least for 512 bytes.

The division is IEEE's (div.rn.f32, zero kept out of it: `e4m3.quotient`), the conversion
`cvt.rn.satfinite.e4m3x2.f32`:
saturating is the recipe's clamp to +-448 (x / scale exceeds 448 by an ulp at most,
and rounds to 448 either way), and a NaN converts to a NaN.

Constraints (`contract_layout.quantize_by_kernel` refuses the rest): n a positive
multiple of 16, m > 0.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32

from jax_dsrelu.kernels.operands import M, KernelOperand, Rows
from jax_dsrelu.kernels.sm90 import e4m3

BLOCK = 128  # rows of a group, threads of a CTA
LINE = 128  # bytes of a CTA's columns in a row, and of a row of the tile
CHUNKS = LINE // e4m3.VECTOR_BYTES  # 16-byte chunks of a line (8): threads loading one row
PASS_ROWS = BLOCK // CHUNKS  # rows the CTA's threads load at a time (16), and of a swizzle range of the tile
PASSES = BLOCK // PASS_ROWS
PARTS = 8  # threads sharing a column in the second phase, 16 rows each (a 128-byte line of k_major)
PART_ROWS = BLOCK // PARTS
PASS_COLUMNS = BLOCK // PARTS  # columns the CTA's threads take at a time in the second phase (16)
_I32 = np.dtype(np.int32)
_F32 = np.dtype(np.float32)
_E4M3 = np.dtype("float8_e4m3fn")


class KMajorQuantizeSm90:
    """The pass for one static configuration: the operand's width n, E experts and its dtype."""

    def __init__(self, n: int, num_experts: int, dtype):
        dtype = np.dtype(dtype)
        if dtype not in e4m3.ELEMENT_TYPES:
            raise TypeError(f"the K-major quantizer takes bfloat16, float16 or float32 rows, got {dtype.name}")
        self.n, self.num_experts, self.dtype = n, num_experts, dtype
        self.element = e4m3.ELEMENT_TYPES[dtype]
        self.per_load = e4m3.VECTOR_BYTES // dtype.itemsize  # elements of a 16-byte load
        self.columns = LINE // dtype.itemsize  # columns of a CTA: one line of each row

    def operands(self) -> list[KernelOperand]:
        """x (m, n), first_rows (G + 1,) int32, k_major (n, G, 128) e4m3 (the (n, 128 G)
        copy, each group's 128 bytes a mode of their own, as the copy kernel writes it),
        scales (G, n) float32; G = ceil(m / 128) + E (`ragged.max_groups`)."""
        groups = Rows(per=BLOCK, plus=self.num_experts)
        return [
            KernelOperand("x", "input", self.dtype, (M, self.n)),
            KernelOperand("first_rows", "input", _I32, (Rows(per=BLOCK, plus=self.num_experts + 1),)),
            KernelOperand("k_major", "output", _E4M3, (self.n, groups, BLOCK)),
            KernelOperand("scales", "output", _F32, (groups, self.n)),
        ]

    @cute.jit
    def __call__(self, stream: cuda.CUstream, x: cute.Tensor, first_rows: cute.Tensor, k_major: cute.Tensor,
                 scales: cute.Tensor):
        groups = cute.size(first_rows, mode=[0]) - 1

        @cute.struct
        class Storage:
            tile: cute.struct.Align[cute.struct.MemRange[self.element, BLOCK * self.columns], 16]

        self.storage = Storage
        column_blocks = (self.n + self.columns - 1) // self.columns
        self.kernel(x, first_rows, k_major, scales).launch(grid=[groups, column_blocks, 1], block=[BLOCK, 1, 1],
                                                           stream=stream)

    @cute.kernel
    def kernel(self, x: cute.Tensor, first_rows: cute.Tensor, k_major: cute.Tensor, scales: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        group, column_block, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        # The tile row after row, and its 16-byte slots: slot 8 r + s is row r's slot s.
        tile = storage.tile.get_tensor(cute.make_layout(BLOCK * self.columns))
        tile_slots = cute.logical_divide(tile, self.per_load)
        first_column = column_block * self.columns
        first = first_rows[group]
        rows = cutlass.min(first_rows[group + 1], cute.size(x, mode=[0])) - first

        # Phase 1: thread t loads chunk t % 8 of rows t // 8 + 16 p, all of them before the first is
        # stored, so that a thread has every load in flight at once; zeros past the group's rows and past n.
        copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.element, num_bits_per_copy=8 * e4m3.VECTOR_BYTES)
        lane = tidx % CHUNKS
        loaded = cute.make_rmem_tensor(cute.make_layout((self.per_load, PASSES)), self.element)
        x_chunks = cute.logical_divide(x, (None, self.per_load))
        loaded.fill(0)
        for p in cutlass.range_constexpr(PASSES):
            row = tidx // CHUNKS + PASS_ROWS * p
            if row < rows and first_column + lane * self.per_load < self.n:
                cute.copy(copy, x_chunks[first + row, (None, first_column // self.per_load + lane)], loaded[None, p])
        for p in cutlass.range_constexpr(PASSES):
            row = tidx // CHUNKS + PASS_ROWS * p
            cute.copy(copy, loaded[None, p], tile_slots[None, row * CHUNKS + (lane ^ (row // PASS_ROWS))])
        cute.arch.sync_threads()

        # Phase 2: thread t takes rows [16 (t % 8), 16 (t % 8) + 16) of columns t // 8 + 16 p.
        part = tidx % PARTS
        write = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Uint16, num_bits_per_copy=8 * e4m3.VECTOR_BYTES)
        packed = cute.make_rmem_tensor(cute.make_layout(e4m3.VECTOR_BYTES // 2), cutlass.Uint16)
        values = cute.make_rmem_tensor(cute.make_layout(PART_ROWS), Float32)
        for p in cutlass.range_constexpr(self.columns // PASS_COLUMNS):
            column = tidx // PARTS + PASS_COLUMNS * p
            slot = (column // self.per_load) ^ part
            amax = Float32(0.0)
            special = cutlass.Int32(0)
            for r in cutlass.range_constexpr(PART_ROWS):
                value = tile[(part * PART_ROWS + r) * self.columns + slot * self.per_load + column % self.per_load].to(Float32)
                values[r] = value
                amax, special = e4m3.fold_magnitude(amax, special, value)
            # The column's eight parts are neighbouring lanes of one warp.
            amax, special = e4m3.across_lanes(amax, special, PARTS)
            scale = e4m3.recipe_scale(amax, special)
            global_column = first_column + column
            if global_column < self.n:
                if part == 0:
                    scales[group, global_column] = scale
                # Its rows' bytes; zeros past the group's rows.
                for k in cutlass.range_constexpr(PART_ROWS // 2):
                    row = part * PART_ROWS + 2 * k
                    low = e4m3.quotient(values[2 * k], scale)
                    high = e4m3.quotient(values[2 * k + 1], scale)
                    if row >= rows:
                        low = Float32(0.0)
                    if row + 1 >= rows:
                        high = Float32(0.0)
                    packed[k] = e4m3.e4m3x2(low, high)
                out_chunks = cute.logical_divide(k_major[global_column, group, None], e4m3.VECTOR_BYTES)
                cute.copy(write, packed, cute.recast_tensor(out_chunks[None, part], cutlass.Uint16))
