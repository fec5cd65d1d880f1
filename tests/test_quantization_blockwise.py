"""The blockwise FP8 recipe (DeepSeek-V3's: 1 x 128 activation blocks, 128 x 128 weight
blocks, float32 scales, promotion every 128 of K) against float64 NumPy.

The quantizer is held bit for bit to an oracle that rounds with np.round on float64 values
(the library converts with XLA); the emulated GEMM is held to float64 of the unquantized
operands within a bound derived from e4m3's precision, the block scales and float32
accumulation, and the bound is shown to catch a wrong answer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsrelu.quantization import blockwise, emulation, schema
from test_mx import round_to_element

RECIPE = schema.FP8_BLOCKWISE
MAX_NORMAL = 448.0
UNIT = 2.0**-4  # e4m3: 3 stored significand bits, round to nearest
SUBNORMAL_HALF_STEP = 2.0**-10  # half of e4m3's subnormal spacing 2^-9, relative to the scale
F32 = 2.0**-24


def oracle_quantize(x: np.ndarray, block: tuple[int, int]):
    """(values float64, scales float32) by the recipe's rules, in NumPy."""
    x = x.astype(np.float32)
    rows, cols = block
    nr, nc = -(-x.shape[-2] // rows), -(-x.shape[-1] // cols)
    scales = np.empty(x.shape[:-2] + (nr, nc), np.float32)
    values = np.empty(x.shape, np.float64)
    for index in np.ndindex(*x.shape[:-2], nr, nc):
        *lead, i, j = index
        part = x[(*lead, slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))]
        if not np.isfinite(part).all():
            scale, value = np.float32(np.nan), np.full(part.shape, np.nan)
        else:
            amax = np.float32(np.abs(part).max())
            smallest_normal = np.finfo(np.float32).tiny
            scale = max(amax * np.float32(1 / MAX_NORMAL), smallest_normal) if amax > 0 else np.float32(1.0)
            value = round_to_element((part / scale).astype(np.float32).astype(np.float64), "float8_e4m3fn")
        scales[index] = scale
        values[(*lead, slice(i * rows, (i + 1) * rows), slice(j * cols, (j + 1) * cols))] = value
    return values, scales


def ragged_magnitudes(rng, shape, block_cols=128):
    """Normal values whose magnitude changes from one K block to the next, so a scale taken
    from the wrong block shows."""
    x = rng.standard_normal(shape)
    blocks = -(-shape[-1] // block_cols)
    factor = np.repeat(np.exp2(rng.integers(-6, 7, blocks)), block_cols)[: shape[-1]]
    return (x * factor).astype(np.float32)


def wide_magnitudes(rng, shape):
    """Values spread over 2^-20 to 2^20 within every block: most of a block's values land
    among e4m3's subnormals, where x / scale and x * (1 / scale), which a compiler may put
    in its place, round apart (an ulp in about one value in a hundred)."""
    return (rng.standard_normal(shape) * np.exp2(rng.uniform(-20, 20, shape))).astype(np.float32)


@pytest.mark.parametrize("operand", ["activations", "weights"])
@pytest.mark.parametrize("shape", [(5, 300), (130, 256), (2, 129, 131), (1, 1), (3, 256, 384)])
@pytest.mark.parametrize("magnitudes, dtype", [(ragged_magnitudes, jnp.float32), (wide_magnitudes, jnp.float32),
                                               (wide_magnitudes, jnp.bfloat16)], ids=["ragged", "wide", "wide-bf16"])
def test_quantize_matches_the_oracle_bit_for_bit(operand, shape, magnitudes, dtype):
    scaling = getattr(RECIPE, operand)
    rng = np.random.default_rng(sum(shape))
    x = np.asarray(jnp.asarray(magnitudes(rng, shape), dtype).astype(jnp.float32))  # what the quantizer is given
    values, scales = blockwise.quantize_blockwise(jnp.asarray(x, dtype), scaling)
    expected_values, expected_scales = oracle_quantize(x, scaling.block)
    assert values.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.float32
    assert scales.shape == scaling.scale_shape(shape)
    np.testing.assert_array_equal(np.asarray(scales), expected_scales)
    np.testing.assert_array_equal(np.asarray(values, np.float64), expected_values)


def test_zero_saturated_and_special_blocks():
    x = np.zeros((3, 256), np.float32)
    x[1, :128] = np.linspace(-3.0, 7.0, 128)  # its amax maps to exactly the largest normal
    x[2, 5], x[2, 200] = np.nan, np.inf
    values, scales = blockwise.quantize_blockwise(jnp.asarray(x), RECIPE.activations)
    values, scales = np.asarray(values, np.float64), np.asarray(scales)
    assert scales[0, 0] == scales[0, 1] == scales[1, 1] == 1.0 and not values[0].any()
    assert np.abs(values[1, :128]).max() == MAX_NORMAL and scales[1, 0] == np.float32(7.0) * np.float32(1 / 448)
    assert np.isnan(scales[2]).all() and np.isnan(values[2]).all()
    back = np.asarray(blockwise.dequantize_blockwise(jnp.asarray(values, jnp.float8_e4m3fn), jnp.asarray(scales),
                                                     RECIPE.activations))
    assert not back[0].any() and np.isnan(back[2]).all()


def test_a_block_of_tiny_values_keeps_a_normal_scale():
    # amax / 448 would be a float32 subnormal here, which XLA:CPU flushes to 0: the scale
    # is held at the smallest normal number, and zeros stay zeros (not 0 / 0).
    x = np.zeros((1, 128), np.float32)
    x[0, 0], x[0, 1] = 1e-37, -3e-38
    values, scales = blockwise.quantize_blockwise(jnp.asarray(x), RECIPE.activations)
    assert np.asarray(scales)[0, 0] == np.finfo(np.float32).tiny
    back = np.asarray(blockwise.dequantize_blockwise(values, scales, RECIPE.activations))
    assert np.isfinite(back).all() and not back[0, 2:].any()
    expected_values, expected_scales = oracle_quantize(x, RECIPE.activations.block)
    np.testing.assert_array_equal(np.asarray(values, np.float64), expected_values)


def test_scales_do_not_depend_on_the_order_of_a_blocks_elements():
    rng = np.random.default_rng(0)
    x = ragged_magnitudes(rng, (64, 384))
    order = np.concatenate([block * 128 + rng.permutation(128) for block in range(3)])
    values, scales = jax.jit(blockwise.quantize_blockwise, static_argnums=1)(jnp.asarray(x), RECIPE.activations)
    shuffled_values, shuffled_scales = blockwise.quantize_blockwise(jnp.asarray(x[:, order]), RECIPE.activations)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(shuffled_scales))
    np.testing.assert_array_equal(np.asarray(values, np.float32)[:, order], np.asarray(shuffled_values, np.float32))


def error_bound(a, a_scales, w, w_scales, a_hat, w_hat):
    """|emulated - float64| per output: each operand's quantization error, at most
    UNIT |x| (plus float32's rounding of x / scale) plus half a subnormal step times its
    block's scale, through the products; and float32 accumulation of the scaled partials
    (128 within a block, then one addition per block)."""
    k = a.shape[1]
    a_block = np.repeat(a_scales.astype(np.float64), 128, axis=1)[:, :k]
    w_block = np.repeat(np.repeat(w_scales.astype(np.float64), 128, axis=0), 128, axis=1)[:k, : w.shape[1]]
    relative = UNIT + 2 * F32
    err_a = relative * np.abs(a) + SUBNORMAL_HALF_STEP * a_block
    err_w = relative * np.abs(w) + SUBNORMAL_HALF_STEP * w_block
    quantization = err_a @ np.abs(w) + np.abs(a) @ err_w + err_a @ err_w
    blocks = -(-k // 128)
    accumulation = (128 + blocks + 2) * F32 * (np.abs(a_hat) @ np.abs(w_hat))
    return 1.001 * (quantization + accumulation)


@pytest.mark.parametrize("m, k, n", [(48, 1856, 200), (7, 128, 128), (33, 300, 129)])
def test_the_emulated_gemm_is_float64_within_the_derived_bound_which_catches_a_wrong_answer(m, k, n):
    rng = np.random.default_rng(k)
    a = ragged_magnitudes(rng, (m, k))
    w = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    a_q, a_s = blockwise.quantize_blockwise(jnp.asarray(a), RECIPE.activations)
    w_q, w_s = blockwise.quantize_blockwise(jnp.asarray(w), RECIPE.weights)
    out = np.asarray(emulation.blockwise_matmul(a_q, a_s, w_q, w_s, RECIPE), np.float64)
    exact = a.astype(np.float64) @ w.astype(np.float64)
    a_hat = np.asarray(blockwise.dequantize_blockwise(a_q, a_s, RECIPE.activations), np.float64)
    w_hat = np.asarray(blockwise.dequantize_blockwise(w_q, w_s, RECIPE.weights), np.float64)
    bound = error_bound(a, np.asarray(a_s), w, np.asarray(w_s), a_hat, w_hat)
    assert (np.abs(out - exact) <= bound).all()
    # Not vacuous: FP8 is visibly inexact, and well inside the bound.
    assert np.abs(out - exact).max() > 1e-3 * np.abs(exact).max()
    # Wrong answers it catches: each activation block's scale taken from its neighbour
    # (where there is one), and every scale off by the factor of two an exponent bug gives.
    wrong_answers = [emulation.blockwise_matmul(a_q, a_s * 2, w_q, w_s, RECIPE)]
    if a_s.shape[1] > 1:
        wrong_answers.append(emulation.blockwise_matmul(a_q, jnp.roll(a_s, 1, axis=1), w_q, w_s, RECIPE))
    for wrong in wrong_answers:
        assert (np.abs(np.asarray(wrong, np.float64) - exact) > bound).any()


def test_bad_arguments_name_what_was_seen():
    with pytest.raises(TypeError, match="x.dtype must be bfloat16, float16 or float32, got x.dtype=int32"):
        blockwise.quantize_blockwise(jnp.ones((2, 128), jnp.int32), RECIPE.activations)
    with pytest.raises(ValueError, match=r"at least two axes \(rows, K\), got x.shape=\(128,\)"):
        blockwise.quantize_blockwise(jnp.ones((128,)), RECIPE.activations)
    with pytest.raises(ValueError, match="scales.shape must be"):
        blockwise.dequantize_blockwise(jnp.ones((2, 256), jnp.float8_e4m3fn), jnp.ones((2, 1)), RECIPE.activations)
    a, a_s = blockwise.quantize_blockwise(jnp.ones((4, 256)), RECIPE.activations)
    w, w_s = blockwise.quantize_blockwise(jnp.ones((256, 256)), RECIPE.weights)
    with pytest.raises(ValueError, match=r"a_scales.shape must be \(4, 2\) .* got \(4, 1\)"):
        emulation.blockwise_matmul(a, a_s[:, :1], w, w_s, RECIPE)
    with pytest.raises(ValueError, match=r"w_scales.shape must be \(2, 2\) .* got \(1, 2\)"):
        emulation.blockwise_matmul(a, a_s, w, w_s[:1], RECIPE)
    with pytest.raises(TypeError, match="a.dtype must be float8_e4m3fn, got float32"):
        emulation.blockwise_matmul(a.astype(jnp.float32), a_s, w, w_s, RECIPE)
    with pytest.raises(ValueError, match="block must be two positive ints"):
        schema.BlockScaling((0, 128))
    with pytest.raises(ValueError, match="needs 1 x 32 activation blocks and 32 x 32 weight blocks"):
        emulation.blockwise_matmul(jnp.ones((2, 32), jnp.float8_e4m3fn), jnp.ones((2, 1)),
                                   jnp.ones((32, 4), jnp.float8_e4m3fn), jnp.ones((1, 1)), schema.MXFP8)
