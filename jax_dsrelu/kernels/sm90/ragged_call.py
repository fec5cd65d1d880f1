"""The sm90 grouped-GEMM kernels as JAX functions: one custom call each.

`implementation(request)` returns the function a primitive's CUDA lowering lowers in its
place, with the call signature documented on the request (`jax_dsrelu.kernels.request`):

    RaggedMatmulRequest, epilogue "none":  (lhs, rhs, group_sizes) -> (out,)
    RaggedMatmulRequest, epilogue "srelu": (lhs, rhs, group_sizes, prob, bias | None) -> (h, act)
    RaggedContractRequest:                 (lhs, rhs, group_sizes) -> (out,)

Both also take `lhs_index=` (m,) int32, and the contraction `rhs_index=`: that operand is
then a source (T, ...) whose rows source[index] the kernel reads itself
(`gathered_kernels.py`, alone rather than in cluster pairs), with no (m, ...) copy of
them. Given both indices, the contraction reads lhs through its index and rhs's rows are
gathered in memory first.

The buffers are each kernel's declared operands (`operands`, from the kernel's
`operands()`): every one passed as it is stored, some seen by the kernel in another mode
order (a view, never a copy). Every output element is written by the kernels, so no
output needs initialising. Compiles are
keyed on the request and the tile configuration only (`cutlass_bridge`): a new m or new
group sizes never recompile.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.kernels import operands as kernel_operands
from jax_dsrelu.kernels.operands import ROWS, SOURCE_ROWS
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest
from jax_dsrelu.kernels.sm90 import config as sm90_config
from jax_dsrelu.kernels.sm90.arch import ARCH, sm_count
from jax_dsrelu.kernels.sm90.mainloop import MAX_ROWS


# The kernel classes reading an operand's rows through its row index, by operand.
_GATHERED_KERNELS = {
    (RaggedMatmulRequest, "lhs"): "GatheredRaggedGemmSm90",
    (RaggedContractRequest, "lhs"): "GatheredContractSm90",
    (RaggedContractRequest, "rhs"): "GatheredRhsContractSm90",
}


@functools.cache
def _kernel(request, config, gathered: str | None = None):
    if gathered is not None:
        from jax_dsrelu.kernels.sm90 import gathered_kernels

        return getattr(gathered_kernels, _GATHERED_KERNELS[type(request), gathered])(config, request)
    if isinstance(request, RaggedContractRequest):
        from jax_dsrelu.kernels.sm90.ragged_contract_kernel import RaggedContractSm90

        return RaggedContractSm90(config, request)
    from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90

    return RaggedGemmSm90(config, request)


def operands(request, config=None, *, gathered: str | None = None) -> list[kernel_operands.KernelOperand]:
    """The kernel's declared operands for this request and config (the chosen one by
    default): `RaggedGemmSm90.operands`, `RaggedContractSm90.operands`, or with the
    operand `gathered` ("lhs", "rhs") read through its row index their gathered variants'."""
    return _kernel(request, config or choose_config(request, gathered=gathered), gathered).operands()


def choose_config(request, *, gathered: str | None = None):
    """The chosen config; with an operand read through its row index, alone: each CTA
    gathers its own rows."""
    if isinstance(request, RaggedContractRequest):
        config = sm90_config.choose_contract_config(request, sm_count())
    else:
        config = sm90_config.choose_gemm_config(request, sm_count())
    return dataclasses.replace(config, cluster_n=1) if gathered else config


def _compile_key(request, config, outputs_in_place: bool = False, gathered: str | None = None):
    key = ("jax_dsrelu.sm90_gemm", request, config, outputs_in_place)
    return key + (f"gathered {gathered}",) if gathered else key


def compile_kernel(
    request, config=None, *, outputs_in_place: bool = False, keep: bool = False, gathered: str | None = None
) -> cutlass_bridge.Compiled:
    """The object code `implementation` runs for this request (compiled now, or found in
    the cache), with the operand `gathered` read through its row index where given.
    keep=True also returns its PTX and cubin."""
    config = config or choose_config(request, gathered=gathered)
    kernel = _kernel(request, config, gathered)
    return kernel_operands.compile_kernel(
        kernel, _compile_key(request, config, outputs_in_place, gathered), kernel.operands(),
        arch=ARCH, outputs_in_place=outputs_in_place, keep=keep,
    )


def implementation(
    request, config=None, *, outputs_in_place: bool = False
) -> Callable[..., tuple[jax.Array, ...]]:
    """The JAX function computing `request` with the sm90 kernel (signatures above).

    With outputs_in_place=True the function takes one more keyword argument, `filled`: a
    dict of pre-filled output buffers by name (the declared outputs), which the kernel
    overwrites in place (aliased in and out) and returns. Tests fill them with NaN to
    show that the kernel writes every element. `config`, where given, serves the call
    without a row index; with one, the gathered kernel takes it alone (cluster_n = 1)."""
    reason = (
        sm90_config.cannot_implement_contract(request)
        if isinstance(request, RaggedContractRequest)
        else sm90_config.cannot_implement_gemm(request)
    )
    if reason is not None:
        raise NotImplementedError(f"backend='sm90' cannot serve this call: {reason}")
    config = config or choose_config(request)
    config.check_fits(request)
    srelu = isinstance(request, RaggedMatmulRequest) and request.epilogue == "srelu"

    def run(lhs, rhs, group_sizes, prob=None, bias=None, *, filled=None, lhs_index=None, rhs_index=None):
        if lhs_index is not None and rhs_index is not None:
            # One operand is gathered in the kernel; the other's rows are read in memory.
            rhs, rhs_index = jnp.take(rhs, rhs_index, axis=0, mode="clip"), None
        gathered, index = next(((name, index) for name, index in (("lhs", lhs_index), ("rhs", rhs_index))
                                if index is not None), (None, None))
        num_rows = index.shape[0] if gathered else lhs.shape[0]
        if num_rows > MAX_ROWS:
            raise NotImplementedError(f"backend='sm90' takes at most {MAX_ROWS} rows, got {num_rows}")
        kernel_config = dataclasses.replace(config, cluster_n=1) if gathered else config
        kernel = _kernel(request, kernel_config, gathered)
        outputs = [o for o in kernel.operands() if o.role == "output"]
        if num_rows == 0:
            # m = 0 is static: no rows, no expert owns any, nothing needs a kernel.
            return tuple(jnp.zeros(o.shape_for({ROWS: 0}), o.dtype) for o in outputs)
        given = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes)
        counts = {ROWS: num_rows}
        if gathered:
            given[f"{gathered}_index"] = index.astype(jnp.int32)
            counts[SOURCE_ROWS] = kernel_operands.source_rows(given[gathered], num_rows, gathered)
        if srelu:
            given["prob"] = prob.astype(jnp.float32)
            if request.with_bias:
                given["bias"] = bias.astype(jnp.float32)
        if outputs_in_place:
            given.update(filled)
        named = kernel_operands.call(kernel, _compile_key(request, kernel_config, outputs_in_place, gathered),
                                     kernel.operands(), given, counts, arch=ARCH,
                                     outputs_in_place=outputs_in_place)
        return tuple(named[o.name] for o in outputs)

    return run

