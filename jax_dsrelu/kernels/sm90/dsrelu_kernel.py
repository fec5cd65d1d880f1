"""Fused grouped GEMM + squared-ReLU backward for Hopper (sm_90a), in CuTe DSL.

Math, with e(i) the expert owning row i (rows are contiguous per expert, in expert order):

    acc[i, j] = grad[i, :] . weight[e(i), j, :]       float32 accumulation, bf16/fp16 operands
    g = alpha[e] * acc,   r = relu(preact[i, j])      (r keeps NaN: relu is a select, not fmax)
    computed as dh = ((2 alpha prob) acc) r and dprob = alpha sum_j r^2 acc: one scale per row
    dh[i, j]  = 2 g r prob[i]          rounded once to out_dtype
    act[i, j] = r^2 prob[i]            (with_act)
    dprob[i]  = sum_j r^2 g
    dbias[e, j] = sum over e's rows of the unrounded dh   (with_dbias)
    amax[e]   = max |dh| over e's rows, 0 for an empty expert
    rows owned by no expert: dh = act = 0, dprob = 0

Features:
    - A variant of the family's base (`gemm_base.RaggedMGemmSm90`): persistent,
      warp-specialized, warp 0 loads grad/weight tiles with TMA into a multi-stage
      shared-memory pipeline, two consumer warpgroups (cooperative, 64 rows each) issue
      wgmma with fp32 accumulators; this kernel adds warp 1, which loads preact subtiles
      with TMA into a second pipeline, and the fused epilogue.
    - Ragged groups read from device memory, no host synchronisation and no padding: every
      CTA builds the clamped expert tables (`jax_dsrelu.kernels.group_tables`) in shared
      memory and walks a linear work index w = bid, bid + grid, ... over (M-tile, N-tile),
      N fastest. M-tiles never mix experts; a boundary tile loads the next expert's rows
      (harmless: those accumulator rows are masked) and stores through a TMA descriptor
      whose row extent ends at the expert's last row (the ragged-tensor trick below), so
      no other expert's rows are written. Work items past the expert tiles store zeros to
      the rows owned by no expert. An expert's last tile with 64 rows or fewer runs on
      the first warpgroup's wgmma alone (`mainloop.mma_k_tiles`' `active`): the other has
      none of its rows to store.
    - Epilogue in accumulator registers, one (128 x epi_n) subtile at a time, in fixed
      order: preact from shared memory (ldmatrix), dh and act converted and stored through
      shared memory (stmatrix) with TMA, per-row dprob partials (thread sums in subtile
      order, then a fixed butterfly over the 4 lanes sharing a row), per-column dbias
      partials (a fixed reduce-scatter over the 8 row groups of each warp, then the 8
      consumer warps summed in warp order), amax as an integer max of |dh|'s bits.
    - deterministic=False: dprob and dbias partials are atomically added to zero-filled
      outputs (the order across CTAs follows the schedule, so the last bits vary).
      deterministic=True: every dprob partial is written to its own (N-tile, row) slot and
      every dbias partial to its own (M-tile, column) slot, each with exactly one writer;
      `SlotReduction` then sums the slots in a fixed order on the same stream.
      amax uses an atomic max in both modes: max is exact, so its result is the same
      whatever order the atomics land in.

Ragged TMA store: dh and act are stored through `mainloop.ragged_view`, one descriptor
whose row mode ends at each expert's last row (the arithmetic is in mainloop.py's
docstring). Loads need no clipping (the next expert's rows are masked, rows past m read
as zeros), so grad and preact use plain descriptors.

Usage: through `jax_dsrelu.grouped_gemm_dsrelu(..., backend="sm90")` (or "auto" on an
H100/H200); `dsrelu_call.py` builds the buffers and the call.

Constraints:
    - grad and weight bfloat16 or float16 (same type), preact and out_dtype 16-bit float
    - n and k multiples of 8 (16-byte TMA row strides); 1 <= E <= 512
    - fewer than 2^30 rows (ragged store coordinates stay in int32)
"""

from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp
from cutlass.tensor_utils import LayoutEnum

from jax_dsrelu.kernels.request import Request
from jax_dsrelu.kernels.slot_reduction import SlotReduction
from jax_dsrelu.kernels.sm90 import mainloop
from jax_dsrelu.kernels.sm90.barriers import NamedBarrier
from jax_dsrelu.kernels.sm90.config import TileConfig
from jax_dsrelu.kernels.sm90.gemm_base import RaggedMGemmSm90

_ABS_MASK = 0x7FFFFFFF


class GroupedGemmDsreluSm90(RaggedMGemmSm90):
    """The kernel for one static configuration. `__call__` is the host function that the
    JAX bridge runs: (stream, *inputs, *outputs) in the order documented on `__call__`."""

    def __init__(self, config: TileConfig, request: Request):
        super().__init__(config, request.num_experts, request.n, request.k)
        self.with_dbias = request.with_dbias
        self.with_act = request.with_act
        self.deterministic = request.deterministic

    # ------------------------------------------------------------------ host side

    @cute.jit
    def __call__(self, stream: cuda.CUstream, *tensors: cute.Tensor):
        """Launches the GEMM and, in deterministic mode, the slot reduction, on `stream`.

        tensors, in order (dsrelu_call.py `buffer_plan` builds the same list):
            grad (m, k), weight as (n, k, E), preact (m, n), prob (m,) f32,
            group_sizes (E,) i32, alpha (E,) f32, amax bits (E,) i32 (zero-filled, updated),
            [deterministic=False: dprob (m,) f32, [dbias (E, n) f32], zero-filled, updated]
            dh (m, n), [act (m, n)],
            [deterministic=True: dprob (m,), [dbias (E, n)], dprob slots (n_tiles, m),
             [dbias slots (max M-tiles, n)]]
        """
        grad, weight, preact, prob, group_sizes, alpha, amax = tensors[:7]
        rest = list(tensors[7:])
        dprob = None
        dbias = None
        if cutlass.const_expr(not self.deterministic):
            dprob = rest.pop(0)
            if cutlass.const_expr(self.with_dbias):
                dbias = rest.pop(0)
        dh = rest.pop(0)
        act = rest.pop(0) if cutlass.const_expr(self.with_act) else None
        dprob_out = None
        dbias_out = None
        if cutlass.const_expr(self.deterministic):
            dprob_out = rest.pop(0)
            if cutlass.const_expr(self.with_dbias):
                dbias_out = rest.pop(0)
            dprob = rest.pop(0)  # the GEMM writes the slots; the reduction writes dprob_out
            if cutlass.const_expr(self.with_dbias):
                dbias = rest.pop(0)

        self.preact_dtype = preact.element_type
        self.out_dtype = dh.element_type
        tiled_mma, a_layout, b_layout = self._mma(grad.element_type, LayoutEnum.ROW_MAJOR, LayoutEnum.ROW_MAJOR)
        p_layout = self._epi_layout(self.preact_dtype, self.config.preact_stages)
        d_layout = self._epi_layout(self.out_dtype, self.config.store_stages)
        tma_a, tma_grad = self._tma_load(grad, a_layout, (self.tile_m, self.tile_k), self.config.cluster_n)
        tma_b, tma_weight = self._tma_load(weight, b_layout, (self.tile_n, self.tile_k))
        tma_p, tma_preact = self._tma_load(preact, p_layout, (self.tile_m, self.epi_n))
        tma_d, tma_dh = self._tma_store(mainloop.ragged_view(dh, 0), d_layout)
        tma_act = None
        tma_act_tensor = None
        buffers = {
            "sP": (self.preact_dtype, cute.cosize(p_layout)),
            "sD": (self.out_dtype, cute.cosize(d_layout)),
        }
        if cutlass.const_expr(self.with_act):
            tma_act, tma_act_tensor = self._tma_store(mainloop.ragged_view(act, 0), d_layout)
            buffers["sAct"] = (self.out_dtype, cute.cosize(d_layout))
        if cutlass.const_expr(self.with_dbias):
            # Per-warp column partials of the tile.
            buffers["dbias_partials"] = (Float32, self.consumer_warps * self.tile_n)
        self.shared_storage = self._shared_storage(
            a_layout, b_layout, {"preact_barriers": self.config.preact_stages}, buffers
        )

        num_rows = cute.size(prob, mode=[0])
        self._launch(
            self.kernel(
                tma_a, tma_grad, tma_b, tma_weight, tma_p, tma_preact, tma_d, tma_dh, tma_act, tma_act_tensor,
                prob, group_sizes, alpha, amax, dprob, dbias, tiled_mma, a_layout, b_layout, p_layout, d_layout,
            ),
            self._grid(num_rows), stream,
        )
        if cutlass.const_expr(self.deterministic):
            SlotReduction(num_experts=self.num_experts, tile_m=self.tile_m)(
                dprob, dbias, group_sizes, dprob_out, dbias_out, stream
            )

    # ---------------------------------------------------------------- device side

    @cute.kernel
    def kernel(
        self,
        # (TMA atom, tensor) pairs: the operands, preact, dh and act
        tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
        tma_p: cute.CopyAtom, mP: cute.Tensor,
        tma_d: cute.CopyAtom, mD: cute.Tensor, tma_act: Optional[cute.CopyAtom], mAct: Optional[cute.Tensor],
        # the epilogue's inputs and reduced outputs in global memory
        mProb: cute.Tensor, mGroupSizes: cute.Tensor, mAlpha: cute.Tensor, mAmax: cute.Tensor,
        mDprob: cute.Tensor, mDbias: Optional[cute.Tensor],
        tiled_mma: cute.TiledMma,
        a_layout: cute.ComposedLayout, b_layout: cute.ComposedLayout,
        p_layout: cute.ComposedLayout, d_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        num_rows = cute.size(mProb, mode=[0])
        self._prefetch([tma_a, tma_b, tma_p, tma_d] + ([tma_act] if cutlass.const_expr(self.with_act) else []))
        storage = cutlass.memory.SmemAllocator().allocate(self.shared_storage)
        ab_pipeline = self._operand_pipeline(storage, a_layout, b_layout)
        preact_pipeline = self._tma_pipeline(
            storage.preact_barriers, self.config.preact_stages,
            cute.size_in_bytes(self.preact_dtype, cute.slice_(p_layout, (None, None, 0))),
        )
        row_start, tile_start = self._publish_tables(storage, mGroupSizes, num_rows, self.tile_m)
        sA = self._smem(storage.sA, a_layout)
        sB = self._smem(storage.sB, b_layout)
        sP = self._smem(storage.sP, p_layout)

        if warp_idx < self.producer_warps:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.load_operands(tma_a, mA, tma_b, mB, sA, sB, ab_pipeline,
                                   self._schedule(row_start, tile_start, num_rows))
            if warp_idx == 1:
                self.load_preact(tma_p, mP, sP, preact_pipeline, self._schedule(row_start, tile_start, num_rows))
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            sD = self._smem(storage.sD, d_layout)
            sAct = self._smem(storage.sAct, d_layout) if cutlass.const_expr(self.with_act) else None
            sDbias = None
            if cutlass.const_expr(self.with_dbias):
                sDbias = storage.dbias_partials.get_tensor(
                    cute.make_layout((self.consumer_warps, self.tile_n), stride=(self.tile_n, 1))
                )
            self.consume(
                tiled_mma, sA, sB, sP, sD, sAct, sDbias, ab_pipeline, preact_pipeline,
                tma_d, mD, tma_act, mAct, mProb, mAlpha, mAmax, mDprob, mDbias,
                self._schedule(row_start, tile_start, num_rows), tidx - 128,
            )

    @cute.jit
    def load_preact(self, tma_p, mP, sP, preact_pipeline, work_schedule):
        """Warp 1: the preact subtiles of every expert work item, in epilogue order.

        A warp of its own, so that waiting for a free preact buffer (freed only by the
        epilogue) never holds back the grad/weight loads of the next tile."""
        state = self._producer_state(self.config.preact_stages)
        while work_schedule.owned():
            tile, work_schedule = work_schedule.located()
            row0 = tile.first_row + tile.local_tile * self.tile_m
            # (tile_m, epi_n, n / epi_n): subtile s of N-tile t is column block t * subtiles + s.
            gP = cute.local_tile(cute.domain_offset((row0, 0), mP), (self.tile_m, self.epi_n), (0, None))
            tPsP, tPgP = mainloop.tma_partition(tma_p, sP, gP)
            for subtile in cutlass.range_constexpr(self.subtiles):
                preact_pipeline.producer_acquire(state)
                cute.copy(
                    tma_p,
                    tPgP[None, tile.n_tile * self.subtiles + subtile],
                    tPsP[None, state.index],
                    tma_bar_ptr=preact_pipeline.producer_get_barrier(state),
                )
                preact_pipeline.producer_commit(state)
                state.advance()
            work_schedule.advance()
        preact_pipeline.producer_tail(state)

    @cute.jit
    def consume(
        self, tiled_mma, sA, sB, sP, sD, sAct, sDbias, ab_pipeline, preact_pipeline,
        tma_d, mD, tma_act, mAct, mProb, mAlpha, mAmax, mDprob, mDbias, work_schedule, ctid: Int32,
    ):
        """Consumer warpgroups: wgmma mainloop, then the fused epilogue, per work item."""
        warp_c = ctid // 32  # consumer warp 0..7, rows [16 warp_c, 16 warp_c + 16) of the tile
        lane = ctid % 32
        tCrA, tCrB, tCcAcc, acc = self._mma_fragments(tiled_mma, sA, sB, ctid)
        # Epilogue copies: stmatrix for dh/act, ldmatrix for preact, both in the layout of
        # the accumulator fragment (value v of a subtile is accumulator value 16 s + v).
        tiled_copy_c, tiled_r2s, thr_r2s, sub_shape = self._store_copy(tiled_mma, self.out_dtype, ctid)
        tRS_rD = cute.make_rmem_tensor(sub_shape, Float32)
        tRS_rAct = cute.make_rmem_tensor(sub_shape, Float32)
        tensors = [(tRS_rD, sD, tma_d, mD)]
        if cutlass.const_expr(self.with_act):
            tensors.append((tRS_rAct, sAct, tma_act, mAct))
        outputs = self._epilogue_outputs(thr_r2s, sub_shape, tensors)
        tiled_s2r = cute.make_tiled_copy_S(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(False, 4), self.preact_dtype), tiled_copy_c
        )
        thr_s2r = tiled_s2r.get_slice(ctid)
        tSR_sP = thr_s2r.partition_S(sP)
        tRS_rP = cute.make_rmem_tensor(sub_shape, self.preact_dtype)
        tSR_rP = thr_s2r.retile(tRS_rP)
        tRS_rPf = cute.make_rmem_tensor(sub_shape, Float32)
        sub_values = cute.size(tRS_rD)  # 2 rows x epi_n / 4 columns

        store_pipeline = self._store_pipeline(self.config.store_stages)
        read_state, release_state = self._consumer_states()
        preact_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.config.preact_stages)
        store_count = Int32(0)

        # This thread's two rows in the tile (h = 0, 1: accumulator values 0 and 2). The wgmma
        # fragment holds value v = c + 2 h + 4 j at column 8 j + 2 (lane % 4) + c, row + 8 h.
        tile_row = [tCcAcc[0][0], tCcAcc[2][0]]

        while work_schedule.valid():
            if work_schedule.owned():
                tile, work_schedule = work_schedule.located()
                row0, rows_valid = self._tile_rows(tile)
                # The epilogue's per-row and per-expert scalars, loaded before the mainloop
                # so that their latency hides behind it.
                alpha = mAlpha[tile.expert]
                valid, prob = self._row_probs(mProb, tile_row, row0, rows_valid)

                # An expert's last tile with 64 rows or fewer runs on the first warpgroup's
                # wgmma alone: 1.2-1.7% less time for this kernel in the Nano step on the H200,
                # with the 128x256 tiles it then took there (docs/sm90.md, "An expert's last
                # tile on one warpgroup").
                read_state, release_state = mainloop.mma_k_tiles(
                    tiled_mma, acc, tCrA, tCrB, ab_pipeline, read_state, release_state, self.k_tiles,
                    self._warpgroup_active(ctid, rows_valid),
                )

                # -------- epilogue
                # dh = 2 alpha acc r prob = (2 alpha prob) acc r: one factor per row.
                two_alpha = alpha + alpha
                row_scale = [two_alpha * prob[0], two_alpha * prob[1]]
                # sum_j r^2 acc per row; alpha multiplies the row's total once at the end.
                row_sum = [Float32(0.0), Float32(0.0)]
                # Largest |dh| bit pattern per row, masked by the row's validity at the end.
                row_max = [Int32(0), Int32(0)]
                stores = self._stores(outputs, tile.first_row, tile.rows, tile.local_tile)

                for subtile in cutlass.range_constexpr(self.subtiles):
                    preact_pipeline.consumer_wait(preact_state)
                    cute.copy(tiled_s2r, tSR_sP[None, None, None, preact_state.index], tSR_rP)
                    preact_pipeline.consumer_release(preact_state)
                    preact_state.advance()
                    tRS_rPf.store(tRS_rP.load().to(Float32))

                    columns = []
                    for v in cutlass.range_constexpr(sub_values):
                        h = (v // 2) % 2
                        a = acc[subtile * sub_values + v]
                        pre = tRS_rPf[v]
                        # A select keeps NaN (NaN < 0 is false); fmax would drop it.
                        r = Float32(cutlass.select_(pre < Float32(0.0), Float32(0.0), pre))
                        r2 = r * r
                        dh = (row_scale[h] * a) * r
                        tRS_rD[v] = dh
                        tRS_rAct[v] = r2 * prob[h]
                        row_sum[h] = row_sum[h] + r2 * a
                        dh_bits = dh.bitcast(Int32) & Int32(_ABS_MASK)
                        if cutlass.const_expr(self.n % self.tile_n != 0):
                            # Padding columns of a partial N-tile: acc = r = 0 there, and an
                            # infinite row scale would make their dh NaN; amax is over the
                            # real columns only.
                            column = tile.n_tile * self.tile_n + tCcAcc[subtile * sub_values + v][1]
                            dh_bits = Int32(cutlass.select_(column < self.n, dh_bits, Int32(0)))
                        row_max[h] = cutlass.max(row_max[h], dh_bits)
                        if cutlass.const_expr(h == 0):
                            columns.append(Float32(cutlass.select_(valid[0], dh, Float32(0.0))))
                        else:
                            # Column q = (v % 2) + 2 (v // 4): rows h = 0 then h = 1.
                            q = (v % 2) + 2 * (v // 4)
                            columns[q] = columns[q] + Float32(
                                cutlass.select_(valid[1], dh, Float32(0.0))
                            )
                    store_count = self._store_subtile(tiled_r2s, stores, store_pipeline, store_count,
                                                      tile.n_tile, subtile, ctid)
                    if cutlass.const_expr(self.with_dbias):
                        self._scatter_columns(columns, lane, warp_c, sDbias, subtile)

                self._finish_rows(row_sum, alpha, valid, row0, tile_row, lane, tile.n_tile, mDprob)
                amax_bits = cutlass.max(
                    Int32(cutlass.select_(valid[0], row_max[0], Int32(0))),
                    Int32(cutlass.select_(valid[1], row_max[1], Int32(0))),
                )
                self._finish_amax(amax_bits, lane, tile.expert, mAmax)
                if cutlass.const_expr(self.with_dbias):
                    self._finish_columns(sDbias, ctid, tile.n_tile, tile.m_tile, tile.expert, mDbias)
            else:
                store_count = self._store_zero_tile(work_schedule, tiled_r2s, outputs, store_pipeline,
                                                    store_count, ctid)
            work_schedule.advance()
        if ctid == 0:
            store_pipeline.producer_tail()

    def _scatter_columns(self, columns, lane: Int32, warp_c: Int32, sDbias, subtile: cutlass.Constexpr):
        """Sums one subtile's column partials over the warp's 16 rows in a fixed tree.

        Reduce-scatter over lane bits 2, 3, 4 (the 8 row groups): at each step a lane keeps
        one half of its values, adds its partner's copy of that half, and hands over the
        other half. A lane ends with columns q = 4 b2 + 2 b3 + b4 (+ 8 i), q being the
        value's index in (v % 2) + 2 (v // 4) order, summed over all 16 rows."""
        values = columns
        for step in range(3):
            bit = 4 << step
            upper = (lane & bit) != 0
            half = len(values) // 2
            kept = []
            for i in range(half):
                low = values[i]
                high = values[half + i]
                send = Float32(cutlass.select_(upper, low, high))
                keep = Float32(cutlass.select_(upper, high, low))
                kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=bit))
            values = kept
        lane_q = 4 * ((lane >> 2) & 1) + 2 * ((lane >> 3) & 1) + ((lane >> 4) & 1)
        per_lane = len(values)
        for i in range(per_lane):
            q = lane_q * per_lane + i
            column = 8 * (q // 2) + 2 * (lane % 4) + (q % 2)
            sDbias[warp_c, subtile * self.epi_n + column] = values[i]

    @cute.jit
    def _finish_rows(
        self, row_sum, alpha: Float32, valid, row0: Int32, tile_row, lane: Int32, n_tile: Int32, mDprob
    ):
        """dprob partials of the tile: the 4 lanes sharing a row combine in a fixed butterfly,
        the total is scaled by alpha, then lane h of the quad writes row h (a slot, or an
        atomic add)."""
        for h in cutlass.range_constexpr(2):
            total = row_sum[h]
            total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
            total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
            total = alpha * total
            if lane % 4 == h:
                if valid[h]:
                    row = row0 + tile_row[h]
                    if cutlass.const_expr(self.deterministic):
                        mDprob[n_tile, row] = total
                    else:
                        cute.arch.atomic_add(mDprob.iterator + row, total)

    @cute.jit
    def _finish_amax(self, amax_bits: Int32, lane: Int32, expert: Int32, mAmax):
        """Integer max of |dh|'s bits over the warp, then one atomic max per warp.

        Non-negative floats order like their bit patterns, and a NaN's bits (sign cleared)
        exceed +Inf's, so NaN wins as it does in jnp.max."""
        bits = amax_bits
        for step in cutlass.range_constexpr(5):
            bits = cutlass.max(bits, cute.arch.shuffle_sync_bfly(bits, offset=1 << step))
        if lane == 0:
            cute.arch.atomic_max(mAmax.iterator + expert, bits)

    @cute.jit
    def _finish_columns(self, sDbias, ctid: Int32, n_tile: Int32, m_tile: Int32, expert: Int32, mDbias):
        """dbias partials of the tile: the 8 consumer warps' column sums, added in warp order,
        to the (M-tile, column) slot or atomically to dbias[expert, column]."""
        cute.arch.barrier(barrier_id=int(NamedBarrier.DBIAS), number_of_threads=self.consumer_threads)
        if ctid < self.tile_n:
            total = sDbias[0, ctid]
            for w in cutlass.range_constexpr(1, self.consumer_warps):
                total = total + sDbias[w, ctid]
            column = n_tile * self.tile_n + ctid
            if column < self.n:
                if cutlass.const_expr(self.deterministic):
                    mDbias[m_tile, column] = total
                else:
                    cute.arch.atomic_add(mDbias.iterator + (expert * self.n + column), total)
        # The partials buffer is rewritten by the next tile's first subtile.
        cute.arch.barrier(barrier_id=int(NamedBarrier.DBIAS), number_of_threads=self.consumer_threads)
