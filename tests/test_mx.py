"""quantize_mx / dequantize_mx against the OCP MX v1.0 rules written out in float64 NumPy.

The oracle shares nothing with the library: it finds the block exponent with frexp and
rounds with np.round on the float64 value, where the library works on float32 bit patterns.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsrelu.quantization import mx

# (exponent bias, mantissa bits, emax, largest normal) of each element format.
FORMATS = {
    "float8_e4m3fn": (7, 3, 8, 448.0),
    "float8_e5m2": (15, 2, 15, 57344.0),
}


def round_to_element(v: np.ndarray, name: str) -> np.ndarray:
    """Round-to-nearest-even into the element format, saturating at its largest normal."""
    bias, mbits, _, max_normal = FORMATS[name]
    magnitude = np.abs(v)
    with np.errstate(divide="ignore"):
        exponent = np.floor(np.log2(np.where(magnitude > 0, magnitude, 1.0)))
    exponent = np.maximum(exponent, 1 - bias)  # subnormals share the smallest exponent
    quantum = np.exp2(exponent - mbits)
    rounded = np.round(magnitude / quantum) * quantum  # np.round: ties to even
    return np.copysign(np.minimum(rounded, max_normal), v)


def oracle_quantize(x: np.ndarray, name: str):
    """(values float64, scale exponents int, NaN-scale mask) for blocks along the last axis."""
    _, _, emax, _ = FORMATS[name]
    blocks = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    special = ~np.all(np.isfinite(blocks), axis=-1)
    amax = np.max(np.where(np.isfinite(blocks), np.abs(blocks), 0.0), axis=-1)
    _, frexp_exp = np.frexp(amax)  # amax = f * 2^e with f in [0.5, 1): floor(log2) = e - 1
    floor_log2 = np.where(amax > 0, frexp_exp - 1, -np.inf)
    shared = np.clip(floor_log2 - emax, -127, 127)
    shared = np.where(special, 0, shared).astype(np.int64)
    finite = np.where(special[..., None], 0.0, blocks)
    values = round_to_element(finite / np.exp2(shared)[..., None], name)
    values = np.where(special[..., None], np.nan, values)
    return values.reshape(x.shape), shared, special


def random_blocks(rng, rows: int, blocks: int) -> np.ndarray:
    """Normal values with a different magnitude per block, over float32's whole range."""
    x = rng.standard_normal((rows, blocks, 32))
    x *= np.exp2(rng.integers(-140, 120, (rows, blocks, 1)))
    return x.reshape(rows, blocks * 32).astype(np.float32)


def scale_bits(scales) -> np.ndarray:
    return np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)).astype(np.int64)


def assert_matches_oracle(x: np.ndarray, name: str, values, scales):
    expected_values, expected_shared, special = oracle_quantize(x, name)
    bits = scale_bits(scales)
    np.testing.assert_array_equal(bits[special], 255)
    np.testing.assert_array_equal(bits[~special], expected_shared[~special] + 127)
    np.testing.assert_array_equal(np.asarray(values, np.float64), expected_values)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_the_spec_on_random_data(name, seed):
    rng = np.random.default_rng(seed)
    x = random_blocks(rng, 48, 6)
    x[3, 32:64] = 0.0  # a block of zeros
    x[5, 64:96] = rng.standard_normal(32) * 2.0**-135  # subnormal float32 inputs
    x[7, :32] = -0.0
    values, scales = jax.jit(mx.quantize_mx, static_argnames="dtype")(x, dtype=jnp.dtype(name))
    assert values.dtype == jnp.dtype(name) and values.shape == x.shape
    assert scales.dtype == jnp.float8_e8m0fnu and scales.shape == (48, 6)
    assert_matches_oracle(x, name, values, scales)
    # The random magnitudes must exercise both the clamp at 2^-127 and ordinary scales.
    bits = scale_bits(scales)
    assert np.any(bits == 0) and np.any(bits > 200)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_zero_block_gets_the_smallest_scale_and_zero_values(name):
    values, scales = mx.quantize_mx(np.zeros((2, 64), np.float32), dtype=jnp.dtype(name))
    np.testing.assert_array_equal(scale_bits(scales), 0)
    np.testing.assert_array_equal(np.asarray(values, np.float32), 0.0)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_saturation_clamps_to_the_largest_normal(name):
    _, _, emax, max_normal = FORMATS[name]
    # amax = 1.99 * 2^3: the shared exponent is 3 - emax, so amax scales to 1.99 * 2^emax,
    # past the largest normal (1.75 * 2^emax for e4m3, 1.75 * 2^15 for e5m2).
    x = np.full((1, 32), 0.5, np.float32)
    x[0, 0] = 1.99 * 8.0
    x[0, 1] = -1.99 * 8.0
    x[0, 2] = 1.8 * 8.0
    values, scales = mx.quantize_mx(x, dtype=jnp.dtype(name))
    v = np.asarray(values, np.float64)
    assert v[0, 0] == max_normal and v[0, 1] == -max_normal and v[0, 2] == max_normal
    assert scale_bits(scales)[0, 0] == 3 - emax + 127
    assert_matches_oracle(x, name, values, scales)


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_infinity_makes_the_block_nan(name, bad):
    x = random_blocks(np.random.default_rng(3), 2, 3)
    x[1, 40] = bad
    values, scales = mx.quantize_mx(x, dtype=jnp.dtype(name))
    assert_matches_oracle(x, name, values, scales)
    bits = scale_bits(scales)
    assert bits[1, 1] == 255 and np.all(bits[0] != 255) and bits[1, 0] != 255
    restored = np.asarray(mx.dequantize_mx(values, scales))
    assert np.all(np.isnan(restored[1, 32:64]))
    assert np.all(np.isfinite(restored[1, :32])) and np.all(np.isfinite(restored[0]))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_dequantize_is_values_times_two_to_the_scale(name):
    rng = np.random.default_rng(4)
    x = random_blocks(rng, 16, 4)
    # Keep results inside float32's normal range: subnormal products are platform-dependent.
    x = np.where(np.abs(x) < 2.0**-100, 1.0, x).astype(np.float32)
    values, scales = mx.quantize_mx(x, dtype=jnp.dtype(name))
    expected_values, shared, _ = oracle_quantize(x, name)
    expected = expected_values * np.repeat(np.exp2(shared), 32, axis=-1)
    normal = np.abs(expected) >= np.finfo(np.float32).tiny
    restored = np.asarray(jax.jit(mx.dequantize_mx)(values, scales), np.float64)
    np.testing.assert_array_equal(restored[normal], expected[normal])
    # The round trip: below the saturation point an element errs by at most half a unit in
    # the last place of the block's top binade; above it, it comes back as +-max_normal * X.
    _, mbits, _, max_normal = FORMATS[name]
    scale = np.repeat(np.exp2(shared), 32, axis=-1)
    saturated = np.abs(x) / scale > max_normal
    half_ulp = scale * 2.0 ** (FORMATS[name][2] - mbits - 1)
    assert np.all(np.abs(restored - x)[~saturated] <= half_ulp[~saturated])
    np.testing.assert_array_equal(restored[saturated], np.copysign(max_normal * scale, x)[saturated])
    assert np.any(saturated) and np.any(~saturated)


def test_axis_selects_the_blocked_dimension():
    x = random_blocks(np.random.default_rng(5), 8, 2)  # (8, 64)
    values_t, scales_t = mx.quantize_mx(x.T, axis=0)  # blocks along axis 0 of (64, 8)
    values, scales = mx.quantize_mx(x, axis=-1)
    np.testing.assert_array_equal(np.asarray(values_t, np.float32).T, np.asarray(values, np.float32))
    np.testing.assert_array_equal(scale_bits(scales_t).T, scale_bits(scales))
    # A middle axis: the same blocks as with that axis moved last, and back again.
    x3 = random_blocks(np.random.default_rng(6), 6, 1).reshape(2, 3, 32).transpose(0, 2, 1)
    values3, scales3 = mx.quantize_mx(x3, axis=1)
    values_last, scales_last = mx.quantize_mx(np.moveaxis(x3, 1, -1))
    assert_matches_oracle(
        np.moveaxis(x3, 1, -1).reshape(6, 32), "float8_e4m3fn", values_last.reshape(6, 32), scales_last.reshape(6, 1)
    )
    np.testing.assert_array_equal(
        np.moveaxis(np.asarray(values3, np.float32), 1, -1), np.asarray(values_last, np.float32)
    )
    np.testing.assert_array_equal(np.moveaxis(scale_bits(scales3), 1, -1), scale_bits(scales_last))
    np.testing.assert_array_equal(
        mx.dequantize_mx(values3, scales3, axis=1),
        np.moveaxis(np.asarray(mx.dequantize_mx(values_last, scales_last)), -1, 1),
    )


def test_bfloat16_and_float16_inputs_quantize_their_float32_values():
    x = random_blocks(np.random.default_rng(7), 4, 2)
    x = np.clip(x, -6e4, 6e4)
    for dtype in (jnp.bfloat16, jnp.float16):
        narrow = jnp.asarray(x, dtype)
        values, scales = mx.quantize_mx(narrow)
        assert_matches_oracle(np.asarray(narrow, np.float32), "float8_e4m3fn", values, scales)


BAD = [
    (lambda: mx.quantize_mx(np.zeros((4, 48), np.float32)), ValueError, "x.shape[1]=48 must be a multiple of the MX block size 32"),
    (lambda: mx.quantize_mx(np.zeros((4, 32), np.float32), axis=2), ValueError, "axis=2 is out of range for x.shape=(4, 32)"),
    (lambda: mx.quantize_mx(np.zeros((4, 32), np.int32)), TypeError, "x.dtype must be one of bfloat16, float16, float32, got x.dtype=int32"),
    (lambda: mx.quantize_mx(np.zeros((4, 32), np.float32), dtype=jnp.bfloat16), TypeError, "dtype must be one of float8_e4m3fn, float8_e5m2"),
    (
        lambda: mx.dequantize_mx(jnp.zeros((4, 64), jnp.float8_e4m3fn), jnp.zeros((4, 3), jnp.float8_e8m0fnu)),
        ValueError,
        "scales.shape must be (4, 2) (values.shape with axis 1 divided by 32), got scales.shape=(4, 3)",
    ),
    (
        lambda: mx.dequantize_mx(jnp.zeros((4, 64), jnp.float8_e4m3fn), jnp.zeros((4, 2), jnp.uint8)),
        TypeError,
        "scales.dtype must be float8_e8m0fnu, got scales.dtype=uint8",
    ),
    (
        lambda: mx.dequantize_mx(jnp.zeros((4, 64), jnp.bfloat16), jnp.zeros((4, 2), jnp.float8_e8m0fnu)),
        TypeError,
        "values.dtype must be one of float8_e4m3fn, float8_e5m2",
    ),
]


@pytest.mark.parametrize("call, error, words", BAD)
def test_bad_arguments_name_what_was_seen(call, error, words):
    with pytest.raises(error, match=re.escape(words)):
        call()
