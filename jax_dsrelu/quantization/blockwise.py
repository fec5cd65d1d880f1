"""Block scaling by amax: float32 scales over blocks of any shape, e4m3 elements.

For each block of `scaling.block` = (rows, columns) elements over a tensor's last two
axes (a partial last block along either axis has a scale of its own):

    amax  = max |x| over the block's finite values, in float32 (exact in any order)
    scale = amax * (1 / max_normal rounded to float32; max_normal is 448 for e4m3), one
            float32 multiplication: a division by a constant is one a compiler may turn
            into that product anyway, on one platform and not another; at least 2^-126,
            float32's smallest normal number, which a platform that flushes subnormals
            (XLA:CPU, a kernel's fast math) would otherwise turn into 0; 1 where amax is 0
    value = x / scale rounded once to float32, then to the element format by round to
            nearest even, clamped to +-max_normal (x / scale can exceed it by an ulp)

so the block's values are value * scale. Special cases:
- a block of zeros gets the scale 1 and values 0, so it dequantizes to exact zeros;
- a block holding a NaN or an infinity gets a NaN scale and NaN values: every element of
  the block dequantizes to NaN (e4m3 has no infinity, and a saturated one would pass an
  overflow off as a plausible number), as `quantize_mx` does.

Every step is an IEEE operation on float32 (a max, a division, a rounding conversion), so
the scales and values are bitwise the same on every run, and the scales on every platform;
XLA:CPU flushes float32 subnormals, which a bf16 or float32 activation of a trained model
does not hold. XLA:GPU divides float32 with div.full.f32, within an ulp of IEEE's quotient
(openxla/xla#37181), so on a GPU a value near a rounding boundary of e4m3 can land a step
away from the CPU's; the sm90 quantizing kernel divides as IEEE asks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu.quantization import stored
from jax_dsrelu.quantization.schema import BlockScaling

INPUT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))


def _check(x: jax.Array, scaling: BlockScaling) -> None:
    if scaling.rule != "amax":
        raise ValueError(f"scaling.rule must be 'amax' here (power-of-two scales are quantize_mx's), got {scaling.rule!r}")
    if x.ndim < 2:
        raise ValueError(f"x must have at least two axes (rows, K), got x.shape={x.shape}")


def _block_view(x: jax.Array, block: tuple[int, int]) -> jax.Array:
    """(..., R, C) -> (..., R / r, r, C / c, c), zero-padded to whole blocks (zeros change
    no block's amax): a reshape, no transpose, so the maxima are reduced where the
    elements lie."""
    rows, cols = block
    pad_r, pad_c = -x.shape[-2] % rows, -x.shape[-1] % cols
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(0, pad_r), (0, pad_c)])
    *lead, big_r, big_c = x.shape
    return x.reshape(*lead, big_r // rows, rows, big_c // cols, cols)


def _per_element(scales: jax.Array, block: tuple[int, int], shape: tuple[int, ...]) -> jax.Array:
    """Each element's block scale, (..., R, C) from (..., R / r, C / c). Reshaped from a
    broadcast, not the broadcast itself: XLA's simplifier turns x / broadcast(s) into
    x * broadcast(1 / s), which rounds some values among e4m3's subnormals an ulp away
    from x / scale (seen on XLA:CPU with bfloat16 inputs; tests/test_quantization_blockwise.py
    holds the values to x / scale)."""
    rows, cols = block
    *lead, nr, nc = scales.shape
    full = jnp.broadcast_to(scales[..., :, None, :, None], (*lead, nr, rows, nc, cols))
    return full.reshape(*lead, nr * rows, nc * cols)[..., : shape[-2], : shape[-1]]


def quantize_blockwise(x: jax.Array, scaling: BlockScaling) -> tuple[jax.Array, jax.Array]:
    """(values, scales): values x.shape in scaling.element, scales float32 of
    scaling.scale_shape(x.shape), with x ~= values * scales over each block (module doc).
    x is bfloat16, float16 or float32."""
    x = jnp.asarray(x)
    if np.dtype(x.dtype) not in INPUT_DTYPES:
        raise TypeError(f"x.dtype must be bfloat16, float16 or float32, got x.dtype={np.dtype(x.dtype).name}")
    _check(x, scaling)
    x = x.astype(jnp.float32)
    amax, special = finite_amax(_block_view(x, scaling.block), axis=(-3, -1))
    scales = scales_from_amax(amax, special, scaling.element)
    values = scaled_values(x, _per_element(scales, scaling.block, x.shape), scaling.element)
    return values, scales


def finite_amax(blocks: jax.Array, axis) -> tuple[jax.Array, jax.Array]:
    """(amax, special) over `axis` of float32 blocks: the largest |value|, and whether the
    block holds a NaN or an infinity, from one maximum in which such a value counts as
    +inf (amax is then +inf, and the block's scale NaN whatever it is). One reduction
    reading the mask once, not a maximum and an any() that both read it (the FP8 step's
    GPU profile holds is-finite fusions of their own; whether this removes them is for the
    next timed run to say); no NaN enters the maximum, so a compiler's max that drops NaNs
    (XLA's fast min/max) changes nothing."""
    amax = jnp.max(jnp.where(jnp.isfinite(blocks), jnp.abs(blocks), jnp.inf), axis=axis)
    return amax, amax == jnp.inf


def scales_from_amax(amax: jax.Array, special: jax.Array, element) -> jax.Array:
    """The scales of blocks of amax `amax` (float32, over the finite values; any value,
    +inf from `finite_amax`, where `special`), NaN where `special` (the block holds a NaN
    or an infinity): the module doc's rule, shared by
    every quantizer of the recipe whatever the shape of its blocks."""
    reciprocal = np.float32(1.0 / float(jnp.finfo(element).max))
    smallest_normal = np.float32(np.finfo(np.float32).tiny)
    scales = jnp.where(amax > 0, jnp.maximum(amax * reciprocal, smallest_normal), 1.0).astype(jnp.float32)
    return jnp.where(special, jnp.nan, scales)


def scaled_values(x: jax.Array, scales: jax.Array, element) -> jax.Array:
    """x / scales (float32, scales broadcast against x) rounded to `element`, clamped to
    its largest normal."""
    max_normal = float(jnp.finfo(element).max)
    return jnp.clip(x / scales, -max_normal, max_normal).astype(element)


def dequantize_blockwise(values: jax.Array, scales: jax.Array, scaling: BlockScaling, dtype=jnp.float32) -> jax.Array:
    """values * scales over each block, in float32, cast to dtype."""
    _check(values, scaling)
    if np.dtype(values.dtype) != np.dtype(scaling.element):
        raise TypeError(f"values.dtype must be {np.dtype(scaling.element).name}, got {np.dtype(values.dtype).name}")
    expected = scaling.scale_shape(values.shape)
    if scales.shape != expected:
        raise ValueError(f"scales.shape must be {expected} for values.shape={values.shape}, got {scales.shape}")
    return (stored.to_float32(values) * _per_element(scales, scaling.block, values.shape)).astype(dtype)
