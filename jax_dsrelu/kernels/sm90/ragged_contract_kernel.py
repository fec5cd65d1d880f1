"""Ragged-contraction grouped GEMM for Hopper (sm_90a), in CuTe DSL: the weight gradients.

Math, over expert e's rows [start_e, end_e) (rows contiguous per expert, in expert order):

    out[e, i, j] = sum_{r in [start_e, end_e)} lhs[r, i] rhs[r, j]
                   float32 accumulation of bf16/fp16 products, rounded once to out's dtype

lhs (m, a) and rhs (m, b) are row-major, so both GEMM operands are MN-major (the
contraction runs over their slow mode): dW1[e] = x_e^T dh_e and dW2[e] = act_e^T dy_e of
a squared-ReLU expert MLP, with no transposed copy of x, dh, act or dy.

Features:
    - Persistent, warp-specialized: one CTA per multiprocessor walks output tiles
      (expert, 128-row block of a, tile_n-column block of b) from `schedule.ContractSchedule`,
      which the producer warp and the consumer warpgroups ask in the same order. At
      fine-grained MoE shapes an expert has a few hundred rows, a tile only a few
      k-tiles: the operand pipeline's state carries from one tile to the next, so warp 0
      streams the next tile's k-tiles while the consumers store the last one, and no
      tile pays a pipeline fill or drain.
    - Work order: experts largest first (the longest tiles start first, the short ones
      fill the tail), an expert's tiles b-block fastest (CTAs in flight share its lhs
      block in L2).
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
    - a and b multiples of 8 (16-byte TMA rows); 1 <= E <= 256; fewer than 2^30 rows
"""

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.group_tables import build_expert_tables
from jax_dsrelu.kernels.sm90 import epilogue_store, mainloop, schedule
from jax_dsrelu.kernels.sm90.config import ContractConfig


class RaggedContractSm90:
    """The kernel for one static configuration; `__call__` is the host function the JAX
    bridge runs: (stream, lhs as (a, m), rhs as (b, m), group_sizes (E,), out as (a, b, E))."""

    producer_warps = 4  # warpgroup 0: warp 0 issues the TMA loads
    consumer_warps = 8  # warpgroups 1 and 2, 64 rows of the tile each
    threads = 128 * 3
    producer_registers = 40
    consumer_registers = 232

    def __init__(self, config: ContractConfig, *, num_experts: int, a: int, b: int):
        self.config = config
        self.num_experts = num_experts
        self.a = a
        self.b = b
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.epi_n = config.epi_n
        self.subtiles = config.subtiles
        self.a_tiles = (a + config.tile_m - 1) // config.tile_m
        self.b_tiles = (b + config.tile_n - 1) // config.tile_n
        # A shared buffer for every subtile: the whole tile is stored at once.
        self.whole_tile = config.store_stages >= config.subtiles
        self.consumer_threads = 32 * self.consumer_warps

    @cute.jit
    def __call__(self, stream: cuda.CUstream, lhs: cute.Tensor, rhs: cute.Tensor,
                 group_sizes: cute.Tensor, out: cute.Tensor):
        self.ab_dtype = lhs.element_type
        self.out_dtype = out.element_type
        # lhs seen as (a, m) and rhs as (b, m): a and b contiguous, the MN-major case.
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.MN,
            cute.nvgpu.OperandMajorMode.MN,
            Float32,
            (2, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        a_layout = sm90_utils.make_smem_layout_a(LayoutEnum.COL_MAJOR, tile_mnk, self.ab_dtype, self.config.ab_stages)
        b_layout = sm90_utils.make_smem_layout_b(LayoutEnum.COL_MAJOR, tile_mnk, self.ab_dtype, self.config.ab_stages)
        epi_tile = (self.tile_m, self.epi_n)
        # out as (a, b, E) has b contiguous: row-major tiles of (a, b).
        d_layout = sm90_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, epi_tile, self.config.store_stages
        )
        tma_a, tma_lhs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mainloop.ragged_view(lhs, 1),
            cute.slice_(a_layout, (None, None, 0)), (self.tile_m, self.tile_k),
        )
        tma_b, tma_rhs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mainloop.ragged_view(rhs, 1),
            cute.slice_(b_layout, (None, None, 0)), (self.tile_n, self.tile_k),
        )
        tma_d, tma_out = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), out, cute.slice_(d_layout, (None, None, 0)), epi_tile,
        )
        self.shared_storage = self._shared_storage(a_layout, b_layout, d_layout)
        num_rows = cute.size(lhs, mode=[1])
        work = self.num_experts * self.a_tiles * self.b_tiles
        self.kernel(
            tma_a, tma_lhs, tma_b, tma_rhs, tma_d, tma_out, group_sizes, num_rows, tiled_mma,
            a_layout, b_layout, d_layout,
        ).launch(
            grid=[min(work, self.config.max_ctas), 1, 1],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _shared_storage(self, a_layout, b_layout, d_layout):
        experts = self.num_experts + 1
        ab_stages = self.config.ab_stages
        ab_dtype = self.ab_dtype
        out_dtype = self.out_dtype

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, ab_stages * 2]
            row_start: cute.struct.MemRange[Int32, experts]
            tile_start: cute.struct.MemRange[Int32, experts]
            expert_order: cute.struct.MemRange[Int32, experts]
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[out_dtype, cute.cosize(d_layout)], 1024]

        return SharedStorage

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d: cute.CopyAtom,
        mOut: cute.Tensor,
        mGroupSizes: cute.Tensor,
        num_rows: Int32,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
        d_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        grid, _, _ = cute.arch.grid_dim()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_d)

        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_barriers.data_ptr(),
            num_stages=self.config.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_warps),
            tx_count=cute.size_in_bytes(self.ab_dtype, cute.slice_(a_layout, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_layout, (None, None, 0))),
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        row_start = storage.row_start.get_tensor(cute.make_layout(self.num_experts + 1))
        tile_start = storage.tile_start.get_tensor(cute.make_layout(self.num_experts + 1))
        expert_order = storage.expert_order.get_tensor(cute.make_layout(self.num_experts + 1))
        if warp_idx == self.producer_warps:
            build_expert_tables(mGroupSizes, num_rows, row_start, tile_start, self.num_experts, self.tile_k)
        # Publishes the barrier initialisation and the expert tables to every warp.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        schedule.rank_experts_by_size(row_start, expert_order, tidx, self.num_experts)
        cute.arch.sync_threads()
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                work_schedule = self._schedule(row_start, expert_order, bidx, grid)
                self.load_operands(tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, work_schedule)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            sD = storage.sD.get_tensor(d_layout.outer, swizzle=d_layout.inner)
            work_schedule = self._schedule(row_start, expert_order, bidx, grid)
            self.consume(tiled_mma, sA, sB, sD, ab_pipeline, tma_d, mOut, work_schedule, tidx - 128)

    def _schedule(self, row_start, expert_order, bidx, grid) -> schedule.ContractSchedule:
        """A role's own walk of the work items, from this CTA's first."""
        return schedule.ContractSchedule(
            row_start, expert_order, self.num_experts, self.a_tiles, self.b_tiles, bidx, grid
        )

    @cute.jit
    def load_operands(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, work_schedule):
        """Warp 0: the k-tiles of every work item, in schedule order, through one ring
        whose state carries across items."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.ab_stages)
        while work_schedule.valid():
            expert, a_tile, b_tile, first_row, expert_rows = work_schedule.locate()
            # (tile, tile_k, k-tiles) of the expert's rows, clipped at its last row.
            gA = cute.local_tile(
                mainloop.expert_rows(mA, 1, first_row, expert_rows), (self.tile_m, self.tile_k), (a_tile, None)
            )
            gB = cute.local_tile(
                mainloop.expert_rows(mB, 1, first_row, expert_rows), (self.tile_n, self.tile_k), (b_tile, None)
            )
            tAsA, tAgA = mainloop.tma_partition(tma_a, sA, gA)
            tBsB, tBgB = mainloop.tma_partition(tma_b, sB, gB)
            k_tiles = (expert_rows + (self.tile_k - 1)) // self.tile_k
            state = mainloop.load_k_tiles(tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles)
            work_schedule.advance()
        ab_pipeline.producer_tail(state)

    @cute.jit
    def consume(self, tiled_mma, sA, sB, sD, ab_pipeline, tma_d, mOut, work_schedule, ctid: Int32):
        """Consumer warpgroups: per work item, the wgmma mainloop, then the tile's stores
        (`store_tile` or `store_subtile`), which drain under the next item's wgmma."""
        # wgmma fragments are per warpgroup: slice the tiled MMA by warpgroup for A/B/C.
        thr_mma_wg = tiled_mma.get_slice(cute.make_layout(2, stride=128)(ctid // 128))
        tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
        tCcAcc = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_rmem_tensor(tCcAcc.shape, Float32)

        # stmatrix for 16-bit outputs, plain shared-memory stores for float32; both in the
        # accumulator's thread layout, so a subtile is a contiguous run of the retiled
        # accumulator's values.
        tiled_copy_c = cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.out_dtype), tiled_mma
        )
        tiled_r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, Float32), tiled_copy_c
        )
        thr_r2s = tiled_r2s.get_slice(ctid)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_rAcc = tiled_r2s.retile(acc)
        sub_shape = thr_r2s.partition_S(cute.make_identity_tensor((self.tile_m, self.epi_n))).shape
        tRS_rD = cute.make_rmem_tensor(sub_shape, Float32)
        tRS_rDout = cute.make_rmem_tensor(sub_shape, self.out_dtype)
        sub_values = cute.size(tRS_rD)

        # With a buffer per subtile, a tile's stores are one bulk group (one stage).
        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=1 if cutlass.const_expr(self.whole_tile) else self.config.store_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
        )
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)
        store_count = Int32(0)
        while work_schedule.valid():
            expert, a_tile, b_tile, first_row, expert_rows = work_schedule.locate()
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
                    epilogue_store.store_subtile(
                        tiled_r2s, outputs, store_pipeline, store_count, b_tile * self.subtiles + subtile, ctid,
                        self.config.store_stages, self.consumer_threads,
                    )
                    store_count = store_count + 1
            work_schedule.advance()
        if ctid == 0:
            store_pipeline.producer_tail()
