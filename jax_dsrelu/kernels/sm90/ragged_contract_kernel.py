"""Ragged-contraction grouped GEMM for Hopper (sm_90a), in CuTe DSL: the weight gradients.

Math, over expert e's rows [start_e, end_e) (rows contiguous per expert, in expert order):

    out[e, i, j] = sum_{r in [start_e, end_e)} lhs[r, i] rhs[r, j]
                   float32 accumulation of bf16/fp16 products, rounded once to out's dtype

lhs (m, a) and rhs (m, b) are row-major, so both GEMM operands are MN-major (the
contraction runs over their slow mode): dW1[e] = x_e^T dh_e and dW2[e] = act_e^T dy_e of
a squared-ReLU expert MLP, with no transposed copy of x, dh, act or dy.

Features:
    - One CTA per output tile (expert, 128-row block of a, tile_n-column block of b): each
      output element has exactly one writer and is summed over its expert's rows in one
      fixed order (k-tile by k-tile, wgmma's own order within a k-tile), with no split-K
      and no atomics, so the result is bitwise reproducible by construction.
    - The grid is (b blocks, a blocks, E) with b fastest, so CTAs in flight share an
      expert's operand tiles in L2. Tiles of large experts run longer than those of small
      ones, so grid slice z takes the expert of z-th largest size (ties to the lower
      index; every CTA ranks the sizes from the device tables): the longest tiles start
      first and the hardware block scheduler fills the tail with the short ones, without
      a host-side plan.
    - Expert e's rows are a ragged view of lhs and rhs (`mainloop.ragged_view` on the row
      mode): the TMA box of the last k-tile is clipped at the expert's last row, so the
      next expert's rows load as zeros and never enter the sum; no row outside every
      expert is ever read into one.
    - An expert with no rows runs no mainloop and stores zeros.
    - Warp 0 streams k-tiles with TMA (`mainloop.load_k_tiles`), two consumer warpgroups
      issue wgmma (`mainloop.mma_k_tiles`), then store the tile from registers, each
      element once: vectorized where a and b are whole tiles, else predicated on the
      tile's real extent.

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
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.group_tables import build_expert_tables
from jax_dsrelu.kernels.sm90 import mainloop
from jax_dsrelu.kernels.sm90.config import ContractConfig


class RaggedContractSm90:
    """The kernel for one static configuration; `__call__` is the host function the JAX
    bridge runs: (stream, lhs as (a, m), rhs as (b, m), group_sizes (E,), out as (a, b, E))."""

    producer_warps = 4
    consumer_warps = 8
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
        self.a_tiles = (a + config.tile_m - 1) // config.tile_m
        self.b_tiles = (b + config.tile_n - 1) // config.tile_n

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
        tma_a, tma_lhs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mainloop.ragged_view(lhs, 1),
            cute.slice_(a_layout, (None, None, 0)), (self.tile_m, self.tile_k),
        )
        tma_b, tma_rhs = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mainloop.ragged_view(rhs, 1),
            cute.slice_(b_layout, (None, None, 0)), (self.tile_n, self.tile_k),
        )
        self.shared_storage = self._shared_storage(a_layout, b_layout)
        num_rows = cute.size(lhs, mode=[1])
        self.kernel(
            tma_a, tma_lhs, tma_b, tma_rhs, group_sizes, out, num_rows, tiled_mma, a_layout, b_layout
        ).launch(
            grid=[self.b_tiles, self.a_tiles, self.num_experts],
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _shared_storage(self, a_layout, b_layout):
        experts = self.num_experts + 1
        ab_stages = self.config.ab_stages
        ab_dtype = self.ab_dtype

        @cute.struct
        class SharedStorage:
            ab_barriers: cute.struct.MemRange[cutlass.Int64, ab_stages * 2]
            row_start: cute.struct.MemRange[Int32, experts]
            tile_start: cute.struct.MemRange[Int32, experts]
            expert_order: cute.struct.MemRange[Int32, experts]
            sA: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(a_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(b_layout)], 1024]

        return SharedStorage

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        mGroupSizes: cute.Tensor,
        mOut: cute.Tensor,
        num_rows: Int32,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout,
        b_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        b_tile, a_tile, position = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

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
            build_expert_tables(mGroupSizes, num_rows, row_start, tile_start, self.num_experts, self.tile_k)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        # Largest expert first: thread t ranks expert t among all sizes.
        expert_order = storage.expert_order.get_tensor(cute.make_layout(self.num_experts + 1))
        if tidx < self.num_experts:
            size = row_start[tidx + 1] - row_start[tidx]
            rank = Int32(0)
            for other in range(self.num_experts):
                other_size = row_start[other + 1] - row_start[other]
                if other_size > size or (other_size == size and other < tidx):
                    rank = rank + 1
            expert_order[rank] = tidx
        cute.arch.sync_threads()
        expert = expert_order[position]

        first_row = row_start[expert]
        expert_rows = row_start[expert + 1] - first_row
        k_tiles = (expert_rows + (self.tile_k - 1)) // self.tile_k
        sA = storage.sA.get_tensor(a_layout.outer, swizzle=a_layout.inner)
        sB = storage.sB.get_tensor(b_layout.outer, swizzle=b_layout.inner)

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.config.ab_stages)
                # (tile, tile_k, k-tiles) of the expert's rows, clipped at its last row.
                gA = cute.local_tile(
                    mainloop.expert_rows(mA, 1, first_row, expert_rows), (self.tile_m, self.tile_k), (a_tile, None)
                )
                gB = cute.local_tile(
                    mainloop.expert_rows(mB, 1, first_row, expert_rows), (self.tile_n, self.tile_k), (b_tile, None)
                )
                tAsA, tAgA = mainloop.tma_partition(tma_a, sA, gA)
                tBsB, tBgB = mainloop.tma_partition(tma_b, sB, gB)
                state = mainloop.load_k_tiles(tma_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles)
                ab_pipeline.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            ctid = tidx - 128
            thr_mma_wg = tiled_mma.get_slice(cute.make_layout(2, stride=128)(ctid // 128))
            tCrA = tiled_mma.make_fragment_A(thr_mma_wg.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma_wg.partition_B(sB))
            tCcAcc = tiled_mma.get_slice(ctid).partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            acc = cute.make_rmem_tensor(tCcAcc.shape, Float32)
            read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)
            release_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.ab_stages)
            read_state, release_state = mainloop.mma_k_tiles(
                tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state, k_tiles
            )
            # Each element once, from registers: the tile is written after its whole sum,
            # so there is nothing for a pipelined store to overlap with.
            if cutlass.const_expr(self.a % self.tile_m == 0 and self.b % self.tile_n == 0):
                gOut = cute.local_tile(mOut[None, None, expert], (self.tile_m, self.tile_n), (a_tile, b_tile))
                tCgOut = tiled_mma.get_slice(ctid).partition_C(gOut)
                rOut = cute.make_rmem_tensor(tCcAcc.shape, self.out_dtype)
                rOut.store(acc.load().to(self.out_dtype))
                cute.autovec_copy(rOut, tCgOut)
            else:
                row0 = a_tile * self.tile_m
                col0 = b_tile * self.tile_n
                for v in cutlass.range_constexpr(cute.size(acc)):
                    row = row0 + tCcAcc[v][0]
                    col = col0 + tCcAcc[v][1]
                    if row < self.a and col < self.b:
                        mOut[row, col, expert] = acc[v].to(self.out_dtype)
