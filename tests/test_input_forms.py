"""Group sizes in every array-like form `jax.lax.ragged_dot` takes, and the empty expert axis.

A list, a tuple or a NumPy array of group sizes means the same as the int32 JAX array;
an expert axis of extent 0 is refused at trace time with an error naming the argument.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layer import make_layer_inputs, plain_moe_mlp
from test_reference import assert_matches_contract, make_inputs

import jax_dsrelu

SIZES = [21, 0, 35, 8]  # ragged, with an empty expert, 64 rows in all
FORMS = {
    "list": lambda sizes: list(sizes),
    "tuple": lambda sizes: tuple(sizes),
    "numpy_int64": lambda sizes: np.asarray(sizes, np.int64),
    "numpy_int32": lambda sizes: np.asarray(sizes, np.int32),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_primitive_takes_group_sizes_as_any_array_like(form):
    rng = np.random.default_rng(31)
    inputs = make_inputs(rng, 64, 32, 24, SIZES, jnp.bfloat16)
    grad, weight, preact, prob, _ = inputs
    given = FORMS[form](SIZES)
    out = jax_dsrelu.grouped_gemm_dsrelu(grad, weight, preact, prob, given, with_dbias=True, with_act=True)
    assert_matches_contract(out, inputs)
    jitted = jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, given, with_dbias=True, with_act=True)
    )(grad, weight, preact, prob)
    assert_matches_contract(jitted, inputs)


@pytest.mark.parametrize("form", sorted(FORMS))
def test_moe_mlp_takes_group_sizes_as_any_array_like(form):
    rng = np.random.default_rng(32)
    x, w1, w2, prob, b1 = make_layer_inputs(rng, 64, 16, 24, SIZES, jnp.float32)
    given = FORMS[form](SIZES)
    cotangent = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)

    def loss(fn):
        return lambda x, w1, w2, prob, b1: jnp.sum(fn(x, w1, w2, prob, b1) * cotangent)

    ours = jax.jit(
        jax.value_and_grad(
            loss(lambda x, w1, w2, prob, b1: jax_dsrelu.moe_mlp(x, w1, w2, prob, given, b1=b1)),
            argnums=(0, 1, 2, 3, 4),
        )
    )(x, w1, w2, prob, b1)
    reference = jax.value_and_grad(
        loss(lambda x, w1, w2, prob, b1: plain_moe_mlp(x, w1, w2, prob, SIZES, b1)),
        argnums=(0, 1, 2, 3, 4),
    )(x, w1, w2, prob, b1)
    for name, got, want in zip(
        ("loss", "dx", "dw1", "dw2", "dprob", "db1"), jax.tree.leaves(ours), jax.tree.leaves(reference)
    ):
        got, want = np.asarray(got), np.asarray(want)
        # float32 throughout: a few 1e-6 of the largest entry, as in test_layer.
        scale = np.max(np.abs(want)) + 1e-12
        np.testing.assert_allclose(got / scale, want / scale, atol=2e-5, err_msg=name)


def test_group_sizes_that_are_not_array_like_name_the_argument():
    rng = np.random.default_rng(33)
    grad, weight, preact, prob, _ = make_inputs(rng, 16, 8, 8, [8, 8], jnp.bfloat16)
    with pytest.raises(TypeError, match=re.escape("group_sizes must be an array-like of E integers, got 'eight'")):
        jax_dsrelu.grouped_gemm_dsrelu(grad, weight, preact, prob, "eight")
    with pytest.raises(TypeError, match=re.escape("group_sizes.dtype must be an integer type (int32), got group_sizes.dtype=float32")):
        jax_dsrelu.grouped_gemm_dsrelu(grad, weight, preact, prob, [8.0, 8.0])


def test_primitive_with_no_experts_names_the_argument():
    rng = np.random.default_rng(34)
    grad, _, preact, prob, _ = make_inputs(rng, 16, 8, 12, [16], jnp.bfloat16)
    weight = jnp.zeros((0, 12, 8), jnp.bfloat16)
    words = "weight.shape[0] is the number of experts E and must be at least 1, got weight.shape=(0, 12, 8)"
    for group_sizes in (jnp.zeros((0,), jnp.int32), []):
        with pytest.raises(ValueError, match=re.escape(words)):
            jax.jit(lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, group_sizes)).trace(grad, weight, preact, prob)


def test_moe_mlp_with_no_experts_names_the_argument():
    rng = np.random.default_rng(35)
    x, _, _, prob, _ = make_layer_inputs(rng, 16, 8, 12, [16], jnp.float32)
    w1 = jnp.zeros((0, 8, 12), jnp.float32)
    w2 = jnp.zeros((0, 12, 8), jnp.float32)
    words = "w1.shape[0] is the number of experts E and must be at least 1, got w1.shape=(0, 8, 12)"
    with pytest.raises(ValueError, match=re.escape(words)):
        jax.jit(lambda *a: jax_dsrelu.moe_mlp(*a, jnp.zeros((0,), jnp.int32))).trace(x, w1, w2, prob)


def test_no_rows_give_empty_row_outputs_and_zero_expert_outputs():
    weight = jnp.asarray(np.random.default_rng(36).standard_normal((3, 8, 16)), jnp.bfloat16)
    empty = dict(grad=jnp.zeros((0, 16), jnp.bfloat16), preact=jnp.zeros((0, 8), jnp.bfloat16), prob=jnp.zeros((0,), jnp.float32))
    out = jax.jit(
        lambda grad, preact, prob: jax_dsrelu.grouped_gemm_dsrelu(
            grad, weight, preact, prob, [0, 0, 0], with_dbias=True, with_act=True
        )
    )(**empty)
    assert out.dh.shape == (0, 8) and out.act.shape == (0, 8) and out.dprob.shape == (0,)
    np.testing.assert_array_equal(out.dbias, np.zeros((3, 8), np.float32))
    np.testing.assert_array_equal(out.amax, np.zeros((3,), np.float32))
