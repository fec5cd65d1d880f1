"""The ragged matmul (both epilogues, both rhs layouts) and the ragged contraction on the
XLA backend, against float64 NumPy written independently (`ragged_numpy`)."""

from __future__ import annotations

import zlib

import contract_numpy
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ragged_numpy

from jax_dsrelu.primitives.ragged_contract import ragged_contract
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu

# Empty experts inside and at the ends, rows past the total, all experts empty, and
# sizes that must be clamped (negative; past m).
GROUPINGS = {
    "ragged": [0, 13, 0, 40, 7, 0],
    "sum_below_m": [5, 9, 0, 11, 2, 1],
    "all_empty": [0, 0, 0, 0, 0, 0],
    "bad_sizes": [9, -4, 30, 2**30, 5, -(2**31)],
}
NUM_ROWS, K, N = 64, 40, 24


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def rhs_of(rng, layout, dtype, num_experts, k=K, n=N):
    shape = (num_experts, k, n) if layout == "kn" else (num_experts, n, k)
    return jnp.asarray(rng.standard_normal(shape) / np.sqrt(k), dtype)


def assert_within(got, expected, terms, num_summed, dtype):
    bound = contract_numpy.tolerance(terms, num_summed, dtype)
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - expected), bound)


@pytest.mark.parametrize("layout", ["kn", "nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_ragged_matmul_matches_float64(grouping, dtype, layout):
    rng = np.random.default_rng(seed((grouping, layout)))
    sizes = GROUPINGS[grouping]
    lhs = jnp.asarray(rng.standard_normal((NUM_ROWS, K)), dtype)
    rhs = rhs_of(rng, layout, dtype, len(sizes))
    out = jax.jit(
        lambda l, r, g: ragged_matmul(l, r, g, rhs_layout=layout, out_dtype=dtype, backend="xla")
    )(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert out.shape == (NUM_ROWS, N) and out.dtype == dtype
    expected, terms = ragged_numpy.ragged_matmul(lhs, rhs, sizes, layout)
    assert_within(out, expected, terms, K, dtype)
    owned = ragged_numpy.owned_rows(sizes, NUM_ROWS)
    np.testing.assert_array_equal(np.asarray(out)[~owned], 0)


def test_ragged_matmul_without_rows():
    rng = np.random.default_rng(3)
    rhs = rhs_of(rng, "nk", jnp.bfloat16, 3)
    out = ragged_matmul(
        jnp.zeros((0, K), jnp.bfloat16), rhs, jnp.asarray([0, 2, 1]),
        rhs_layout="nk", out_dtype=jnp.float32, backend="auto",
    )
    assert out.shape == (0, N) and out.dtype == jnp.float32


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grouping", ["ragged", "sum_below_m", "bad_sizes"])
def test_srelu_epilogue_matches_float64(grouping, dtype, with_bias):
    rng = np.random.default_rng(seed((grouping, with_bias, "srelu")))
    sizes = GROUPINGS[grouping]
    lhs = jnp.asarray(rng.standard_normal((NUM_ROWS, K)), dtype)
    rhs = rhs_of(rng, "kn", dtype, len(sizes))
    prob = jnp.asarray(rng.uniform(0.05, 1.0, NUM_ROWS), jnp.float32)
    bias = jnp.asarray(0.3 * rng.standard_normal((len(sizes), N)), jnp.float32) if with_bias else None
    h, act = jax.jit(
        lambda l, r, g, p, b: ragged_matmul_srelu(
            l, r, g, p, b, rhs_layout="kn", out_dtype=dtype, backend="xla"
        )
    )(lhs, rhs, jnp.asarray(sizes, jnp.int32), prob, bias)
    expected, terms = ragged_numpy.srelu_preact(lhs, rhs, sizes, bias)
    assert_within(h, expected, terms, K + 1, dtype)
    # act comes from the rounded h, as the backward regenerates it: r * r * prob in
    # float32, rounded once.
    r = np.maximum(np.asarray(h, np.float32), np.float32(0))
    want_act = (r * r * np.asarray(prob)[:, None]).astype(dtype)
    np.testing.assert_array_equal(np.asarray(act), want_act)
    owned = ragged_numpy.owned_rows(sizes, NUM_ROWS)
    np.testing.assert_array_equal(np.asarray(h)[~owned], 0)
    np.testing.assert_array_equal(np.asarray(act)[~owned], 0)


def test_srelu_epilogue_without_act_gives_the_same_h_alone():
    """with_act=False: no act made or returned, and h bit for bit the one beside act."""
    rng = np.random.default_rng(seed(("ragged", "srelu", "h alone")))
    sizes = GROUPINGS["ragged"]
    lhs = jnp.asarray(rng.standard_normal((NUM_ROWS, K)), jnp.bfloat16)
    rhs = rhs_of(rng, "kn", jnp.bfloat16, len(sizes))
    prob = jnp.asarray(rng.uniform(0.05, 1.0, NUM_ROWS), jnp.float32)
    bias = jnp.asarray(0.3 * rng.standard_normal((len(sizes), N)), jnp.float32)

    def up(with_act):
        return jax.jit(lambda l, r, g, p, b: ragged_matmul_srelu(
            l, r, g, p, b, with_act=with_act, rhs_layout="kn", out_dtype=jnp.bfloat16, backend="xla"))

    group_sizes = jnp.asarray(sizes, jnp.int32)
    (h, act), (h_alone, no_act) = up(True)(lhs, rhs, group_sizes, prob, bias), up(False)(lhs, rhs, group_sizes, prob, bias)
    assert act is not None and no_act is None
    np.testing.assert_array_equal(np.asarray(h_alone).view(np.uint16), np.asarray(h).view(np.uint16))
    products = [up(with_act).lower(lhs, rhs, group_sizes, prob, bias).as_text().count("stablehlo.multiply")
                for with_act in (True, False)]
    assert products[1] == products[0] - 2  # no r * r * prob formed


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_ragged_contract_matches_float64(grouping, dtype, out_dtype):
    rng = np.random.default_rng(seed((grouping, "contract")))
    sizes = GROUPINGS[grouping]
    lhs = jnp.asarray(rng.standard_normal((NUM_ROWS, K)), dtype)
    rhs = jnp.asarray(rng.standard_normal((NUM_ROWS, N)), dtype)
    out = jax.jit(
        lambda l, r, g: ragged_contract(l, r, g, out_dtype=out_dtype, backend="xla")
    )(lhs, rhs, jnp.asarray(sizes, jnp.int32))
    assert out.shape == (len(sizes), K, N) and out.dtype == out_dtype
    expected, terms = ragged_numpy.ragged_contract(lhs, rhs, sizes, len(sizes))
    assert_within(out, expected, terms, NUM_ROWS, out_dtype)
    empty = [e for e, (s, t) in enumerate(contract_numpy.expert_rows(sizes, NUM_ROWS)) if s == t]
    np.testing.assert_array_equal(np.asarray(out)[empty], 0)


def test_ragged_contract_without_rows_is_zeros():
    out = ragged_contract(
        jnp.zeros((0, 5), jnp.float32), jnp.zeros((0, 7), jnp.float32), jnp.asarray([3, 0]),
        out_dtype=jnp.float32, backend="auto",
    )
    np.testing.assert_array_equal(np.asarray(out), np.zeros((2, 5, 7)))


def test_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="rhs_layout must be one of .*got 'mk'"):
        ragged_matmul(
            jnp.zeros((4, 2)), jnp.zeros((1, 2, 3)), jnp.asarray([4]),
            rhs_layout="mk", out_dtype=jnp.float32, backend="xla",
        )


def test_kernel_backend_off_cuda_is_refused():
    # Lowered for the CPU, a CUDA-only backend must refuse, not fall back silently.
    with pytest.raises(NotImplementedError, match="sm90"):
        jax.jit(
            lambda l, r, g: ragged_contract(l, r, g, out_dtype=jnp.float32, backend="sm90")
        ).lower(jnp.zeros((4, 2)), jnp.zeros((4, 3)), jnp.asarray([4]))
