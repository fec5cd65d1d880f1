"""NaN and Inf in one expert's weights stay in that expert's rows (XLA backend).

The contract: NaN and Inf propagate as IEEE arithmetic says, and arithmetic never brings
one expert's weights to another expert's rows. For every output of grouped_gemm_dsrelu
and for moe_mlp's output and gradients: the poisoned expert's values follow the float64
contract (for the layer: a NaN reaches its expert's output), and every other expert's rows, and its rows
of the per-expert outputs, are bit for bit those of the same call without the NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import assert_matches_contract, expert_rows
from test_layer import make_layer_inputs
from test_reference import make_inputs

import jax_dsrelu

SIZES = [9, 0, 23, 1, 15]  # ragged, with an empty expert; rows past the total own none
NUM_ROWS = 56
# Columns of dh: wide enough that XLA's CPU max reduction takes its vectorized path, which
# drops NaN unless amax says otherwise.
NUM_COLS = 136
SPECIALS = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}
POISONED = [0, 2, 3]  # the first expert, one in the middle, a one-row expert


def other_rows(poisoned: int) -> np.ndarray:
    """Rows owned by an expert other than `poisoned`, or by none."""
    start, end = expert_rows(SIZES, NUM_ROWS)[poisoned]
    keep = np.ones(NUM_ROWS, bool)
    keep[start:end] = False
    return keep


def assert_bitwise_equal(got, want, name):
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8), err_msg=name
    )


@jax.jit
def dsrelu(grad, weight, preact, prob, group_sizes, alpha):
    return jax_dsrelu.grouped_gemm_dsrelu(
        grad, weight, preact, prob, group_sizes, alpha=alpha,
        with_dbias=True, with_act=True, out_dtype=grad.dtype, backend="xla",
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("special", sorted(SPECIALS))
@pytest.mark.parametrize("poisoned", POISONED)
def test_grouped_gemm_dsrelu_keeps_a_bad_weight_in_its_expert(poisoned, special, dtype):
    rng = np.random.default_rng(100 * poisoned + len(special))
    grad, weight, preact, prob, group_sizes = make_inputs(rng, NUM_ROWS, 16, NUM_COLS, SIZES, dtype)
    alpha = jnp.asarray(rng.uniform(0.5, 2.0, len(SIZES)), jnp.float32)
    bad_weight = weight.at[poisoned, 5, 3].set(SPECIALS[special])
    out, clean = (dsrelu(grad, w, preact, prob, group_sizes, alpha) for w in (bad_weight, weight))
    # The poisoned expert's values, NaN and Inf included, are the float64 contract's.
    assert_matches_contract(out, (grad, bad_weight, preact, prob, group_sizes), alpha=alpha, out_dtype=dtype)
    assert not np.all(np.isfinite(np.asarray(out.dh, np.float32)))
    keep = other_rows(poisoned)
    others = np.arange(len(SIZES)) != poisoned
    for name in ("dh", "dprob", "act"):
        assert_bitwise_equal(getattr(out, name)[keep], getattr(clean, name)[keep], name)
    for name in ("dbias", "amax"):
        assert_bitwise_equal(getattr(out, name)[others], getattr(clean, name)[others], name)
    assert np.all(np.isfinite(np.asarray(out.dh, np.float32)[keep]))


def layer_loss(x, w1, w2, prob, b1, group_sizes, cotangent):
    y = jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1, backend="xla")
    return jnp.sum(y.astype(jnp.float32) * cotangent), y


# (dx, dw1, dw2, dprob, db1), y: compiled once per dtype for every case.
layer_loss_and_grads = jax.jit(jax.grad(layer_loss, argnums=(0, 1, 2, 3, 4), has_aux=True))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("special", sorted(SPECIALS))
@pytest.mark.parametrize("which", ["w1", "w2"])
@pytest.mark.parametrize("poisoned", POISONED)
def test_moe_mlp_keeps_a_bad_weight_in_its_expert(poisoned, which, special, dtype):
    rng = np.random.default_rng(7 + 100 * poisoned + len(special) + 10 * (which == "w2"))
    x, w1, w2, prob, b1 = make_layer_inputs(rng, NUM_ROWS, 16, 24, SIZES, dtype)
    group_sizes = jnp.asarray(SIZES, jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((NUM_ROWS, 16)), jnp.float32)
    weights = dict(w1=w1, w2=w2)
    clean_grads, clean_y = layer_loss_and_grads(x, w1, w2, prob, b1, group_sizes, cotangent)
    weights[which] = weights[which].at[poisoned, 3, 5].set(SPECIALS[special])
    grads, y = layer_loss_and_grads(x, weights["w1"], weights["w2"], prob, b1, group_sizes, cotangent)

    keep = other_rows(poisoned)
    others = np.arange(len(SIZES)) != poisoned
    if special == "nan":
        # A NaN reaches its own expert's output, it is not dropped (an infinity may
        # legitimately vanish: relu(-inf) = 0).
        start, end = expert_rows(SIZES, NUM_ROWS)[poisoned]
        assert np.all(np.isnan(np.asarray(y[start:end], np.float32)).any(axis=1))
    dx, dw1, dw2, dprob, db1 = grads
    for name, got, want in (("y", y, clean_y), ("dx", dx, clean_grads[0]), ("dprob", dprob, clean_grads[3])):
        assert np.all(np.isfinite(np.asarray(got[keep], np.float32))), name
        assert_bitwise_equal(got[keep], want[keep], name)
    for name, got, want in (("dw1", dw1, clean_grads[1]), ("dw2", dw2, clean_grads[2]), ("db1", db1, clean_grads[4])):
        assert np.all(np.isfinite(np.asarray(got[others], np.float32))), name
        assert_bitwise_equal(got[others], want[others], name)
