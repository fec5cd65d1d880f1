"""The ragged-M grouped GEMM on FP8_BLOCKWISE operands, for Hopper (sm_90a), in CuTe DSL.

Math, with e(i) the expert owning row i and b the K blocks of 128:

    acc[i, j] = sum over b of (lhs[i, b] . rhs[e(i)][j, b]) * lhs_scale[i, b] * rhs_scale[e(i), j // 128, b]

each block's partial sum of e4m3 products formed by wgmma and promoted to float32 before
it is scaled and added, block after block (`promoted_mainloop.py`); then the epilogues of
the 16-bit kernel (`ragged_matmul_kernel.py`): out = acc, or h = acc (+ bias) and
act = relu(h)^2 prob, rounded once to the 16-bit output.

Operands: lhs (m, k) and rhs (E, n, k) e4m3, both K-major as Hopper's FP8 wgmma reads
them; lhs_scale (m, ceil(k / 128)) and rhs_scale (E, ceil(n / 128), ceil(k / 128))
float32, as `quantization.blockwise.quantize_blockwise` makes them. A k-tile is one K
block (128 e4m3, a 128-byte swizzle row) and an N tile at most one N block (128
columns), so each k-tile of a tile has one weight scale and a row scale per row.
A partial last K block is zero-filled by TMA past k, and its scale is its own.

Constraints (`config.cannot_implement_gemm`): rhs_layout "nk", n and k multiples of 16
(16-byte TMA rows), 16-bit outputs, 1 <= E <= 512, fewer than 2^30 rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Int32

from jax_dsrelu.kernels.operands import M, KernelOperand
from jax_dsrelu.kernels.request import RaggedMatmulRequest
from jax_dsrelu.kernels.sm90 import promoted_mainloop
from jax_dsrelu.kernels.sm90.config import BLOCK, GemmConfig
from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90, UpProjectionContext

_F32 = np.dtype(np.float32)


@dataclasses.dataclass(eq=False, slots=True)
class BlockScaledContext(UpProjectionContext):
    acc_blocks: Any = None  # K blocks' partial sums before their promotion: one, or two in turn


class BlockScaledRaggedGemmSm90(RaggedGemmSm90):
    """The 16-bit ragged-M GEMM's epilogues over a promoted FP8 mainloop."""

    context_type = BlockScaledContext

    def __init__(self, config: GemmConfig, request: RaggedMatmulRequest):
        if not request.block_scaled:
            raise ValueError(f"{type(self).__name__} serves block-scaled requests, got block_scaled=False")
        if config.tile_k != BLOCK or config.tile_n > BLOCK:
            raise ValueError(f"the FP8 GEMM needs tile_k={BLOCK} and tile_n <= {BLOCK} (one scale per k-tile), "
                             f"got tile_k={config.tile_k}, tile_n={config.tile_n}")
        super().__init__(config, request)

    def operands(self) -> list[KernelOperand]:
        """The 16-bit kernel's declaration on e4m3 lhs and rhs, with lhs_scale (m, K
        blocks) and rhs_scale (E, N blocks, K blocks) after group_sizes."""
        plan = super().operands()
        k_blocks, n_blocks = -(-self.k // BLOCK), -(-self.n // BLOCK)
        after = next(i for i, o in enumerate(plan) if o.name == "group_sizes") + 1
        plan[after:after] = [
            KernelOperand("lhs_scale", "input", _F32, (M, k_blocks)),
            KernelOperand("rhs_scale", "input", _F32, (self.num_experts, n_blocks, k_blocks)),
        ]
        return plan

    def kernel_params(self, t) -> dict:
        return dict(super().kernel_params(t), lhs_scale=t.lhs_scale, rhs_scale=t.rhs_scale)

    # ---------------------------------------------------------------- device side

    def epilogue_setup(self, ctx) -> None:
        super().epilogue_setup(ctx)
        buffers = 2 if self.config.overlap_promotion else 1
        ctx.acc_blocks = [cute.make_rmem_tensor(ctx.tCcAcc.shape, cutlass.Float32) for _ in range(buffers)]

    def mainloop(self, ctx, item, tile, read_state, release_state):
        """The promoted mainloop (`promoted_mainloop.mma_k_tiles_promoted`), with this
        thread's two rows' scales: a row past m reads row 0's (never stored)."""
        row0, _ = self._tile_rows(tile)
        rows = []
        for h in range(len(ctx.tile_row)):
            row = row0 + ctx.tile_row[h]
            rows.append(Int32(cutlass.select_(row < ctx.params.num_rows, row, Int32(0))))
        n_block = (tile.n_tile * self.tile_n) // BLOCK
        if self.config.overlap_promotion:
            return promoted_mainloop.mma_k_tiles_promoted_overlapped(
                ctx.tiled_mma, ctx.acc, ctx.acc_blocks, ctx.tCrA, ctx.tCrB, ctx.ab_pipeline, read_state,
                release_state, self.k_tiles, ctx.params.lhs_scale, rows, ctx.params.rhs_scale, tile.expert, n_block,
            )
        return promoted_mainloop.mma_k_tiles_promoted(
            ctx.tiled_mma, ctx.acc, ctx.acc_blocks[0], ctx.tCrA, ctx.tCrB, ctx.ab_pipeline, read_state, release_state,
            self.k_tile_count(tile), ctx.params.lhs_scale, rows, ctx.params.rhs_scale, tile.expert, n_block,
        )
