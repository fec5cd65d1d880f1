"""Ragged-M grouped GEMM for Hopper (sm_90a), in CuTe DSL, with a plain or squared-ReLU epilogue.

Math, with e(i) the expert owning row i (rows contiguous per expert, in expert order):

    acc[i, j] = lhs[i, :] . rhs[e(i)][:, j]        float32 accumulation, bf16/fp16 operands
    epilogue "none":  out[i, j] = acc              rounded once to out's dtype
    epilogue "srelu": h[i, j] = acc (+ bias[e, j]) rounded once to h's dtype;
                      act[i, j] = relu(h)^2 prob[i], from the rounded h (r keeps NaN:
                      relu is a select), rounded once; with_act=False: h alone
    rows owned by no expert: every output 0

It is the forward of a squared-ReLU expert MLP (the up-projection with its activation in
one kernel, then the down-projection) and its dx = dh @ W1[e]^T.

Features:
    - rhs read in place in either layout: stored (E, k, n) ("kn", N-major B, as W1 and
      W2 are for the forward) or (E, n, k) ("nk", K-major B, a weight read transposed);
      the declared mode order says which, wgmma takes both from shared memory, so no
      transpose is ever materialized.
    - A variant of the family's skeleton (`gemm_base.GemmSm90`) over the ragged-M work
      schedule (`ragged_m.RaggedMGemmSm90`): lhs is A, rhs B, out (h) and act the stored
      outputs; this file holds the operand declaration and the epilogue's hooks, in
      accumulator registers one (128 x epi_n) subtile at a time.
    - Deterministic by construction: every output element has one writer and one fixed
      summation order (the k loop), no atomics.

Constraints:
    - lhs and rhs bfloat16 or float16 (same type), outputs 16-bit float
    - n and k multiples of 8 (16-byte TMA rows); 1 <= E <= 512; fewer than 2^30 rows
"""

import dataclasses
from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass import Float32, Int32

from jax_dsrelu.kernels import squared_relu
from jax_dsrelu.kernels.operands import KernelOperand
from jax_dsrelu.kernels.request import RaggedMatmulRequest
from jax_dsrelu.kernels.sm90 import fragment
from jax_dsrelu.kernels.sm90.config import GemmConfig
from jax_dsrelu.kernels.sm90.epilogue_context import EpilogueContext
from jax_dsrelu.kernels.sm90.ragged_m import RaggedMGemmSm90
from jax_dsrelu.primitive_schema import RAGGED_MATMUL, RAGGED_MATMUL_SRELU

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
# How the kernel sees rhs, (n, k, E), whichever way it is stored: "kn" (E, k, n) has n
# contiguous (N-major B), "nk" (E, n, k) has k contiguous (K-major B).
_RHS_MODES = {"kn": (2, 1, 0), "nk": (1, 2, 0)}


@dataclasses.dataclass(eq=False, slots=True)
class UpProjectionContext(EpilogueContext):
    rounded_h: Any = None  # a subtile's h as stored (rounded), back in float32: act is made from it


class TileScalars(NamedTuple):
    """A work item's values loaded before its mainloop."""

    prob: list  # this thread's two rows' prob (0 past the expert)
    bias: list  # the bias of every column of this thread's accumulator ([] without bias)


class RaggedGemmSm90(RaggedMGemmSm90):
    """The kernel for one static configuration: the ragged-M GEMM with the plain or the
    squared-ReLU epilogue's hooks."""

    operand_a = "lhs"
    operand_b = "rhs"
    context_type = UpProjectionContext

    def __init__(self, config: GemmConfig, request: RaggedMatmulRequest):
        if request.rhs_layout not in ("kn", "nk"):
            raise ValueError(f"rhs_layout must be 'kn' or 'nk', got {request.rhs_layout!r}")
        if request.epilogue not in ("none", "srelu"):
            raise ValueError(f"epilogue must be 'none' or 'srelu', got {request.epilogue!r}")
        if request.with_bias and request.epilogue != "srelu":
            raise ValueError(f"with_bias=True needs epilogue='srelu' (only it adds a bias), got epilogue={request.epilogue!r}")
        if not request.with_act and request.epilogue != "srelu":
            raise ValueError(f"with_act=False needs epilogue='srelu' (only it stores an act), got epilogue={request.epilogue!r}")
        super().__init__(config, request.num_experts, request.n, request.k)
        self.check_operand_bytes(request.operand_dtype)
        self.request = request
        self.srelu = request.epilogue == "srelu"
        self.with_bias = request.with_bias
        self.with_act = self.srelu and request.with_act
        # With the FP8 promotion overlapped (two partial-sum buffers) the tile's bias values
        # held from before the mainloop spill registers (ptxas: 52 bytes, act or not), so
        # each subtile loads its columns' bias as it adds them.
        self.bias_per_subtile = self.with_bias and config.overlap_promotion
        self.whole_tile = config.whole_tile_store

    def operands(self) -> list[KernelOperand]:
        """lhs (m, k), rhs (E, k, n) or (E, n, k), group_sizes, [srelu: prob (m,) f32,
        [bias (E, n) f32]], out (m, n) (srelu: h), [srelu with act: act (m, n)]."""
        r, declare = self.request, self.declare
        plan = [
            declare("lhs", "input", r.operand_dtype),
            declare("rhs", "input", r.operand_dtype, mode=_RHS_MODES[r.rhs_layout]),
            declare("group_sizes", "input", _I32),
        ]
        if self.srelu:
            plan.append(declare("prob", "input", _F32))
            if self.with_bias:
                plan.append(declare("bias", "input", _F32))
        plan += [declare(name, "output", r.out_dtype) for name in self.stored_outputs()]
        return plan

    @property
    def primitive_schema(self):
        return RAGGED_MATMUL_SRELU if self.srelu else RAGGED_MATMUL

    def schema_sizes(self) -> dict[str, int]:
        return dict(e=self.num_experts, n=self.n, k=self.k)

    def stored_outputs(self) -> tuple[str, ...]:
        # The primitives' result names: ragged_matmul_srelu's h (and act), ragged_matmul's out.
        if self.srelu:
            return ("h", "act") if self.with_act else ("h",)
        return ("out",)

    def kernel_params(self, t) -> dict:
        return dict(
            group_sizes=t.group_sizes, prob=t.prob if self.with_act else None, bias=t.bias if self.with_bias else None,
            num_rows=cute.size(t.lhs, mode=[0]),
        )

    # ---------------------------------------------------------------- device side

    def epilogue_setup(self, ctx) -> None:
        if self.with_act:
            ctx.rounded_h = cute.make_rmem_tensor(ctx.sub_shape, Float32)

    def epilogue_prefetch(self, ctx, tile):
        """prob (for act) and the bias, loaded before the mainloop so that their latency
        hides behind it."""
        row0, rows_valid = self._tile_rows(tile)
        prob = [Float32(0.0), Float32(0.0)]
        if self.with_act:
            _, prob = self._row_probs(ctx.params.prob, ctx.tile_row, row0, rows_valid)
        bias = [] if self.bias_per_subtile else self._column_bias(ctx.params.bias, ctx.tCcAcc, tile)
        return TileScalars(prob=prob, bias=bias)

    # Both warpgroups multiply every tile, an expert's last one too (the default
    # `mma_active`): with the idle warpgroup's wgmma skipped, the up-projection was no
    # faster and down and dx 5-7% slower in the Nano step on the H200 (docs/sm90.md, "An
    # expert's last tile on one warpgroup").

    def epilogue_visit(self, ctx, item, tile, subtile: int) -> None:
        """out = acc; srelu: h = acc (+ bias), and act from h as stored: rounded first,
        then widened again (the store rounds h as it rounds out)."""
        tRS_rD = ctx.registers[0]
        for v in range(ctx.sub_values):
            tRS_rD[v] = ctx.acc[subtile * ctx.sub_values + v]
        if self.bias_per_subtile:
            for v in range(ctx.sub_values):
                tRS_rD[v] = tRS_rD[v] + self._bias_of(ctx.params.bias, ctx.tCcAcc, tile, subtile * ctx.sub_values + v)
        elif self.with_bias:
            for v in range(ctx.sub_values):
                tRS_rD[v] = tRS_rD[v] + item.bias[self._bias_slot(subtile * ctx.sub_values + v)]
        if self.with_act:
            tRS_rDout = ctx.outputs[0].rounded
            tRS_rDout.store(tRS_rD.load().to(self.out_dtype))
            ctx.rounded_h.store(tRS_rDout.load().to(Float32))
            tRS_rAct = ctx.registers[1]
            for v in range(ctx.sub_values):
                tRS_rAct[v] = squared_relu.activation(ctx.rounded_h[v], item.prob[fragment.row_half(v)])

    @staticmethod
    def _bias_slot(value: int) -> int:
        """The index in `_column_bias`'s list of accumulator value `value`'s column."""
        return fragment.column_slot(value)

    def _bias_of(self, mBias, tCcAcc, tile, value: int):
        """The bias of accumulator value `value`'s column (column 0's past n, where nothing
        is stored)."""
        column = tile.n_tile * self.tile_n + tCcAcc[value][1]
        return Float32(mBias[tile.expert, Int32(cutlass.select_(column < self.n, column, Int32(0)))])

    def _column_bias(self, mBias, tCcAcc, tile):
        """The bias of every column this thread's accumulator holds (column 0's past n,
        where nothing is stored), loaded before the mainloop so that the loads' latency
        hides behind it; [] without bias. Loaded in the epilogue instead, subtile by
        subtile (as `bias_per_subtile` does beside the FP8 overlapped promotion), the bf16
        up-projection took 4% more time at Nemotron-3 Nano's shape and 6% more at
        (65536, 2048, 768, 256) (sweep_gemm_bias_257da8f.json, under
        benchmarks/results/fine_grained/ at commit 03cb159)."""
        if not self.with_bias:
            return []
        return [self._bias_of(mBias, tCcAcc, tile, slot % 2 + 4 * (slot // 2)) for slot in range(cute.size(tCcAcc) // 2)]
