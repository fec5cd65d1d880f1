"""route's sigmoid scores, selection bias, groups, normalization and scale, by hand;
update_expert_bias; DeepSeek-V3's balance loss; the errors of bad options."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu


def logit(p):
    return np.log(p) - np.log1p(-p)


def slot_experts(plan):
    """(T, top_k) expert of each token's slots, read back from the plan."""
    experts = np.repeat(np.arange(plan.num_experts), np.asarray(plan.group_sizes))
    return experts[np.asarray(plan.inverse)].reshape(plan.num_tokens, plan.top_k)


def slot_weights(plan):
    return np.asarray(plan.row_prob)[np.asarray(plan.inverse)].reshape(plan.num_tokens, plan.top_k)


# One token's sigmoid scores over 8 experts in 4 groups of 2.
SCORES = np.array([[0.9, 0.1, 0.6, 0.55, 0.7, 0.05, 0.3, 0.35]])
LOGITS = jnp.asarray(logit(SCORES), jnp.float32)


def test_sigmoid_scores_are_the_weights():
    plan = jax_dsrelu.route(LOGITS, 3, score="sigmoid")
    np.testing.assert_array_equal(slot_experts(plan), [[0, 4, 2]])
    np.testing.assert_allclose(slot_weights(plan), [[0.9, 0.7, 0.6]], rtol=1e-6)


def test_bias_moves_the_choice_but_not_the_weights():
    bias = jnp.asarray([0.0, 0.0, 0.0, 0.2, 0.0, 0.0, 0.0, 0.0], jnp.float32)  # 0.55 + 0.2 beats 0.7
    plan = jax_dsrelu.route(LOGITS, 3, score="sigmoid", expert_bias=bias)
    np.testing.assert_array_equal(slot_experts(plan), [[0, 3, 4]])
    np.testing.assert_allclose(slot_weights(plan), [[0.9, 0.55, 0.7]], rtol=1e-6)


def test_groups_score_by_their_two_largest():
    # Group sums of the top two: g0 1.0, g1 1.15, g2 0.75, g3 0.65. Keeping 2 groups keeps
    # g0 and g1, so expert 4 (0.7, the second best single score) is out.
    plan = jax_dsrelu.route(LOGITS, 3, score="sigmoid", num_groups=4, top_groups=2)
    np.testing.assert_array_equal(slot_experts(plan), [[0, 2, 3]])
    # One group kept: g1 only, both its experts.
    plan = jax_dsrelu.route(LOGITS, 2, score="sigmoid", num_groups=4, top_groups=1)
    np.testing.assert_array_equal(slot_experts(plan), [[2, 3]])
    # The bias counts in the group scores: g2 gets +0.5 per expert and wins.
    bias = jnp.asarray([0, 0, 0, 0, 0.5, 0.5, 0, 0], jnp.float32)
    plan = jax_dsrelu.route(LOGITS, 2, score="sigmoid", expert_bias=bias, num_groups=4, top_groups=1)
    np.testing.assert_array_equal(slot_experts(plan), [[4, 5]])
    np.testing.assert_allclose(slot_weights(plan), [[0.7, 0.05]], rtol=1e-5)


def test_one_expert_groups_score_by_that_expert():
    # Groups of one: keeping 2 groups keeps the best two experts, so top_k = 2 is plain top-2.
    plan = jax_dsrelu.route(LOGITS, 2, score="sigmoid", num_groups=8, top_groups=2)
    np.testing.assert_array_equal(slot_experts(plan), [[0, 4]])


def test_group_ties_go_to_the_lower_group():
    logits = jnp.asarray(logit(np.array([[0.5, 0.5, 0.5, 0.5]])), jnp.float32)
    plan = jax_dsrelu.route(logits, 2, score="sigmoid", num_groups=2, top_groups=1)
    np.testing.assert_array_equal(slot_experts(plan), [[0, 1]])


def test_normalize_then_scale():
    plan = jax_dsrelu.route(LOGITS, 3, score="sigmoid", normalize=True, scale=2.5)
    np.testing.assert_allclose(slot_weights(plan), [[2.5 * 0.9 / 2.2, 2.5 * 0.7 / 2.2, 2.5 * 0.6 / 2.2]], rtol=1e-6)
    softmax = jax_dsrelu.route(LOGITS, 2, scale=3.0)
    np.testing.assert_allclose(
        np.asarray(softmax.row_prob), 3.0 * np.asarray(jax_dsrelu.route(LOGITS, 2).row_prob), rtol=1e-6
    )


def test_scores_that_underflow_give_zero_weights_not_nan():
    plan = jax_dsrelu.route(jnp.full((2, 4), -200.0, jnp.float32), 2, score="sigmoid", normalize=True)
    np.testing.assert_array_equal(plan.row_prob, 0.0)


def test_router_gradient_flows_through_the_chosen_scores_only():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((10, 8)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(8), jnp.float32)
    options = dict(score="sigmoid", num_groups=4, top_groups=2, normalize=True, scale=2.5)
    chosen = slot_experts(jax_dsrelu.route(logits, 3, expert_bias=bias, **options))
    weights_cotangent = jnp.asarray(rng.standard_normal((10, 3)), jnp.float32)

    def through_route(logits, bias):
        plan = jax_dsrelu.route(logits, 3, expert_bias=bias, **options)
        return jnp.sum(plan.row_prob[plan.inverse].reshape(10, 3) * weights_cotangent)

    def by_hand(logits):
        weights = jnp.take_along_axis(jax.nn.sigmoid(logits), jnp.asarray(chosen), axis=1)
        return jnp.sum(2.5 * weights / (jnp.sum(weights, axis=1, keepdims=True) + 1e-20) * weights_cotangent)

    dlogits, dbias = jax.grad(through_route, argnums=(0, 1))(logits, bias)
    np.testing.assert_allclose(dlogits, jax.grad(by_hand)(logits), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(dbias, 0.0)


def test_sigmoid_balance_loss_is_deepseek_v3s():
    rng = np.random.default_rng(1)
    num_tokens, num_experts, top_k = 12, 6, 2
    logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32)
    plan = jax_dsrelu.route(logits, top_k, score="sigmoid")
    # DeepSeek-V3, eqs. 17-20: f_i = E / (K T) * count_i, s'_i = s_i / sum_j s_j,
    # P_i = mean_t s'_i, loss = sum_i f_i P_i.
    counts = np.bincount(slot_experts(plan).reshape(-1), minlength=num_experts)
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    f = num_experts / (top_k * num_tokens) * counts
    p = np.mean(scores / scores.sum(axis=1, keepdims=True), axis=0)
    np.testing.assert_allclose(plan.load_balancing_loss, np.sum(f * p), rtol=1e-6)
    np.testing.assert_allclose(plan.expert_prob, p, rtol=1e-6)

    # One loss per sequence: route each sequence on its own with vmap.
    per_sequence = jax.vmap(lambda l: jax_dsrelu.route(l, top_k, score="sigmoid").load_balancing_loss)(
        logits.reshape(3, 4, num_experts)
    )
    want = [float(jax_dsrelu.route(logits[4 * s : 4 * s + 4], top_k, score="sigmoid").load_balancing_loss) for s in range(3)]
    np.testing.assert_allclose(per_sequence, want, rtol=1e-6)


def test_update_expert_bias():
    bias = jnp.asarray([0.0, 0.1, -0.2, 0.3], jnp.float32)
    sizes = jnp.asarray([4, 1, 2, 1], jnp.int32)  # mean 2
    new = jax_dsrelu.update_expert_bias(bias, sizes, 1e-2)
    assert new.dtype == jnp.float32
    np.testing.assert_allclose(new, [-0.01, 0.11, -0.2, 0.31], rtol=1e-6)
    # A bfloat16 bias comes back in float32; the rate may be a traced scalar.
    traced = jax.jit(jax_dsrelu.update_expert_bias)(bias.astype(jnp.bfloat16), sizes, jnp.float32(1e-2))
    assert traced.dtype == jnp.float32
    # Balancing moves load: a skewed router, corrected by the bias over a few steps.
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.standard_normal((256, 8)) + np.linspace(-1, 1, 8), jnp.float32)
    bias = jnp.zeros(8, jnp.float32)
    spread = []
    for _ in range(60):
        sizes = jax_dsrelu.route(logits, 2, score="sigmoid", expert_bias=bias).group_sizes
        spread.append(int(jnp.max(sizes) - jnp.min(sizes)))
        bias = jax_dsrelu.update_expert_bias(bias, sizes, 2e-2)
    assert spread[-1] < spread[0] / 3, spread


def test_bad_options_raise_naming_them():
    logits = jnp.zeros((5, 8), jnp.float32)
    route = jax_dsrelu.route
    with pytest.raises(ValueError, match="score must be 'softmax' or 'sigmoid', got 'relu'"):
        route(logits, 2, score="relu")
    with pytest.raises(ValueError, match=r"num_groups must be at least 1 and divide the number of experts E=8, got num_groups=3"):
        route(logits, 2, num_groups=3)
    with pytest.raises(ValueError, match="got num_groups=0"):
        route(logits, 2, num_groups=0)
    with pytest.raises(TypeError, match=r"num_groups must be a Python int, got 2.0 \(float\)"):
        route(logits, 2, num_groups=2.0)
    with pytest.raises(ValueError, match="top_groups must be None or between 1 and num_groups=4, got top_groups=5"):
        route(logits, 2, num_groups=4, top_groups=5)
    with pytest.raises(ValueError, match="got top_groups=0"):
        route(logits, 2, num_groups=4, top_groups=0)
    with pytest.raises(ValueError, match=r"top_k must be at most the 4 experts that top_groups=2 groups of E/num_groups=2 hold, got top_k=5"):
        route(logits, 5, num_groups=4, top_groups=2)
    with pytest.raises(ValueError, match=r"expert_bias must be \(E,\) with E=8 experts, got expert_bias.shape=\(7,\)"):
        route(logits, 2, expert_bias=jnp.zeros(7))
    with pytest.raises(TypeError, match="expert_bias must be a JAX or NumPy array, got list"):
        route(logits, 2, expert_bias=[0.0] * 8)
    with pytest.raises(TypeError, match="expert_bias.dtype must be one of"):
        route(logits, 2, expert_bias=jnp.zeros(8, jnp.int32))
    with pytest.raises(TypeError, match=r"scale must be a Python float, got '2' \(str\)"):
        route(logits, 2, scale="2")
    with pytest.raises(ValueError, match="scale must be finite, got scale=inf"):
        route(logits, 2, scale=float("inf"))
    with pytest.raises(TypeError, match="logits must be a JAX or NumPy array, got list"):
        route([[0.0, 1.0]], 1)
    with pytest.raises(ValueError, match=r"group_sizes.shape\[0\] must equal expert_bias.shape\[0\] \(E\)=8"):
        jax_dsrelu.update_expert_bias(jnp.zeros(8), jnp.zeros(7, jnp.int32), 1e-3)


def test_update_under_data_parallelism_takes_the_psum_of_the_group_sizes():
    """Each of 8 devices routes its own tokens; the psum of their group sizes is the sizes
    of all the tokens, so every device moves the replicated bias as one device would."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)
    bias = jnp.asarray(0.01 * rng.standard_normal(16), jnp.float32)

    def step(logits, bias):
        sizes = jax_dsrelu.route(logits, 4, score="sigmoid", expert_bias=bias).group_sizes
        return jax_dsrelu.update_expert_bias(bias, jax.lax.psum(sizes, "data"), 1e-3)

    sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))(logits, bias)
    whole = jax_dsrelu.route(logits, 4, score="sigmoid", expert_bias=bias).group_sizes
    np.testing.assert_array_equal(sharded, jax_dsrelu.update_expert_bias(bias, whole, 1e-3))


def test_bad_balancing_steps_raise_naming_them():
    bias, sizes = jnp.zeros(4), jnp.array([3, 1, 0, 4], jnp.int32)
    with pytest.raises(TypeError, match=r"rate must be a float or a float scalar array, got '1e-3' \(str\)"):
        jax_dsrelu.update_expert_bias(bias, sizes, "1e-3")
    with pytest.raises(ValueError, match="rate must be finite and >= 0, got nan"):
        jax_dsrelu.update_expert_bias(bias, sizes, float("nan"))
    with pytest.raises(ValueError, match="rate must be finite and >= 0, got -0.1"):
        jax_dsrelu.update_expert_bias(bias, sizes, -0.1)
    with pytest.raises(TypeError, match="group_sizes.dtype must be an integer type"):
        jax_dsrelu.update_expert_bias(bias, sizes.astype(jnp.float32), 1e-3)
