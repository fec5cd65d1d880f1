"""Token rounding (`round_to`): each expert keeps the largest multiple of round_to of its
assignments, its best-scored ones, against a per-expert NumPy selection and a per-token
plain jnp MoE that leaves the cut slots out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu
from test_moe_layer import NUM_EXPERTS, NUM_TOKENS, assert_close, make_inputs, plain_moe, top_experts


def kept_slots(scores, experts, round_to):
    """(T, top_k) bool: per expert, its assignments in decreasing score, ties to the lower
    token, the first round_to * floor(count / round_to) kept. Plain Python, one expert at
    a time."""
    keep = np.zeros(experts.shape, bool)
    for expert in range(scores.shape[1]):
        tokens, slots = np.nonzero(experts == expert)
        ranked = sorted(zip(tokens, slots), key=lambda ts: (-scores[ts[0], expert], ts[0]))
        for token, slot in ranked[: len(ranked) // round_to * round_to]:
            keep[token, slot] = True
    return keep


def softmax64(logits):
    logits = np.asarray(logits, np.float64)
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("round_to", [2, 4, 7, 16])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_plan_keeps_each_experts_best_multiple(top_k, round_to):
    rng = np.random.default_rng(10 * top_k + round_to)
    num_tokens, num_experts = 96, 6
    logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32)
    plan = jax.jit(lambda l: jax_dsrelu.route(l, top_k, round_to=round_to))(logits)
    experts = np.argsort(-np.asarray(logits, np.float64), axis=1, kind="stable")[:, :top_k]
    counts = np.bincount(experts.reshape(-1), minlength=num_experts)
    keep = kept_slots(softmax64(logits), experts, round_to)
    np.testing.assert_array_equal(plan.chosen_sizes, counts)
    np.testing.assert_array_equal(plan.group_sizes, counts // round_to * round_to)
    # Rows by expert, each expert's kept tokens in token order, then the cut ones.
    order, inverse = np.asarray(plan.order), np.asarray(plan.inverse)
    np.testing.assert_array_equal(order[inverse], np.arange(num_tokens * top_k))
    kept_rows = [a for e in range(num_experts) for a in np.flatnonzero((experts.reshape(-1) == e) & keep.reshape(-1))]
    total = int(np.sum(plan.group_sizes))
    np.testing.assert_array_equal(order[:total], kept_rows)
    np.testing.assert_array_equal(np.sort(order[total:]), np.flatnonzero(~keep.reshape(-1)))
    # At least one assignment is cut somewhere in these draws, and the cut rows weigh 0.
    assert total < num_tokens * top_k
    np.testing.assert_array_equal(np.asarray(plan.row_prob)[total:], 0.0)
    assert np.all(np.asarray(plan.row_prob)[:total] > 0)


def test_ties_keep_the_lower_token_and_a_wrong_tie_break_is_caught():
    # Eight tokens with the same logits: expert 0 is everyone's choice at the same score.
    logits = jnp.tile(jnp.asarray([[2.0, 0.0, -1.0]]), (8, 1))
    plan = jax_dsrelu.route(logits, 1, round_to=3)
    np.testing.assert_array_equal(plan.group_sizes, [6, 0, 0])
    np.testing.assert_array_equal(np.asarray(plan.order)[:6], np.arange(6))
    scores, experts = softmax64(logits), np.zeros((8, 1), int)
    np.testing.assert_array_equal(kept_slots(scores, experts, 3)[:, 0], np.arange(8) < 6)


def test_sigmoid_bias_and_groups_cut_by_the_score_and_vmap_routes_each_batch_alone():
    rng = np.random.default_rng(12)
    logits = jnp.asarray(rng.standard_normal((3, 80, 8)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(8), jnp.float32)
    options = dict(score="sigmoid", expert_bias=bias, num_groups=4, top_groups=2, normalize=True, scale=2.5)
    plans = jax.vmap(lambda l: jax_dsrelu.route(l, 3, round_to=5, **options))(logits)
    for batch in range(3):
        plain = jax_dsrelu.route(logits[batch], 3, **options)  # the selection, tested elsewhere
        experts = np.zeros((80, 3), int)  # each slot's expert, from the plain plan's rows
        experts.reshape(-1)[np.asarray(plain.order)] = np.repeat(np.arange(8), np.asarray(plain.group_sizes))
        scores = 1.0 / (1.0 + np.exp(-np.asarray(logits[batch], np.float64)))
        keep = kept_slots(scores, experts, 5)
        sizes = np.asarray(plans.group_sizes[batch])
        np.testing.assert_array_equal(sizes, np.asarray(plain.group_sizes) // 5 * 5)
        kept_rows = [a for e in range(8) for a in np.flatnonzero((experts.reshape(-1) == e) & keep.reshape(-1))]
        np.testing.assert_array_equal(np.asarray(plans.order[batch])[: sizes.sum()], kept_rows)
        single = jax_dsrelu.route(logits[batch], 3, round_to=5, **options)
        for got, want in zip(jax.tree.leaves(single), jax.tree.leaves(jax.tree.map(lambda a: a[batch], plans))):
            np.testing.assert_array_equal(got, want)


def test_no_rounding_is_the_plain_plan_bitwise():
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((50, 5)), jnp.float32)
    plain = jax_dsrelu.route(logits, 2)
    for round_to in (None, 1):
        rounded = jax_dsrelu.route(logits, 2, round_to=round_to)
        for got, want in zip(jax.tree.leaves(rounded), jax.tree.leaves(plain)):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(plain.group_sizes, plain.chosen_sizes)


@pytest.mark.parametrize("normalize", [False, True], ids=["softmax", "normalized"])
@pytest.mark.parametrize("round_to", [3, 8])
def test_layer_values_and_gradients_leave_the_cut_slots_out(round_to, normalize):
    rng = np.random.default_rng(round_to + normalize)
    x, router, w1, w2, b1 = make_inputs(rng)
    top_k = 2
    experts = top_experts(x, router, top_k)
    keep = kept_slots(softmax64(np.asarray(x, np.float64) @ np.asarray(router, np.float64)), experts, round_to)
    assert 0 < np.sum(~keep) < keep.size  # some slots cut, some kept
    cotangent = jnp.asarray(rng.standard_normal((NUM_TOKENS, x.shape[1])), jnp.float32)

    def value_and_grads(fn):
        out, pullback = jax.vjp(fn, x, router, w1, w2, b1)
        return out, pullback(cotangent)

    def layer(*args):
        return jax_dsrelu.moe_layer(*args[:4], b1=args[4], top_k=top_k, normalize=normalize, round_to=round_to)

    out, grads = jax.jit(lambda: value_and_grads(layer))()
    want_out, want_grads = jax.jit(lambda: value_and_grads(
        lambda *a: plain_moe(*a, top_k, normalize, experts=experts, keep=keep)))()
    assert_close(out, want_out, 2e-6, "out")
    for name, got, expected in zip(("dx", "drouter", "dw1", "dw2", "db1"), grads, want_grads):
        assert_close(got, expected, 2e-5, name)
    # The uncut layer differs: the comparison above can tell a cut from none.
    uncut = jax.jit(lambda: jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=top_k, normalize=normalize))()
    assert np.max(np.abs(np.asarray(uncut) - np.asarray(want_out))) > 1e-3


def test_an_expert_below_round_to_runs_nothing_and_its_weights_get_no_gradient():
    rng = np.random.default_rng(5)
    x, router, w1, w2, b1 = make_inputs(rng)
    counts = np.bincount(top_experts(x, router, 2).reshape(-1), minlength=NUM_EXPERTS)
    round_to = int(np.max(counts)) + 1  # every expert below it: everything is cut
    loss = lambda *a: jnp.sum(jax_dsrelu.moe_layer(*a, b1=b1, round_to=round_to) ** 2)  # noqa: E731
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, router, w1, w2)
    assert value == 0.0
    for grad in grads:
        np.testing.assert_array_equal(grad, 0.0)


def test_aux_counts_the_choice_before_the_cut():
    rng = np.random.default_rng(6)
    x, router, w1, w2, b1 = make_inputs(rng)
    _, aux = jax_dsrelu.moe_layer(x, router, w1, w2, round_to=4, return_aux=True)
    _, plain_aux = jax_dsrelu.moe_layer(x, router, w1, w2, return_aux=True)
    for got, want in zip(aux, plain_aux):
        np.testing.assert_array_equal(got, want)


def test_flax_module_takes_round_to():
    flax = pytest.importorskip("flax")  # noqa: F841
    from flax import nnx

    from jax_dsrelu.flax import MoE

    rng = np.random.default_rng(8)
    x, router, w1, w2, b1 = make_inputs(rng)
    module = MoE(x.shape[1], w1.shape[2], NUM_EXPERTS, round_to=4, rngs=nnx.Rngs(0))
    module.router[...], module.w1[...], module.w2[...], module.b1[...] = router, w1, w2, b1
    want = jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, round_to=4)
    np.testing.assert_array_equal(module(x), want)
    assert module.options.round_to == 4
    tensors = {"gate.weight": np.asarray(router).T, "gate.e_score_correction_bias": np.zeros(NUM_EXPERTS, np.float32),
               "experts.up_proj": np.asarray(w1).transpose(0, 2, 1), "experts.down_proj": np.asarray(w2).transpose(0, 2, 1)}
    block = MoE.from_hf_nemotron_h(tensors, top_k=2, round_to=4)
    params = jax_dsrelu.params_from_hf_nemotron_h(tensors)
    np.testing.assert_array_equal(block(x), jax_dsrelu.moe_layer(x, **params, top_k=2, score="sigmoid", round_to=4))
    assert not np.array_equal(block(x), jax_dsrelu.moe_layer(x, **params, top_k=2, score="sigmoid"))


@pytest.mark.parametrize("round_to, error", [(0, ValueError), (-128, ValueError), (2.5, TypeError), (True, TypeError)])
def test_bad_round_to_is_refused_by_name(round_to, error):
    logits = jnp.zeros((4, 3))
    with pytest.raises(error, match=f"round_to.*{round_to!r}"):
        jax_dsrelu.route(logits, 1, round_to=round_to)


def test_expert_parallel_refuses_round_to_by_name():
    rng = np.random.default_rng(9)
    x, router, w1, w2, _ = make_inputs(rng)
    mesh = jax.make_mesh((1,), ("expert",))
    with pytest.raises(ValueError, match="round_to must be None or 1 under expert parallelism.*round_to=128"):
        jax_dsrelu.moe_layer_expert_parallel(x, router, w1, w2, mesh=mesh, round_to=128)
