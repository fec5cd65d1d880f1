"""route, dispatch and combine: plans and losses by hand, ties, order, gradients without scatter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu

# Token t's router probabilities, and a constant added to its logits: softmax ignores the
# constant and logsumexp(logits[t]) equals it, so both losses are simple by hand.
PROBS = np.array(
    [
        [0.1, 0.2, 0.3, 0.4],  # top-2: experts 3, 2
        [0.4, 0.3, 0.2, 0.1],  # 0, 1
        [0.25, 0.25, 0.25, 0.25],  # a four-way tie: 0, 1
        [0.1, 0.6, 0.1, 0.2],  # 1, 3
    ]
)
SHIFT = np.array([0.0, 1.0, 2.0, -1.0])
HAND_LOGITS = np.log(PROBS) + SHIFT[:, None]


def test_plan_of_a_small_case_by_hand():
    plan = jax_dsrelu.route(jnp.asarray(HAND_LOGITS, jnp.float32), 2)
    # Assignments a = 2 t + s, sorted by (expert, a): e0 <- a2 a4, e1 <- a3 a5 a6,
    # e2 <- a1, e3 <- a0 a7.
    np.testing.assert_array_equal(plan.order, [2, 4, 3, 5, 6, 1, 0, 7])
    np.testing.assert_array_equal(plan.inverse, [6, 5, 0, 2, 1, 3, 4, 7])
    np.testing.assert_array_equal(plan.group_sizes, [2, 3, 1, 2])
    assert plan.group_sizes.dtype == jnp.int32 and plan.order.dtype == jnp.int32
    np.testing.assert_allclose(plan.row_prob, [0.4, 0.25, 0.3, 0.25, 0.6, 0.3, 0.4, 0.2], rtol=1e-6)
    assert plan.row_prob.dtype == jnp.float32
    np.testing.assert_allclose(plan.expert_prob, [0.2125, 0.3375, 0.2125, 0.2375], rtol=1e-6)
    # f = [2, 3, 1, 2] / 8, P as above: 4 * (2*.2125 + 3*.3375 + .2125 + 2*.2375) / 8.
    np.testing.assert_allclose(plan.load_balancing_loss, 1.0625, rtol=1e-6)
    # mean of the shifts squared: (0 + 1 + 4 + 1) / 4.
    np.testing.assert_allclose(plan.router_z_loss, 1.5, rtol=1e-6, atol=1e-6)
    assert (plan.num_tokens, plan.top_k, plan.num_experts) == (4, 2, 4)


def test_normalize_divides_by_the_top_k_sum():
    plan = jax_dsrelu.route(jnp.asarray(HAND_LOGITS, jnp.float32), 2, normalize=True)
    want = [0.4 / 0.7, 0.5, 0.3 / 0.7, 0.5, 0.75, 0.3 / 0.7, 0.4 / 0.7, 0.25]
    np.testing.assert_allclose(plan.row_prob, want, rtol=1e-6)
    # The losses do not depend on normalize.
    np.testing.assert_allclose(plan.load_balancing_loss, 1.0625, rtol=1e-6)


def test_uniform_router_losses():
    plan = jax_dsrelu.route(jnp.zeros((6, 8), jnp.float32), 3)
    np.testing.assert_allclose(plan.router_z_loss, np.log(8.0) ** 2, rtol=1e-6)
    # All ties: every token picks experts 0, 1, 2, so f = (1/3, 1/3, 1/3, 0, ...) and
    # P = 1/8 everywhere: 8 * (1/8) = 1.
    np.testing.assert_array_equal(plan.group_sizes, [6, 6, 6, 0, 0, 0, 0, 0])
    np.testing.assert_allclose(plan.load_balancing_loss, 1.0, rtol=1e-6)


@pytest.mark.parametrize(
    "row, top_k, chosen",
    [
        ([1.0, 1.0, 1.0, 1.0], 3, [0, 1, 2]),
        ([5.0, 3.0, 5.0, 3.0], 3, [0, 2, 1]),
        ([0.0, 2.0, 2.0, 0.0], 2, [1, 2]),
        ([-1.0, -1.0, 7.0, -1.0], 2, [2, 0]),
    ],
)
def test_ties_go_to_the_lower_expert_index(row, top_k, chosen):
    plan = jax_dsrelu.route(jnp.asarray([row], jnp.float32), top_k)
    # One token: sorted rows are its slots ordered by expert, so order lists the slots.
    experts = np.repeat(np.arange(len(row)), np.asarray(plan.group_sizes))
    slot_experts = experts[np.asarray(plan.inverse)]
    np.testing.assert_array_equal(slot_experts, chosen)


def test_load_balancing_gradient_flows_through_mean_probability_only():
    rng = np.random.default_rng(30)
    logits = jnp.asarray(rng.standard_normal((24, 5)), jnp.float32)
    top_k = 2
    fraction = np.asarray(jax_dsrelu.route(logits, top_k).group_sizes) / (24 * top_k)

    def by_hand(logits):  # Switch Transformer's loss with the fractions held fixed
        return 5 * jnp.sum(fraction * jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0))

    def z_by_hand(logits):
        return jnp.mean(jax.scipy.special.logsumexp(logits, axis=-1) ** 2)

    for loss, reference in (("load_balancing_loss", by_hand), ("router_z_loss", z_by_hand)):
        value, grad = jax.value_and_grad(lambda l: getattr(jax_dsrelu.route(l, top_k), loss))(logits)
        want_value, want_grad = jax.value_and_grad(reference)(logits)
        np.testing.assert_allclose(value, want_value, rtol=1e-6, err_msg=loss)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7, err_msg=loss)


def random_plan(rng, num_tokens, num_experts, top_k, normalize=False):
    logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32)
    # The last expert gets no token, so an empty group is always part of the case.
    logits = logits.at[:, -1].set(-30.0)
    return logits, jax_dsrelu.route(logits, top_k, normalize=normalize)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_plan_matches_numpy_sort(top_k):
    rng = np.random.default_rng(31 + top_k)
    logits, plan = random_plan(rng, 37, 6, top_k)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :top_k]  # (T, top_k)
    flat = experts.reshape(-1)
    order = np.argsort(flat, kind="stable")
    np.testing.assert_array_equal(plan.order, order)
    np.testing.assert_array_equal(plan.inverse, np.argsort(order))
    np.testing.assert_array_equal(plan.group_sizes, np.bincount(flat, minlength=6))
    assert int(plan.group_sizes[-1]) == 0
    np.testing.assert_array_equal(plan.row_prob, np.take_along_axis(probs, experts, 1).reshape(-1)[order])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dispatch_and_combine_values_and_gradients(top_k, dtype):
    rng = np.random.default_rng(40 + top_k)
    num_tokens, d = 29, 7
    _, plan = random_plan(rng, num_tokens, 5, top_k)
    order = np.asarray(plan.order)
    token_of_row = order // top_k
    x = jnp.asarray(rng.standard_normal((num_tokens, d)), dtype)
    y = jnp.asarray(rng.standard_normal((num_tokens * top_k, d)), dtype)
    x64, y64 = np.asarray(x, np.float64), np.asarray(y, np.float64)

    rows = jax_dsrelu.dispatch(x, plan)
    assert rows.dtype == dtype
    np.testing.assert_array_equal(np.asarray(rows, np.float64), x64[token_of_row])

    combined = jax_dsrelu.combine(y, plan)
    assert combined.dtype == jnp.float32
    want = np.zeros((num_tokens, d))
    np.add.at(want, token_of_row, y64)
    np.testing.assert_allclose(combined, want, rtol=1e-6, atol=1e-6)

    g_rows = rng.standard_normal((num_tokens * top_k, d)).astype(np.float32)
    dx = jax.grad(lambda x: jnp.sum(jax_dsrelu.dispatch(x, plan).astype(jnp.float32) * g_rows))(x)
    g_rows = np.asarray(jnp.asarray(g_rows, dtype), np.float64)  # the cotangent in x's dtype
    want_dx = np.zeros((num_tokens, d))
    np.add.at(want_dx, token_of_row, g_rows)
    assert dx.dtype == dtype
    tolerance = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=tolerance, atol=tolerance)

    g_out = rng.standard_normal((num_tokens, d)).astype(np.float32)
    dy = jax.grad(lambda y: jnp.sum(jax_dsrelu.combine(y, plan) * g_out))(y)
    assert dy.dtype == dtype
    np.testing.assert_array_equal(np.asarray(dy, np.float32), np.asarray(jnp.asarray(g_out[token_of_row], dtype), np.float32))


def test_combine_adds_slots_left_to_right_in_float32():
    # One token, three slots, each in its own expert (so sorted row s is slot s):
    # (1 + 1e8) - 1e8 is 0 in float32, while 1 + (1e8 - 1e8) would be 1.
    plan = jax_dsrelu.route(jnp.asarray([[3.0, 2.0, 1.0]], jnp.float32), 3)
    np.testing.assert_array_equal(plan.order, [0, 1, 2])
    y = jnp.asarray([[1.0], [1e8], [-1e8]], jnp.float32)
    assert float(jax_dsrelu.combine(y, plan)[0, 0]) == float((np.float32(1) + np.float32(1e8)) - np.float32(1e8))
    assert float(jax_dsrelu.combine(y, plan)[0, 0]) == 0.0


def test_gradients_lower_to_no_scatter():
    rng = np.random.default_rng(50)
    logits, plan = random_plan(rng, 16, 4, 2)
    x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)

    def through_all(logits, x):
        plan = jax_dsrelu.route(logits, 2, normalize=True)
        rows = jax_dsrelu.dispatch(x, plan) * plan.row_prob[:, None]
        return jnp.sum(jax_dsrelu.combine(rows, plan) ** 2) + plan.load_balancing_loss + plan.router_z_loss

    for name, fn, args in (
        ("dispatch", lambda x: jnp.sum(jax_dsrelu.dispatch(x, plan) ** 2), (x,)),
        ("combine", lambda y: jnp.sum(jax_dsrelu.combine(y, plan) ** 2), (jnp.repeat(x, 2, axis=0),)),
        ("route, dispatch and combine", through_all, (logits, x)),
    ):
        hlo = jax.jit(jax.grad(fn, argnums=tuple(range(len(args))))).lower(*args).as_text()
        assert "scatter" not in hlo, name
    # The naive form of the same gradient does scatter, so the check can fail.
    naive = jax.jit(jax.grad(lambda x: jnp.sum(x[plan.order // 2] ** 2))).lower(x).as_text()
    assert "scatter" in naive


def test_plan_is_a_pytree_through_jit():
    rng = np.random.default_rng(51)
    logits, plan = random_plan(rng, 12, 4, 2)
    x = jnp.asarray(rng.standard_normal((12, 3)), jnp.float32)
    leaves, treedef = jax.tree.flatten(plan)
    assert len(leaves) == 8  # order, inverse, group_sizes, chosen_sizes, row_prob, expert_prob, two losses
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.top_k == 2
    jitted = jax.jit(lambda x, plan: jax_dsrelu.dispatch(x, plan))(x, plan)
    np.testing.assert_array_equal(jitted, jax_dsrelu.dispatch(x, plan))
    jitted_plan = jax.jit(jax_dsrelu.route, static_argnums=1)(logits, 2)
    np.testing.assert_array_equal(jitted_plan.order, plan.order)


def test_validation_names_the_argument():
    logits = jnp.zeros((5, 4), jnp.float32)
    with pytest.raises(ValueError, match=r"top_k must be between 1 and the number of experts E=4, got top_k=5"):
        jax_dsrelu.route(logits, 5)
    with pytest.raises(ValueError, match="got top_k=0"):
        jax_dsrelu.route(logits, 0)
    with pytest.raises(TypeError, match=r"top_k must be a Python int, got 2.0 \(float\)"):
        jax_dsrelu.route(logits, 2.0)
    with pytest.raises(ValueError, match=r"logits must be \(T, E\), got logits.shape=\(5,\)"):
        jax_dsrelu.route(logits[:, 0], 1)
    with pytest.raises(TypeError, match="normalize must be a Python bool"):
        jax_dsrelu.route(logits, 2, normalize="yes")
    with pytest.raises(TypeError, match="logits.dtype must be one of"):
        jax_dsrelu.route(logits.astype(jnp.int32), 2)
    plan = jax_dsrelu.route(logits, 2)
    with pytest.raises(ValueError, match=r"x.shape\[0\] must equal plan.num_tokens \(T\)=5, got x.shape=\(6, 3\)"):
        jax_dsrelu.dispatch(jnp.zeros((6, 3)), plan)
    with pytest.raises(ValueError, match=r"y.shape\[0\] must equal plan.num_tokens \* plan.top_k=10, got y.shape=\(5, 3\)"):
        jax_dsrelu.combine(jnp.zeros((5, 3)), plan)
