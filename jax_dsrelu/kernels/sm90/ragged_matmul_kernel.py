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
    - A variant of the family's base (`gemm_base.RaggedMGemmSm90`): persistent,
      warp-specialized, the ragged-M schedule and producer; this file adds the
      epilogue, in accumulator registers one (128 x epi_n) subtile at a time: stmatrix
      to shared memory, TMA store through the ragged row view clipped at the expert's
      last row.
    - Ragged groups from device memory (`group_tables`, `schedule`): no
      host sync, no padding; rows owned by no expert are extra work items storing zeros.
    - Deterministic by construction: every output element has one writer and one fixed
      summation order (the k loop), no atomics.

Constraints:
    - lhs and rhs bfloat16 or float16 (same type), outputs 16-bit float
    - n and k multiples of 8 (16-byte TMA rows); 1 <= E <= 512; fewer than 2^30 rows
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.request import RaggedMatmulRequest
from jax_dsrelu.kernels.sm90 import mainloop
from jax_dsrelu.kernels.sm90.config import GemmConfig
from jax_dsrelu.kernels.sm90.gemm_base import RaggedMGemmSm90


class RaggedGemmSm90(RaggedMGemmSm90):
    """The kernel for one static configuration; `__call__` is the host function the JAX
    bridge runs: (stream, *inputs, *outputs) in the order documented on `__call__`."""

    def __init__(self, config: GemmConfig, request: RaggedMatmulRequest):
        if request.rhs_layout not in ("kn", "nk"):
            raise ValueError(f"rhs_layout must be 'kn' or 'nk', got {request.rhs_layout!r}")
        if request.epilogue not in ("none", "srelu"):
            raise ValueError(f"epilogue must be 'none' or 'srelu', got {request.epilogue!r}")
        if request.with_bias and request.epilogue != "srelu":
            raise ValueError(f"with_bias=True needs epilogue='srelu' (only it adds a bias), got epilogue={request.epilogue!r}")
        super().__init__(config, request.num_experts, request.n, request.k)
        self.rhs_layout = request.rhs_layout
        self.srelu = request.epilogue == "srelu"
        self.with_bias = request.with_bias

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

        self.out_dtype = out.element_type
        # "kn": rhs as (n, k, E) has n contiguous (N-major B); "nk": k contiguous.
        b_major = LayoutEnum.COL_MAJOR if cutlass.const_expr(self.rhs_layout == "kn") else LayoutEnum.ROW_MAJOR
        tiled_mma, a_layout, b_layout = self._mma(lhs.element_type, LayoutEnum.ROW_MAJOR, b_major)
        d_layout = self._epi_layout(self.out_dtype, self.config.store_stages)
        tma_a, tma_lhs = self._tma_load(lhs, a_layout, (self.tile_m, self.tile_k), self.config.cluster_n)
        tma_b, tma_rhs = self._tma_load(rhs, b_layout, (self.tile_n, self.tile_k))
        tma_d, tma_out = self._tma_store(mainloop.ragged_view(out, 0), d_layout)
        tma_act = None
        tma_act_tensor = None
        buffers = {"sD": (self.out_dtype, cute.cosize(d_layout))}
        if cutlass.const_expr(self.srelu):
            tma_act, tma_act_tensor = self._tma_store(mainloop.ragged_view(act, 0), d_layout)
            buffers["sAct"] = (self.out_dtype, cute.cosize(d_layout))
        self.shared_storage = self._shared_storage(a_layout, b_layout, {}, buffers)

        num_rows = cute.size(lhs, mode=[0])
        self._launch(
            self.kernel(
                tma_a, tma_lhs, tma_b, tma_rhs, tma_d, tma_out, tma_act, tma_act_tensor,
                group_sizes, prob, bias, num_rows, tiled_mma, a_layout, b_layout, d_layout,
            ),
            self._grid(num_rows), stream,
        )

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(
        self,
        # (TMA atom, tensor) pairs: the operands, out (or h) and act
        tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
        tma_d: cute.CopyAtom, mD: cute.Tensor, tma_act: Optional[cute.CopyAtom], mAct: Optional[cute.Tensor],
        mGroupSizes: cute.Tensor, mProb: Optional[cute.Tensor], mBias: Optional[cute.Tensor], num_rows: Int32,
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch([tma_a, tma_b, tma_d] + ([tma_act] if cutlass.const_expr(self.srelu) else []))
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = self._operand_pipeline(storage, a_layout, b_layout)
        row_start, tile_start = self._publish_tables(storage, mGroupSizes, num_rows, self.tile_m)
        sA = self._smem(storage.sA, a_layout)
        sB = self._smem(storage.sB, b_layout)

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load_operands(tma_a, mA, tma_b, mB, sA, sB, ab_pipeline,
                                   self._schedule(row_start, tile_start, num_rows))
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            sD = self._smem(storage.sD, d_layout)
            sAct = self._smem(storage.sAct, d_layout) if cutlass.const_expr(self.srelu) else None
            self.consume(tiled_mma, sA, sB, sD, sAct, ab_pipeline, tma_d, mD, tma_act, mAct, mProb, mBias,
                         self._schedule(row_start, tile_start, num_rows), tidx - 128)

    @staticmethod
    def _bias_slot(value: int) -> int:
        """The index in `_column_bias`'s list of accumulator value `value`'s column: the
        wgmma fragment holds value v = c + 2 h + 4 j at column 8 j + 2 (lane % 4) + c of
        row h, so both rows share slot c + 2 j."""
        return value % 2 + 2 * (value // 4)

    def _column_bias(self, mBias, tCcAcc, tile):
        """The bias of every column this thread's accumulator holds (column 0's past n,
        where nothing is stored), loaded before the mainloop so that the loads' latency
        hides behind it; [] without bias. Loaded in the epilogue instead, subtile by
        subtile, the up-projection took 4% more time at Nemotron-3 Nano's shape and 6% more
        at (65536, 2048, 768, 256) (benchmarks/results/fine_grained/sweep_gemm_bias_257da8f.json)."""
        if cutlass.const_expr(not self.with_bias):
            return []
        bias = []
        for slot in range(cute.size(tCcAcc) // 2):
            value = slot % 2 + 4 * (slot // 2)
            column = tile.n_tile * self.tile_n + tCcAcc[value][1]
            safe_column = Int32(cutlass.select_(column < self.n, column, Int32(0)))
            bias.append(Float32(mBias[tile.expert, safe_column]))
        return bias

    @cute.jit
    def consume(self, tiled_mma, sA, sB, sD, sAct, ab_pipeline, tma_d, mD, tma_act, mAct, mProb, mBias,
                work_schedule, ctid: Int32):
        """Consumer warpgroups: the wgmma mainloop, then the epilogue, per work item."""
        tCrA, tCrB, tCcAcc, acc = self._mma_fragments(tiled_mma, sA, sB, ctid)
        _, tiled_r2s, thr_r2s, sub_shape = self._store_copy(tiled_mma, self.out_dtype, ctid)
        tRS_rD = cute.make_rmem_tensor(sub_shape, Float32)
        tRS_rH = cute.make_rmem_tensor(sub_shape, Float32)  # the rounded h, back in float32
        tRS_rAct = cute.make_rmem_tensor(sub_shape, Float32)
        sub_values = cute.size(tRS_rD)
        tensors = [(tRS_rD, sD, tma_d, mD)]
        if cutlass.const_expr(self.srelu):
            tensors.append((tRS_rAct, sAct, tma_act, mAct))
        outputs = self._epilogue_outputs(thr_r2s, sub_shape, tensors)
        tRS_rDout = outputs[0][1]

        store_pipeline = self._store_pipeline(self.config.store_stages)
        read_state, release_state = self._consumer_states()
        store_count = Int32(0)
        # This thread's two rows in the tile: accumulator values 0 and 2.
        tile_row = [tCcAcc[0][0], tCcAcc[2][0]]
        while work_schedule.valid():
            if work_schedule.owned():
                tile, work_schedule = work_schedule.located()
                row0, rows_valid = self._tile_rows(tile)
                prob = [Float32(0.0), Float32(0.0)]
                if cutlass.const_expr(self.srelu):
                    _, prob = self._row_probs(mProb, tile_row, row0, rows_valid)
                bias = self._column_bias(mBias, tCcAcc, tile)

                # Both warpgroups multiply every tile, an expert's last one too: with the
                # idle warpgroup's wgmma skipped (`mma_k_tiles`' `active`), the up-projection
                # was no faster and down and dx 5-7% slower in the Nano step on the H200
                # (docs/sm90.md, "An expert's last tile on one warpgroup").
                read_state, release_state = mainloop.mma_k_tiles(
                    tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state, self.k_tiles
                )

                stores = self._stores(outputs, tile.first_row, tile.rows, tile.local_tile)
                for subtile in cutlass.range_constexpr(self.subtiles):
                    for v in cutlass.range_constexpr(sub_values):
                        tRS_rD[v] = acc[subtile * sub_values + v]
                    if cutlass.const_expr(self.srelu):
                        if cutlass.const_expr(self.with_bias):
                            for v in cutlass.range_constexpr(sub_values):
                                tRS_rD[v] = tRS_rD[v] + bias[self._bias_slot(subtile * sub_values + v)]
                        # act is computed from h as stored: round first, then widen again.
                        tRS_rDout.store(tRS_rD.load().to(self.out_dtype))
                        tRS_rH.store(tRS_rDout.load().to(Float32))
                        for v in cutlass.range_constexpr(sub_values):
                            h = (v // 2) % 2
                            pre = tRS_rH[v]
                            # A select keeps NaN (NaN < 0 is false); fmax would drop it.
                            r = Float32(cutlass.select_(pre < Float32(0.0), Float32(0.0), pre))
                            tRS_rAct[v] = (r * r) * prob[h]
                    store_count = self._store_subtile(tiled_r2s, stores, store_pipeline, store_count,
                                                      tile.n_tile, subtile, ctid)
            else:
                store_count = self._store_zero_tile(work_schedule, tiled_r2s, outputs, store_pipeline,
                                                    store_count, ctid)
            work_schedule.advance()
        if ctid == 0:
            store_pipeline.producer_tail()
