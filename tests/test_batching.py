"""jax.vmap over any subset of arguments: each batch element equals the unbatched call."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layer import make_layer_inputs
from test_reference import make_inputs

import jax_dsrelu
from jax_dsrelu.primitives.ragged_contract import ragged_contract
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul_srelu

BATCH = 3
SIZES = [[10, 0, 25, 9], [0, 44, 0, 0], [3, 3, 3, 3]]


def stack(parts, axis=0):
    return jnp.stack(parts, axis=axis)


def assert_loop_equal(mapped, loop):
    """Leaves of `mapped` (batched along 0) against a list of unbatched results."""
    for i, one in enumerate(loop):
        for got, want in zip(jax.tree.leaves(mapped), jax.tree.leaves(one)):
            np.testing.assert_allclose(
                np.asarray(got[i], np.float64), np.asarray(want, np.float64), rtol=1e-6, atol=1e-6
            )


def batched_call(fn, arrays, batched, axis=0):
    """vmap of fn over the arrays named in `batched` (each a list of BATCH values), the
    others shared (their first value), against a Python loop over the batch."""
    names = list(arrays)
    in_axes = tuple(axis if n in batched else None for n in names)
    args = [stack(arrays[n], axis) if n in batched else arrays[n][0] for n in names]
    mapped = jax.jit(jax.vmap(fn, in_axes=in_axes))(*args)
    loop = [fn(*(arrays[n][i] if n in batched else arrays[n][0] for n in names)) for i in range(BATCH)]
    return mapped, loop


def dsrelu_arrays(seed):
    rng = np.random.default_rng(seed)
    parts = [make_inputs(rng, 44, 16, 24, sizes, jnp.bfloat16) for sizes in SIZES]
    names = ("grad", "weight", "preact", "prob", "group_sizes")
    return {name: [p[i] for p in parts] for i, name in enumerate(names)}


@pytest.mark.parametrize(
    "batched",
    [("grad",), ("weight",), ("preact", "prob"), ("group_sizes",), ("grad", "weight", "preact", "prob", "group_sizes")],
    ids=lambda b: "+".join(b),
)
def test_grouped_gemm_dsrelu(batched):
    arrays = dsrelu_arrays(len(batched))
    run = lambda *a: tuple(jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True))
    assert_loop_equal(*batched_call(run, arrays, batched))


def ragged_dot_arrays(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return dict(
        lhs=[jnp.asarray(rng.standard_normal((44, 16)), dtype) for _ in SIZES],
        rhs=[jnp.asarray(rng.standard_normal((4, 16, 8)), dtype) for _ in SIZES],
        group_sizes=[jnp.asarray(s, jnp.int32) for s in SIZES],
    )


@pytest.mark.parametrize(
    "batched", [("lhs",), ("rhs",), ("group_sizes",), ("lhs", "group_sizes"), ("lhs", "rhs", "group_sizes")],
    ids=lambda b: "+".join(b),
)
def test_ragged_dot(batched):
    arrays = ragged_dot_arrays(10 + len(batched))
    assert_loop_equal(*batched_call(jax_dsrelu.ragged_dot, arrays, batched))


def test_ragged_dot_batched_along_a_later_axis():
    arrays = ragged_dot_arrays(20)
    assert_loop_equal(*batched_call(jax_dsrelu.ragged_dot, arrays, ("lhs", "rhs"), axis=1))


def test_ragged_dot_nested_vmap():
    rng = np.random.default_rng(21)
    lhs = jnp.asarray(rng.standard_normal((2, 3, 20, 5)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 7, 5, 6)), jnp.float32)
    sizes = jnp.asarray([[4, 0, 6, 1, 1, 8, 0]] * 2, jnp.int32)
    # Batched over (2, 3): lhs over both, rhs over the inner one, sizes over the outer.
    mapped = jax.vmap(jax.vmap(jax_dsrelu.ragged_dot, in_axes=(0, 0, None)), in_axes=(0, None, 0))(lhs, rhs, sizes)
    for i in range(2):
        for j in range(3):
            want = jax_dsrelu.ragged_dot(lhs[i, j], rhs[j], sizes[i])
            np.testing.assert_allclose(np.asarray(mapped[i, j]), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_ragged_dot_per_example_gradients():
    arrays = ragged_dot_arrays(22)
    rhs, sizes = arrays["rhs"][0], arrays["group_sizes"][0]
    loss = lambda lhs, rhs: jnp.sum(jnp.sin(jax_dsrelu.ragged_dot(lhs, rhs, sizes)))
    lhs = stack(arrays["lhs"])
    mapped = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(lhs, rhs)
    loop = [jax.grad(loss, argnums=(0, 1))(lhs[i], rhs) for i in range(BATCH)]
    assert_loop_equal(mapped, loop)


def test_srelu_matmul_and_contraction_with_one_operand_batched():
    rng = np.random.default_rng(23)
    x = jnp.asarray(rng.standard_normal((44, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 16, 8)), jnp.float32)
    sizes = jnp.asarray(SIZES[0], jnp.int32)
    probs = jnp.asarray(rng.uniform(0.1, 1, (BATCH, 44)), jnp.float32)
    biases = jnp.asarray(rng.standard_normal((BATCH, 4, 8)), jnp.float32)
    srelu = lambda p, b: ragged_matmul_srelu(x, w, sizes, p, b, rhs_layout="kn", out_dtype=jnp.float32, backend="auto")
    assert_loop_equal(jax.vmap(srelu)(probs, biases), [srelu(probs[i], biases[i]) for i in range(BATCH)])
    rhs = jnp.asarray(rng.standard_normal((BATCH, 44, 6)), jnp.float32)
    contract = lambda r: ragged_contract(x, r, sizes, out_dtype=jnp.float32, backend="auto")
    assert_loop_equal(jax.vmap(contract)(rhs), [contract(rhs[i]) for i in range(BATCH)])


def layer_arrays(seed):
    rng = np.random.default_rng(seed)
    parts = [make_layer_inputs(rng, 44, 8, 12, sizes, jnp.float32) for sizes in SIZES]
    x, w1, w2, prob, b1 = (list(p) for p in zip(*parts))
    return x, w1[0], w2[0], prob, b1[0], [jnp.asarray(s, jnp.int32) for s in SIZES]


def test_moe_mlp_batched_tokens_with_shared_weights():
    x, w1, w2, prob, b1, sizes = layer_arrays(30)
    run = lambda x, prob, sizes: jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1)
    mapped = jax.jit(jax.vmap(run))(stack(x), stack(prob), stack(sizes))
    assert_loop_equal(mapped, [run(x[i], prob[i], sizes[i]) for i in range(BATCH)])


def test_moe_mlp_per_example_gradients():
    x, w1, w2, prob, b1, sizes = layer_arrays(31)

    def loss(x, prob, sizes, w1, w2, b1):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1, deterministic=True)
        return jnp.sum(y * y)

    grads = jax.grad(loss, argnums=(0, 1, 3, 4, 5))
    mapped = jax.jit(jax.vmap(grads, in_axes=(0, 0, 0, None, None, None)))(
        stack(x), stack(prob), stack(sizes), w1, w2, b1
    )
    loop = [grads(x[i], prob[i], sizes[i], w1, w2, b1) for i in range(BATCH)]
    assert_loop_equal(mapped, loop)
