"""moe_mlp: its custom VJP against autodiff of a plain jnp expert MLP."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import expert_rows
from jax.test_util import check_grads

import jax_dsrelu


def plain_moe_mlp(x, w1, w2, prob, group_sizes, b1=None):
    """The expert MLP written the obvious way: one dense pass per expert, rows masked.

    group_sizes is concrete here, so the rows of each expert come from plain Python.
    """
    y = jnp.zeros(x.shape, jnp.float32)
    for e, (start, end) in enumerate(expert_rows(group_sizes, x.shape[0])):
        h = x[start:end].astype(jnp.float32) @ w1[e].astype(jnp.float32)
        if b1 is not None:
            h = h + b1[e]
        a = jnp.maximum(h, 0.0) ** 2 * prob[start:end, None]
        y = y.at[start:end].set(a @ w2[e].astype(jnp.float32))
    return y


def make_layer_inputs(rng, num_rows, d, f, group_sizes, dtype):
    num_experts = len(group_sizes)
    x = jnp.asarray(rng.standard_normal((num_rows, d)), dtype)
    w1 = jnp.asarray(rng.standard_normal((num_experts, d, f)) / np.sqrt(d), dtype)
    w2 = jnp.asarray(rng.standard_normal((num_experts, f, d)) / np.sqrt(f), dtype)
    prob = jnp.asarray(rng.uniform(0.1, 1.0, num_rows), jnp.float32)
    b1 = jnp.asarray(0.1 * rng.standard_normal((num_experts, f)), jnp.float32)
    return x, w1, w2, prob, b1


GROUPINGS = [[20, 0, 31, 13], [64, 0, 0, 0], [7, -3, 9, 100]]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("sizes", GROUPINGS, ids=["ragged", "one_expert", "bad_sizes"])
def test_gradients_match_autodiff_float32(sizes, with_bias):
    rng = np.random.default_rng(len(sizes) * 10 + sum(abs(s) for s in sizes) + with_bias)
    x, w1, w2, prob, b1 = make_layer_inputs(rng, 64, 24, 40, sizes, jnp.float32)
    b1 = b1 if with_bias else None
    group_sizes = jnp.asarray(sizes, jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((64, 24)), jnp.float32)

    def loss(fn):
        return lambda x, w1, w2, prob, b1: jnp.sum(fn(x, w1, w2, prob, b1) * cotangent)

    ours = jax.jit(
        jax.value_and_grad(
            loss(lambda x, w1, w2, prob, b1: jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1)),
            argnums=(0, 1, 2, 3, 4),
        )
    )(x, w1, w2, prob, b1)
    reference = jax.value_and_grad(
        loss(lambda x, w1, w2, prob, b1: plain_moe_mlp(x, w1, w2, prob, sizes, b1)),
        argnums=(0, 1, 2, 3, 4),
    )(x, w1, w2, prob, b1)

    for name, got, want in zip(
        ("loss", "dx", "dw1", "dw2", "dprob", "db1"),
        jax.tree.leaves(ours, is_leaf=lambda v: v is None),
        jax.tree.leaves(reference, is_leaf=lambda v: v is None),
    ):
        if want is None:
            assert got is None, name
            continue
        got, want = np.asarray(got), np.asarray(want)
        # float32 throughout: a relative error of a few 1e-6 of the largest entry.
        scale = np.max(np.abs(want)) + 1e-12
        np.testing.assert_allclose(got / scale, want / scale, atol=2e-5, err_msg=name)


def test_gradients_match_autodiff_bfloat16():
    rng = np.random.default_rng(21)
    sizes = [30, 0, 50, 48]
    x, w1, w2, prob, b1 = make_layer_inputs(rng, 128, 32, 64, sizes, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    ours = jax.grad(
        lambda *a: jnp.sum(jax_dsrelu.moe_mlp(*a[:4], group_sizes, b1=a[4]).astype(jnp.float32) ** 2),
        argnums=(0, 1, 2, 3, 4),
    )(x, w1, w2, prob, b1)
    reference = jax.grad(
        lambda *a: jnp.sum(plain_moe_mlp(*a[:4], sizes, a[4]) ** 2), argnums=(0, 1, 2, 3, 4)
    )(x, w1, w2, prob, b1)
    for name, got, want in zip(("dx", "dw1", "dw2", "dprob", "db1"), ours, reference):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        # bf16 rounds h, a, y and dh once each (2^-8 relative apiece); a few of those
        # compound, so 3e-2 of the norm is the bf16 budget, and well below a wrong formula.
        assert np.linalg.norm(got - want) <= 3e-2 * np.linalg.norm(want), name
        assert got.dtype == want.dtype


def test_check_grads_reverse_mode():
    rng = np.random.default_rng(22)
    sizes = jnp.asarray([5, 0, 7, 4], jnp.int32)
    x, w1, w2, prob, b1 = make_layer_inputs(rng, 16, 6, 10, [5, 0, 7, 4], jnp.float32)
    check_grads(
        lambda x, w1, w2, prob, b1: jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1),
        (x, w1, w2, prob, b1),
        order=1,
        modes=["rev"],
        eps=1e-2,
        atol=5e-2,
        rtol=5e-2,
    )


def test_forward_matches_plain_and_zeroes_unowned_rows():
    rng = np.random.default_rng(23)
    sizes = [10, 0, 20]
    x, w1, w2, prob, b1 = make_layer_inputs(rng, 40, 16, 24, sizes, jnp.float32)
    y = jax_dsrelu.moe_mlp(x, w1, w2, prob, jnp.asarray(sizes, jnp.int32), b1=b1)
    np.testing.assert_allclose(y, plain_moe_mlp(x, w1, w2, prob, sizes, b1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(y[30:], 0.0)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_xla_gradients_have_no_scatter(platform):
    """What makes moe_mlp's XLA gradients reproducible on a GPU: every sum over rows is a
    dot or a fixed reduction, never a scatter-add (whose GPU order varies)."""
    rng = np.random.default_rng(24)
    sizes = jnp.asarray([100, 0, 60, 96], jnp.int32)
    args = make_layer_inputs(rng, 256, 32, 64, [100, 0, 60, 96], jnp.bfloat16)
    grad_fn = jax.grad(
        lambda *a: jnp.sum(
            jax_dsrelu.moe_mlp(*a[:4], sizes, b1=a[4], deterministic=True, backend="xla").astype(jnp.float32)
            ** 2
        ),
        argnums=(0, 1, 2, 3, 4),
    )
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    text = jax.jit(grad_fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
    assert "dot_general" in text
    assert "scatter" not in text


def test_layer_validation_names_the_argument():
    rng = np.random.default_rng(25)
    x, w1, w2, prob, b1 = make_layer_inputs(rng, 8, 4, 6, [4, 4], jnp.float32)
    sizes = jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(ValueError, match=r"w2.shape\[1\] must equal w1.shape\[2\] \(f\)=6"):
        jax_dsrelu.moe_mlp(x, w1, w2[:, :5], prob, sizes)
    with pytest.raises(ValueError, match=r"b1.shape\[1\] must equal w1.shape\[2\] \(f\)=6"):
        jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1[:, :3])
    with pytest.raises(TypeError, match="w1.dtype must equal x.dtype=float32, got w1.dtype=bfloat16"):
        jax_dsrelu.moe_mlp(x, w1.astype(jnp.bfloat16), w2, prob, sizes)
