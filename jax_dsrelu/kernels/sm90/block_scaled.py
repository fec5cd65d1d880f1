"""What a kernel of the family on FP8_BLOCKWISE operands adds to its 16-bit variant: the
two scale operands and the promoted mainloop (`promoted_mainloop.py`).

A variant mixes `BlockScaledMainloop` in before its 16-bit kernel class and names the
request field that says its operands are block-scaled (`scaled_flag`) and its scale
operands: `a_scale` (rows, K blocks), one per row of A and 128 of K, and `b_scale`
(E, N blocks, K blocks), one per 128 x 128 block of B stored (E, N, K). The config's
k-tile is one K block and its N tile at most one N block (`config.BLOCK`), so each
k-tile of a work tile has one B scale and a scale per row, or, in a variant taking wide
tiles, WIDE_TILE_N columns over two N blocks; the 16-bit variant's epilogue then reads the
promoted float32 accumulator as it reads its own.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from jax_dsrelu.kernels.operands import KernelOperand
from jax_dsrelu.kernels.sm90 import promoted_mainloop
from jax_dsrelu.kernels.sm90.config import BLOCK, WIDE_TILE_N

_F32 = np.dtype(np.float32)


def check_block_scaled(kernel: str, config, request, scaled_flag: str, wide_tiles: bool = False) -> None:
    """What every FP8_BLOCKWISE kernel asks: a request whose `scaled_flag` is set, k-tiles
    of one scale block along K and N tiles of at most one; with `wide_tiles`, N tiles of
    WIDE_TILE_N columns too (promoted between the batches, or with overlap_promotion in
    column halves)."""
    if not getattr(request, scaled_flag):
        raise ValueError(f"{kernel} serves requests with {scaled_flag}=True, got False")
    wide = wide_tiles and config.tile_n == WIDE_TILE_N
    if config.tile_k != BLOCK or (config.tile_n > BLOCK and not wide):
        widths = f"tile_n <= {BLOCK}" + (f" or {WIDE_TILE_N}" if wide_tiles else "")
        raise ValueError(f"{kernel} needs tile_k={BLOCK} and {widths} (the scale blocks a k-tile's promotion reads), "
                         f"got tile_k={config.tile_k}, tile_n={config.tile_n}, "
                         f"overlap_promotion={config.overlap_promotion}")


class BlockScaledMainloop:
    """Mixin (before the 16-bit kernel class): the scale operands, after `scales_after`
    in the declaration, and the promoted mainloop."""

    a_scale: str
    b_scale: str
    scaled_flag: str  # the request's field saying its operands are FP8_BLOCKWISE
    # With the config's overlap_promotion: each k-tile's batch split into the tile's two
    # column halves (`mma_k_tiles_promoted_in_halves`, the registers of the waited form),
    # where a kernel keeps too much live across its mainloop for a second whole buffer
    # (the fused kernel's epilogue state); else a second buffer of the whole tile
    # (`mma_k_tiles_promoted_overlapped`).
    promotion_by_column_halves = False
    # Whether the variant takes N tiles of WIDE_TILE_N (`mma_k_tiles_promoted` given `wide`;
    # with the config's overlap_promotion, `mma_k_tiles_promoted_in_halves` given it: two
    # whole buffers of 192 columns beside the total would spill).
    wide_tiles = False
    scales_after = "group_sizes"

    def __init__(self, config, request):
        check_block_scaled(type(self).__name__, config, request, self.scaled_flag, self.wide_tiles)
        super().__init__(config, request)

    def operands(self) -> list[KernelOperand]:
        plan = super().operands()
        after = next(i for i, o in enumerate(plan) if o.name == self.scales_after) + 1
        plan[after:after] = [self.declare(self.a_scale, "input", _F32), self.declare(self.b_scale, "input", _F32)]
        return plan

    def schema_sizes(self) -> dict[str, int]:
        # The scales' p and q: the BLOCK-wide blocks of n and k.
        return dict(super().schema_sizes(), p=-(-self.n // BLOCK), q=-(-self.k // BLOCK))

    def kernel_params(self, t) -> dict:
        return dict(super().kernel_params(t), a_scale=getattr(t, self.a_scale), b_scale=getattr(t, self.b_scale))

    def promotes_in_halves(self) -> bool:
        """Whether the promotion runs beside the wgmma in column halves (`promotion_by_column_halves`)."""
        return self.config.overlap_promotion and (self.promotion_by_column_halves or self.tile_n > BLOCK)

    def mainloop_setup(self, ctx, sA, sB) -> None:
        if cutlass.const_expr(self.promotes_in_halves()):
            ctx.column_halves = promoted_mainloop.column_halves(self, ctx.ctid, sA, sB)

    def mainloop(self, ctx, item, tile, read_state, release_state):
        """The promoted mainloop with this thread's two rows' scales (a row past m reads
        row 0's, never stored); both warpgroups multiply every tile. The partial-sum
        buffers are the work item's registers."""
        row0, _ = self._tile_rows(tile)
        num_rows = self.num_rows(ctx.params)
        rows = []
        for h in range(len(ctx.tile_row)):
            row = row0 + ctx.tile_row[h]
            rows.append(Int32(cutlass.select_(row < num_rows, row, Int32(0))))
        n_block = (tile.n_tile * self.tile_n) // BLOCK
        scales = (ctx.params.a_scale, rows, ctx.params.b_scale, tile.expert, n_block)
        wide = None
        if cutlass.const_expr(self.tile_n > BLOCK):
            # The tile's second N block (clamped to the last, whose columns past n are zeros never
            # stored); columns [64, 128) lie in it unless the tile starts on a block's edge.
            last_block = -(-self.n // BLOCK) - 1
            wide = (Int32(cutlass.min(n_block + 1, last_block)), (tile.n_tile * self.tile_n) % BLOCK != 0)
        if self.promotes_in_halves():
            half_blocks = [cute.make_rmem_tensor(ctx.column_halves.shape, Float32) for _ in range(2)]
            return promoted_mainloop.mma_k_tiles_promoted_in_halves(
                ctx, half_blocks, read_state, release_state, self.k_tiles, *scales, wide)
        if self.config.overlap_promotion:
            blocks = [cute.make_rmem_tensor(ctx.tCcAcc.shape, Float32) for _ in range(2)]
            return promoted_mainloop.mma_k_tiles_promoted_overlapped(
                ctx, blocks, read_state, release_state, self.k_tiles, *scales)
        return promoted_mainloop.mma_k_tiles_promoted(
            ctx, cute.make_rmem_tensor(ctx.tCcAcc.shape, Float32), read_state, release_state, self.k_tile_count(tile),
            *scales, wide)
