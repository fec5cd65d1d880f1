"""MXFP8 block scaling (OCP Microscaling Formats v1.0) for `grouped_gemm_dsrelu` operands.

An MX block is 32 consecutive elements along one axis sharing one power-of-two scale X
stored as float8_e8m0fnu; each element P_i is float8_e4m3fn or float8_e5m2, and the
block's values are X * P_i. `quantize_mx` follows the spec's conversion (section 6.3):

    shared_exp = floor(log2(max_i |V_i|)) - emax_elem     (emax_elem: 8 for e4m3, 15 for e5m2)
    X          = 2^shared_exp, clamped to E8M0's range [2^-127, 2^127]
    P_i        = V_i / X rounded to nearest even, normal numbers past the element's
                 largest normal clamped to it (448 for e4m3, 57344 for e5m2)

Special cases, as the spec's scale semantics give them:
- a block of zeros has max |V_i| = 0, so shared_exp is -inf and clamps to -127; its
  elements are 0;
- a block holding a NaN or an infinity gets the NaN scale (E8M0 0xFF), which makes every
  element of the block NaN when dequantized; its elements are stored as NaN too. An
  infinity cannot be kept as a finite value: e4m3 has no infinity, and saturating it would
  turn an overflow into a plausible number.

Everything is computed on the float32 bit patterns, never with log2 or a division, so the
result is exact and the same on every platform, including for subnormal inputs that
XLA:CPU would flush to zero in arithmetic.

NVFP4 (float4 e2m1 elements with float8_e4m3 scales per 16 elements and a per-tensor
float32 scale) is not provided: see docs/sm100.md for why.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu.quantization import stored

BLOCK_SIZE = 32
SCALE_DTYPE = np.dtype(jnp.float8_e8m0fnu)
_SCALE_NAN_BITS = 0xFF
_SCALE_BIAS = 127


@dataclasses.dataclass(frozen=True)
class _ElementFormat:
    emax: int  # exponent of the largest normal number
    max_normal: float


_ELEMENT_FORMATS = {
    np.dtype(jnp.float8_e4m3fn): _ElementFormat(emax=8, max_normal=448.0),
    np.dtype(jnp.float8_e5m2): _ElementFormat(emax=15, max_normal=57344.0),
}
ELEMENT_DTYPES = tuple(_ELEMENT_FORMATS)
_INPUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _names(dtypes) -> str:
    return ", ".join(np.dtype(d).name for d in dtypes)


def _element_format(dtype, argument: str) -> _ElementFormat:
    try:
        return _ELEMENT_FORMATS[np.dtype(dtype)]
    except (TypeError, KeyError):
        raise TypeError(
            f"{argument} must be one of {_names(ELEMENT_DTYPES)}, got {argument}={dtype!r}"
        ) from None


def _blocked_axis(shape: tuple[int, ...], axis: int, argument: str) -> int:
    if not shape:
        raise ValueError(f"{argument} must have at least one dimension, got {argument}.shape=()")
    if not -len(shape) <= axis < len(shape):
        raise ValueError(f"axis={axis} is out of range for {argument}.shape={shape}")
    axis %= len(shape)
    if shape[axis] % BLOCK_SIZE:
        raise ValueError(
            f"{argument}.shape[{axis}]={shape[axis]} must be a multiple of the MX block size "
            f"{BLOCK_SIZE}, got {argument}.shape={shape}"
        )
    return axis


def _power_of_two(exponent: jax.Array) -> jax.Array:
    """2^exponent as float32 for integer exponents in [-126, 127], built from its bits."""
    return lax.bitcast_convert_type((exponent + 127).astype(jnp.uint32) << 23, jnp.float32)


def quantize_mx(
    x: jax.Array,  # (..., K, ...) with K a multiple of 32 along `axis`
    axis: int = -1,
    dtype=jnp.float8_e4m3fn,
) -> tuple[jax.Array, jax.Array]:
    """Returns (values, scales): values x.shape in `dtype`, scales float8_e8m0fnu with
    x.shape[axis] divided by 32, such that x ~= values * scales repeated 32 times along axis.

    x is bfloat16, float16 or float32; dtype is float8_e4m3fn or float8_e5m2. See the module
    docstring for the rounding, saturation, zero and NaN/Inf rules.
    """
    fmt = _element_format(dtype, "dtype")
    x = jnp.asarray(x)
    if np.dtype(x.dtype) not in _INPUT_DTYPES:
        raise TypeError(f"x.dtype must be one of {_names(_INPUT_DTYPES)}, got x.dtype={np.dtype(x.dtype).name}")
    axis = _blocked_axis(x.shape, axis, "x")

    moved = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    bits = lax.bitcast_convert_type(blocks, jnp.uint32)
    biased_exp = ((bits >> 23) & 0xFF).astype(jnp.int32)
    largest_biased_exp = jnp.max(biased_exp, axis=-1)
    special = largest_biased_exp == 0xFF  # NaN or infinity in the block: one reduction serves both

    # floor(log2(max |V_i|)) is the largest biased exponent minus the bias for normal
    # numbers; a block of zeros and subnormals has its true value below -126, and both
    # land on the clamp at -127 because emax_elem > 0.
    max_exp = largest_biased_exp - _SCALE_BIAS
    shared_exp = jnp.maximum(max_exp - fmt.emax, -_SCALE_BIAS)

    # |V_i| = significand * 2^(e_i - 150) exactly, significand < 2^24 (exact in float32).
    # V_i / X is then significand * 2^(e_i - 150 - shared_exp): the exponent is at most
    # emax_elem - 23, and below -126 the value is far under the element's smallest
    # subnormal, so clamping it there changes no rounded result.
    significand = (bits & 0x7FFFFF) | jnp.where(biased_exp > 0, 1 << 23, 0).astype(jnp.uint32)
    exponent = jnp.maximum(biased_exp, 1) - 150 - shared_exp[..., None]
    magnitude = significand.astype(jnp.float32) * _power_of_two(jnp.maximum(exponent, -126))
    magnitude = jnp.minimum(magnitude, fmt.max_normal)
    scaled = jnp.where((bits >> 31) == 1, -magnitude, magnitude)
    values = jnp.where(special[..., None], jnp.nan, scaled).astype(dtype)

    scale_bits = jnp.where(special, _SCALE_NAN_BITS, shared_exp + _SCALE_BIAS).astype(jnp.uint8)
    scales = lax.bitcast_convert_type(scale_bits, jnp.float8_e8m0fnu)
    values = jnp.moveaxis(values.reshape(moved.shape), -1, axis)
    return values, jnp.moveaxis(scales, -1, axis)


def dequantize_mx(
    values: jax.Array,  # (..., K, ...) float8_e4m3fn or float8_e5m2
    scales: jax.Array,  # (..., K / 32, ...) float8_e8m0fnu
    axis: int = -1,
    dtype=jnp.float32,
) -> jax.Array:
    """values * 2^scale, each scale applied to its 32 values along `axis`, in `dtype`.

    The product is formed in float32: exact, except that a result below float32's
    normal range is subject to the platform's subnormal handling. A NaN scale gives NaN.
    """
    _element_format(values.dtype, "values.dtype")
    if np.dtype(scales.dtype) != SCALE_DTYPE:
        raise TypeError(f"scales.dtype must be float8_e8m0fnu, got scales.dtype={np.dtype(scales.dtype).name}")
    axis = _blocked_axis(values.shape, axis, "values")
    expected = values.shape[:axis] + (values.shape[axis] // BLOCK_SIZE,) + values.shape[axis + 1 :]
    if scales.shape != expected:
        raise ValueError(
            f"scales.shape must be {expected} (values.shape with axis {axis} divided by "
            f"{BLOCK_SIZE}), got scales.shape={scales.shape}"
        )

    scale_bits = lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    exponent = scale_bits - _SCALE_BIAS
    # 2^exponent reaches 2^-127, below float32's normal range: apply it as two normal factors.
    low = exponent // 2
    factor_a, factor_b = _power_of_two(low), _power_of_two(exponent - low)
    factor_a = jnp.where(scale_bits == _SCALE_NAN_BITS, jnp.nan, factor_a)
    repeat = lambda f: jnp.repeat(f, BLOCK_SIZE, axis=axis)
    return (stored.to_float32(values) * repeat(factor_a) * repeat(factor_b)).astype(dtype)
