"""Ragged-M grouped GEMM for Hopper (sm_90a), in CuTe DSL, with a plain or squared-ReLU epilogue.

Math, with e(i) the expert owning row i (rows contiguous per expert, in expert order):

    acc[i, j] = lhs[i, :] . rhs[e(i)][:, j]        float32 accumulation, bf16/fp16 operands
    epilogue "none":  out[i, j] = acc              rounded once to out's dtype
    epilogue "srelu": h[i, j] = acc (+ bias[e, j]) rounded once to h's dtype;
                      act[i, j] = relu(h)^2 prob[i], from the rounded h (r keeps NaN:
                      relu is a select), rounded once
    rows owned by no expert: every output 0

It is the forward of a squared-ReLU expert MLP (the up-projection with its activation in
one kernel, then the down-projection) and its dx = dh @ W1[e]^T.

Features:
    - rhs read in place in either layout: stored (E, k, n) ("kn", N-major B, as W1 and
      W2 are for the forward) or (E, n, k) ("nk", K-major B, a weight read transposed);
      wgmma takes both from shared memory, so no transpose is ever materialized.
    - Persistent, warp-specialized: warp 0 streams lhs/rhs k-tiles with TMA into a
      multi-stage ring (`mainloop.load_k_tiles`), two consumer warpgroups (cooperative,
      64 rows each) issue wgmma (`mainloop.mma_k_tiles`), then run the epilogue in
      accumulator registers one (128 x epi_n) subtile at a time: stmatrix to shared
      memory, TMA store through the ragged row view clipped at the expert's last row.
    - Ragged groups from device memory (`group_tables`, `schedule`): no
      host sync, no padding; rows owned by no expert are extra work items storing zeros.
    - Deterministic by construction: every output element has one writer and one fixed
      summation order (the k loop), no atomics.

Constraints:
    - lhs and rhs bfloat16 or float16 (same type), outputs 16-bit float
    - n and k multiples of 8 (16-byte TMA rows); 1 <= E <= 256; fewer than 2^30 rows
"""

from typing import Optional

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
from jax_dsrelu.kernels.sm90.config import GemmConfig


class RaggedGemmSm90:
    """The kernel for one static configuration; `__call__` is the host function the JAX
    bridge runs: (stream, *inputs, *outputs) in the order documented on `__call__`."""

    producer_warps = 4  # warpgroup 0: warp 0 issues the TMA loads
    consumer_warps = 8  # warpgroups 1 and 2
    threads = 128 * 3
    producer_registers = 40
    consumer_registers = 232

    def __init__(self, config: GemmConfig, *, num_experts: int, n: int, k: int,
                 rhs_layout: str, epilogue: str, with_bias: bool):
        if rhs_layout not in ("kn", "nk"):
            raise ValueError(f"rhs_layout must be 'kn' or 'nk', got {rhs_layout!r}")
        if epilogue not in ("none", "srelu"):
            raise ValueError(f"epilogue must be 'none' or 'srelu', got {epilogue!r}")
        if with_bias and epilogue != "srelu":
            raise ValueError("a bias is added only by the 'srelu' epilogue")
        self.config = config
        self.num_experts = num_experts
        self.n = n
        self.k = k
        self.rhs_layout = rhs_layout
        self.srelu = epilogue == "srelu"
        self.with_bias = with_bias
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.tile_k = config.tile_k
        self.epi_n = config.epi_n
        self.subtiles = config.subtiles
        self.n_tiles = (n + config.tile_n - 1) // config.tile_n
        self.k_tiles = (k + config.tile_k - 1) // config.tile_k
        self.consumer_threads = 32 * self.consumer_warps

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(self, stream: cuda.CUstream, *tensors: cute.Tensor):
        """Launches the GEMM on `stream`.

        tensors, in order (ragged_call.py builds the same list):
            lhs (m, k), rhs as (n, k, E), group_sizes (E,) i32,
            [srelu: prob (m,) f32, [bias (E, n) f32]],
            out (m, n) (srelu: h), [srelu: act (m, n)]
        """
        lhs, rhs, group_sizes = tensors[:3]
        rest = list(tensors[3:])
        prob = None
        bias = None
        if cutlass.const_expr(self.srelu):
            prob = rest.pop(0)
            if cutlass.const_expr(self.with_bias):
                bias = rest.pop(0)
        out = rest.pop(0)
        act = rest.pop(0) if cutlass.const_expr(self.srelu) else None

        self.ab_dtype = lhs.element_type
        self.out_dtype = out.element_type
        # "kn": rhs as (n, k, E) has n contiguous (N-major B); "nk": k contiguous.
        b_enum = LayoutEnum.COL_MAJOR if cutlass.const_expr(self.rhs_layout == "kn") else LayoutEnum.ROW_MAJOR

        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype,
            self.ab_dtype,
            cute.nvgpu.OperandMajorMode.K,
            b_enum.sm90_mma_major_mode(),
            Float32,
            (2, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        a_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, tile_mnk, self.ab_dtype, self.config.ab_stages
        )
        b_layout = sm90_utils.make_smem_layout_b(b_enum, tile_mnk, self.ab_dtype, self.config.ab_stages)
        epi_tile = (self.tile_m, self.epi_n)
        d_layout = sm90_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, epi_tile, self.config.store_stages
        )

        tma_a, tma_lhs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), lhs, cute.slice_(a_layout, (None, None, 0)),
            (self.tile_m, self.tile_k),
        )
        tma_b, tma_rhs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), rhs, cute.slice_(b_layout, (None, None, 0)),
            (self.tile_n, self.tile_k),
        )
        tma_d, tma_out = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mainloop.ragged_view(out, 0),
            cute.slice_(d_layout, (None, None, 0)), epi_tile,
        )
        tma_act = None
        tma_act_tensor = None
        if cutlass.const_expr(self.srelu):
            tma_act, tma_act_tensor = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mainloop.ragged_view(act, 0),
                cute.slice_(d_layout, (None, None, 0)), epi_tile,
            )

        self.shared_storage = self._shared_storage(a_layout, b_layout, d_layout)

        num_rows = cute.size(lhs, mode=[0])
        m_tiles = (num_rows + (self.tile_m - 1)) // self.tile_m
        # Expert tiles are at most m_tiles + E and the zero-fill tiles at most m_tiles.
        max_work = (2 * m_tiles + self.num_experts) * self.n_tiles
        grid = cutlass.min(max_work, Int32(self.config.max_ctas))
        self.kernel(
            tma_a, tma_lhs, tma_b, tma_rhs, tma_d, tma_out, tma_act, tma_act_tensor,
            group_sizes, prob, bias, num_rows, tiled_mma, a_layout, b_layout, d_layout,
        ).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], min_blocks_per_mp=1, stream=stream)

    def _shared_storage(self, a_layout, b_layout, d_layout):
        experts = self.num_experts + 1
        ab_stages = self.config.ab_stages
        ab_dtype = self.ab_dtype
        out_dtype = self.out_dtype
        act_elems = cute.cosize(d_layout) if self.srelu else 1

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, ab_stages * 2]
            row_start: cute.struct.MemRange[Int32, experts]
            tile_start: cute.struct.MemRange[Int32, experts]
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[out_dtype, cute.cosize(d_layout)], 1024]
            sAct: cute.struct.Align[cute.struct.MemRange[out_dtype, act_elems], 1024]

        return SharedStorage

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_d: cute.CopyAtom,
        mD: cute.Tensor,
        tma_act: Optional[cute.CopyAtom],
        mAct: Optional[cute.Tensor],
        mGroupSizes: cute.Tensor,
        mProb: Optional[cute.Tensor],
        mBias: Optional[cute.Tensor],
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
            if cutlass.const_expr(self.srelu):
                cpasync.prefetch_descriptor(tma_act)

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
        if warp_idx == self.producer_warps:
            build_expert_tables(mGroupSizes, num_rows, row_start, tile_start, self.num_experts, self.tile_m)
        # Publishes the barrier initialisation and the expert tables to every warp.
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load_operands(tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, row_start, tile_start, bidx, grid)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            sD = storage.sD.get_tensor(d_layout.outer, swizzle=d_layout.inner)
            sAct = None
            if cutlass.const_expr(self.srelu):
                sAct = storage.sAct.get_tensor(d_layout.outer, swizzle=d_layout.inner)
            self.consume(
                tiled_mma, sA, sB, sD, sAct, ab_pipeline, tma_d, mD, tma_act, mAct, mProb, mBias,
                row_start, tile_start, num_rows, tidx - 128, bidx, grid,
            )

    @cute.jit
    def load_operands(self, tma_a, mA, tma_b, mB, sA, sB, ab_pipeline, row_start, tile_start,
                      bidx: Int32, grid: Int32):
        """Warp 0: the lhs/rhs k-tiles of every expert work item, in schedule order."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.ab_stages)
        expert_work = schedule.expert_work(tile_start, self.num_experts, self.n_tiles)
        work = bidx
        expert = Int32(0)
        while work < expert_work:
            expert, m_tile, n_tile, local_tile, first_row, expert_rows = schedule.locate(
                row_start, tile_start, work, expert, self.n_tiles
            )
            row0 = first_row + local_tile * self.tile_m
            # Rows past the expert are loaded and never stored; rows past m read as zeros.
            gA = cute.local_tile(cute.domain_offset((row0, 0), mA), (self.tile_m, self.tile_k), (0, None))
            gB = cute.local_tile(mB[None, None, expert], (self.tile_n, self.tile_k), (n_tile, None))
            tAsA, tAgA = mainloop.tma_partition(tma_a, sA, gA)
            tBsB, tBgB = mainloop.tma_partition(tma_b, sB, gB)
            state = mainloop.load_k_tiles(tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, self.k_tiles)
            work = work + grid
        ab_pipeline.producer_tail(state)

    @cute.jit
    def consume(
        self, tiled_mma, sA, sB, sD, sAct, ab_pipeline, tma_d, mD, tma_act, mAct, mProb, mBias,
        row_start, tile_start, num_rows: Int32, ctid: Int32, bidx: Int32, grid: Int32,
    ):
        """Consumer warpgroups: the wgmma mainloop, then the epilogue, per work item."""
        # wgmma fragments are per warpgroup: slice the tiled MMA by warpgroup for A/B/C.
        thr_mma_wg = tiled_mma.get_slice(cute.make_layout(2, stride=128)(ctid // 128))
        tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
        # (tile_m, tile_n) coordinates of this thread's accumulator values, and the values.
        tCcAcc = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        acc = cute.make_rmem_tensor(tCcAcc.shape, Float32)

        # Subtile value v is accumulator value subtile * sub_values + v (stmatrix layout).
        tiled_copy_c = cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.out_dtype), tiled_mma
        )
        tiled_r2s = cute.make_tiled_copy_S(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.out_dtype), tiled_copy_c
        )
        thr_r2s = tiled_r2s.get_slice(ctid)
        tRS_sD = thr_r2s.partition_D(sD)
        tRS_sAct = thr_r2s.partition_D(sAct) if cutlass.const_expr(self.srelu) else None
        sub_shape = thr_r2s.partition_S(cute.make_identity_tensor((self.tile_m, self.epi_n))).shape
        tRS_rD = cute.make_rmem_tensor(sub_shape, Float32)
        tRS_rDout = cute.make_rmem_tensor(sub_shape, self.out_dtype)
        tRS_rH = cute.make_rmem_tensor(sub_shape, Float32)  # the rounded h, back in float32
        tRS_rAct = cute.make_rmem_tensor(sub_shape, Float32)
        tRS_rActOut = cute.make_rmem_tensor(sub_shape, self.out_dtype)
        sub_values = cute.size(tRS_rD)

        store_pipeline = pipeline.PipelineTmaStore.create(
            num_stages=self.config.store_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
        )
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)
        release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)
        store_count = Int32(0)
        # This thread's two rows in the tile: accumulator values 0 and 2.
        tile_row = [tCcAcc[0][0], tCcAcc[2][0]]

        expert_work = schedule.expert_work(tile_start, self.num_experts, self.n_tiles)
        all_work = schedule.all_work(row_start, tile_start, num_rows, self.num_experts, self.n_tiles, self.tile_m)
        work = bidx
        expert = Int32(0)
        while work < all_work:
            if work < expert_work:
                expert, m_tile, n_tile, local_tile, first_row, expert_rows = schedule.locate(
                    row_start, tile_start, work, expert, self.n_tiles
                )
                row0 = first_row + local_tile * self.tile_m
                rows_valid = expert_rows - local_tile * self.tile_m
                prob = [Float32(0.0), Float32(0.0)]
                if cutlass.const_expr(self.srelu):
                    # Loaded before the mainloop so that the latency hides behind it. Rows
                    # past the expert may be past m: read row 0 for them (never stored).
                    for h in cutlass.range_constexpr(2):
                        valid = tile_row[h] < rows_valid
                        safe_row = Int32(cutlass.select_(valid, row0 + tile_row[h], Int32(0)))
                        prob[h] = mProb[safe_row]

                read_state, release_state = mainloop.mma_k_tiles(
                    tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state, self.k_tiles
                )

                outputs = self._outputs(tRS_rD, tRS_rDout, tRS_sD, tma_d, mD, sD, tRS_rAct, tRS_rActOut,
                                        tRS_sAct, tma_act, mAct, sAct, first_row, expert_rows, local_tile)
                for subtile in cutlass.range_constexpr(self.subtiles):
                    for v in cutlass.range_constexpr(sub_values):
                        tRS_rD[v] = acc[subtile * sub_values + v]
                    if cutlass.const_expr(self.srelu):
                        if cutlass.const_expr(self.with_bias):
                            for v in cutlass.range_constexpr(sub_values):
                                column = n_tile * self.tile_n + tCcAcc[subtile * sub_values + v][1]
                                safe_column = Int32(cutlass.select_(column < self.n, column, Int32(0)))
                                tRS_rD[v] = tRS_rD[v] + mBias[expert, safe_column]
                        # act is computed from h as stored: round first, then widen again.
                        tRS_rDout.store(tRS_rD.load().to(self.out_dtype))
                        tRS_rH.store(tRS_rDout.load().to(Float32))
                        for v in cutlass.range_constexpr(sub_values):
                            h = (v // 2) % 2
                            pre = tRS_rH[v]
                            # A select keeps NaN (NaN < 0 is false); fmax would drop it.
                            r = Float32(cutlass.select_(pre < Float32(0.0), Float32(0.0), pre))
                            tRS_rAct[v] = (r * r) * prob[h]
                    epilogue_store.store_subtile(
                        tiled_r2s, outputs, store_pipeline, store_count, n_tile * self.subtiles + subtile, ctid,
                        self.config.store_stages, self.consumer_threads,
                    )
                    store_count = store_count + 1
            else:
                # Rows owned by no expert: every output is stored as zeros.
                tile, n_tile, first_row, rows = schedule.locate_unowned(
                    row_start, tile_start, work, num_rows, self.num_experts, self.n_tiles
                )
                outputs = self._outputs(tRS_rD, tRS_rDout, tRS_sD, tma_d, mD, sD, tRS_rAct, tRS_rActOut,
                                        tRS_sAct, tma_act, mAct, sAct, first_row, rows, tile)
                tRS_rD.fill(0.0)
                tRS_rAct.fill(0.0)
                for subtile in cutlass.range_constexpr(self.subtiles):
                    epilogue_store.store_subtile(
                        tiled_r2s, outputs, store_pipeline, store_count, n_tile * self.subtiles + subtile, ctid,
                        self.config.store_stages, self.consumer_threads,
                    )
                    store_count = store_count + 1
            work = work + grid
        if ctid == 0:
            store_pipeline.producer_tail()

    def _outputs(self, rD, rDout, tRS_sD, tma_d, mD, sD, rAct, rActOut, tRS_sAct, tma_act, mAct, sAct,
                 offset, length, local_tile):
        """What `epilogue_store.store_subtile` stores for a tile of rows [offset, offset +
        length): out (or h), and act with the srelu epilogue."""
        view = lambda tensor: epilogue_store.store_view(  # noqa: E731
            tensor, offset, length, local_tile, self.tile_m, self.epi_n
        )
        outputs = [(rD, rDout, tRS_sD, tma_d, view(mD), sD)]
        if cutlass.const_expr(self.srelu):
            outputs.append((rAct, rActOut, tRS_sAct, tma_act, view(mAct), sAct))
        return outputs
