"""The sm90 backend's implementation of the primitive: one custom call per use.

`implementation(request)` returns a function of the primitive's operands by name that the
primitive's CUDA lowering lowers in its place, returning the results by name: the kernel
declares its buffers under the primitive's names (`GroupedGemmDsreluSm90.operands`), so
operands pass straight through to the call and results straight back. It casts prob to float32, passes
zero-filled buffers for the atomically updated outputs (aliased in and out, so XLA fills
them on the call's stream), and emits one custom call whose host function launches the
GEMM kernel and, in deterministic mode, the slot reduction. Compiles are keyed on the
static facts of the request and the tile configuration only (`cutlass_bridge`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.kernels import operands as kernel_operands
from jax_dsrelu.kernels.operands import ROWS, SOURCE_ROWS
from jax_dsrelu.kernels.request import Request
from jax_dsrelu.kernels.sm90 import config as sm90_config
from jax_dsrelu.kernels.sm90.arch import ARCH, sm_count
from jax_dsrelu.kernels.sm90.dsrelu_kernel import GroupedGemmDsreluSm90
from jax_dsrelu.kernels.sm90.mainloop import MAX_ROWS

_F32 = np.dtype(np.float32)


@functools.cache
def _kernel(request: Request, config: sm90_config.TileConfig, gathered: str | None = None) -> GroupedGemmDsreluSm90:
    if gathered is not None:
        if gathered != "grad":
            raise ValueError(f"the fused kernel reads grad's rows through an index, not {gathered!r}'s")
        from jax_dsrelu.kernels.sm90.gathered_kernels import GatheredDsreluSm90

        return GatheredDsreluSm90(config, request)
    if request.blockwise_scaled:
        from jax_dsrelu.kernels.sm90.blockwise_dsrelu_kernel import BlockScaledDsreluSm90

        return BlockScaledDsreluSm90(config, request)
    return GroupedGemmDsreluSm90(config, request)


def kernel_request(request: Request) -> Request:
    """The request as the kernel sees it: prob arrives as float32 whatever its dtype, so
    prob's dtype is not a compile fact."""
    return dataclasses.replace(request, prob_dtype=_F32)


def operands(
    request: Request, config: sm90_config.TileConfig, *, gathered: str | None = None
) -> list[kernel_operands.KernelOperand]:
    """The kernel's declared operands for this request and config
    (`GroupedGemmDsreluSm90.operands`, or with gathered="grad", grad read through
    grad_index, `GatheredDsreluSm90.operands`)."""
    return _kernel(kernel_request(request), config, gathered).operands()


def _compile_key(request: Request, config: sm90_config.TileConfig, outputs_in_place: bool,
                 gathered: str | None = None):
    key = ("jax_dsrelu.sm90", request, config, outputs_in_place)
    return key + (f"gathered {gathered}",) if gathered else key


def compile_kernel(
    request: Request,
    config: sm90_config.TileConfig,
    *,
    outputs_in_place: bool = False,
    keep: bool = False,
    gathered: str | None = None,
) -> cutlass_bridge.Compiled:
    """The object code `implementation` runs for this request and config (compiled now,
    or found in the cache), with grad read through grad_index where gathered="grad".
    keep=True also returns its PTX and cubin."""
    request = kernel_request(request)
    kernel = _kernel(request, config, gathered)
    return kernel_operands.compile_kernel(
        kernel, _compile_key(request, config, outputs_in_place, gathered), kernel.operands(),
        arch=ARCH, outputs_in_place=outputs_in_place, keep=keep,
    )


def implementation(
    request: Request,
    config: sm90_config.TileConfig | None = None,
    *,
    outputs_in_place: bool = False,
) -> Callable[..., Mapping[str, jax.Array]]:
    """(grad=, weight=, preact=, prob=, group_sizes=, alpha=) -> {dh, dprob, [dbias],
    [act], amax}, and in deterministic mode the slot workspaces (dprob_slots,
    [dbias_slots]) beside them.

    With outputs_in_place=True the function takes `filled=`, a dict of pre-filled output
    buffers by name (dh, act, and in deterministic mode dprob, dbias and the slot
    workspaces), which the kernels update in place and return. Tests fill them with NaN
    to show that the kernels write every element they own.

    With `grad_index=` (m,) int32, grad is a source (T, k) whose rows grad[grad_index]
    the kernel reads itself (`gathered_kernels.GatheredDsreluSm90`, alone rather than in
    cluster pairs), with no (m, k) copy.
    """
    reason = sm90_config.cannot_implement(request)
    if reason is not None:
        raise NotImplementedError(f"backend='sm90' cannot serve this call: {reason}")
    request = kernel_request(request)
    if config is None:
        config = sm90_config.choose_config(request, sm_count())
    config.check_fits(request.num_experts, request.with_act, request.with_dbias, np.dtype(request.out_dtype).itemsize)

    def run(*, filled=None, **operands) -> dict[str, jax.Array]:
        gathered = "grad" if operands.get("grad_index") is not None else None
        num_rows = operands["preact"].shape[0]
        if num_rows > MAX_ROWS:
            raise NotImplementedError(
                f"backend='sm90' takes at most {MAX_ROWS} rows, got preact.shape={operands['preact'].shape}"
            )
        if num_rows == 0:
            return _no_rows(request)
        kernel_config = dataclasses.replace(config, cluster_n=1) if gathered else config
        kernel = _kernel(request, kernel_config, gathered)
        # The epilogue reads prob and alpha as float32 whatever their dtype.
        given = dict(operands, prob=operands["prob"].astype(jnp.float32), alpha=operands["alpha"].astype(jnp.float32))
        counts = {ROWS: num_rows}
        if gathered:
            given["grad_index"] = operands["grad_index"].astype(jnp.int32)
            counts[SOURCE_ROWS] = kernel_operands.source_rows(operands["grad"], num_rows, "grad")
        if outputs_in_place:
            given.update(filled)
        named = kernel_operands.call(kernel, _compile_key(request, kernel_config, outputs_in_place, gathered),
                                     kernel.operands(), given, counts, arch=ARCH,
                                     outputs_in_place=outputs_in_place)
        # The kernel takes the per-expert max of |dh| with an integer atomic max on the
        # float's bits, exact for the nonnegative values it sees.
        return dict(named, amax=lax.bitcast_convert_type(named["amax"], jnp.float32))

    return run


def _no_rows(request: Request) -> dict[str, jax.Array]:
    """m = 0 is static: no rows, so no expert owns any, and nothing needs a kernel."""
    n, num_experts = request.n, request.num_experts
    results = dict(dh=jnp.zeros((0, n), request.out_dtype), dprob=jnp.zeros((0,), jnp.float32),
                   amax=jnp.zeros((num_experts,), jnp.float32))
    if request.with_dbias:
        results["dbias"] = jnp.zeros((num_experts, n), jnp.float32)
    if request.with_act:
        results["act"] = jnp.zeros((0, n), request.out_dtype)
    return results
