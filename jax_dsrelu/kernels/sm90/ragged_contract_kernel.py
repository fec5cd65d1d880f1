"""Ragged-contraction grouped GEMM for Hopper (sm_90a), in CuTe DSL: the weight gradients.

Math, over expert e's rows [start_e, end_e) (rows contiguous per expert, in expert order):

    out[e, i, j] = sum_{r in [start_e, end_e)} lhs[r, i] rhs[r, j]
                   float32 accumulation of bf16/fp16 products, rounded once to out's dtype

lhs (m, a) and rhs (m, b) are row-major, so both GEMM operands are MN-major (the
contraction runs over their slow mode): dW1[e] = x_e^T dh_e and dW2[e] = act_e^T dy_e of
a squared-ReLU expert MLP, with no transposed copy of x, dh, act or dy.

Features:
    - A variant of the family's base (`gemm_base.GemmSm90`), both operands MN-major.
    - Persistent, warp-specialized: one CTA per multiprocessor walks output tiles
      (expert, 128-row block of a, tile_n-column block of b) from `schedule.ContractSchedule`,
      which the producer warp and the consumer warpgroups ask in the same order. At
      fine-grained MoE shapes an expert has a few hundred rows, a tile only a few
      k-tiles: the operand pipeline's state carries from one tile to the next, so warp 0
      streams the next tile's k-tiles while the consumers store the last one, and no
      tile pays a pipeline fill or drain.
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
    - Epilogue (`epilogue_store`): each (128 x epi_n) subtile is rounded once, written to
      shared memory and stored by TMA, which clips the box at a and b: widths that are
      not a tile multiple need no predication. The store is asynchronous: where shared
      memory holds a whole tile (store_stages >= subtiles), the tile is staged at once
      and its stores go out as one bulk group that drains under the next tile's wgmma
      (`store_tile`: two barriers per tile); else through a ring of store_stages
      subtile buffers (`store_subtile`).

Constraints:
    - lhs and rhs bfloat16 or float16 (same type); out float32, bfloat16 or float16
    - a and b multiples of 8 (16-byte TMA rows); 1 <= E <= 512; fewer than 2^30 rows
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.request import RaggedContractRequest
from jax_dsrelu.kernels.sm90 import epilogue_store, mainloop, schedule
from jax_dsrelu.kernels.sm90.config import ContractConfig
from jax_dsrelu.kernels.sm90.gemm_base import GemmSm90


class RaggedContractSm90(GemmSm90):
    """The kernel for one static configuration; `__call__` is the host function the JAX
    bridge runs: (stream, lhs as (a, m), rhs as (b, m), group_sizes (E,), out as (a, b, E))."""

    tables = GemmSm90.tables + ("expert_order",)

    def __init__(self, config: ContractConfig, request: RaggedContractRequest):
        super().__init__(config, request.num_experts)
        self.a = request.a
        self.b = request.b
        self.a_tiles = (self.a + config.tile_m - 1) // config.tile_m
        self.b_tiles = (self.b + config.tile_n - 1) // config.tile_n
        self._check_pairs_up(self.b_tiles, f"b={self.b}")
        # A shared buffer for every subtile: the whole tile is stored at once.
        self.whole_tile = config.store_stages >= config.subtiles

    @cute.jit
    def __call__(self, stream: cuda.CUstream, lhs: cute.Tensor, rhs: cute.Tensor,
                 group_sizes: cute.Tensor, out: cute.Tensor):
        self.out_dtype = out.element_type
        # lhs seen as (a, m) and rhs as (b, m): a and b contiguous, the MN-major case.
        tiled_mma, a_layout, b_layout = self._mma(lhs.element_type, LayoutEnum.COL_MAJOR, LayoutEnum.COL_MAJOR)
        # out as (a, b, E) has b contiguous: row-major tiles of (a, b).
        d_layout = self._epi_layout(self.out_dtype, self.config.store_stages)
        tma_a, tma_lhs = self._tma_load(mainloop.ragged_view(lhs, 1), a_layout, (self.tile_m, self.tile_k),
                                        self.config.cluster_n)
        tma_b, tma_rhs = self._tma_load(mainloop.ragged_view(rhs, 1), b_layout, (self.tile_n, self.tile_k))
        tma_d, tma_out = self._tma_store(out, d_layout)
        self.shared_storage = self._shared_storage(
            a_layout, b_layout, {}, {"sD": (self.out_dtype, cute.cosize(d_layout))}
        )
        # Whole clusters, no more than there are work items.
        cluster_n = self.config.cluster_n
        work = self.num_experts * self.a_tiles * (self.b_tiles // cluster_n)
        self._launch(
            self.kernel(tma_a, tma_lhs, tma_b, tma_rhs, tma_d, tma_out, group_sizes, cute.size(lhs, mode=[1]),
                        tiled_mma, a_layout, b_layout, d_layout),
            min(work, self.config.max_ctas // cluster_n) * cluster_n, stream,
        )

    @cute.kernel
    def kernel(
        self,
        # (TMA atom, tensor) pairs: the operands and out
        tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
        tma_d: cute.CopyAtom, mOut: cute.Tensor,
        mGroupSizes: cute.Tensor, num_rows: Int32,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch([tma_a, tma_b, tma_d])
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = self._operand_pipeline(storage, a_layout, b_layout)
        row_start, _ = self._publish_tables(storage, mGroupSizes, num_rows, self.tile_k)
        expert_order = self._table(storage, "expert_order")
        schedule.rank_experts_by_size(row_start, expert_order, tidx, self.num_experts, self.threads)
        cute.arch.sync_threads()
        sA = self._smem(storage.sA, a_layout)
        sB = self._smem(storage.sB, b_layout)

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load_operands(tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, self._schedule(row_start, expert_order))
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            self.consume(tiled_mma, sA, sB, self._smem(storage.sD, d_layout), ab_pipeline, tma_d, mOut,
                         self._schedule(row_start, expert_order), tidx - 128)

    def _schedule(self, row_start, expert_order) -> schedule.ContractSchedule:
        """A role's own walk of the work items (`_cluster_walk`)."""
        first, stride, rank = self._cluster_walk()
        return schedule.ContractSchedule(
            row_start, expert_order, self.num_experts, self.a_tiles, self.b_tiles,
            first, stride, self.config.cluster_n, rank, self.config.a_fastest,
        )

    @cute.jit
    def load_operands(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, work_schedule):
        """Warp 0: the k-tiles of every work item, in schedule order, through one ring
        whose state carries across items."""
        state = self._producer_state(self.config.ab_stages)
        while work_schedule.valid():
            expert, a_tile, b_tile, first_row, expert_rows = work_schedule.tile()
            # (tile, tile_k, k-tiles) of the expert's rows, clipped at its last row.
            gA = cute.local_tile(
                mainloop.expert_rows(mA, 1, first_row, expert_rows), (self.tile_m, self.tile_k), (a_tile, None)
            )
            gB = cute.local_tile(
                mainloop.expert_rows(mB, 1, first_row, expert_rows), (self.tile_n, self.tile_k), (b_tile, None)
            )
            # The CTAs of a cluster share the a-block: each loads its slice of it for all.
            tAsA, tAgA = mainloop.tma_partition(tma_a, sA, gA, work_schedule.rank, self.config.cluster_n)
            tBsB, tBgB = mainloop.tma_partition(tma_b, sB, gB)
            k_tiles = (expert_rows + (self.tile_k - 1)) // self.tile_k
            state = mainloop.load_k_tiles(tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles,
                                          self.config.cluster_n)
            work_schedule.advance()
        ab_pipeline.producer_tail(state)

    @cute.jit
    def consume(self, tiled_mma, sA, sB, sD, ab_pipeline, tma_d, mOut, work_schedule, ctid: Int32):
        """Consumer warpgroups: per work item, the wgmma mainloop, then the tile's stores
        (`store_tile` or `store_subtile`), which drain under the next item's wgmma."""
        tCrA, tCrB, _, acc = self._mma_fragments(tiled_mma, sA, sB, ctid)
        _, tiled_r2s, thr_r2s, sub_shape = self._store_copy(tiled_mma, self.out_dtype, ctid)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_rAcc = tiled_r2s.retile(acc)
        tRS_rD = cute.make_rmem_tensor(sub_shape, Float32)
        tRS_rDout = cute.make_rmem_tensor(sub_shape, self.out_dtype)
        sub_values = cute.size(tRS_rD)

        # With a buffer per subtile, a tile's stores are one bulk group (one stage).
        store_pipeline = self._store_pipeline(1 if cutlass.const_expr(self.whole_tile) else self.config.store_stages)
        read_state, release_state = self._consumer_states()
        store_count = Int32(0)
        while work_schedule.valid():
            expert, a_tile, b_tile, first_row, expert_rows = work_schedule.tile()
            k_tiles = (expert_rows + (self.tile_k - 1)) // self.tile_k
            read_state, release_state = mainloop.mma_k_tiles(
                tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state, k_tiles
            )
            # (tile_m, epi_n, b / epi_n) of out[expert]'s a-block; TMA clips at a and b.
            gOut = cute.local_tile(mOut[None, None, expert], (self.tile_m, self.epi_n), (a_tile, None))
            if cutlass.const_expr(self.whole_tile):
                epilogue_store.store_tile(
                    tiled_r2s, tRS_rAcc, tRS_rD, tRS_rDout, tRS_sD, tma_d, gOut, sD, store_pipeline,
                    b_tile * self.subtiles, ctid, self.subtiles, self.consumer_threads,
                )
            else:
                outputs = [(tRS_rD, tRS_rDout, tRS_sD, tma_d, gOut, sD)]
                for subtile in cutlass.range_constexpr(self.subtiles):
                    for v in cutlass.range_constexpr(sub_values):
                        tRS_rD[v] = tRS_rAcc[subtile * sub_values + v]
                    store_count = self._store_subtile(tiled_r2s, outputs, store_pipeline, store_count, b_tile,
                                                      subtile, ctid)
            work_schedule.advance()
        if ctid == 0:
            store_pipeline.producer_tail()
