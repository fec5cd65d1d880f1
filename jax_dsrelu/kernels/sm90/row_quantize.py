"""Activation rows quantized for the FP8 GEMMs' A operands by one custom call
(`row_quantize_kernel.py`): x (m, k) in 1 x 128 blocks along each row, its values and
scales as `quantization.blockwise.quantize_blockwise` makes them; given prob (m,), of the
squared-ReLU activation relu(x)**2 * prob[:, None] formed in float32 (x a pre-activation).
It reads x once where XLA's quantizer reads it for the maxima and again for the values
(and, in the squared-ReLU form, writes the float32 activation first)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu.kernels.request import RowQuantizeRequest, row_quantize_request
from jax_dsrelu.kernels.sm90.arch import ARCH
from jax_dsrelu.quantization.blockwise import INPUT_DTYPES
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE

_BLOCK = FP8_BLOCKWISE.activations.block[1]  # the kernel's blocks along a row


def cannot_quantize_rows(request: RowQuantizeRequest) -> str | None:
    """Why the kernel does not take these rows, or None: it takes x (m, k) of k a positive
    multiple of 16 (every row then starts 16-byte aligned for the loads and 8-byte aligned
    for the stores, in every dtype; the FP8 GEMMs ask as much of K), in bfloat16, float16
    or float32."""
    if request.k <= 0 or request.k % 16:
        return f"the sm90 row quantizer takes rows of k a positive multiple of 16, got k={request.k}"
    if np.dtype(request.rows_dtype) not in INPUT_DTYPES:
        return (f"the sm90 row quantizer takes bfloat16, float16 or float32 rows, got "
                f"{np.dtype(request.rows_dtype).name}")
    if request.prob_dtype is not None and np.dtype(request.prob_dtype) not in INPUT_DTYPES:
        return (f"the sm90 row quantizer takes bfloat16, float16 or float32 prob, got "
                f"{np.dtype(request.prob_dtype).name}")
    return None


@functools.cache
def row_quantize_kernel(k: int, dtype, prob_dtype=None):
    """The pass for rows of width k in dtype; given prob_dtype, its squared-ReLU form."""
    from jax_dsrelu.kernels.sm90 import row_quantize_kernel as kernels  # CuTe DSL: the 'gpu' extra

    if prob_dtype is None:
        return kernels.RowQuantizeSm90(k, dtype)
    return kernels.SquaredReluRowQuantizeSm90(k, dtype, prob_dtype)


def _key(k: int, dtype, prob_dtype, outputs_in_place: bool):
    return ("jax_dsrelu.sm90_row_quantize", k, np.dtype(dtype).name,
            None if prob_dtype is None else np.dtype(prob_dtype).name, outputs_in_place)


def compile_row_quantize_kernel(k: int, dtype, prob_dtype=None, *, outputs_in_place: bool = False,
                                keep: bool = False):
    """The pass's object code (compiled now, or found in the cache); keep=True also returns its PTX and cubin."""
    from jax_dsrelu.kernels import operands as kernel_operands  # CuTe DSL: the 'gpu' extra

    prob_dtype = None if prob_dtype is None else np.dtype(prob_dtype)
    kernel = row_quantize_kernel(k, np.dtype(dtype), prob_dtype)
    return kernel_operands.compile_kernel(kernel, _key(k, dtype, prob_dtype, outputs_in_place), kernel.operands(),
                                          arch=ARCH, outputs_in_place=outputs_in_place, keep=keep)


def quantize_rows_by_kernel(x: jax.Array, filled: dict[str, jax.Array] | None = None,
                            prob: jax.Array | None = None) -> dict[str, jax.Array]:
    """{values (m, k) e4m3, scales (m, ceil(k / 128)) float32} of x (m, k), or given prob
    (m,) of relu(x)**2 * prob[:, None] (`cannot_quantize_rows`). With `filled` (those two
    arrays) the kernel writes into them (the tests poison them first). No rows: empty
    outputs, and no launch."""
    from jax_dsrelu.kernels import operands as kernel_operands  # CuTe DSL: the 'gpu' extra

    if x.ndim != 2:
        raise ValueError(f"the row quantizer takes x (m, k), got x.shape={tuple(x.shape)}")
    if prob is not None and tuple(prob.shape) != x.shape[:1]:
        raise ValueError(f"the row quantizer takes prob (m,) = {x.shape[:1]} for x {tuple(x.shape)}, "
                         f"got prob.shape={tuple(prob.shape)}")
    request = row_quantize_request(x, prob)
    reason = cannot_quantize_rows(request)
    if reason is not None:
        given = "" if prob is None else f", prob {np.dtype(prob.dtype).name}{tuple(prob.shape)}"
        raise ValueError(f"{reason}; x is {np.dtype(x.dtype).name}{tuple(x.shape)}{given}")
    m, k = x.shape
    if m == 0:
        return dict(values=jnp.zeros((0, k), jnp.float8_e4m3fn), scales=jnp.zeros((0, -(-k // _BLOCK)), jnp.float32))
    in_place = filled is not None
    kernel = row_quantize_kernel(k, np.dtype(x.dtype), request.prob_dtype)
    given = dict(x=x, **({} if prob is None else {"prob": prob}), **(filled or {}))
    return kernel_operands.call(kernel, _key(k, x.dtype, request.prob_dtype, in_place), kernel.operands(), given,
                                {kernel_operands.ROWS: m}, arch=ARCH, outputs_in_place=in_place)
