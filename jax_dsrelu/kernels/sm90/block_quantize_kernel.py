"""Expert weights quantized in 128 x 128 blocks into both layouts their FP8 GEMMs read, for
Hopper (sm_90a), in CuTe DSL: `quantization.blockwise.quantize_blockwise` of w (E, N, K)
at the recipe's weight blocks, and the values' transpose, in one pass over w.

Math, with w (E, N, K) bfloat16, float16 or float32 and B_e,i,j its block of rows
[128 i, 128 i + 128) and columns [128 j, 128 j + 128) (partial at the far edges):

    amax[e, i, j]   = max |value| over B_e,i,j's finite values, 0 where there are none
    scales[e, i, j] = the recipe's scale of amax (`quantization.blockwise`: amax / 448 by a
                      product, at least float32's smallest normal, 1 where amax is 0, NaN
                      where the block holds a NaN or an infinity)
    values[e, r, c]     = e4m3(w[e, r, c] / scales[e, r // 128, c // 128])  (round to
                          nearest even, saturated to +-448; NaN where the scale is)
    transposed[e, c, r] = values[e, r, c]

which is `quantize_blockwise`'s values and scales byte for byte, but for the sign of a
NaN, where XLA divides as IEEE asks (XLA:CPU); XLA:GPU's division (div.full.f32) can put a
quotient an ulp off, and a value a step of e4m3 away (`quantization.blockwise`). The
blocks are square, so the transposed values' scales are `scales` transposed (the caller's
to take): the GEMMs that read w one way and the other read the same numbers.

A CTA of 256 threads takes one block. Each thread loads four pieces of 16 elements, each
by 16-byte loads (a piece is 32 bytes of bf16: a warp's first load instruction reads every
other 16 bytes of four whole rows and its second the rest, from the same sectors), keeps
them in registers and takes the maximum over them; warp shuffles and a shared-memory
exchange across the 8 warps give the block's (a maximum is exact in any order). Each
thread then quantizes its pieces, stores each as 16 bytes of `values` and into a shared
byte tile; after a barrier, eight neighbouring threads take one column of the tile, 16
rows each (16 byte loads from shared memory), and store them as one 128-byte line of
`transposed` row first_column + column (16-byte stores), a warp four lines. Every output
byte is written once, by one thread: the same bits on every run. w is read once and each
output written once: 2 + 2 bytes an element for 16-bit weights, the pass's least traffic.

The byte tile is `byte_tile.py`'s, its 16-byte slots swizzled so that neither the
pieces' stores nor the column reads meet a bank conflict. The division is IEEE's
(div.rn.f32, zero kept out of it: `e4m3.quotient`), the conversion
`cvt.rn.satfinite.e4m3x2.f32` (`e4m3.py`).

Constraints (`weight_quantize.quantize_by_kernel` refuses the rest): N and K positive
multiples of 16, so that every 16-byte piece lies whole inside w.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32

from jax_dsrelu.kernels.operands import KernelOperand
from jax_dsrelu.kernels.sm90 import byte_tile, e4m3

BLOCK = 128  # rows and columns of a block
THREADS = 256
PIECE = 16  # elements of a piece: 16 e4m3 bytes, one 16-byte store
PIECES = BLOCK * BLOCK // PIECE // THREADS  # pieces a thread loads (4)
SLOTS = BLOCK // PIECE  # 16-byte slots of a tile row (8)
PARTS = SLOTS  # threads storing one transposed row's 128 bytes, PART_ROWS rows of the block each (8)
PART_ROWS = BLOCK // PARTS  # rows of a part, and of a swizzle range of the tile (16)
WARPS = THREADS // 32
_E4M3 = np.dtype("float8_e4m3fn")
_F32 = np.dtype(np.float32)


class BlockQuantizeSm90:
    """The pass for one static configuration: E experts, w's N and K and its dtype."""

    def __init__(self, num_experts: int, n: int, k: int, dtype):
        dtype = np.dtype(dtype)
        if dtype not in e4m3.ELEMENT_TYPES:
            raise TypeError(f"the block quantizer takes bfloat16, float16 or float32 weights, got {dtype.name}")
        self.num_experts, self.n, self.k, self.dtype = num_experts, n, k, dtype
        self.element = e4m3.ELEMENT_TYPES[dtype]
        self.per_load = e4m3.VECTOR_BYTES // dtype.itemsize  # elements of a 16-byte load

    def operands(self) -> list[KernelOperand]:
        """w (E, N, K), values (E, N, K) e4m3, transposed (E, K, N) e4m3, scales
        (E, ceil(N / 128), ceil(K / 128)) float32."""
        e, n, k = self.num_experts, self.n, self.k
        return [
            KernelOperand("w", "input", self.dtype, (e, n, k)),
            KernelOperand("values", "output", _E4M3, (e, n, k)),
            KernelOperand("transposed", "output", _E4M3, (e, k, n)),
            KernelOperand("scales", "output", _F32, (e, -(-n // BLOCK), -(-k // BLOCK))),
        ]

    @cute.jit
    def __call__(self, stream: cuda.CUstream, w: cute.Tensor, values: cute.Tensor, transposed: cute.Tensor,
                 scales: cute.Tensor):
        @cute.struct
        class Storage:
            tile: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, BLOCK * BLOCK], 16]
            # Each warp's maximum and whether it saw a NaN or an infinity.
            amax: cute.struct.MemRange[Float32, WARPS]
            special: cute.struct.MemRange[cutlass.Int32, WARPS]

        self.storage = Storage
        grid = [(self.k + BLOCK - 1) // BLOCK, (self.n + BLOCK - 1) // BLOCK, self.num_experts]
        self.kernel(w, values, transposed, scales).launch(grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, w: cute.Tensor, values: cute.Tensor, transposed: cute.Tensor, scales: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        column_block, row_block, expert = cute.arch.block_idx()
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        # The byte tile row after row, and its 16-byte slots: slot 8 r + s is row r's slot s.
        tile = storage.tile.get_tensor(cute.make_layout(BLOCK * BLOCK))
        tile_slots = cute.logical_divide(tile, PIECE)
        warp_amax = storage.amax.get_tensor(cute.make_layout(WARPS))
        warp_special = storage.special.get_tensor(cute.make_layout(WARPS))
        first_row, first_column = row_block * BLOCK, column_block * BLOCK
        rows = cutlass.min(self.n - first_row, BLOCK)
        columns = cutlass.min(self.k - first_column, BLOCK)
        pieces_per_row = SLOTS

        # Phase 1: piece p = tidx + 256 q is row p // 8, columns 16 (p % 8) on: loaded, widened, its maximum.
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.element, num_bits_per_copy=8 * e4m3.VECTOR_BYTES)
        loaded = cute.make_rmem_tensor(cute.make_layout(PIECE), self.element)
        widened = cute.make_rmem_tensor(cute.make_layout((PIECE, PIECES)), Float32)
        w_loads = cute.logical_divide(w[expert, None, None], (None, self.per_load))
        loaded_loads = cute.logical_divide(loaded, self.per_load)
        amax = Float32(0.0)
        special = cutlass.Int32(0)
        for q in cutlass.range_constexpr(PIECES):
            piece = tidx + THREADS * q
            row, column = piece // pieces_per_row, (piece % pieces_per_row) * PIECE
            loaded.fill(0)
            if row < rows and column < columns:
                for v in cutlass.range_constexpr(PIECE // self.per_load):
                    cute.copy(load, w_loads[first_row + row, (None, (first_column + column) // self.per_load + v)],
                              loaded_loads[None, v])
            for i in cutlass.range_constexpr(PIECE):
                value = loaded[i].to(Float32)
                widened[i, q] = value
                amax, special = e4m3.fold_magnitude(amax, special, value)
        amax, special = e4m3.across_lanes(amax, special, 32)
        warp = tidx // 32
        if tidx % 32 == 0:
            warp_amax[warp] = amax
            warp_special[warp] = special
        cute.arch.sync_threads()
        for other in cutlass.range_constexpr(WARPS):
            amax = cute.arch.fmax(amax, warp_amax[other])
            special = special | warp_special[other]
        scale = e4m3.recipe_scale(amax, special)
        if tidx == 0:
            scales[expert, row_block, column_block] = scale

        # Phase 2: each piece quantized, to `values` and the byte tile, 16 bytes each.
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Uint8, num_bits_per_copy=8 * e4m3.VECTOR_BYTES)
        packed = cute.make_rmem_tensor(cute.make_layout(PIECE // 2), cutlass.Uint16)
        packed_bytes = cute.recast_tensor(packed, cutlass.Uint8)
        value_pieces = cute.logical_divide(cute.recast_tensor(values[expert, None, None], cutlass.Uint8), (None, PIECE))
        for q in cutlass.range_constexpr(PIECES):
            piece = tidx + THREADS * q
            row, column = piece // pieces_per_row, (piece % pieces_per_row) * PIECE
            for i in cutlass.range_constexpr(PIECE // 2):
                packed[i] = e4m3.e4m3x2(e4m3.quotient(widened[2 * i, q], scale),
                                         e4m3.quotient(widened[2 * i + 1, q], scale))
            cute.copy(store, packed_bytes, tile_slots[None, byte_tile.slot_of(row, column // PIECE)])
            if row < rows and column < columns:
                cute.copy(store, packed_bytes, value_pieces[first_row + row, (None, (first_column + column) // PIECE)])
        cute.arch.sync_threads()

        # Phase 3: thread t reads rows [16 (t % 8), 16 (t % 8) + 16) of the tile's columns t // 8 + 32 q,
        # stored as 16 bytes of `transposed` row first_column + column.
        part = tidx % PARTS
        column_piece = cute.make_rmem_tensor(cute.make_layout(PIECE), cutlass.Uint8)
        transposed_pieces = cute.logical_divide(cute.recast_tensor(transposed[expert, None, None], cutlass.Uint8),
                                                (None, PIECE))
        for q in cutlass.range_constexpr(BLOCK // (THREADS // PARTS)):
            column = tidx // PARTS + (THREADS // PARTS) * q
            byte_tile.read_column_part(tile, column, part, column_piece)
            if column < columns and part * PART_ROWS < rows:
                cute.copy(store, column_piece, transposed_pieces[first_column + column, (None, first_row // PIECE + part)])
