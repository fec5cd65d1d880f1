"""How the sm90 backend presents itself to the registry. Imports no CuTe DSL.

Kernels not yet verified on the hardware they claim are compiled and lowered, but
no call uses them unless the environment variable `UNVERIFIED_VARIABLE` names their kind
(comma-separated), which the Hopper run that checks them sets: until then the primitives
gather rows themselves and run the verified kernels, and the gather-and-sum runs on XLA.
A kind leaves `UNVERIFIED_KINDS` once such a run has checked it and timed it faster than
what `backend="auto"` runs in its place; the variable may still name it
(`VERIFIED_KINDS`), to no effect.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Iterator, Mapping

import jax

from jax_dsrelu.kernels import software
from jax_dsrelu.kernels.request import (
    AnyRequest,
    GatherSumRequest,
    RaggedContractRequest,
    RaggedMatmulRequest,
    Request,
    RowQuantizeRequest,
    WeightQuantizeRequest,
)

NAME = "sm90"
DEVICE_DESCRIPTION = "Hopper GPUs (compute capability 9.0: H100, H200)"
REQUEST_KINDS = (Request, RaggedMatmulRequest, RaggedContractRequest, GatherSumRequest, WeightQuantizeRequest,
                 RowQuantizeRequest)

UNVERIFIED_VARIABLE = "JAX_DSRELU_SM90_UNVERIFIED"
# Kernel kinds not verified on an H200:
#   "gathered"    the GEMMs reading rows through a row index (`gathered_kernels.py`):
#                 the up-projection's x rows, the fused dsReLU kernel's dy rows, the
#                 weight gradients' x rows (dW1) and dy rows (dW2). Run at 13cf1f7: wrong
#                 rows from the fused kernel at Nano's widths, the block on them outside
#                 its check at nano_8k and varying within a process in both modes, and
#                 slower where it passed (benchmarks/results/bench_moe_block.json.gz,
#                 device_checks.log).
#   "gather_sum"  the ordered gather-and-sum (`gather_sum_kernel.py`). Run at 13cf1f7:
#                 bit for bit XLA's sequential sum, no memcheck error or racecheck hazard,
#                 and, in the block records, faster than XLA's fused gather-and-sum at
#                 one block of three and slower at two.
# The expert weights' quantizing pass (`block_quantize_kernel.py`, a `WeightQuantizeRequest`)
# left this list at 5aa3437: on an H100 its GPU tier passed (the recipe's oracle byte for
# byte, both layouts, into poisoned outputs), memcheck and racecheck were clean, and the FP8
# step on it took 10.9 ms at Nano's shape against 15.1 with XLA's quantizer.
# The FP8 GEMMs left it together (kinds "fp8" and "fp8_quantize"): the ragged-M GEMM
# (`blockwise_matmul_kernel.py`), the fused dsReLU kernel (`blockwise_dsrelu_kernel.py`), the
# weight gradients' contraction (`blockwise_contract_kernel.py`) and the pass that quantizes
# its operands straight into their K-major copies (`k_major_quantize_kernel.py`). On H100s
# their GPU tiers passed (float64 and the recipe's emulation, outputs poisoned, ragged and
# empty experts, experts of fewer rows than a scale group, 1 to 256 experts, Nano's
# widths; the contraction with its staged scales at 7f6a334 and the quantizing pass's
# raw-byte tile at 260cdac, each the same code at 8554063), and memcheck and racecheck were
# clean at their boundary cases (the contraction at 7f6a334, the quantizing pass at
# 8554063). Deterministic mode gave one digest of the layer's gradients over 4 processes
# at 7e94690, and the FP8 determinism tests passed at 8554063, both with dW's operands
# quantized by XLA and the copy kernel; the quantizing pass writes each byte once, by one
# thread, and its tier holds it to its formula byte for byte; the step on all of them
# (bench_layer's sm90_fp8_quantize) was within its check against XLA's path at both
# shapes at 895e92c (bench_layer_fp8.json.gz in git at fac393b). What "auto" ran in their
# place, XLA's FP8 path, took 270 ms and 8.1 s a step where they took 4.4 and 15.5 ms (an
# H100 at 895e92c, bench_layer_fp8.json.gz in git at fac393b); at 8554063 the FP8 step on
# them took 3.00 and 8.77 ms, still 1.26x and 1.47x the bf16 step's time
# (docs/fp8-kernels.md).
# The rows' quantizing pass (kind "fp8_rows": `row_quantize_kernel.py`, a `RowQuantizeRequest`;
# the FP8 GEMMs' A operands x, act, dy and dh quantized in one pass over the rows, act formed
# from h and prob as the pass reads them) left it at 57103cd. On an H100 its GPU tier passed
# (12 cases: the recipe's oracle byte for byte into poisoned outputs, the squared-ReLU form
# with negative, NaN and infinite h, a NaN prob and an overflowing square), memcheck and
# racecheck were clean (the squared-ReLU form's first run, 4 cases; the plain form, 2, and
# 7 at a6916f6), and the FP8 step on it took 2.82 and 8.37 ms against 2.96 and 8.64 with
# XLA's quantizer (bench_layer_fp8.json.gz at 57103cd: sm90_fp8_rows against sm90_fp8). Each
# byte and scale has one writer and the maxima are exact in any order. Before its
# squared-ReLU form (a6916f6) the step on it was 1.5-2.2% slower: XLA wrote the float32 act
# for it to read.
UNVERIFIED_KINDS = ("gathered", "gather_sum")
# Kinds that left the list: the variable may name them (as it was set while they were
# on it) without an error; "auto" runs them whether named or not.
VERIFIED_KINDS = ("fp8", "fp8_quantize", "fp8_rows")
# The operands of each request kind that the "gathered" kernels read through an index.
_GATHERED_OPERANDS = {
    Request: frozenset({"grad"}),
    RaggedMatmulRequest: frozenset({"lhs"}),
    RaggedContractRequest: frozenset({"lhs", "rhs"}),
}


def enabled(kind: str) -> bool:
    """Whether kernels of `kind` may serve calls: verified, or named in UNVERIFIED_VARIABLE."""
    if kind not in UNVERIFIED_KINDS:
        return True
    named = {name.strip() for name in os.environ.get(UNVERIFIED_VARIABLE, "").split(",") if name.strip()}
    unknown = named - set(UNVERIFIED_KINDS) - set(VERIFIED_KINDS)
    if unknown:
        raise ValueError(
            f"{UNVERIFIED_VARIABLE} names {sorted(unknown)}; the sm90 kernel kinds not yet verified are "
            f"{list(UNVERIFIED_KINDS)} (and {list(VERIFIED_KINDS)}, verified, may still be named)"
        )
    return kind in named


@contextlib.contextmanager
def unverified_enabled(*kinds: str, on: bool = True) -> Iterator[None]:
    """Within the block, functions traced may use the kernels of `kinds` (all of
    UNVERIFIED_KINDS if none is named): the switch set for the block's duration, as the
    H200 run's benchmarks set it to time them beside the verified kernels. It names exactly
    these kinds for the block, an outer setting's included. With on=False the block leaves
    the switch as it finds it (a script's variants with and without the kernels)."""
    unknown = set(kinds) - set(UNVERIFIED_KINDS)
    if unknown:
        raise ValueError(f"kinds names {sorted(unknown)}; the sm90 kernel kinds not yet verified are "
                         f"{list(UNVERIFIED_KINDS)}")
    if not on:
        yield
        return
    saved = os.environ.get(UNVERIFIED_VARIABLE)
    os.environ[UNVERIFIED_VARIABLE] = ",".join(kinds or UNVERIFIED_KINDS)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(UNVERIFIED_VARIABLE, None)
        else:
            os.environ[UNVERIFIED_VARIABLE] = saved


def software_missing() -> str | None:
    return software.missing("cutlass", "gpu")


def supports_compute_capability(capability: tuple[int, int]) -> bool:
    # wgmma and the sm_90a features the kernel uses exist on 9.0 only.
    return capability == (9, 0)


def cannot_implement(request: AnyRequest) -> str | None:
    from jax_dsrelu.kernels.sm90 import config, gather_sum_config

    if isinstance(request, WeightQuantizeRequest):
        from jax_dsrelu.kernels.sm90 import weight_quantize

        return weight_quantize.cannot_quantize(request)
    if isinstance(request, RowQuantizeRequest):
        from jax_dsrelu.kernels.sm90 import row_quantize

        return row_quantize.cannot_quantize_rows(request)
    if isinstance(request, GatherSumRequest):
        if not enabled("gather_sum"):
            return (f"the sm90 gather-and-sum kernel is not verified on an H200 (set {UNVERIFIED_VARIABLE}="
                    f"gather_sum to use it)")
        return gather_sum_config.cannot_implement(request)
    if isinstance(request, RaggedMatmulRequest):
        return config.cannot_implement_gemm(request)
    if isinstance(request, RaggedContractRequest):
        return config.cannot_implement_contract(request)
    return config.cannot_implement(request)


def gathers_rows(request: AnyRequest) -> frozenset[str]:
    """The operands of `request`'s primitive whose rows the kernels read through a row
    index themselves ("lhs" of a ragged matmul, "lhs" and "rhs" of the contraction,
    "grad" of the fused dsReLU kernel, not with MXFP8 operands); the primitives gather the others
    before calling `implementation` (see `jax_dsrelu.primitives.base`). None while the
    "gathered" kernels are unverified."""
    if not enabled("gathered") or getattr(request, "block_scaled", False) or getattr(request, "blockwise_scaled", False):
        return frozenset()
    return _GATHERED_OPERANDS.get(type(request), frozenset())


def implementation(request: AnyRequest) -> Callable[..., Mapping[str, jax.Array]]:
    if isinstance(request, Request):
        from jax_dsrelu.kernels.sm90 import dsrelu_call

        return dsrelu_call.implementation(request)
    if isinstance(request, GatherSumRequest):
        from jax_dsrelu.kernels.sm90 import gather_sum_call

        return gather_sum_call.implementation(request)
    if isinstance(request, WeightQuantizeRequest):
        from jax_dsrelu.kernels.sm90 import weight_quantize

        return weight_quantize.quantize_by_kernel  # the kernel is built from w's shape and dtype
    if isinstance(request, RowQuantizeRequest):
        from jax_dsrelu.kernels.sm90 import row_quantize

        return row_quantize.quantize_rows_by_kernel  # the kernel is built from x's width and dtype (and prob's)
    from jax_dsrelu.kernels.sm90 import ragged_call

    return ragged_call.implementation(request)
