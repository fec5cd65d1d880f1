"""The blockwise recipe's groups along each expert's rows (`quantization.ragged`), the weight
gradients' K = tokens, against a loop over the experts that quantizes each one's rows on
their own with the blockwise recipe's NumPy oracle: groups of
128 rows that start at each expert's first row, never straddle two experts, and end in a
partial group."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dsrelu.quantization import qdq, ragged, schema
from test_quantization_blockwise import oracle_quantize

RECIPE = schema.FP8_BLOCKWISE
SCALING = RECIPE.activations
R = 128


def per_expert_loop(x: np.ndarray, sizes) -> tuple[np.ndarray, list[np.ndarray]]:
    """(dequantized (m, n) float32, each segment's scales (n, groups)): each expert's rows,
    then the rows past the experts' total as one more segment, quantized on their own by
    the NumPy oracle of the 1 x 128 blocks (which `quantize_blockwise` matches bit for bit)
    and dequantized with one float32 product, as the library does."""
    num_rows = x.shape[0]
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes), 0)), num_rows)
    bounds = [0, *ends.tolist(), num_rows]
    back = np.zeros(x.shape, np.float32)
    segment_scales = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue
        values, scales = oracle_quantize(x[start:end].T, SCALING.block)
        per_value = np.repeat(scales, R, axis=1)[:, : end - start].astype(np.float64)
        back[start:end] = (values * per_value).astype(np.float32).T
        segment_scales.append(scales)
    return back, segment_scales


def expert_magnitudes(rng, sizes, num_rows, n):
    """Normal values scaled by a power of two per expert, so that a group holding rows of two
    experts would take the larger one's scale and show it."""
    x = rng.standard_normal((num_rows, n))
    expert = np.searchsorted(np.cumsum(np.maximum(sizes, 0)), np.arange(num_rows), side="right")
    return (x * np.exp2(rng.integers(-8, 9, len(sizes) + 1))[expert][:, None]).astype(np.float32)


CASES = {
    "ragged_and_empty": ([0, 70, 200, 5, 130, 0], 420),  # 15 rows past the total
    "all_small": ([3, 1, 127, 0, 2], 133),
    "aligned": ([128, 256, 0], 384),
    "one_expert": ([300], 300),
    "sizes_past_m": ([100, 90, 80], 200),  # clamped: the last expert owns 10 rows
    "negative_size": ([50, -7, 60], 120),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("wide", [False, True], ids=["", "wide-bf16"])
def test_matches_a_loop_over_the_experts_bit_for_bit(case, wide):
    sizes, num_rows = CASES[case]
    n = 200
    rng = np.random.default_rng(num_rows)
    x = expert_magnitudes(rng, sizes, num_rows, n)
    dtype = jnp.bfloat16 if wide else jnp.float32
    if wide:  # bf16 values over 2^-20 to 2^20 in each group: most land among e4m3's subnormals
        x = np.asarray(jnp.asarray(x * np.exp2(rng.uniform(-20, 20, x.shape)), dtype).astype(jnp.float32))
    quantized = jax.jit(ragged.quantize_ragged_rows, static_argnums=2)(jnp.asarray(x, dtype), jnp.asarray(sizes), SCALING)
    expected, segment_scales = per_expert_loop(x, sizes)
    np.testing.assert_array_equal(np.asarray(ragged.dequantize_ragged_rows(quantized)), expected)
    along_rows = jax.jit(qdq.along_expert_rows, static_argnums=2)
    np.testing.assert_array_equal(np.asarray(along_rows(jnp.asarray(x, dtype), jnp.asarray(sizes), RECIPE)), expected)
    # The scales, group by group, in row order.
    scales = np.asarray(quantized.scales)
    groups = np.concatenate(segment_scales, axis=1).T  # (groups, n)
    assert scales.shape == (ragged.max_groups(num_rows, len(sizes), R), n)
    np.testing.assert_array_equal(scales[: len(groups)], groups)
    assert (scales[len(groups):] == 1).all()
    assert quantized.values.dtype == jnp.float8_e4m3fn


def test_groups_restart_at_each_expert_and_hold_at_most_128_rows():
    sizes, num_rows = [0, 70, 200, 5, 130, 0], 420
    row_group = np.asarray(jax.jit(ragged.row_groups, static_argnums=(1, 2))(jnp.asarray(sizes), num_rows, R))
    starts = np.cumsum([0, *sizes])[:-1]
    for start, size in zip(starts, sizes):
        if size:
            assert start == 0 or row_group[start] == row_group[start - 1] + 1
            assert len(np.unique(row_group[start:start + size])) == -(-size // R)
    assert np.bincount(row_group).max() <= R
    # 0 (70 rows), 1 and 2 (128 + 72), 3 (5), 4 and 5 (128 + 2), 6 (the 15 rows of no expert)
    assert row_group[-1] == 6 and np.all(np.diff(row_group) >= 0)


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf])
def test_a_nan_or_an_infinity_stays_in_its_own_group_and_zeros_stay_zeros(special):
    # The whole group dequantizes to NaN: e4m3 has no infinity to keep.
    sizes, num_rows = [70, 200], 300
    x = np.zeros((num_rows, 3), np.float32)
    x[:, 1] = 1.0
    x[100, 1] = special  # expert 1's first group, column 1
    back = np.asarray(jax.jit(qdq.along_expert_rows, static_argnums=2)(jnp.asarray(x), jnp.asarray(sizes), RECIPE))
    assert not back[:, 0].any() and not back[:, 2].any()
    nan_rows = np.flatnonzero(np.isnan(back[:, 1]))
    np.testing.assert_array_equal(nan_rows, np.arange(70, 70 + 128))
    assert (back[np.isfinite(back[:, 1]), 1] == 1.0).all()


def test_no_rows():
    quantized = ragged.quantize_ragged_rows(jnp.zeros((0, 5)), jnp.asarray([0, 0], jnp.int32), SCALING)
    assert quantized.values.shape == (0, 5) and quantized.row_group.shape == (0,)
    assert ragged.dequantize_ragged_rows(quantized).shape == (0, 5)


def test_new_group_sizes_reuse_the_compiled_function():
    traces = []

    @jax.jit
    def quantize(x, sizes):
        traces.append(None)
        return qdq.along_expert_rows(x, sizes, RECIPE)

    x = expert_magnitudes(np.random.default_rng(1), [10, 200, 30], 240, 8)
    for sizes in ([10, 200, 30], [200, 30, 10], [0, 0, 240]):
        expected, _ = per_expert_loop(x, sizes)
        np.testing.assert_array_equal(np.asarray(quantize(jnp.asarray(x), jnp.asarray(sizes, jnp.int32))), expected)
    assert len(traces) == 1


def test_bad_arguments_name_what_was_seen():
    sizes = jnp.asarray([2], jnp.int32)
    with pytest.raises(ValueError, match=r"1 x r blocks with amax scales .* got block=\(128, 128\)"):
        ragged.quantize_ragged_rows(jnp.ones((2, 4)), sizes, RECIPE.weights)
    with pytest.raises(ValueError, match=r"x must be \(m, n\), got x.shape=\(2, 4, 1\)"):
        ragged.quantize_ragged_rows(jnp.ones((2, 4, 1)), sizes, SCALING)
    with pytest.raises(TypeError, match="x.dtype must be bfloat16, float16 or float32, got x.dtype=int32"):
        ragged.quantize_ragged_rows(jnp.ones((2, 4), jnp.int32), sizes, SCALING)


ROW_GROUPS = jax.jit(ragged.row_groups, static_argnums=(1, 2))


def first_rows_by_rows(sizes, num_rows: int) -> np.ndarray:
    """Each group's first row read off `row_groups`' answer in NumPy: the first row holding
    each group number, m for a number no row holds."""
    row_group = np.asarray(ROW_GROUPS(jnp.asarray(sizes, jnp.int32), num_rows, R))
    return np.searchsorted(row_group, np.arange(ragged.max_groups(num_rows, len(sizes), R) + 1), side="left")


def test_the_groups_first_rows_from_the_sizes_are_those_of_the_rows_groups():
    """`group_first_rows` from the sizes alone against the groups read row by row, over the
    cases above, no rows, and random groupings of 1 to 256 experts: empty experts, negative
    sizes, totals short of m and past it (clamped)."""
    first_rows = jax.jit(ragged.group_first_rows, static_argnums=(1, 2))
    rng = np.random.default_rng(0)
    groupings = [*CASES.values(), ([0, 0], 0), ([5], 0)]
    for experts, num_rows in ((1, 300), (7, 1000), (64, 4097), (256, 20000)):
        for scale in (0.5, 1.0, 1.5):  # totals short of m, about m and past it
            sizes = rng.integers(0, 2 * scale * num_rows / experts + 1, experts) * (rng.random(experts) < 0.8)
            sizes[rng.random(experts) < 0.05] = -3  # a negative size owns no rows
            groupings.append((sizes.tolist(), num_rows))
    for sizes, num_rows in groupings:
        got = np.asarray(first_rows(jnp.asarray(sizes, jnp.int32), num_rows, R))
        np.testing.assert_array_equal(got, first_rows_by_rows(sizes, num_rows), err_msg=f"{sizes}, m={num_rows}")
    # The comparison tells groupings apart: one expert's row moved to its neighbour moves a group.
    moved = np.asarray(first_rows(jnp.asarray([71, 199, 5], jnp.int32), 290, R))
    assert not np.array_equal(moved, first_rows_by_rows([70, 200, 5], 290))


def test_the_groups_first_rows_take_no_loop():
    """On a GPU a binary search over the m rows is a loop of log2(m) steps, a kernel or two
    each; the first rows from the sizes are one fusion of comparisons (the search over the
    rows, lowered alike, shows the check can fail)."""
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    text = jax.jit(lambda s: ragged.group_first_rows(s, 16384, R)).lower(sizes).as_text()
    assert "while" not in text
    by_rows = jax.jit(lambda s: jnp.searchsorted(ragged.row_groups(s, 16384, R), jnp.arange(137), side="left"))
    assert "while" in by_rows.lower(sizes).as_text()
