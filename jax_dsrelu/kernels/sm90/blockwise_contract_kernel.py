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
lhs_scale (G, a) and rhs_scale (G, b). They are staged (`GemmSm90.staged_inputs`): the
producer loads a k-tile's run of each, the tile's tile_m rows' and tile_n columns' scales
of its group (zeros past a or b), by TMA into the k-tile's stage beside its operands, so
they arrive stages ahead with them; each consumer thread reads its two rows' and its
tile_n / 4 column slots' from there while the k-tile's batch runs.

Constraints (`config.cannot_implement_contract`): a and b multiples of 16 (16-byte TMA
rows of e4m3), out float32 or 16-bit, 1 <= E <= 512.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32

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
        return dict(group_sizes=t.padded_sizes, num_rows=cute.size(t.lhs_k_major, mode=[1]))

    def staged_inputs(self) -> dict[str, int]:
        """A k-tile's scales of the tile's rows (of lhs) and columns (of rhs)."""
        return {"lhs_scale": self.tile_m, "rhs_scale": self.tile_n}

    def staged_view(self, name: str, tensor: cute.Tensor) -> cute.Tensor:
        """The scales (G, x) as (x, G): a group's scales are contiguous."""
        return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=[1, 0]))

    def staged_tiles(self, name: str, view: cute.Tensor, tile, params) -> cute.Tensor:
        """The tile's run of each of the expert's groups, from its first (`first_row` / 128)."""
        index = tile.m_tile if name == "lhs_scale" else tile.n_tile
        extent = self.staged_inputs()[name]
        return cute.local_tile(cute.domain_offset((0, tile.first_row // BLOCK), view), (extent, 1), (index, None))

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
        """The promoted mainloop with the staged scales of this thread's two rows of the
        tile and its column slots (a row or column past a or b reads a staged zero: its
        operand rows are zero-filled too, and it is never stored)."""
        row_scales, column_scales = ctx.staged
        if self.config.overlap_promotion:
            half_blocks = [cute.make_rmem_tensor(ctx.column_halves.shape, Float32) for _ in range(2)]
            # Per half: the thread's two row scales, then one per column slot (tile_n / 2 columns, 4 a slot).
            scales = [cute.make_rmem_tensor(2 + self.tile_n // 8, Float32) for _ in range(2)]
            return promoted_mainloop.mma_k_tiles_promoted_by_column_in_halves(
                ctx, half_blocks, scales, read_state, release_state, self.k_tile_count(tile), row_scales, ctx.tile_row,
                column_scales, ctx.tCcAcc[0][1])
        # The tile's column of the first of the thread's values in each column slot (fragment.column_slot).
        columns = [ctx.tCcAcc[slot % 2 + 4 * (slot // 2)][1] for slot in range(cute.size(ctx.acc) // 2)]
        return promoted_mainloop.mma_k_tiles_promoted_by_column(
            ctx, cute.make_rmem_tensor(ctx.tCcAcc.shape, Float32), read_state, release_state, self.k_tile_count(tile),
            row_scales, ctx.tile_row, column_scales, columns)
