"""The FP8 weight gradients' K-major copy for Hopper (sm_90a), in CuTe DSL: a quantized
operand's rows gathered into the groups' padded layout and transposed, bytes only.

Math, with values (m, n) the e4m3 bits of a block-scaled operand, first_rows (G + 1,) the
first row of each group of `quantization.ragged` (`ragged.group_first_rows`) and
R = 128 G:

    k_major[c, 128 g + i] = values[first_rows[g] + i, c]   for i < first_rows[g + 1] - first_rows[g]
                            0                               for the other i < 128

the layout `contract_layout.py` makes (`ragged.padded_sources`), which the contraction's
kernel reads K-major (`blockwise_contract_kernel.py`). XLA:GPU writes it in one loop
fusion whose threads read across rows (docs/fp8-kernels.md, the step's record).

A CTA of 128 threads takes one group and 128 columns, a 128 x 128 byte tile, and moves it
in whole 128-byte lines both ways: eight neighbouring threads load one row's 128 bytes
(16-byte loads; zeros past the group's rows and past n), a warp four rows, into shared
memory; after a barrier, eight neighbouring threads store one column's 128 padded rows
(16-byte stores of 16 byte reads down the tile), a warp four columns. Every byte of
k_major is written once, by one thread, so the copy is the same on every run.

The tile is `byte_tile.py`'s, its 16-byte slots swizzled so that neither phase meets a
bank conflict.

Constraints (`contract_layout.copy_by_kernel` refuses the rest): n a positive multiple of
16 (16-byte rows of e4m3, as TMA asks of the contraction's operands), m > 0 (no rows, no
copy).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np

from jax_dsrelu.kernels.operands import M, KernelOperand, Rows
from jax_dsrelu.kernels.sm90 import byte_tile

BLOCK = 128  # rows of a group, columns of a CTA, threads of a CTA
VECTOR = 16  # bytes per load and store
CHUNKS = BLOCK // VECTOR  # 16-byte chunks of a tile row: threads sharing a row or a column (8)
PASS_ROWS = BLOCK // CHUNKS  # rows (columns) a pass of the CTA takes, and the rows of a swizzle range (16)
PASSES = BLOCK // PASS_ROWS  # rows (columns) a thread loads (stores), PASS_ROWS apart (8)
_U8 = np.dtype(np.uint8)
_I32 = np.dtype(np.int32)


class KMajorCopySm90:
    """The copy for one static configuration: the operand's width n and E experts."""

    def __init__(self, n: int, num_experts: int):
        self.n = n
        self.num_experts = num_experts

    def operands(self) -> list[KernelOperand]:
        """values (m, n) uint8, first_rows (G + 1,) int32, k_major (n, G, 128) uint8 (the
        (n, 128 G) copy, its groups a mode of their own so that every group's 128 bytes
        start at a multiple of 128 the compiler can see), G = ceil(m / 128) + E
        (`ragged.max_groups`)."""
        groups = Rows(per=BLOCK, plus=self.num_experts)
        return [
            KernelOperand("values", "input", _U8, (M, self.n)),
            KernelOperand("first_rows", "input", _I32, (Rows(per=BLOCK, plus=self.num_experts + 1),)),
            KernelOperand("k_major", "output", _U8, (self.n, groups, BLOCK)),
        ]

    @cute.jit
    def __call__(self, stream: cuda.CUstream, values: cute.Tensor, first_rows: cute.Tensor, k_major: cute.Tensor):
        groups = cute.size(first_rows, mode=[0]) - 1

        @cute.struct
        class Storage:
            tile: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, BLOCK * BLOCK], 16]

        self.storage = Storage
        column_blocks = (self.n + BLOCK - 1) // BLOCK
        self.kernel(values, first_rows, k_major).launch(grid=[groups, column_blocks, 1], block=[BLOCK, 1, 1],
                                                        stream=stream)

    @cute.kernel
    def kernel(self, values: cute.Tensor, first_rows: cute.Tensor, k_major: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        group, column_block, _ = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        # The tile's bytes, row after row, and their 16-byte slots: slot 8 r + s is row r's slot s.
        tile = storage.tile.get_tensor(cute.make_layout(BLOCK * BLOCK))
        tile_slots = cute.logical_divide(tile, VECTOR)
        copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Uint8, num_bits_per_copy=8 * VECTOR)
        chunk = cute.make_rmem_tensor(cute.make_layout(VECTOR), cutlass.Uint8)
        first_column = column_block * BLOCK
        first = first_rows[group]
        rows = cutlass.min(first_rows[group + 1], cute.size(values, mode=[0])) - first
        # (vector, chunks) views: chunk c of a row is its bytes [16 c, 16 c + 16).
        value_chunks = cute.logical_divide(values, (None, VECTOR))
        lane = tidx % CHUNKS
        # Phase 1: thread t loads chunk t % 8 of rows t // 8 + 16 p, all of them before the first is
        # stored, so that a thread has every load in flight at once; zeros past the group's rows and past n.
        loaded = cute.make_rmem_tensor(cute.make_layout((VECTOR, PASSES)), cutlass.Uint8)
        loaded.fill(0)
        for p in cutlass.range_constexpr(PASSES):
            row = tidx // CHUNKS + PASS_ROWS * p
            if row < rows and first_column + lane * VECTOR < self.n:
                cute.copy(copy, value_chunks[first + row, (None, first_column // VECTOR + lane)], loaded[None, p])
        for p in cutlass.range_constexpr(PASSES):
            row = tidx // CHUNKS + PASS_ROWS * p
            cute.copy(copy, loaded[None, p], tile_slots[None, byte_tile.slot_of(row, lane)])
        cute.arch.sync_threads()
        # Phase 2: thread t stores rows [16 (t % 8), 16 (t % 8) + 16) of columns t // 8 + 16 p.
        for p in cutlass.range_constexpr(PASSES):
            column = tidx // CHUNKS + PASS_ROWS * p
            if first_column + column < self.n:
                byte_tile.read_column_part(tile, column, lane, chunk)
                out_chunks = cute.logical_divide(k_major[first_column + column, group, None], VECTOR)
                cute.copy(copy, chunk, out_chunks[None, lane])
