"""Ragged-contraction grouped GEMM for Hopper (sm_90a), in CuTe DSL: the weight gradients.

Math, over expert e's rows [start_e, end_e) (rows contiguous per expert, in expert order):

    out[e, i, j] = sum_{r in [start_e, end_e)} lhs[r, i] rhs[r, j]
                   float32 accumulation of bf16/fp16 products, rounded once to out's dtype

lhs (m, a) and rhs (m, b) are row-major, so both GEMM operands are MN-major (the
contraction runs over their slow mode): dW1[e] = x_e^T dh_e and dW2[e] = act_e^T dy_e of
a squared-ReLU expert MLP, with no transposed copy of x, dh, act or dy.

Features:
    - A variant of the family's skeleton (`gemm_base.GemmSm90`), both operands MN-major
      (the declared mode order), with the contraction's work schedule: one CTA per
      multiprocessor walks output tiles (expert, 128-row block of a, tile_n-column block
      of b) from `schedule.ContractSchedule`. At fine-grained MoE shapes an expert has a
      few hundred rows, a tile only a few k-tiles: the operand pipeline's state carries
      from one tile to the next, so warp 0 streams the next tile's k-tiles while the
      consumers store the last one, and no tile pays a pipeline fill or drain.
    - Work order: experts largest first (the longest tiles start first, the short ones
      fill the tail), an expert's tiles b-block fastest (CTAs in flight share its lhs
      block in L2) or, with `a_fastest`, a-block fastest (they share its rhs block).
    - Deterministic by construction: each output element has exactly one writer (its
      tile's CTA) and is summed over its expert's rows in one fixed order (k-tile by
      k-tile, wgmma's own order within a k-tile), with no split-K and no atomics.
    - Expert e's rows are a ragged view of lhs and rhs (`mainloop.ragged_view` on the row
      mode): the TMA box of the last k-tile is clipped at the expert's last row, so the
      next expert's rows load as zeros and never enter the sum; no row outside every
      expert is ever read into one. An expert with no rows runs no mainloop and stores
      zeros.
    - Epilogue: the accumulator, each (128 x epi_n) subtile rounded once and stored by
      TMA, which clips the box at a and b: widths that are not a tile multiple need no
      predication. Where shared memory holds a whole tile (store_stages >= subtiles), the
      tile is staged at once and its stores go out as one bulk group that drains under
      the next tile's wgmma (`whole_tile`: two barriers per tile); else through a ring of
      store_stages subtile buffers.

Constraints:
    - lhs and rhs bfloat16 or float16 (same type); out float32, bfloat16 or float16
    - a and b multiples of 8 (16-byte TMA rows); 1 <= E <= 512; fewer than 2^30 rows
"""

import dataclasses
from typing import Any

import cutlass.cute as cute
import numpy as np
from cutlass import Int32

from jax_dsrelu.kernels.operands import KernelOperand
from jax_dsrelu.kernels.request import RaggedContractRequest
from jax_dsrelu.kernels.sm90 import mainloop, schedule
from jax_dsrelu.kernels.sm90.config import ContractConfig
from jax_dsrelu.kernels.sm90.epilogue_context import EpilogueContext
from jax_dsrelu.kernels.sm90.gemm_base import GemmSm90
from jax_dsrelu.primitive_schema import RAGGED_CONTRACT

_I32 = np.dtype(np.int32)


@dataclasses.dataclass(eq=False, slots=True)
class ContractContext(EpilogueContext):
    acc_r2s: Any = None  # the accumulator retiled for the store copy, read subtile by subtile


class RaggedContractSm90(GemmSm90):
    """The kernel for one static configuration: the contraction's walk over output tiles,
    its operands' ragged row views, and an epilogue that stores the accumulator."""

    operand_a = "lhs"
    operand_b = "rhs"
    tables = GemmSm90.tables + ("expert_order",)
    context_type = ContractContext

    def __init__(self, config: ContractConfig, request: RaggedContractRequest):
        super().__init__(config, request.num_experts)
        self.check_operand_bytes(request.operand_dtype)
        self.request = request
        self.a = request.a
        self.b = request.b
        self.a_blocks = (self.a + config.tile_m - 1) // config.tile_m
        self.b_blocks = (self.b + config.tile_n - 1) // config.tile_n
        self._check_pairs_up(self.b_blocks, f"b={self.b}")
        # A shared buffer for every subtile: the whole tile is stored at once.
        self.whole_tile = config.store_stages >= config.subtiles

    def operands(self) -> list[KernelOperand]:
        """lhs (m, a) and rhs (m, b), seen as (a, m) and (b, m): a and b contiguous, the
        MN-major case; group_sizes; out (E, a, b), seen as (a, b, E)."""
        r, declare = self.request, self.declare
        return [
            declare("lhs", "input", r.operand_dtype, mode=(1, 0)),
            declare("rhs", "input", r.operand_dtype, mode=(1, 0)),
            declare("group_sizes", "input", _I32),
            declare("out", "output", r.out_dtype, mode=(1, 2, 0)),
        ]

    primitive_schema = RAGGED_CONTRACT

    def schema_sizes(self) -> dict[str, int]:
        return dict(e=self.num_experts, a=self.a, b=self.b)

    def stored_outputs(self) -> tuple[str, ...]:
        return ("out",)

    # ------------------------------------------------------------------ host side

    def a_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return mainloop.ragged_view(tensor, 1)

    def b_view(self, tensor: cute.Tensor) -> cute.Tensor:
        return mainloop.ragged_view(tensor, 1)

    def kernel_params(self, t) -> dict:
        return dict(group_sizes=t.group_sizes, num_rows=cute.size(t.lhs, mode=[1]))

    def grid(self, t) -> int:
        """Whole clusters, no more than there are work items."""
        cluster_n = self.config.cluster_n
        work = self.num_experts * self.a_blocks * (self.b_blocks // cluster_n)
        return min(work, self.config.max_ctas // cluster_n) * cluster_n

    # ---------------------------------------------------------------- device side

    def publish_schedule(self, storage, params, num_rows: Int32, tidx: Int32):
        """(row_start, expert_order): the expert tables (of tile_k-row k-tiles), and the
        experts ranked largest first."""
        row_start, _ = self._publish_tables(storage, params.group_sizes, num_rows, self.tile_k)
        expert_order = self._table(storage, "expert_order")
        schedule.rank_experts_by_size(row_start, expert_order, tidx, self.num_experts, self.threads)
        cute.arch.sync_threads()
        return row_start, expert_order

    def make_schedule(self, tables, num_rows: Int32) -> schedule.ContractSchedule:
        """A role's own walk of the work items (`_cluster_walk`)."""
        row_start, expert_order = tables
        first, stride, rank = self._cluster_walk()
        return schedule.ContractSchedule(
            row_start, expert_order, self.num_experts, self.a_blocks, self.b_blocks,
            first, stride, self.config.cluster_n, rank, self.config.a_fastest,
        )

    def a_tiles(self, mA: cute.Tensor, tile: schedule.ContractTile, params) -> cute.Tensor:
        """(tile_m, tile_k, k-tiles) of the expert's rows of lhs at the a-block, clipped at
        its last row."""
        rows = mainloop.expert_rows(mA, 1, tile.first_row, tile.rows)
        return cute.local_tile(rows, (self.tile_m, self.tile_k), (tile.m_tile, None))

    def b_tiles(self, mB: cute.Tensor, tile: schedule.ContractTile, params) -> cute.Tensor:
        rows = mainloop.expert_rows(mB, 1, tile.first_row, tile.rows)
        return cute.local_tile(rows, (self.tile_n, self.tile_k), (tile.n_tile, None))

    def k_tile_count(self, tile: schedule.ContractTile) -> Int32:
        return (tile.rows + (self.tile_k - 1)) // self.tile_k

    def store_views(self, outputs, tile: schedule.ContractTile):
        """out[expert]'s a-block as (tile_m, epi_n, b / epi_n); TMA clips at a and b."""
        return [
            output._replace(gmem=cute.local_tile(output.gmem[None, None, tile.expert], (self.tile_m, self.epi_n),
                                                 (tile.m_tile, None)))
            for output in outputs
        ]

    def epilogue_setup(self, ctx) -> None:
        ctx.acc_r2s = ctx.tiled_r2s.retile(ctx.acc)

    def epilogue_visit(self, ctx, item, tile, subtile: int) -> None:
        """out = acc, rounded once when stored."""
        tRS_rD = ctx.registers[0]
        for v in range(ctx.sub_values):
            tRS_rD[v] = ctx.acc_r2s[subtile * ctx.sub_values + v]
