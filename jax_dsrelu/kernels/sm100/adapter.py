"""cuDNN's Blackwell grouped GEMM + dsReLU kernel, launched from one JAX custom call.

The kernel is `BlockScaledMoEGroupedGemmQuantBwdKernel` from nvidia-cudnn-frontend 1.32
(`cudnn.gemm.cutedsl.grouped.dsrelu`), a CuTe DSL class; this module constructs it and
calls it from our own `@cute.jit` host function (`Sm100Call`) through the project's JAX
bridge (`jax_dsrelu.ffi.cutlass_bridge`, built on CuTe DSL's `cutlass.jax`), with no
torch and none of cuDNN's framework wrappers. Per call, on XLA's stream:

1. cuDNN's kernel: D = 2 relu(C) (alpha acc) prob (our dh), d_srelu = relu(C)^2 prob (our
   act), the per-expert amax of D, and dprob and dbias partials.
2. deterministic=True only: the shared slot-reduction pass
   (`jax_dsrelu.kernels.slot_reduction`, mapped onto cuDNN's slot layout in `slots.py`) on
   the same stream, summing the partials in a fixed order.

Determinism. With `deterministic=True` cuDNN's kernel gives every dprob partial its own
(row, N-tile) slot and every dbias partial its own (128-row M-tile, column) slot, so each
slot has exactly one writer, and sums each N-tile's subtiles in a fixed order; the
reduction pass then adds the slots in a fixed order, so dprob and dbias are bitwise
reproducible. With `deterministic=False` the kernel adds its partials into dprob and dbias
with atomics, in whatever order the CTAs finish: the last bits may change between runs.
dh, act and amax are written once per element (amax by an atomic max, which is exact) and
are reproducible in both modes.

Precision. cuDNN's kernel accumulates dbias partials as bfloat16: in deterministic mode each
128-row partial is rounded to bfloat16 once and the pass adds the partials in float32; in
the atomic mode every addition rounds to bfloat16. dprob partials stay float32 in both.

Layouts: slot workspaces are outputs of the call, zero-initialised by XLA (zeros passed in
and aliased to the outputs), because the kernel adds into them. D and d_srelu are plain
outputs: the kernel writes every padded row the bridge later reads.

Compiled and lowered for SM100 on machines without a Blackwell GPU; not executed there.
"""

from __future__ import annotations

import dataclasses
import functools

import cuda.bindings.driver as cuda
import cudnn
import cutlass
import cutlass.cute as cute
import jax.numpy as jnp
import numpy as np
from cudnn.gemm.cutedsl.grouped.dsrelu.moe_blockscaled_grouped_gemm_dsrelu_quant import (
    BlockScaledMoEGroupedGemmQuantBwdKernel,
    EpilogueType,
)
from cudnn.gemm.cutedsl.grouped.moe_utils import MoEWeightMode
from cutlass.cute.nvgpu import OperandMajorMode

from jax_dsrelu.kernels import request as request_facts
from jax_dsrelu.kernels.operands import M, KernelOperand, Rows, by_name, declaration
from jax_dsrelu.kernels.request import Request
from jax_dsrelu.kernels.slot_reduction import SlotReduction
from jax_dsrelu.kernels.sm100 import slots
from jax_dsrelu.kernels.sm100.config import Sm100Config
from jax_dsrelu.primitive_schema import GROUPED_GEMM_DSRELU

_F32, _I32, _BF16 = np.dtype(np.float32), np.dtype(np.int32), np.dtype(jnp.bfloat16)
_SCALE = np.dtype(jnp.float8_e8m0fnu)

# Persistent clusters to launch when no GPU is visible (compile-only lowering). B200 has 148
# SMs and this kernel fits one CTA per SM, so 74 two-CTA clusters. The number only sizes the
# persistent grid: the scheduler strides tiles by the grid, so any positive value computes
# the same result; a program lowered here and run elsewhere may just use its GPU less well.
COMPILE_ONLY_MAX_ACTIVE_CLUSTERS = 74


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """The static facts the compiled custom call depends on; the row count m is not one.

    `request` carries E, n, k and the dtypes, with prob's dtype fixed to float32 (the
    bridge casts prob), so every compile fact is here and nothing else is.
    """

    request: Request
    config: Sm100Config
    max_active_clusters: int
    cudnn_version: str = cudnn.__version__


def max_active_clusters(config: Sm100Config) -> int:
    """How many clusters of this kernel's shape fit on the visible GPU at once.

    Asked of the CUDA driver through CuTe DSL's occupancy query, as cuDNN does, when a CUDA
    device is visible; otherwise (compile-only use) the B200 figure above, since the
    driver cannot be asked without a device.
    """
    if request_facts.cuda_compute_capability() is None:
        return COMPILE_ONLY_MAX_ACTIVE_CLUSTERS
    cluster_size = config.cluster_shape_mn[0] * config.cluster_shape_mn[1]
    return cutlass.utils.HardwareInfo().get_max_active_clusters(cluster_size)


@functools.cache
def gemm_kernel(key: KernelKey) -> BlockScaledMoEGroupedGemmQuantBwdKernel:
    """cuDNN's kernel object for a key.

    Constructed directly rather than through cuDNN's GroupedGemmDsreluSm100 API, whose
    check_support probes the device (and refuses without an SM100 one) and which only
    accepts float8 D for float8 operands. The kernel itself accepts bfloat16, float16 and
    float32 D for MXFP8 operands (`can_implement`); with no output scale tensors it stores
    D unquantized, as its FP4 path does, and produces the per-expert amax.
    """
    config, request = key.config, key.request
    return BlockScaledMoEGroupedGemmQuantBwdKernel(
        # The tile configuration (config.py).
        sf_vec_size=config.sf_vec_size, use_2cta_instrs=config.use_2cta_instrs,
        mma_tiler_mn=config.mma_tiler_mn, cluster_shape_mn=config.cluster_shape_mn,
        # The call's static facts.
        expert_cnt=request.num_experts, generate_dbias=request.with_dbias, generate_d_srelu=request.with_act,
        deterministic=request.deterministic,
        # Fixed: float32 accumulation, dense weights, the static scheduler, the dsReLU
        # epilogue, D unquantized and without scale factors.
        acc_dtype=cutlass.Float32, weight_mode=MoEWeightMode.DENSE, use_dynamic_sched=False,
        epilogue_type=EpilogueType.DSRELU.value, vectorized_f32=False, generate_sfd=False,
        discrete_col_sfd=False, use_dsrelu_reuse=False,
    )


def _with_unit_batch(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols) -> (rows, cols, 1): the kernel's (M, N, L) view with one batch.

    The unit batch mode gets the stride a dense batch would have, not 0: the kernel builds
    TMA descriptors over all three modes, and that is the form cuDNN itself hands them.
    """
    rows, cols = t.shape
    row_stride, col_stride = t.stride
    return cute.make_tensor(t.iterator, cute.make_layout((rows, cols, 1), stride=(row_stride, col_stride, row_stride * rows)))


def _column(t: cute.Tensor, unit_modes: int) -> cute.Tensor:
    """(rows,) -> (rows, 1[, 1]): a per-row vector as the kernel indexes it."""
    shape = (t.shape[0],) + (1,) * unit_modes
    stride = (t.stride[0],) + (t.stride[0] * t.shape[0],) * unit_modes
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


class Sm100Call:
    """The custom call's host function for one key: cuDNN's kernel, then (deterministic
    mode) the reduction pass, on the stream XLA passes in. `__call__(stream, *tensors)`
    takes the buffers `operands()` declares, in that order."""

    def __init__(self, key: KernelKey):
        request = key.request
        self.request = request
        self.config = key.config
        self.gemm = gemm_kernel(key)
        self.with_act = request.with_act
        self.with_dbias = request.with_dbias
        self.deterministic = request.deterministic
        self.max_active_clusters = key.max_active_clusters
        self.reduction = None
        if request.deterministic:
            self.reduction = SlotReduction(num_experts=request.num_experts, tile_m=key.config.cta_tile_m)

    def operands(self) -> list[KernelOperand]:
        """The call's buffers, inputs and accumulators before outputs: the primitive's
        under its schema's names and shapes (`declare`), the rows extent M the padded row
        count (`layout.py`), and the kernel's own: the scales MMA-tiled, the padded
        segments and the slots. The
        accumulators are zero-filled by XLA and updated in place: dprob and dbias partials
        (deterministic: dprob_slots and dbias_slots, a slot per N-tile of each row and per
        CTA M-tile of each column; else dprob and dbias themselves, added by atomics, dbias
        in bfloat16) and amax."""
        r, config = self.request, self.config
        e, n, k = r.num_experts, r.n, r.k
        declare = declaration(GROUPED_GEMM_DSRELU, r, dict(e=e, n=n, k=k))
        scale_atoms = 512 * (-(-k // 128))  # MMA-tiled scale bytes per 128 rows (layout.tile_scales)
        plan = [
            declare("grad", "input", r.operand_dtype),
            declare("weight", "input", r.operand_dtype),
            declare("preact", "input", r.preact_dtype),
            KernelOperand("grad_scale_tiled", "input", _SCALE, (Rows(per=128, times=scale_atoms),)),
            KernelOperand("weight_scale_tiled", "input", _SCALE, (e * (-(-n // 128)) * scale_atoms,)),
            KernelOperand("padded_offsets", "input", _I32, (e,)),
        ]
        if self.deterministic:
            plan.append(KernelOperand("padded_sizes", "input", _I32, (e,)))
        plan += [declare("alpha", "input", _F32), declare("prob", "input", _F32)]
        if self.deterministic:
            plan.append(KernelOperand("dprob_slots", "accumulate", _F32, (M, config.dprob_slots(n))))
        else:
            plan.append(declare("dprob", "accumulate", _F32))
        if self.with_dbias:
            if self.deterministic:
                plan.append(KernelOperand("dbias_slots", "accumulate", _BF16, (Rows(per=config.cta_tile_m), n)))
            else:
                plan.append(declare("dbias", "accumulate", _BF16))
        plan += [declare("amax", "accumulate", _F32), declare("dh", "output", r.out_dtype)]
        if self.with_act:
            plan.append(declare("act", "output", r.out_dtype))
        if self.deterministic:
            plan.append(declare("dprob", "output", _F32))
            if self.with_dbias:
                plan.append(declare("dbias", "output", _F32))
        return plan

    @cute.jit
    def __call__(self, stream: cuda.CUstream, *tensors: cute.Tensor):
        t = by_name(self.operands(), tensors, type(self).__name__)
        padded_sizes = t.padded_sizes if cutlass.const_expr(self.deterministic) else None
        # The buffers cuDNN's kernel adds its dprob and dbias partials into: the slots in
        # deterministic mode, the results themselves with atomics.
        dprob_acc = t.dprob_slots if cutlass.const_expr(self.deterministic) else t.dprob
        dbias_acc = (
            (t.dbias_slots if cutlass.const_expr(self.deterministic) else t.dbias)
            if cutlass.const_expr(self.with_dbias) else None
        )
        act = t.act if cutlass.const_expr(self.with_act) else None

        if cutlass.const_expr(self.deterministic):
            dprob_kernel = _with_unit_batch(dprob_acc)
        else:
            dprob_kernel = _column(dprob_acc, 2)
        d_kernel = _with_unit_batch(t.dh)
        # cuDNN's names (A, B, C, D and their scale factors) appear only in this call.
        self.gemm(
            a=_with_unit_batch(t.grad),
            # Dense weights: the kernel sees B as (n, k, E) with k contiguous.
            b=cute.make_tensor(t.weight.iterator, cute.select(t.weight.layout, [1, 2, 0])),
            sfb=t.weight_scale_tiled,
            # n, k, b_stride_size and b_major_mode describe per-expert weight pointers
            # (cuDNN's discrete mode); dense weights carry them in b's layout.
            n=cutlass.Int32(0),
            k=cutlass.Int32(0),
            b_stride_size=cutlass.Int64(0),
            b_major_mode=OperandMajorMode.K,
            # Dense weights with the static scheduler use no workspace.
            workspace_ptr=cute.make_ptr(cutlass.Uint8, 0, cute.AddressSpace.gmem, assumed_align=128),
            c=_with_unit_batch(t.preact),
            d=d_kernel,
            # Unquantized D needs only a second TMA descriptor here, never written through.
            d_col=d_kernel,
            sfa=t.grad_scale_tiled,
            sfd_row_tensor=None,
            sfd_col_tensor=None,
            amax_tensor=_column(t.amax, 1),
            norm_const_tensor=None,
            padded_offsets=t.padded_offsets,
            alpha=t.alpha,
            prob=_column(t.prob, 2),
            dprob=dprob_kernel,
            dbias_tensor=_with_unit_batch(dbias_acc) if cutlass.const_expr(self.with_dbias) else None,
            d_srelu=_with_unit_batch(act) if cutlass.const_expr(self.with_act) else None,
            sfd_col_d_srelu_tensor=None,
            max_active_clusters=self.max_active_clusters,
            stream=stream,
        )
        if cutlass.const_expr(self.deterministic):
            dprob = t.dprob
            dbias = t.dbias if cutlass.const_expr(self.with_dbias) else None
            slots.reduce_cudnn_slots(dprob_acc, dbias_acc, padded_sizes, dprob, dbias, self.reduction, stream)
