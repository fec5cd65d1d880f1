"""The one tile configuration of cuDNN's Blackwell kernel that this backend drives, and what
follows from it: row padding, slot counts, and which requests the kernel can serve.

Pure Python (no CuTe DSL, no cuDNN), so backend choice, the layout bridge and the CPU tests can
all ask it. It is the single source of truth for these numbers: the bridge pads with them,
the adapter sizes the slot workspaces with them, and `cannot_implement` states the
constraints that cuDNN's `BlockScaledMoEGroupedGemmQuantBwdKernel.can_implement` checks for
the shapes this backend produces.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_dsrelu.quantization import mx
from jax_dsrelu.kernels.request import Request

_MXFP8_DTYPES = tuple(np.dtype(d) for d in mx.ELEMENT_DTYPES)
# D, the regenerated activation and C (preact) may be any of these in the kernel; float8 D
# would need cuDNN's output quantization, which the contract has no place for.
_FLOAT_DTYPES = tuple(np.dtype(d) for d in ("bfloat16", "float16", "float32"))
_MAX_EXPERTS = 1024  # the kernel keeps per-expert state in fixed-size tables


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class Sm100Config:
    """cuDNN's default for this kernel: a 256x256 MMA tile issued by a pair of CTAs (the
    2-SM tcgen05 MMA), so each CTA's epilogue owns 128 rows; clusters of 2 CTAs along M.

    The kernel also accepts a 128-row 1-SM tile; this backend uses the 2-SM one only, so
    every compiled variant has been compiled (see tests/test_sm100_compile.py).
    """

    mma_tiler_mn: tuple[int, int] = (256, 256)
    cluster_shape_mn: tuple[int, int] = (2, 1)
    # The kernel pads every expert's row segment to a multiple of this (its FIX_PAD_SIZE).
    segment_rows: int = 256
    sf_vec_size: int = mx.BLOCK_SIZE

    def __post_init__(self):
        if self.mma_tiler_mn != (256, 256) or self.cluster_shape_mn != (2, 1):
            raise ValueError(
                f"only mma_tiler_mn=(256, 256) with cluster_shape_mn=(2, 1) is compiled and "
                f"tested, got mma_tiler_mn={self.mma_tiler_mn}, cluster_shape_mn={self.cluster_shape_mn}"
            )

    @property
    def use_2cta_instrs(self) -> bool:
        return self.mma_tiler_mn[0] == 256

    @property
    def cta_tile_m(self) -> int:
        """Rows one CTA's epilogue owns: the row granularity of a dbias slot."""
        return self.mma_tiler_mn[0] // (2 if self.use_2cta_instrs else 1)

    def padded_rows(self, num_rows: int, num_experts: int) -> int:
        """Static row extent of the padded layout, enough for any group sizes.

        Each expert's clamped rows round up to a multiple of segment_rows, adding at most
        segment_rows - 1 rows per expert.
        """
        bound = num_rows + (self.segment_rows - 1) * num_experts
        return _ceil_div(bound, self.segment_rows) * self.segment_rows

    def dprob_slots(self, n: int) -> int:
        """dprob slots per row in deterministic mode: one per N-tile the scheduler can emit.

        The scheduler counts whole clusters along N and expands them to CTAs, so the count
        rounds up to a multiple of the cluster's N extent, not just to whole tiles.
        """
        cluster_n = self.cluster_shape_mn[1]
        return _ceil_div(n, self.mma_tiler_mn[1] * cluster_n) * cluster_n

    def dbias_slots(self, padded_rows: int) -> int:
        """dbias slot rows in deterministic mode: one per CTA M-tile of the padded rows.

        Single writers need the scheduler to emit no tile past an expert's segment: it
        emits ceil(rows / (cta_tile_m * cluster_m)) * cluster_m tiles per expert, exact
        because segment_rows is a multiple of cta_tile_m * cluster_m.
        """
        return padded_rows // self.cta_tile_m


CONFIG = Sm100Config()


def cannot_implement(request: Request) -> str | None:
    """Why cuDNN's kernel cannot serve this request, or None when it can."""
    if not request.block_scaled:
        return (
            "cuDNN's Blackwell kernel takes MXFP8 operands only (float8 grad and weight with "
            f"grad_scale and weight_scale), got {request.operand_dtype.name} operands"
        )
    if request.operand_dtype not in _MXFP8_DTYPES:
        return f"operands must be float8_e4m3fn or float8_e5m2, got {request.operand_dtype.name}"
    if not 1 <= request.num_experts <= _MAX_EXPERTS:
        return f"the kernel takes 1 to {_MAX_EXPERTS} experts, got E={request.num_experts}"
    if request.n % 64:
        return f"n={request.n} must be a multiple of 64 for the kernel's epilogue tiling"
    if request.preact_dtype not in _FLOAT_DTYPES:
        return f"preact must be bfloat16, float16 or float32, got {request.preact_dtype.name}"
    if request.out_dtype not in _FLOAT_DTYPES:
        return f"out_dtype must be bfloat16, float16 or float32, got {request.out_dtype.name}"
    return None
