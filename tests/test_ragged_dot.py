"""jax_dsrelu.ops.ragged_dot against jax.lax.ragged_dot: values, both gradients, errors."""

from __future__ import annotations

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import expert_rows
from jax.test_util import check_grads

import jax_dsrelu

GROUPINGS = {
    "ragged": [0, 21, 0, 30, 13],
    "sum_below_m": [3, 17, 0, 20, 1],
    "all_empty": [0, 0, 0, 0, 0],
    "one_group": [0, 0, 64, 0, 0],
}
NUM_ROWS, K, N = 64, 32, 48


def seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def make(rng, num_rows, num_groups, dtype, k=K, n=N):
    lhs = jnp.asarray(rng.standard_normal((num_rows, k)), dtype)
    rhs = jnp.asarray(rng.standard_normal((num_groups, k, n)) / np.sqrt(k), dtype)
    cotangent = jnp.asarray(rng.standard_normal((num_rows, n)), dtype)
    return lhs, rhs, cotangent


def value_and_grads(fn, lhs, rhs, group_sizes, cotangent):
    out, vjp = jax.vjp(lambda l, r: fn(l, r, group_sizes), lhs, rhs)
    return (out, *vjp(cotangent.astype(out.dtype)))


def clamped(sizes, num_rows):
    return jnp.asarray([end - start for start, end in expert_rows(sizes, num_rows)], jnp.int32)


# float32: the same float32 sums in another order; bfloat16: one rounding of the output
# or gradient (2^-8 relative) on top, against its largest entry.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def assert_close(got, want, dtype, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, name
    scale = np.max(np.abs(want), initial=0.0) + 1e-30
    np.testing.assert_allclose(got / scale, want / scale, atol=TOLERANCE[dtype], rtol=0, err_msg=name)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("grouping", GROUPINGS)
def test_values_and_gradients_match_lax(grouping, dtype):
    rng = np.random.default_rng(seed(grouping, dtype.__name__))
    sizes = jnp.asarray(GROUPINGS[grouping], jnp.int32)
    lhs, rhs, cotangent = make(rng, NUM_ROWS, len(sizes), dtype)
    ours = jax.jit(lambda *a: value_and_grads(jax_dsrelu.ragged_dot, *a))(lhs, rhs, sizes, cotangent)
    theirs = value_and_grads(jax.lax.ragged_dot, lhs, rhs, sizes, cotangent)
    for name, got, want in zip(("out", "d lhs", "d rhs"), ours, theirs):
        assert got.dtype == want.dtype, name
        assert_close(got, want, dtype, name)
    if grouping == "all_empty":
        for got in ours:
            np.testing.assert_array_equal(np.asarray(got), 0)


def test_empty_groups_get_zero_gradients_and_unowned_rows_zero():
    rng = np.random.default_rng(5)
    sizes = GROUPINGS["sum_below_m"]
    lhs, rhs, cotangent = make(rng, NUM_ROWS, len(sizes), jnp.float32)
    out, d_lhs, d_rhs = value_and_grads(jax_dsrelu.ragged_dot, lhs, rhs, jnp.asarray(sizes), cotangent)
    total = sum(sizes)
    np.testing.assert_array_equal(np.asarray(out)[total:], 0)
    np.testing.assert_array_equal(np.asarray(d_lhs)[total:], 0)
    np.testing.assert_array_equal(np.asarray(d_rhs)[2], 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bad_group_sizes_are_clamped(dtype):
    rng = np.random.default_rng(seed("bad", dtype.__name__))
    sizes = [9, -4, 30, 2**30, -(2**31)]
    lhs, rhs, cotangent = make(rng, NUM_ROWS, len(sizes), dtype)
    ours = value_and_grads(jax_dsrelu.ragged_dot, lhs, rhs, jnp.asarray(sizes, jnp.int32), cotangent)
    # lax.ragged_dot leaves bad sizes undefined; the contract clamps them first.
    theirs = value_and_grads(jax.lax.ragged_dot, lhs, rhs, clamped(sizes, NUM_ROWS), cotangent)
    for name, got, want in zip(("out", "d lhs", "d rhs"), ours, theirs):
        assert_close(got, want, dtype, name)


def test_no_rows():
    rng = np.random.default_rng(6)
    lhs, rhs, cotangent = make(rng, 0, 3, jnp.bfloat16)
    out, d_lhs, d_rhs = value_and_grads(jax_dsrelu.ragged_dot, lhs, rhs, jnp.asarray([0, 4, 1]), cotangent)
    assert out.shape == (0, N) and d_lhs.shape == (0, K)
    np.testing.assert_array_equal(np.asarray(d_rhs, np.float32), np.zeros(rhs.shape))


def test_preferred_element_type_float32_from_bfloat16():
    rng = np.random.default_rng(7)
    sizes = jnp.asarray(GROUPINGS["ragged"], jnp.int32)
    lhs, rhs, cotangent = make(rng, NUM_ROWS, 5, jnp.bfloat16)
    fn = lambda l, r, g, **kw: jax_dsrelu.ragged_dot(l, r, g, preferred_element_type=jnp.float32)
    lax_fn = lambda l, r, g: jax.lax.ragged_dot(l, r, g, preferred_element_type=jnp.float32)
    ours = value_and_grads(fn, lhs, rhs, sizes, cotangent)
    theirs = value_and_grads(lax_fn, lhs, rhs, sizes, cotangent)
    assert ours[0].dtype == jnp.float32
    assert ours[1].dtype == ours[2].dtype == jnp.bfloat16
    # The float32 output is the float32 accumulation itself.
    assert_close(ours[0], theirs[0], jnp.float32, "out")
    for name, got, want in zip(("d lhs", "d rhs"), ours[1:], theirs[1:]):
        assert_close(got, want, jnp.bfloat16, name)


def test_check_grads():
    rng = np.random.default_rng(8)
    sizes = jnp.asarray([3, 0, 6, 2], jnp.int32)
    lhs, rhs, _ = make(rng, 13, 4, jnp.float32, k=5, n=6)
    check_grads(
        lambda l, r: jax_dsrelu.ragged_dot(l, r, sizes), (lhs, rhs), order=1, modes=["rev"],
        atol=1e-2, rtol=1e-2,
    )


def test_group_sizes_as_a_list_and_eager_equals_jit():
    rng = np.random.default_rng(9)
    lhs, rhs, _ = make(rng, 20, 3, jnp.float32)
    eager = jax_dsrelu.ragged_dot(lhs, rhs, [5, 0, 15])
    jitted = jax.jit(jax_dsrelu.ragged_dot)(lhs, rhs, jnp.asarray([5, 0, 15], jnp.int32))
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))


def test_group_sizes_get_a_float0_cotangent():
    rng = np.random.default_rng(10)
    lhs, rhs, _ = make(rng, 8, 2, jnp.float32)
    sizes = jnp.asarray([3, 5], jnp.int32)
    _, vjp = jax.vjp(jax_dsrelu.ragged_dot, lhs, rhs, sizes)
    d_sizes = vjp(jnp.ones((8, N)))[2]
    assert d_sizes.dtype == jax.dtypes.float0 and d_sizes.shape == (2,)


BAD_CALLS = [
    (lambda a: a | {"lhs": a["lhs"][None]}, ValueError, "lhs must be (m, k), got lhs.shape=(1, 16, 8)"),
    (lambda a: a | {"rhs": a["rhs"][0]}, ValueError, "rhs must be (E, k, n), got rhs.shape=(8, 12)"),
    (lambda a: a | {"rhs": a["rhs"][:, :7]}, ValueError, "rhs.shape[1] must equal lhs.shape[1] (k)=8, got rhs.shape=(3, 7, 12)"),
    (lambda a: a | {"rhs": a["rhs"][:0]}, ValueError, "rhs.shape[0] is the number of experts E and must be at least 1, got rhs.shape=(0, 8, 12)"),
    (lambda a: a | {"group_sizes": a["group_sizes"][:2]}, ValueError, "group_sizes.shape[0] must equal rhs.shape[0] (E)=3, got group_sizes.shape=(2,)"),
    (lambda a: a | {"group_sizes": a["group_sizes"][None]}, ValueError, "group_sizes must be (E,), got group_sizes.shape=(1, 3)"),
    (lambda a: a | {"group_sizes": a["group_sizes"].astype(jnp.float32)}, TypeError, "group_sizes.dtype must be an integer type"),
    (lambda a: a | {"rhs": a["rhs"].astype(jnp.float16)}, TypeError, "rhs.dtype must equal lhs.dtype=bfloat16, got rhs.dtype=float16"),
    (lambda a: a | {"lhs": a["lhs"].astype(jnp.int8), "rhs": a["rhs"].astype(jnp.int8)}, TypeError, "lhs.dtype must be one of bfloat16, float16, float32, got lhs.dtype=int8"),
    (lambda a: a | {"preferred_element_type": jnp.int32}, TypeError, "preferred_element_type must be one of bfloat16, float16, float32, got int32"),
    (lambda a: a | {"backend": "cuda"}, ValueError, "backend must be one of 'auto', 'xla', 'sm90', 'sm100', got 'cuda'"),
]


@pytest.mark.parametrize("change, error, words", BAD_CALLS)
def test_bad_arguments_raise_at_trace_time(change, error, words):
    args = change(
        dict(
            lhs=jnp.zeros((16, 8), jnp.bfloat16),
            rhs=jnp.zeros((3, 8, 12), jnp.bfloat16),
            group_sizes=jnp.asarray([4, 4, 8], jnp.int32),
        )
    )
    positional = [args.pop(name) for name in ("lhs", "rhs", "group_sizes")]
    with pytest.raises(error, match=re.escape(words)):
        jax.jit(lambda *p: jax_dsrelu.ragged_dot(*p, **args)).trace(*positional)


def test_a_backend_without_the_kernel_names_the_ones_that_can():
    with pytest.raises(NotImplementedError, match=r"backend='sm100' cannot serve this call.*'xla'"):
        jax_dsrelu.ragged_dot(jnp.zeros((4, 2)), jnp.zeros((1, 2, 3)), jnp.asarray([4]), backend="sm100")
