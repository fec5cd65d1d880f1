"""Routing for an MoE layer: which experts each token goes to, and back.

`route` turns router logits into a `RoutingPlan`; `dispatch` copies each token's row to
its top_k experts, sorted by expert as `moe_mlp` wants them; `combine` adds each token's
top_k expert outputs back together. None of their gradients adds two values into one
place in an order the hardware chooses: every gradient is a gather by an inverse
permutation, or a sum over a token's top_k slots in slot order, so they are bitwise
reproducible, and their HLO holds no scatter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu.moe import permutation
from jax_dsrelu.primitives import validation


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "order",
        "inverse",
        "group_sizes",
        "row_prob",
        "expert_prob",
        "load_balancing_loss",
        "router_z_loss",
    ],
    meta_fields=["top_k"],
)
@dataclasses.dataclass(frozen=True)
class RoutingPlan:
    """Where every (token, slot) assignment goes: a pytree, so it passes through jit.

    Assignment a = t * top_k + s is token t's s-th choice (slots in decreasing
    probability). Rows sorted by expert are numbered 0..T*top_k-1.
    """

    order: jax.Array  # (T*top_k,) int32, the assignment at each expert-sorted row
    inverse: jax.Array  # (T*top_k,) int32, the expert-sorted row of each assignment
    group_sizes: jax.Array  # (E,) int32, rows of each expert, in row order
    row_prob: jax.Array  # (T*top_k,) float32, routing probability of each sorted row
    expert_prob: jax.Array  # (E,) float32, P_e: mean router probability of expert e over tokens
    load_balancing_loss: jax.Array  # () float32, E * sum_e f_e * P_e
    router_z_loss: jax.Array  # () float32, mean over tokens of logsumexp(logits)**2
    top_k: int

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0] // self.top_k

    @property
    def num_experts(self) -> int:
        return self.group_sizes.shape[0]


def route(
    logits: jax.Array,  # (T, E) router logits
    top_k: int,
    *,
    normalize: bool = False,
) -> RoutingPlan:
    """Softmax over the E experts in float32, then each token's top_k experts.

    Ties go to the lower expert index. row_prob is each slot's softmax probability, or,
    with normalize=True, that probability divided by the sum over the token's top_k
    slots. The auxiliary losses:

        load_balancing_loss = E * sum_e f_e * P_e    (Switch Transformer)
            f_e = group_sizes[e] / (T * top_k), the fraction of assignments to expert e
            P_e = mean over tokens of softmax(logits)[:, e]  (the gradient flows through P)
        router_z_loss = mean over tokens of logsumexp(logits[t])**2    (ST-MoE)

    Both are 1 and log(E)**2 for a perfectly uniform router; with T = 0 they are 0.
    """
    validation.check_logits(logits)
    num_tokens, num_experts = logits.shape
    validation.require_top_k(top_k, num_experts)
    validation.require_bool("normalize", normalize)

    logits = logits.astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    # lax.top_k puts the lower index first among equal values. The selection itself is
    # piecewise constant: only the probabilities of the chosen slots carry a gradient.
    _, experts = lax.top_k(lax.stop_gradient(probs), top_k)
    slot_prob = _take_slots(num_experts, probs, experts)  # (T, top_k)
    if normalize:
        slot_prob = slot_prob / _sum_slots(slot_prob[:, :, None])

    grouping = permutation.sort_by_group(experts.reshape(-1), num_experts)
    row_prob = permutation.gather_rows(slot_prob.reshape(-1), grouping.order, grouping.inverse)

    token_count = max(num_tokens, 1)  # T = 0 gives zero losses, not 0 / 0
    expert_prob = jnp.sum(probs, axis=0) / token_count
    fraction = grouping.sizes.astype(jnp.float32) / (token_count * top_k)
    log_normalizer = jax.nn.logsumexp(logits, axis=-1)
    return RoutingPlan(
        order=grouping.order,
        inverse=grouping.inverse,
        group_sizes=grouping.sizes,
        row_prob=row_prob,
        expert_prob=expert_prob,
        load_balancing_loss=num_experts * jnp.sum(fraction * expert_prob),
        router_z_loss=jnp.sum(log_normalizer**2) / token_count,
        top_k=top_k,
    )


def dispatch(
    x: jax.Array,  # (T, d) tokens
    plan: RoutingPlan,
) -> jax.Array:  # (T*top_k, d), x.dtype
    """Each token's row once per chosen expert, sorted by expert (the rows `moe_mlp` takes).

    Its gradient gathers the rows back by the inverse order and adds each token's top_k
    slots in slot order, in float32.
    """
    validation.check_token_rows("x", x, plan.num_tokens, "plan.num_tokens (T)")
    return _dispatch(plan.top_k, x, plan.order, plan.inverse)


def combine(
    y: jax.Array,  # (T*top_k, d) expert outputs in expert-sorted row order
    plan: RoutingPlan,
) -> jax.Array:  # (T, d) float32
    """out[t] = sum over token t's slots s = 0..top_k-1 of its row's output, in slot order.

    The sum is taken in float32, and returned in float32 (cast it as the model wants).
    Weight the rows by routing probability before (`moe_mlp` does, through `prob`).
    Its gradient is a gather: each row receives its token's gradient.
    """
    validation.check_token_rows("y", y, plan.num_tokens * plan.top_k, "plan.num_tokens * plan.top_k")
    return _combine(plan.top_k, np.dtype(y.dtype), y, plan.order, plan.inverse)


def _sum_slots(slots: jax.Array) -> jax.Array:
    """(T, top_k, ...) -> (T, ...) float32, added left to right over the slots."""
    total = slots[:, 0].astype(jnp.float32)
    for slot in range(1, slots.shape[1]):
        total = total + slots[:, slot].astype(jnp.float32)
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take_slots(num_experts, probs, experts):
    return jnp.take_along_axis(probs, experts, axis=1)


def _take_slots_fwd(num_experts, probs, experts):
    return _take_slots(num_experts, probs, experts), experts


def _take_slots_bwd(num_experts, experts, g):
    chosen = experts[:, :, None] == jnp.arange(num_experts)  # (T, top_k, E)
    # A token's top_k experts are distinct, so each (t, e) gets at most one nonzero
    # term: the sum is exact whatever order it is taken in.
    return jnp.sum(jnp.where(chosen, g[:, :, None], 0.0), axis=1), None


_take_slots.defvjp(_take_slots_fwd, _take_slots_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(top_k, x, order, inverse):
    return jnp.take(x, order // top_k, axis=0)


def _dispatch_fwd(top_k, x, order, inverse):
    return _dispatch(top_k, x, order, inverse), (order, inverse)


def _dispatch_bwd(top_k, residuals, g):
    order, inverse = residuals
    slots = jnp.take(g, inverse, axis=0).reshape(-1, top_k, *g.shape[1:])
    # g has x's dtype: dispatch returns rows of x unchanged.
    return _sum_slots(slots).astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine(top_k, dtype, y, order, inverse):
    return _sum_slots(jnp.take(y, inverse, axis=0).reshape(-1, top_k, *y.shape[1:]))


def _combine_fwd(top_k, dtype, y, order, inverse):
    return _combine(top_k, dtype, y, order, inverse), (order, inverse)


def _combine_bwd(top_k, dtype, residuals, g):
    order, inverse = residuals
    return jnp.take(g, order // top_k, axis=0).astype(dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)
