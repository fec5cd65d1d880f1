"""Expert weights quantized for the FP8 GEMMs by one custom call (`block_quantize_kernel.py`):
w (E, N, K) in 128 x 128 blocks, its values in w's layout and transposed, and the scales,
as `quantization.blockwise.quantize_blockwise` makes the first and the third. It reads w
once where XLA's quantizer reads it for the maxima and again for the values, and writes
the transposed copy from the same pass where XLA transposes the values in another."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jax_dsrelu.kernels.request import WeightQuantizeRequest, weight_quantize_request
from jax_dsrelu.kernels.sm90.arch import ARCH
from jax_dsrelu.quantization.blockwise import INPUT_DTYPES


def cannot_quantize(request: WeightQuantizeRequest) -> str | None:
    """Why the kernel does not take this weight, or None: it takes (E, N, K) of E positive and
    N and K positive multiples of 16 (every 16-byte piece inside w), in bfloat16, float16 or
    float32."""
    if request.num_experts <= 0 or request.n <= 0 or request.k <= 0 or request.n % 16 or request.k % 16:
        return (f"the sm90 weight quantizer takes w (E, N, K) of E positive and N and K positive multiples of 16, "
                f"got ({request.num_experts}, {request.n}, {request.k})")
    if np.dtype(request.weight_dtype) not in INPUT_DTYPES:
        return (f"the sm90 weight quantizer takes bfloat16, float16 or float32 weights, got "
                f"{np.dtype(request.weight_dtype).name}")
    return None


@functools.cache
def block_quantize_kernel(num_experts: int, n: int, k: int, dtype):
    from jax_dsrelu.kernels.sm90.block_quantize_kernel import BlockQuantizeSm90  # CuTe DSL: the 'gpu' extra

    return BlockQuantizeSm90(num_experts, n, k, dtype)


def _key(num_experts: int, n: int, k: int, dtype, outputs_in_place: bool):
    return ("jax_dsrelu.sm90_block_quantize", num_experts, n, k, np.dtype(dtype).name, outputs_in_place)


def compile_block_quantize_kernel(num_experts: int, n: int, k: int, dtype, *, outputs_in_place: bool = False,
                                  keep: bool = False):
    """The pass's object code (compiled now, or found in the cache); keep=True also returns its PTX and cubin."""
    from jax_dsrelu.kernels import operands as kernel_operands  # CuTe DSL: the 'gpu' extra

    kernel = block_quantize_kernel(num_experts, n, k, np.dtype(dtype))
    return kernel_operands.compile_kernel(kernel, _key(num_experts, n, k, dtype, outputs_in_place), kernel.operands(),
                                          arch=ARCH, outputs_in_place=outputs_in_place, keep=keep)


def quantize_by_kernel(w: jax.Array, filled: dict[str, jax.Array] | None = None) -> dict[str, jax.Array]:
    """{values (E, N, K) e4m3, transposed (E, K, N) e4m3, scales (E, ceil(N / 128),
    ceil(K / 128)) float32} of w (E, N, K) (`cannot_quantize`). With `filled` (those three
    arrays) the kernel writes into them (the tests poison them first)."""
    from jax_dsrelu.kernels import operands as kernel_operands  # CuTe DSL: the 'gpu' extra

    if w.ndim != 3:
        raise ValueError(f"the block quantizer takes w (E, N, K), got w.shape={tuple(w.shape)}")
    reason = cannot_quantize(weight_quantize_request(w))
    if reason is not None:
        raise ValueError(f"{reason}; w is {np.dtype(w.dtype).name}{tuple(w.shape)}")
    in_place = filled is not None
    kernel = block_quantize_kernel(*w.shape, np.dtype(w.dtype))
    given = dict(w=w, **(filled or {}))
    return kernel_operands.call(kernel, _key(*w.shape, w.dtype, in_place), kernel.operands(), given,
                                {kernel_operands.ROWS: 0}, arch=ARCH, outputs_in_place=in_place)
