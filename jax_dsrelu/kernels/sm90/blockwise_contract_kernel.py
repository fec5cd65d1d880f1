"""The ragged contraction on FP8_BLOCKWISE operands, the FP8 recipe's weight gradients,
for Hopper (sm_90a), in CuTe DSL.

Math, over expert e's groups g of 128 rows (the groups restart at each expert,
`quantization.ragged`):

    out[e, i, j] = sum over g of (lhs_g[:, i] . rhs_g[:, j]) * lhs_scale[g, i] * rhs_scale[g, j]

each group's partial sum of e4m3 products formed by wgmma over one k-tile and promoted
to float32 before it is scaled and added, group after group
(`promoted_mainloop.mma_k_tiles_promoted_by_column`, or with `overlap_promotion` each
group's batch split by columns, one half promoted while the other's batch runs:
`mma_k_tiles_promoted_by_column_in_halves`); then stored as the 16-bit
contraction stores it (`ragged_contract_kernel.py`), whose walk and epilogue it keeps.

Operands: Hopper's FP8 wgmma reads both operands K-major, and the contraction's K is the
rows, so the kernel reads K-major copies of lhs and rhs, (a, R) and (b, R), in which each
group of rows has 128 of its own (`quantization.ragged.padded_sources`; a partial
group's other rows are zeros), R = 128 G for the primitive's G groups. The call makes them
from the primitive's row-major operands (`contract_layout.py`). An expert's padded size
(`padded_sizes`) is then a multiple of 128 and its k-tiles are its groups: k-tile t of the
expert starting at padded row r0 is group r0 / 128 + t, whose scales are the primitive's
lhs_scale (G, a) and rhs_scale (G, b). Each thread loads, per k-tile, its two rows' scales
and one scale per column slot of its accumulator (tile_n / 4 of them, a group's scales
contiguous along b).

Constraints (`config.cannot_implement_contract`): a and b multiples of 16 (16-byte TMA
rows of e4m3), out float32 or 16-bit, 1 <= E <= 512.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from jax_dsrelu.kernels.operands import M, KernelOperand, Rows
from jax_dsrelu.kernels.request import RaggedContractRequest
from jax_dsrelu.kernels.sm90 import promoted_mainloop
from jax_dsrelu.kernels.sm90.block_scaled import check_block_scaled
from jax_dsrelu.kernels.sm90.config import BLOCK, ContractConfig
from jax_dsrelu.kernels.sm90.ragged_contract_kernel import RaggedContractSm90

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


class BlockScaledContractSm90(RaggedContractSm90):
    """The 16-bit contraction's walk and epilogue over a mainloop promoting each group of
    rows with its per-row and per-column scales."""

    operand_a = "lhs_k_major"
    operand_b = "rhs_k_major"

    def __init__(self, config: ContractConfig, request: RaggedContractRequest):
        # A k-tile is one group of rows; a thread holds a scale per column of its tile.
        check_block_scaled(type(self).__name__, config, request, "block_scaled")
        super().__init__(config, request)

    def operands(self) -> list[KernelOperand]:
        """lhs and rhs as K-major copies (a, R) and (b, R), the count R the padded rows;
        the padded group sizes; the primitive's scales (G, a), (G, b), G = R / 128; out
        (E, a, b), seen as (a, b, E)."""
        r, declare = self.request, self.declare
        return [
            KernelOperand("lhs_k_major", "input", r.operand_dtype, (self.a, M)),
            KernelOperand("rhs_k_major", "input", r.operand_dtype, (self.b, M)),
            KernelOperand("padded_sizes", "input", _I32, (self.num_experts,)),
            declare("lhs_scale", "input", _F32),
            declare("rhs_scale", "input", _F32),
            declare("out", "output", r.out_dtype, mode=(1, 2, 0)),
        ]

    def schema_sizes(self) -> dict:
        # The groups: one per 128 of the padded rows.
        return dict(super().schema_sizes(), g=Rows(per=BLOCK))

    def kernel_params(self, t) -> dict:
        return dict(group_sizes=t.padded_sizes, num_rows=cute.size(t.lhs_k_major, mode=[1]),
                    lhs_scale=t.lhs_scale, rhs_scale=t.rhs_scale)

    # The copies are read as they are: every expert's rows are whole groups of 128 there, so
    # no TMA box needs clipping at an expert's end, and the 16-bit kernel's ragged view,
    # whose extra strides along a contiguous mode are not multiples of 16 bytes, cannot
    # describe them to TMA.

    def a_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor

    def b_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return tensor

    def a_tiles(self, mA: cute.Tensor, tile, params) -> cute.Tensor:
        """(tile_m, tile_k, k-tiles) of the a-block, from the expert's first padded row."""
        return cute.local_tile(cute.domain_offset((0, tile.first_row), mA), (self.tile_m, self.tile_k),
                               (tile.m_tile, None))

    def b_tiles(self, mB: cute.Tensor, tile, params) -> cute.Tensor:
        return cute.local_tile(cute.domain_offset((0, tile.first_row), mB), (self.tile_n, self.tile_k),
                               (tile.n_tile, None))

    def mainloop_setup(self, ctx, sA, sB) -> None:
        """With the overlapped promotion, the wgmma over half the tile's columns and its
        fragments of the rings, B's split into the tile's two column halves."""
        if cutlass.const_expr(self.config.overlap_promotion):
            ctx.column_halves = promoted_mainloop.column_halves(self, ctx.ctid, sA, sB)

    def mainloop(self, ctx, item, tile, read_state, release_state):
        """The promoted mainloop with this thread's two rows of the a-block and its
        columns of the b-block (a row or column past a or b reads row 0's scales, or with
        the overlapped promotion a column past b reads column b - 1's: its operand rows
        are zero-filled and it is never stored)."""
        rows = []
        for h in range(len(ctx.tile_row)):
            row = tile.m_tile * self.tile_m + ctx.tile_row[h]
            rows.append(Int32(cutlass.select_(row < self.a, row, Int32(0))))
        if self.config.overlap_promotion:
            half_blocks = [cute.make_rmem_tensor(ctx.column_halves.shape, Float32) for _ in range(2)]
            # Per half: the thread's two row scales, then one per column slot (tile_n / 2 columns, 4 a slot).
            scales = [cute.make_rmem_tensor(2 + self.tile_n // 8, Float32) for _ in range(2)]
            first_column = tile.n_tile * self.tile_n + ctx.tCcAcc[0][1]
            return promoted_mainloop.mma_k_tiles_promoted_by_column_in_halves(
                ctx, half_blocks, scales, read_state, release_state, self.k_tile_count(tile), ctx.params.lhs_scale, rows,
                ctx.params.rhs_scale, first_column, Int32(self.b - 1), tile.first_row // BLOCK)
        columns = []
        for slot in range(cute.size(ctx.acc) // 2):
            # The first of the thread's values in column slot `slot` (fragment.column_slot).
            column = tile.n_tile * self.tile_n + ctx.tCcAcc[slot % 2 + 4 * (slot // 2)][1]
            columns.append(Int32(cutlass.select_(column < self.b, column, Int32(0))))
        return promoted_mainloop.mma_k_tiles_promoted_by_column(
            ctx, cute.make_rmem_tensor(ctx.tCcAcc.shape, Float32), read_state, release_state, self.k_tile_count(tile),
            ctx.params.lhs_scale, rows, ctx.params.rhs_scale, columns, tile.first_row // BLOCK)
