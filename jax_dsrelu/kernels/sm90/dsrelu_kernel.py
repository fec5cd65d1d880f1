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
    - A variant of the family's skeleton (`gemm_base.GemmSm90`) over the ragged-M work
      schedule (`ragged_m.RaggedMGemmSm90`): grad is A, weight B, preact the epilogue
      input (loaded by producer warp 1 into its own ring), dh and act the stored outputs;
      this file holds the operand declaration and the epilogue's hooks. An expert's last
      tile with 64 rows or fewer runs on the first warpgroup's wgmma alone
      (`mma_active`): the other has none of its rows to store.
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

Usage: through `jax_dsrelu.grouped_gemm_dsrelu(..., backend="sm90")` (or "auto" on an
H100/H200); `dsrelu_call.py` makes the call from the declared operands.

Constraints:
    - grad and weight bfloat16 or float16 (same type), preact and out_dtype 16-bit float
    - n and k multiples of 8 (16-byte TMA row strides); 1 <= E <= 512
    - fewer than 2^30 rows (ragged store coordinates stay in int32)
"""

import dataclasses
from typing import Any

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from jax_dsrelu.kernels.operands import M, KernelOperand, Rows
from jax_dsrelu.kernels.request import Request
from jax_dsrelu.kernels import squared_relu
from jax_dsrelu.kernels.slot_reduction import SlotReduction
from jax_dsrelu.kernels.sm90 import fragment
from jax_dsrelu.kernels.sm90.barriers import NamedBarrier
from jax_dsrelu.kernels.sm90.config import TileConfig
from jax_dsrelu.kernels.sm90.ragged_m import RaggedMGemmSm90
from jax_dsrelu.primitive_schema import GROUPED_GEMM_DSRELU

_ABS_MASK = 0x7FFFFFFF
_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)


@dataclasses.dataclass(eq=False, slots=True)
class DsreluTile:
    """A work item's epilogue state: loaded before its mainloop (`epilogue_prefetch`),
    then the running per-row partials (`epilogue_begin` on), this thread's two rows each."""

    row0: Any  # the tile's first row
    rows_valid: Any  # how many of its rows the expert owns
    alpha: Any  # the expert's scale
    valid: list  # whether each of this thread's rows is the expert's
    prob: list  # each row's prob (0 where not valid)
    row_scale: list = dataclasses.field(default_factory=list)  # 2 alpha prob per row
    row_sum: list = dataclasses.field(default_factory=list)  # sum over the columns so far of r^2 acc
    row_max: list = dataclasses.field(default_factory=list)  # largest |dh| bit pattern so far
    columns: list = dataclasses.field(default_factory=list)  # the subtile's column partials of dh


class GroupedGemmDsreluSm90(RaggedMGemmSm90):
    """The kernel for one static configuration: the ragged-M GEMM of grad and weight, with
    preact as the epilogue input and the fused epilogue's hooks."""

    operand_a = "grad"
    operand_b = "weight"
    epilogue_input = "preact"

    def __init__(self, config: TileConfig, request: Request):
        super().__init__(config, request.num_experts, request.n, request.k)
        self.check_operand_bytes(request.operand_dtype)
        self.request = request
        self.with_dbias = request.with_dbias
        self.with_act = request.with_act
        self.deterministic = request.deterministic
        self.epilogue_input_stages = config.preact_stages
        if self.with_dbias:
            # Per-warp column partials of the tile.
            self.epilogue_scratch = (Float32, (self.consumer_warps, self.tile_n))

    def operands(self) -> list[KernelOperand]:
        """The host function's buffers in its order: every input and accumulate buffer
        before every output. deterministic=False: dprob and dbias are zero-filled and
        updated by atomics; deterministic=True: the GEMM writes their partials to slots
        (one writer each) and the slot reduction writes them whole."""
        r, e, n, declare = self.request, self.num_experts, self.n, self.declare
        plan = [
            declare("grad", "input", r.operand_dtype),
            # The kernel sees weight (E, n, k) as (n, k, E): a mode permutation, not a copy.
            declare("weight", "input", r.operand_dtype, mode=(1, 2, 0)),
            declare("preact", "input", r.preact_dtype),
            declare("prob", "input", _F32),
            declare("group_sizes", "input", _I32),
            declare("alpha", "input", _F32),
            # amax as int32 bits: the kernel's atomic max is on the bit pattern.
            declare("amax", "accumulate", _I32),
        ]
        reduced_role = "output" if self.deterministic else "accumulate"
        reduced = [declare("dprob", reduced_role, _F32)]
        if self.with_dbias:
            reduced.append(declare("dbias", reduced_role, _F32))
        if not self.deterministic:
            plan += reduced
        plan.append(declare("dh", "output", r.out_dtype))
        if self.with_act:
            plan.append(declare("act", "output", r.out_dtype))
        if self.deterministic:
            plan += reduced
            plan.append(KernelOperand("dprob_slots", "output", _F32, (self.n_tiles, M)))
            if self.with_dbias:
                # One row per expert M-tile: at most ceil(m / tile_m) + E (`config.max_m_tiles`).
                plan.append(KernelOperand("dbias_slots", "output", _F32, (Rows(self.tile_m, e), n)))
        return plan

    def stored_outputs(self) -> tuple[str, ...]:
        return ("dh", "act") if self.with_act else ("dh",)

    primitive_schema = GROUPED_GEMM_DSRELU

    def schema_sizes(self) -> dict[str, int]:
        return dict(e=self.num_experts, n=self.n, k=self.k)

    # ------------------------------------------------------------------ host side

    def kernel_params(self, t) -> dict:
        """Where the epilogue's reductions go: the zero-filled outputs (atomics), or in
        deterministic mode their slots."""
        slots = self.deterministic
        return dict(
            prob=t.prob, group_sizes=t.group_sizes, alpha=t.alpha, amax=t.amax,
            dprob=t.dprob_slots if slots else t.dprob,
            dbias=(t.dbias_slots if slots else t.dbias) if self.with_dbias else None,
        )

    def after_gemm(self, t, stream) -> None:
        """deterministic=True: the slot reduction, on the GEMM's stream."""
        if self.deterministic:
            SlotReduction(num_experts=self.num_experts, tile_m=self.tile_m)(
                t.dprob_slots, t.dbias_slots if self.with_dbias else None, t.group_sizes, t.dprob,
                t.dbias if self.with_dbias else None, stream,
            )

    # ---------------------------------------------------------------- device side

    def num_rows(self, params) -> Int32:
        return cute.size(params.prob, mode=[0])

    def epilogue_prefetch(self, ctx, tile):
        """The epilogue's per-row and per-expert scalars, loaded before the mainloop so
        that their latency hides behind it."""
        row0, rows_valid = self._tile_rows(tile)
        alpha = ctx.params.alpha[tile.expert]
        valid, prob = self._row_probs(ctx.params.prob, ctx.tile_row, row0, rows_valid)
        return DsreluTile(row0=row0, rows_valid=rows_valid, alpha=alpha, valid=valid, prob=prob)

    def mma_active(self, ctx, item):
        """An expert's last tile with 64 rows or fewer runs on the first warpgroup's
        wgmma alone: 1.2-1.7% less time for this kernel in the Nano step on the H200,
        with the 128x256 tiles it then took there (docs/sm90.md, "An expert's last tile
        on one warpgroup")."""
        return self._warpgroup_active(ctx.ctid, item.rows_valid)

    def epilogue_begin(self, ctx, item) -> None:
        # dh = 2 alpha acc r prob = (2 alpha prob) acc r: one factor per row.
        two_alpha = item.alpha + item.alpha
        item.row_scale = [two_alpha * item.prob[0], two_alpha * item.prob[1]]
        # sum_j r^2 acc per row; alpha multiplies the row's total once at the end.
        item.row_sum = [Float32(0.0), Float32(0.0)]
        # Largest |dh| bit pattern per row, masked by the row's validity at the end.
        item.row_max = [Int32(0), Int32(0)]

    def epilogue_visit(self, ctx, item, tile, subtile: int) -> None:
        """dh and act of the subtile from the accumulator and preact; the rows' dprob and
        amax partials; the subtile's column partials of dh for dbias (`item.columns`)."""
        tRS_rD = ctx.registers[0]
        tRS_rAct = ctx.registers[1] if self.with_act else None
        tRS_rPf = ctx.input_registers
        columns = []
        for v in range(ctx.sub_values):
            h = fragment.row_half(v)
            dh, act, dprob_term = squared_relu.backward(
                ctx.acc[subtile * ctx.sub_values + v], tRS_rPf[v], item.row_scale[h], item.prob[h])
            tRS_rD[v] = dh
            if self.with_act:
                tRS_rAct[v] = act
            item.row_sum[h] = item.row_sum[h] + dprob_term
            dh_bits = dh.bitcast(Int32) & Int32(_ABS_MASK)
            if self.n % self.tile_n != 0:
                # Padding columns of a partial N-tile: acc = r = 0 there, and an
                # infinite row scale would make their dh NaN; amax is over the
                # real columns only.
                column = tile.n_tile * self.tile_n + ctx.tCcAcc[subtile * ctx.sub_values + v][1]
                dh_bits = Int32(cutlass.select_(column < self.n, dh_bits, Int32(0)))
            item.row_max[h] = cutlass.max(item.row_max[h], dh_bits)
            if h == 0:  # the row-0 value of each column slot comes first
                columns.append(Float32(cutlass.select_(item.valid[0], dh, Float32(0.0))))
            else:
                q = fragment.column_slot(v)
                columns[q] = columns[q] + Float32(cutlass.select_(item.valid[1], dh, Float32(0.0)))
        item.columns = columns

    def epilogue_reduce(self, ctx, item, tile, subtile: int) -> None:
        if self.with_dbias:
            self._scatter_columns(item.columns, ctx.lane, ctx.warp, ctx.scratch, subtile)

    def epilogue_end(self, ctx, item, tile) -> None:
        """The tile's dprob, amax and dbias partials."""
        self._finish_rows(item.row_sum, item.alpha, item.valid, item.row0, ctx.tile_row, ctx.lane, tile.n_tile,
                          ctx.params.dprob)
        amax_bits = cutlass.max(
            Int32(cutlass.select_(item.valid[0], item.row_max[0], Int32(0))),
            Int32(cutlass.select_(item.valid[1], item.row_max[1], Int32(0))),
        )
        self._finish_amax(amax_bits, ctx.lane, tile.expert, ctx.params.amax)
        if self.with_dbias:
            self._finish_columns(ctx.scratch, ctx.ctid, tile.n_tile, tile.m_tile, tile.expert, ctx.params.dbias)

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
