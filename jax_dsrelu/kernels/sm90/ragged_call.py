"""The sm90 grouped-GEMM kernels as JAX functions: one custom call each.

`implementation(request)` returns the function a primitive's CUDA lowering lowers in its
place: the primitive's operands by name in, its results by name out, the names those the
kernels declare for their buffers (`jax_dsrelu.kernels.request` documents each call):

    RaggedMatmulRequest, epilogue "none":  (lhs=, rhs=, group_sizes=) -> {out}
    RaggedMatmulRequest, epilogue "srelu": (lhs=, rhs=, group_sizes=, prob=, [bias=]) -> {h, act}, or {h}
                                           with with_act=False
    RaggedMatmulRequest, block_scaled:     the same, with lhs_scale= and rhs_scale= (FP8)
    RaggedContractRequest:                 (lhs=, rhs=, group_sizes=) -> {out}
    RaggedContractRequest, block_scaled:   the same, with lhs_scale= and rhs_scale= (FP8), the
                                           kernel reading K-major copies (`contract_layout.py`)
    RaggedContractRequest, quantized_from: (lhs=, rhs=, group_sizes=) unquantized -> {out}: quantized
                                           into those copies first, then the block-scaled kernel

Both (16-bit) also take `lhs_index=` (m,) int32, and the contraction `rhs_index=`: that operand is
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
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.kernels import operands as kernel_operands
from jax_dsrelu.kernels.operands import ROWS
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest
from jax_dsrelu.kernels.sm90 import config as sm90_config
from jax_dsrelu.kernels.sm90 import contract_layout
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
        if request.block_scaled:
            from jax_dsrelu.kernels.sm90.blockwise_contract_kernel import BlockScaledContractSm90

            return BlockScaledContractSm90(config, request)
        from jax_dsrelu.kernels.sm90.ragged_contract_kernel import RaggedContractSm90

        return RaggedContractSm90(config, request)
    if request.block_scaled:
        from jax_dsrelu.kernels.sm90.blockwise_matmul_kernel import BlockScaledRaggedGemmSm90

        return BlockScaledRaggedGemmSm90(config, request)
    from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90

    return RaggedGemmSm90(config, request)


def operands(request, config=None, *, gathered: str | None = None) -> list[kernel_operands.KernelOperand]:
    """The kernel's declared operands for this request and config (the chosen one by
    default): `RaggedGemmSm90.operands`, `RaggedContractSm90.operands`, or with the
    operand `gathered` ("lhs", "rhs") read through its row index their gathered variants'."""
    request = kernel_request(request)
    return _kernel(request, config or choose_config(request, gathered=gathered), gathered).operands()


def kernel_request(request):
    """The request the GEMM kernel serves: a contraction quantized here is the block-scaled
    one once its operands are quantized (one kernel, one compile, for both)."""
    if isinstance(request, RaggedContractRequest) and request.quantized_from is not None:
        return dataclasses.replace(request, quantized_from=None)
    return request


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
    request = kernel_request(request)
    config = config or choose_config(request, gathered=gathered)
    kernel = _kernel(request, config, gathered)
    return kernel_operands.compile_kernel(
        kernel, _compile_key(request, config, outputs_in_place, gathered), kernel.operands(),
        arch=ARCH, outputs_in_place=outputs_in_place, keep=keep,
    )


def implementation(
    request, config=None, *, outputs_in_place: bool = False
) -> Callable[..., Mapping[str, jax.Array]]:
    """The JAX function computing `request` with the sm90 kernel (signatures above).

    With outputs_in_place=True the function takes one more keyword argument, `filled`: a
    dict of pre-filled output buffers by name (the declared outputs), which the kernel
    overwrites in place (aliased in and out) and returns. Tests fill them with NaN to
    show that the kernel writes every element. `config`, where given, serves the call
    without a row index; with one, the gathered kernel takes it alone (cluster_n = 1).
    A contraction quantizing its operands does so by the quantizing pass
    (`contract_layout.quantized_k_major_operands`)."""
    quantized_here = isinstance(request, RaggedContractRequest) and request.quantized_from is not None
    request = kernel_request(request)
    reason = (
        sm90_config.cannot_implement_contract(request)
        if isinstance(request, RaggedContractRequest)
        else sm90_config.cannot_implement_gemm(request)
    )
    if reason is not None:
        raise NotImplementedError(f"backend='sm90' cannot serve this call: {reason}")
    config = config or choose_config(request)
    config.check_fits(request)

    def run(*, filled=None, **operands) -> dict[str, jax.Array]:
        given = dict(operands)
        if given.get("lhs_index") is not None and given.get("rhs_index") is not None:
            # One operand is gathered in the kernel; the other's rows are read in memory.
            given["rhs"] = jnp.take(given.pop("rhs"), given.pop("rhs_index"), axis=0, mode="clip")
        gathered = next((name for name in ("lhs", "rhs") if given.get(f"{name}_index") is not None), None)
        num_rows = given[f"{gathered}_index" if gathered else "lhs"].shape[0]
        if num_rows > MAX_ROWS:
            raise NotImplementedError(f"backend='sm90' takes at most {MAX_ROWS} rows, got {num_rows}")
        kernel_config = dataclasses.replace(config, cluster_n=1) if gathered else config
        kernel = _kernel(request, kernel_config, gathered)
        if num_rows == 0:
            # m = 0 is static: no rows, no expert owns any, nothing needs a kernel.
            return {o.name: jnp.zeros(o.shape_for({ROWS: 0}), o.dtype) for o in kernel.operands() if o.role == "output"}
        counts = {ROWS: num_rows}
        if isinstance(request, RaggedContractRequest) and request.block_scaled:
            # The kernel reads K-major copies whose rows are the groups' padded rows.
            operands = given.pop("lhs"), given.pop("rhs"), given.pop("group_sizes")
            given.update(contract_layout.quantized_k_major_operands(*operands)
                         if quantized_here else contract_layout.k_major_operands(*operands))
            counts = {ROWS: contract_layout.padded_rows(num_rows, request.num_experts)}
            if counts[ROWS] > MAX_ROWS:
                raise NotImplementedError(f"backend='sm90' takes at most {MAX_ROWS} padded rows, got {counts[ROWS]}")
        if gathered:
            given[f"{gathered}_index"] = given[f"{gathered}_index"].astype(jnp.int32)
            # The count the source's rows are declared with (the schema's letter for them).
            source_count = kernel.operand(gathered).shape[0].of
            counts[source_count] = kernel_operands.source_rows(given[gathered], num_rows, gathered)
        # The srelu epilogue reads prob and bias as float32 whatever their dtype.
        for name in ("prob", "bias"):
            if given.get(name) is not None:
                given[name] = given[name].astype(jnp.float32)
        if outputs_in_place:
            given.update(filled)
        return kernel_operands.call(kernel, _compile_key(request, kernel_config, outputs_in_place, gathered),
                                    kernel.operands(), given, counts, arch=ARCH, outputs_in_place=outputs_in_place)

    return run

