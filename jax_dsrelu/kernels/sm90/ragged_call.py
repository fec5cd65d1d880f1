"""The sm90 grouped-GEMM kernels as JAX functions: one custom call each.

`implementation(request)` returns the function a primitive's CUDA lowering lowers in its
place, with the call signature documented on the request (`jax_dsrelu.kernels.request`):

    RaggedMatmulRequest, epilogue "none":  (lhs, rhs, group_sizes) -> (out,)
    RaggedMatmulRequest, epilogue "srelu": (lhs, rhs, group_sizes, prob, bias | None) -> (h, act)
    RaggedContractRequest:                 (lhs, rhs, group_sizes) -> (out,)

Every buffer is passed as it is stored; the kernels see permuted views of some (a mode
order, never a copy): rhs (E, k, n) or (E, n, k) as (n, k, E); the contraction's lhs
(m, a) and rhs (m, b) as (a, m) and (b, m), and its output (E, a, b) as (a, b, E). Every
output element is written by the kernels, so no output needs initialising. Compiles are
keyed on the request and the tile configuration only (`cutlass_bridge`): a new m or new
group sizes never recompile.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.ffi.cutlass_bridge import Operand
from jax_dsrelu.kernels.sm90.dsrelu_call import ARCH, sm_count
from jax_dsrelu.kernels.sm90 import config as sm90_config
from jax_dsrelu.kernels.sm90.mainloop import MAX_ROWS
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest

_F32 = np.dtype(np.float32)
_I32 = np.dtype(np.int32)
# How the kernels see rhs: (n, k, E) whichever way it is stored.
_RHS_MODES = {"kn": (2, 1, 0), "nk": (1, 2, 0)}


def _rows(dtype, rank: int = 2, mode=None) -> Operand:
    """A buffer whose first dimension is the row count m (varies without a recompile)."""
    return Operand(np.dtype(dtype), rank, varying=(0,), mode=mode)


def matmul_operands(request: RaggedMatmulRequest) -> tuple[list[Operand], list[Operand]]:
    """(inputs, outputs) of the ragged-M host function, in its order (ragged_matmul_kernel.py)."""
    dtype = request.operand_dtype
    inputs = [_rows(dtype), Operand(np.dtype(dtype), 3, mode=_RHS_MODES[request.rhs_layout]), Operand(_I32, 1)]
    outputs = [_rows(request.out_dtype)]
    if request.epilogue == "srelu":
        inputs.append(_rows(_F32, 1))
        if request.with_bias:
            inputs.append(Operand(_F32, 2))
        outputs.append(_rows(request.out_dtype))
    return inputs, outputs


def contract_operands(request: RaggedContractRequest) -> tuple[list[Operand], list[Operand]]:
    """(inputs, outputs) of the ragged-contraction host function, in its order."""
    dtype = request.operand_dtype
    inputs = [_rows(dtype, mode=(1, 0)), _rows(dtype, mode=(1, 0)), Operand(_I32, 1)]
    return inputs, [Operand(np.dtype(request.out_dtype), 3, mode=(1, 2, 0))]


@functools.cache
def _matmul_kernel(request: RaggedMatmulRequest, config: sm90_config.GemmConfig):
    from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90

    return RaggedGemmSm90(config, request)


@functools.cache
def _contract_kernel(request: RaggedContractRequest, config: sm90_config.ContractConfig):
    from jax_dsrelu.kernels.sm90.ragged_contract_kernel import RaggedContractSm90

    return RaggedContractSm90(config, request)


def _shapes(request, num_rows: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Array shapes of the host function's (inputs, outputs) for m = num_rows."""
    e = request.num_experts
    if isinstance(request, RaggedContractRequest):
        return [(num_rows, request.a), (num_rows, request.b), (e,)], [(e, request.a, request.b)]
    n, k = request.n, request.k
    rhs = (e, k, n) if request.rhs_layout == "kn" else (e, n, k)
    inputs = [(num_rows, k), rhs, (e,)]
    outputs = [(num_rows, n)]
    if request.epilogue == "srelu":
        inputs.append((num_rows,))
        if request.with_bias:
            inputs.append((e, n))
        outputs.append((num_rows, n))
    return inputs, outputs


def _kernel_and_operands(request, config):
    if isinstance(request, RaggedContractRequest):
        return _contract_kernel(request, config), contract_operands(request)
    return _matmul_kernel(request, config), matmul_operands(request)


def choose_config(request):
    if isinstance(request, RaggedContractRequest):
        return sm90_config.choose_contract_config(request, sm_count())
    return sm90_config.choose_gemm_config(request, sm_count())


def _compile_key(request, config, outputs_in_place: bool = False):
    return ("jax_dsrelu.sm90_gemm", request, config, outputs_in_place)


def compile_kernel(
    request, config=None, *, outputs_in_place: bool = False, keep: bool = False
) -> cutlass_bridge.Compiled:
    """The object code `implementation` runs for this request (compiled now, or found in
    the cache). keep=True also returns its PTX and cubin."""
    config = config or choose_config(request)
    kernel, (inputs, outputs) = _kernel_and_operands(request, config)
    in_shapes, out_shapes = _shapes(request, 1)
    described_inputs = list(zip(inputs, in_shapes))
    aliases = {}
    if outputs_in_place:
        aliases = {len(described_inputs) + j: j for j in range(len(outputs))}
        described_inputs += list(zip(outputs, out_shapes))
    return cutlass_bridge.compile_function(
        kernel,
        _compile_key(request, config, outputs_in_place),
        described_inputs,
        list(zip(outputs, out_shapes)),
        aliases,
        arch=ARCH,
        keep=keep,
    )


def implementation(
    request, config=None, *, outputs_in_place: bool = False
) -> Callable[..., tuple[jax.Array, ...]]:
    """The JAX function computing `request` with the sm90 kernel (signatures above).

    With outputs_in_place=True the function takes one more keyword argument, `filled`: a
    list of pre-filled output buffers, which the kernel overwrites in place (aliased in
    and out) and returns. Tests fill them with NaN to show that the kernel writes every
    element."""
    reason = (
        sm90_config.cannot_implement_contract(request)
        if isinstance(request, RaggedContractRequest)
        else sm90_config.cannot_implement_gemm(request)
    )
    if reason is not None:
        raise NotImplementedError(f"backend='sm90' cannot serve this call: {reason}")
    config = config or choose_config(request)
    config.check_fits(request)
    kernel, (inputs, outputs) = _kernel_and_operands(request, config)
    srelu = isinstance(request, RaggedMatmulRequest) and request.epilogue == "srelu"

    def run(lhs, rhs, group_sizes, prob=None, bias=None, *, filled=None):
        num_rows = lhs.shape[0]
        if num_rows > MAX_ROWS:
            raise NotImplementedError(f"backend='sm90' takes at most {MAX_ROWS} rows, got lhs.shape={lhs.shape}")
        in_shapes, out_shapes = _shapes(request, num_rows)
        if num_rows == 0:
            # m = 0 is static: no rows, no expert owns any, nothing needs a kernel.
            return tuple(jnp.zeros(shape, operand.dtype) for operand, shape in zip(outputs, out_shapes))
        arrays = [lhs, rhs, group_sizes]
        if srelu:
            arrays.append(prob.astype(jnp.float32))
            if request.with_bias:
                arrays.append(bias.astype(jnp.float32))
        call_inputs = list(zip(inputs, arrays))
        aliases = {}
        if outputs_in_place:
            aliases = {len(call_inputs) + j: j for j in range(len(outputs))}
            call_inputs += list(zip(outputs, filled))
        return tuple(
            cutlass_bridge.call(
                kernel,
                _compile_key(request, config, outputs_in_place),
                call_inputs,
                [(operand, jax.ShapeDtypeStruct(shape, operand.dtype)) for operand, shape in zip(outputs, out_shapes)],
                aliases,
                arch=ARCH,
            )
        )

    return run
