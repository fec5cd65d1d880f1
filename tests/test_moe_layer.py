"""moe_layer and route/dispatch/moe_mlp/combine against a per-token plain jnp MoE."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu

NUM_TOKENS, D_MODEL, D_FF, NUM_EXPERTS = 40, 12, 20, 5


def top_experts(x, router, top_k):
    """(T, top_k) experts of each token, from float64 logits in NumPy (stable: ties to the
    lower index). The selection is piecewise constant, so it is fixed for autodiff."""
    logits = np.asarray(x, np.float64) @ np.asarray(router, np.float64)
    return np.argsort(-logits, axis=1, kind="stable")[:, :top_k]


def plain_moe(x, router, w1, w2, b1, top_k, normalize, experts=None, keep=None):
    """Each token: the sum over its top_k experts of prob * relu(x @ w1[e] + b1[e])**2 @ w2[e].

    No sort by expert, no group sizes: every token with its own experts' weights. `keep`
    (T, top_k) bool: the slots that count (token rounding's cut ones do not), else all.
    """
    if experts is None:
        experts = top_experts(x, router, top_k)
    probs = jnp.take_along_axis(jax.nn.softmax(x @ router, axis=-1), jnp.asarray(experts), axis=1)
    if normalize:
        probs = probs / jnp.sum(probs, axis=1, keepdims=True)
    if keep is not None:
        probs = jnp.where(jnp.asarray(keep), probs, 0.0)
    h = jnp.einsum("td,tsdf->tsf", x, w1[experts]) + (0.0 if b1 is None else b1[experts])
    y = jnp.einsum("tsf,tsfd->tsd", jnp.maximum(h, 0.0) ** 2, w2[experts])
    return jnp.sum(probs[:, :, None] * y, axis=1)


def make_inputs(rng, dtype=jnp.float32, num_tokens=NUM_TOKENS):
    x = rng.standard_normal((num_tokens, D_MODEL))
    x[:, 0] = 1.0  # a constant feature, so the router can hold an expert off
    router = rng.standard_normal((D_MODEL, NUM_EXPERTS))
    router[0, -1] = -40.0  # the last expert gets no token: an empty group
    w1 = rng.standard_normal((NUM_EXPERTS, D_MODEL, D_FF)) / np.sqrt(D_MODEL)
    w2 = rng.standard_normal((NUM_EXPERTS, D_FF, D_MODEL)) / np.sqrt(D_FF)
    b1 = 0.1 * rng.standard_normal((NUM_EXPERTS, D_FF))
    return (
        jnp.asarray(x, jnp.float32),
        jnp.asarray(router, jnp.float32),
        jnp.asarray(w1, dtype),
        jnp.asarray(w2, dtype),
        jnp.asarray(b1, jnp.float32),
    )


def composed_layer(x, router, w1, w2, b1, top_k, normalize):
    """docs/moe.md's four steps, by hand."""
    plan = jax_dsrelu.route(x @ router, top_k, normalize=normalize)
    rows = jax_dsrelu.dispatch(x.astype(w1.dtype), plan)
    y = jax_dsrelu.moe_mlp(rows, w1, w2, plan.row_prob, plan.group_sizes, b1=b1)
    return jax_dsrelu.combine(y, plan)


def library_layer(x, router, w1, w2, b1, top_k, normalize):
    return jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=top_k, normalize=normalize)


def assert_close(got, want, atol, name):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want)) + 1e-12
    np.testing.assert_allclose(got / scale, want / scale, atol=atol, err_msg=name)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("normalize", [False, True], ids=["softmax", "normalized"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("layer", [library_layer, composed_layer], ids=["moe_layer", "composed"])
def test_values_and_gradients_match_plain_moe(layer, top_k, normalize, with_bias):
    rng = np.random.default_rng(100 * top_k + 10 * normalize + with_bias)
    x, router, w1, w2, b1 = make_inputs(rng)
    experts = top_experts(x, router, top_k)
    sizes = np.bincount(experts.reshape(-1), minlength=NUM_EXPERTS)
    assert sizes[-1] == 0 and sizes[:-1].min() > 0  # ragged, with an empty expert
    args = (x, router, w1, w2) + ((b1,) if with_bias else ())
    cotangent = jnp.asarray(rng.standard_normal((NUM_TOKENS, D_MODEL)), jnp.float32)

    def value_and_grads(fn):
        def run(*args):
            out, pullback = jax.vjp(lambda *a: fn(*a[:4], a[4] if with_bias else None, top_k, normalize), *args)
            return out, pullback(cotangent)

        return jax.jit(run)(*args)

    out, grads = value_and_grads(layer)
    want_out, want_grads = value_and_grads(functools.partial(plain_moe, experts=experts))
    assert out.dtype == jnp.float32 and out.shape == (NUM_TOKENS, D_MODEL)
    # float32 throughout; sums in another order than the reference's: a few ulps.
    assert_close(out, want_out, 2e-6, "out")
    for name, got, expected in zip(("dx", "drouter", "dw1", "dw2", "db1"), grads, want_grads):
        if name == "drouter" and top_k == 1 and normalize:
            # Every weight is p / p = 1: the router gets no gradient, only rounding noise.
            assert np.max(np.abs(got)) < 1e-5 and np.max(np.abs(expected)) < 1e-5
            continue
        assert_close(got, expected, 2e-5, name)
    # The empty expert gets exactly zero weight gradients.
    np.testing.assert_array_equal(grads[2][-1], 0.0)
    np.testing.assert_array_equal(grads[3][-1], 0.0)


def test_bfloat16_experts_with_float32_tokens():
    rng = np.random.default_rng(7)
    x, router, w1, w2, b1 = make_inputs(rng, jnp.bfloat16, num_tokens=64)
    out = jax.jit(lambda *a: jax_dsrelu.moe_layer(*a, b1=b1))(x, router, w1, w2)
    assert out.dtype == jnp.float32
    experts = top_experts(x, router, 2)
    want = jax.jit(lambda *a: plain_moe(*a, b1, 2, False, experts))(x, router, w1.astype(jnp.float32), w2.astype(jnp.float32))
    # The experts round x, h, a and y to bfloat16 (2^-8 relative apiece).
    assert np.linalg.norm(out - want) <= 2e-2 * np.linalg.norm(want)
    grads = jax.jit(jax.grad(
        lambda x, r, w1, w2: jnp.sum(jax_dsrelu.moe_layer(x, r, w1, w2, b1=b1) ** 2), argnums=(0, 1, 2, 3)
    ))(x, router, w1, w2)
    want_grads = jax.jit(jax.grad(
        lambda x, r, w1, w2: jnp.sum(plain_moe(x, r, w1, w2, b1, 2, False, experts) ** 2), argnums=(0, 1, 2, 3)
    ))(x, router, w1.astype(jnp.float32), w2.astype(jnp.float32))
    for name, got, expected in zip(("dx", "drouter", "dw1", "dw2"), grads, want_grads):
        got, expected = np.asarray(got, np.float32), np.asarray(expected)
        assert np.linalg.norm(got - expected) <= 4e-2 * np.linalg.norm(expected), name
    assert grads[2].dtype == jnp.bfloat16 and grads[0].dtype == jnp.float32


def test_aux_holds_the_plan_losses():
    rng = np.random.default_rng(8)
    x, router, w1, w2, b1 = make_inputs(rng)
    out, aux = jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=3, return_aux=True)
    plan = jax_dsrelu.route(x @ router, 3)
    np.testing.assert_array_equal(out, jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=3))
    np.testing.assert_array_equal(aux.group_sizes, plan.group_sizes)
    assert int(jnp.sum(aux.group_sizes)) == 3 * NUM_TOKENS
    np.testing.assert_allclose(aux.load_balancing_loss, plan.load_balancing_loss, rtol=1e-6)
    np.testing.assert_allclose(aux.router_z_loss, plan.router_z_loss, rtol=1e-6)
    # The losses are differentiable in the router.
    grad = jax.grad(lambda r: jax_dsrelu.moe_layer(x, r, w1, w2, return_aux=True)[1].load_balancing_loss)(router)
    assert float(jnp.max(jnp.abs(grad))) > 0


def test_deterministic_gradients_repeat_bit_for_bit():
    rng = np.random.default_rng(9)
    x, router, w1, w2, b1 = make_inputs(rng, jnp.bfloat16, num_tokens=128)
    grad_fn = jax.jit(
        jax.grad(
            lambda *a: jnp.sum(
                jax_dsrelu.moe_layer(*a[:4], b1=a[4], top_k=2, deterministic=True, return_aux=True)[0] ** 2
            ),
            argnums=(0, 1, 2, 3, 4),
        )
    )
    first = jax.device_get(grad_fn(x, router, w1, w2, b1))
    for _ in range(2):
        again = jax.device_get(grad_fn(x, router, w1, w2, b1))
        for a, b in zip(first, again):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_layer_gradient_lowers_to_no_scatter():
    rng = np.random.default_rng(10)
    x, router, w1, w2, b1 = make_inputs(rng)

    def loss(*a):
        out, aux = jax_dsrelu.moe_layer(*a[:4], b1=a[4], normalize=True, deterministic=True, backend="xla", return_aux=True)
        return jnp.sum(out**2) + aux.load_balancing_loss + aux.router_z_loss

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))).lower(x, router, w1, w2, b1).as_text()
    assert "scatter" not in hlo


def test_no_tokens():
    rng = np.random.default_rng(11)
    x, router, w1, w2, b1 = make_inputs(rng, num_tokens=0)
    out, aux = jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, return_aux=True)
    assert out.shape == (0, D_MODEL)
    assert float(aux.load_balancing_loss) == 0.0 and float(aux.router_z_loss) == 0.0
    np.testing.assert_array_equal(aux.group_sizes, 0)


def test_validation_names_the_argument():
    rng = np.random.default_rng(12)
    x, router, w1, w2, b1 = make_inputs(rng, num_tokens=8)
    layer = jax_dsrelu.moe_layer
    with pytest.raises(ValueError, match=r"router.shape\[0\] must equal x.shape\[1\] \(d\)=12, got router.shape=\(11, 5\)"):
        layer(x, router[:11], w1, w2)
    with pytest.raises(ValueError, match=r"router.shape\[1\] must equal w1.shape\[0\] \(E\)=5, got router.shape=\(12, 4\)"):
        layer(x, router[:, :4], w1, w2)
    with pytest.raises(ValueError, match=r"w2.shape\[2\] must equal x.shape\[1\] \(d\)=12"):
        layer(x, router, w1, w2[:, :, :3])
    with pytest.raises(ValueError, match=r"b1.shape\[1\] must equal w1.shape\[2\] \(f\)=20"):
        layer(x, router, w1, w2, b1=b1[:, :3])
    with pytest.raises(ValueError, match=r"x must be \(T, d\), got x.shape=\(8, 1, 12\)"):
        layer(x[:, None], router, w1, w2)
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts E=5, got top_k=6"):
        layer(x, router, w1, w2, top_k=6)
    with pytest.raises(TypeError, match="deterministic must be a Python bool, got 1"):
        layer(x, router, w1, w2, deterministic=1)
    with pytest.raises(TypeError, match="return_aux must be a Python bool"):
        layer(x, router, w1, w2, return_aux="yes")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'xla', 'sm90', 'sm100', got 'tpu'"):
        layer(x, router, w1, w2, backend="tpu")
    with pytest.raises(TypeError, match="w2.dtype must equal w1.dtype=float32, got w2.dtype=bfloat16"):
        layer(x, router, w1, w2.astype(jnp.bfloat16))


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bfloat16_router_scores_are_computed_in_float32(score):
    # bfloat16 logits (8 significant bits) turn near ties into ties, which go to the lower
    # expert: with bfloat16 x and router the layer must still choose as float32 logits do.
    rng = np.random.default_rng(13)
    num_tokens, d, num_experts, f, top_k = 256, 64, 16, 8, 2
    x = jnp.asarray(rng.standard_normal((num_tokens, d)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((d, num_experts)) / np.sqrt(d), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((num_experts, d, f)) / np.sqrt(d), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((num_experts, f, d)) / np.sqrt(f), jnp.bfloat16)

    # Eagerly, op by op: under jit, XLA may fuse a bfloat16 dot into what reads it and keep
    # its float32 sum, so that a layer rounding its logits could pass unseen.
    def composed(logits_in_float32, x, router, w1, w2):
        logits = jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32)) if logits_in_float32 else jnp.dot(x, router)
        plan = jax_dsrelu.route(logits, top_k, score=score)
        y = jax_dsrelu.moe_mlp(jax_dsrelu.dispatch(x, plan), w1, w2, plan.row_prob, plan.group_sizes)
        return jax_dsrelu.combine(y, plan).astype(x.dtype), plan.group_sizes

    want, want_sizes = composed(True, x, router, w1, w2)
    wrong, _ = composed(False, x, router, w1, w2)
    # The data are such that bfloat16 logits choose other experts for a few tokens, so
    # the outputs differ: the test can tell.
    assert not np.array_equal(want, wrong)
    out, aux = jax_dsrelu.moe_layer(x, router, w1, w2, top_k=top_k, score=score, return_aux=True)
    np.testing.assert_array_equal(aux.group_sizes, want_sizes)
    np.testing.assert_array_equal(out, want)
