"""The sm90 gather-and-sum as a JAX function: one custom call (`gather_sum_kernel.py`).

`implementation(request)` returns (rows=, index=) -> {out}, the call documented on
`GatherSumRequest`, by the names the kernel declares for its buffers. The buffers are the kernel's declared operands; m and T are run-time
extents, so a new token count or a new row count reuses the compiled kernel, which is
keyed on the request alone.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from jax_dsrelu.ffi import cutlass_bridge
from jax_dsrelu.kernels import operands as kernel_operands
from jax_dsrelu.kernels.operands import ROWS, SOURCE_ROWS
from jax_dsrelu.kernels.request import GatherSumRequest
from jax_dsrelu.kernels.sm90 import gather_sum_config
from jax_dsrelu.kernels.sm90.arch import ARCH
from jax_dsrelu.kernels.sm90.gather_sum_kernel import GatherSumSm90


@functools.cache
def _kernel(request: GatherSumRequest) -> GatherSumSm90:
    return GatherSumSm90(request)


def operands(request: GatherSumRequest) -> list[kernel_operands.KernelOperand]:
    """The kernel's declared operands (`GatherSumSm90.operands`)."""
    return _kernel(request).operands()


def _compile_key(request: GatherSumRequest):
    return ("jax_dsrelu.sm90_gather_sum", request)


def compile_kernel(request: GatherSumRequest, *, keep: bool = False) -> cutlass_bridge.Compiled:
    """The object code `implementation` runs for this request (compiled now, or found in
    the cache). keep=True also returns its PTX and cubin."""
    kernel = _kernel(request)
    return kernel_operands.compile_kernel(kernel, _compile_key(request), kernel.operands(), arch=ARCH, keep=keep)


def implementation(request: GatherSumRequest) -> Callable[..., Mapping[str, jax.Array]]:
    """(rows= (m, n), index= (T, slots) int32) -> {out: (T, n) float32}."""
    reason = gather_sum_config.cannot_implement(request)
    if reason is not None:
        raise NotImplementedError(f"backend='sm90' cannot serve this call: {reason}")
    kernel = _kernel(request)
    key = _compile_key(request)

    def run(*, rows, index) -> dict[str, jax.Array]:
        num_rows, tokens = rows.shape[0], index.shape[0]
        if tokens == 0:
            return dict(out=jnp.zeros((0, request.n), jnp.float32))
        if num_rows == 0:
            raise ValueError(
                f"gather_sum cannot read rows of an empty rows array: rows.shape={rows.shape}, "
                f"index.shape={index.shape} (every token reads {request.slots} rows)"
            )
        return kernel_operands.call(
            kernel, key, kernel.operands(), dict(rows=rows, index=index.astype(jnp.int32)),
            {ROWS: num_rows, SOURCE_ROWS: tokens}, arch=ARCH,
        )

    return run
