"""The fixed-order reduction pass of deterministic mode, shared by the GPU backends.

A deterministic GEMM kernel writes every dprob partial to its own (slot, row) entry and
every dbias partial to its own (tile, column) entry, each with exactly one writer. This
pass then sums the slots in one documented order, so dprob and dbias are bitwise the same
from run to run whatever order the GEMM's CTAs ran in:

    dprob[i]    = (...((slot[0, i] + slot[1, i]) + slot[2, i]) ... + slot[S_p - 1, i])
                  for a row i owned by an expert, 0 for a row owned by none;
    dbias[e, j] = (...(tile[T_e, j] + tile[T_e + 1, j]) ... + tile[T_e + c_e - 1, j])
                  with c_e = ceil(size_e / tile_m) and T_e = c_0 + ... + c_{e-1}; 0 for an
                  empty expert.

Each slot value is converted to float32 before it is added; the sums are float32.
Sizes are clamped as in `jax_dsrelu.groups`, in the slots' row space R (the row extent of
dprob_slots): negative sizes count as 0 and the running total stops at R. Tile rows past
the extent of dbias_slots are never read.

Python interface (stable; both backends call it from their own `@cute.jit` host function,
on the stream their GEMM ran on, after it):

    SlotReduction(num_experts=E, tile_m=tile_m)(
        dprob_slots,  # (S_p, R) float32 (or 16-bit float), any strides
        dbias_slots,  # (S_b, n) float32 (or 16-bit float), any strides, or None
        group_sizes,  # (E,) int32, sizes in the slots' row space
        dprob,        # (R,) float32 output
        dbias,        # (E, n) float32 output, or None
        stream,
    )
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from jax_dsrelu.kernels.group_tables import build_expert_tables


class SlotReduction:
    """One launch: blocks [0, ceil(R / 256)) reduce dprob rows, the rest reduce dbias,
    one (expert, 256-column block) each. Reads are coalesced along rows and columns."""

    threads = 256

    def __init__(self, *, num_experts: int, tile_m: int):
        if num_experts < 1:
            raise ValueError(f"num_experts must be positive, got {num_experts}")
        if tile_m < 1:
            raise ValueError(f"tile_m must be positive, got {tile_m}")
        self.num_experts = num_experts
        self.tile_m = tile_m

    @cute.jit
    def __call__(
        self,
        dprob_slots: cute.Tensor,
        dbias_slots: Optional[cute.Tensor],
        group_sizes: cute.Tensor,
        dprob: cute.Tensor,
        dbias: Optional[cute.Tensor],
        stream: cuda.CUstream,
    ):
        num_rows = cute.size(dprob_slots, mode=[1])
        row_blocks = (num_rows + (self.threads - 1)) // self.threads
        grid = row_blocks
        if cutlass.const_expr(dbias is not None):
            col_blocks = (cute.size(dbias, mode=[1]) + (self.threads - 1)) // self.threads
            grid = row_blocks + self.num_experts * col_blocks

        @cute.struct
        class Tables:
            row_start: cute.struct.MemRange[Int32, self.num_experts + 1]
            tile_start: cute.struct.MemRange[Int32, self.num_experts + 1]

        self.tables = Tables
        self.kernel(dprob_slots, dbias_slots, group_sizes, dprob, dbias, row_blocks).launch(
            grid=[cutlass.max(grid, Int32(1)), 1, 1],
            block=[self.threads, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(self, dprob_slots: cute.Tensor, dbias_slots: Optional[cute.Tensor], group_sizes: cute.Tensor,
               dprob: cute.Tensor, dbias: Optional[cute.Tensor], row_blocks: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_rows = cute.size(dprob_slots, mode=[1])

        storage = cutlass.memory.SmemAllocator().allocate(self.tables)
        row_start = storage.row_start.get_tensor(cute.make_layout(self.num_experts + 1))
        tile_start = storage.tile_start.get_tensor(cute.make_layout(self.num_experts + 1))
        if warp_idx == 0:
            build_expert_tables(
                group_sizes, num_rows, row_start, tile_start, self.num_experts, self.tile_m
            )
        cute.arch.sync_threads()

        if bidx < row_blocks:
            row = bidx * self.threads + tidx
            if row < num_rows:
                total = Float32(0.0)
                if row < row_start[self.num_experts]:
                    # Slot order 0, 1, ..., S_p - 1: the documented order.
                    # Unrolled so that the slots' loads are in flight together.
                    for slot in cutlass.range(cute.size(dprob_slots, mode=[0]), unroll=8):
                        total = total + dprob_slots[slot, row].to(Float32)
                dprob[row] = total
        else:
            if cutlass.const_expr(dbias is not None):
                n = cute.size(dbias, mode=[1])
                col_blocks = (n + (self.threads - 1)) // self.threads
                block = bidx - row_blocks
                expert = block // col_blocks
                col = (block - expert * col_blocks) * self.threads + tidx
                if col < n:
                    first = tile_start[expert]
                    stop = cutlass.min(tile_start[expert + 1], cute.size(dbias_slots, mode=[0]))
                    total = Float32(0.0)
                    # Tile order T_e, T_e + 1, ...: the documented order.
                    for tile in cutlass.range(first, stop, unroll=8):
                        total = total + dbias_slots[tile, col].to(Float32)
                    dbias[expert, col] = total
