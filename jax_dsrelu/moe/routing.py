"""Routing for an MoE layer: which experts each token goes to, and back.

`route` turns router logits into a `RoutingPlan`; `dispatch` copies each token's row to
its top_k experts, sorted by expert as `moe_mlp` wants them; `combine` adds each token's
top_k expert outputs back together. None of their gradients adds two values into one
place in an order the hardware chooses: every gradient is a gather by an inverse
permutation, or a sum over a token's top_k slots in slot order (the ordered
gather-and-sum, `jax_dsrelu.primitives.gather_sum`), so they are bitwise reproducible,
and their HLO holds no scatter.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jax_dsrelu.moe import permutation
from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.primitives import validation
from jax_dsrelu.primitives.gather_sum import gather_sum


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=[
        "order",
        "inverse",
        "group_sizes",
        "chosen_sizes",
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

    Assignment a = t * top_k + s is token t's s-th choice (slots in decreasing order of
    the score `route` selects by: the probability, plus expert_bias if given). Rows
    sorted by expert are numbered 0..T*top_k-1. With round_to, the assignments cut from
    their experts take the rows after every expert's, which belong to no expert (their
    outputs are 0): sum(group_sizes) <= T*top_k.
    """

    order: jax.Array  # (T*top_k,) int32, the assignment at each expert-sorted row
    inverse: jax.Array  # (T*top_k,) int32, the expert-sorted row of each assignment
    group_sizes: jax.Array  # (E,) int32, rows each expert runs, in row order
    chosen_sizes: jax.Array  # (E,) int32, assignments the tokens chose for each expert (before round_to)
    row_prob: jax.Array  # (T*top_k,) float32, routing weight of each sorted row (normalized, scaled)
    expert_prob: jax.Array  # (E,) float32, P_e: mean over tokens of expert e's share of the scores (see `route`)
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
    # The defaults are MoEOptions', declared there once.
    score: str = MoEOptions.score,
    expert_bias: jax.Array | None = None,  # (E,) float, for selection only
    num_groups: int = MoEOptions.num_groups,
    top_groups: int | None = MoEOptions.top_groups,
    normalize: bool = MoEOptions.normalize,
    scale: float = MoEOptions.scale,
    round_to: int | None = MoEOptions.round_to,
) -> RoutingPlan:
    """Scores over the E experts in float32, then each token's top_k experts.

    score="softmax": s = softmax(logits) over E; score="sigmoid": s = sigmoid(logits),
    each expert on its own (Nemotron-H, Nemotron 3, DeepSeek-V3).

    Selection: the top_k experts of s + expert_bias, ties to the lower expert index. The
    bias moves which experts are chosen, never their weights, and gets no gradient
    (the auxiliary-loss-free balancing of DeepSeek-V3; move it with
    `update_expert_bias`). With num_groups > 1 the experts form num_groups equal
    contiguous groups; a group's score is the sum of its two largest biased scores (its
    largest if it has one expert), the top_groups best groups are kept (ties to the
    lower group) and experts of the other groups are never chosen. top_groups=None
    keeps every group.

    Weights: row_prob is each slot's s (unbiased), divided by the sum over the token's
    top_k slots when normalize=True, then multiplied by scale (the routed scaling
    factor). Slots are in decreasing order of biased score. With sigmoid scores the sum
    gets 1e-20 added, as Hugging Face's NemotronHMoE does, so that a token whose chosen
    scores all underflow to 0 gets weights 0 instead of NaN (softmax's top_k sum is at
    least top_k / E and needs no guard).

    Token rounding (round_to, off by default; SonicMoE's tile-aware rounding, rounding
    down): each expert keeps the largest multiple of round_to of the assignments the
    tokens chose for it, those with the highest scores s (the bias, the same for all of an
    expert's tokens, orders them alike), ties to the lower token index; the others are
    cut: their rows belong to no expert and add nothing to their token's output, and the
    token's other slots keep their weights (no renormalization after the cut: with
    normalize=True a cut slot's score stays in the sum its token's weights are divided by,
    and takes its part of that sum's gradient). The
    kernels then run whole tiles of round_to rows (128: the sm90 kernels' tile) without
    the partly empty last tile of each expert. An expert with fewer than round_to
    assignments runs none. It is a function of the scores, so it changes the model: it
    applies wherever it is passed, evaluation included (pass round_to=None to evaluate
    on every assignment). The auxiliary losses and `chosen_sizes`, which the
    expert-bias update takes, count the assignments before the cut: the router's choice,
    not what the cut left. round_to=None or 1 cuts nothing.

    The auxiliary losses, with f_e = chosen_sizes[e] / (T * top_k) the fraction of
    assignments to expert e and P_e the mean over tokens of a_e (the gradient flows
    through P):

        load_balancing_loss = E * sum_e f_e * P_e
            softmax: a = softmax(logits), Switch Transformer's loss.
            sigmoid: a = s / sum_e s, each token's scores scaled to sum to 1: this is
            DeepSeek-V3's complementary sequence-wise balance loss (without its weight
            alpha) for the T tokens routed together. For one loss per sequence, route
            each sequence on its own (route is vmappable: jax.vmap over (B, S, E) logits
            gives one plan per sequence) and average their losses.
        router_z_loss = mean over tokens of logsumexp(logits[t])**2    (ST-MoE)

    For a uniform softmax router the losses are 1 and log(E)**2; with T = 0 they are 0.
    The defaults are plain softmax top-k routing.
    """
    _check_logits(logits)
    options = MoEOptions(
        top_k=top_k, score=score, num_groups=num_groups, top_groups=top_groups, normalize=normalize, scale=scale,
        round_to=round_to,
    )
    options.check_experts(logits.shape[1])
    check_expert_bias(expert_bias, logits.shape[1])
    return plan_routes(logits, options, expert_bias)


def plan_routes(
    logits: jax.Array,  # (T, E) router logits, checked
    options: MoEOptions,  # checked against the E experts
    expert_bias: jax.Array | None = None,  # (E,) float, checked
) -> RoutingPlan:
    """`route` on arguments already checked: what the layers call (the options'
    deterministic and backend are not routing's and are not read).

    One pass over the (T, E) logits makes the scores, the selection and what the
    auxiliary losses need (`_select`); one sort makes the plan
    (`permutation.sort_choices`), and with round_to a few more make it again from the
    experts' best multiples (`_round_down`).
    """
    num_tokens, num_experts = logits.shape
    top_k, score = options.top_k, options.score
    token_count = max(num_tokens, 1)  # T = 0 gives zero losses, not 0 / 0
    slot_prob, experts, expert_prob, log_normalizer = _select(
        logits.astype(jnp.float32), expert_bias, options, token_count
    )
    if options.rounds:
        chosen_sizes = permutation.choice_counts(experts, num_experts)
        grouping = _round_down(experts, slot_prob, chosen_sizes, options.round_to)
    else:
        grouping = permutation.sort_choices(experts, num_experts)
        chosen_sizes = grouping.sizes
    if options.normalize:
        total = _sum_slots(slot_prob[:, :, None])
        slot_prob = slot_prob / (total if score == "softmax" else total + 1e-20)
    if options.scale != 1.0:
        slot_prob = slot_prob * jnp.float32(options.scale)

    row_prob = permutation.gather_rows(slot_prob.reshape(-1), grouping.order, grouping.inverse)
    if options.rounds:
        # A cut row belongs to no expert, so its output is 0 whatever its weight; its
        # weight is 0 too, for a layer of the caller's own that reads row_prob alone.
        owned = lax.iota(jnp.int32, row_prob.shape[0]) < jnp.sum(grouping.sizes)
        row_prob = jnp.where(owned, row_prob, 0.0)
    fraction = chosen_sizes.astype(jnp.float32) / (token_count * top_k)
    return RoutingPlan(
        order=grouping.order,
        inverse=grouping.inverse,
        group_sizes=grouping.sizes,
        chosen_sizes=chosen_sizes,
        row_prob=row_prob,
        expert_prob=expert_prob,
        load_balancing_loss=num_experts * jnp.sum(fraction * expert_prob),
        router_z_loss=jnp.sum(log_normalizer**2) / token_count,
        top_k=top_k,
    )


def _round_down(
    experts: jax.Array,  # (T, top_k) int32, each token's distinct experts
    slot_score: jax.Array,  # (T, top_k) float32, their scores s
    chosen_sizes: jax.Array,  # (E,) int32, assignments of each expert
    round_to: int,
) -> permutation.GroupOrder:
    """The rows sorted by expert, each expert keeping its round_to * floor(size / round_to)
    best assignments (highest score, ties to the lower assignment index, which is the lower
    token: a token chooses an expert once); the cut ones sort after every expert's rows.

    Sorts with unique keys rank the assignments within their experts and then order the
    rows (`permutation.sort_by_group`): every order is fully determined, so deterministic.
    """
    num_experts = chosen_sizes.shape[0]
    expert = experts.reshape(-1)
    assignment = lax.iota(jnp.int32, expert.shape[0])
    # The selection is piecewise constant: no gradient flows through the ranking.
    score = lax.stop_gradient(slot_score).reshape(-1)
    _, _, ranked = lax.sort((expert, -score, assignment), num_keys=3)
    _, place = lax.sort((ranked, assignment), num_keys=1)  # each assignment's place in `ranked`
    starts = jnp.cumsum(chosen_sizes) - chosen_sizes
    kept_sizes = chosen_sizes // round_to * round_to
    kept = place - starts[expert] < kept_sizes[expert]
    return permutation.sort_by_group(jnp.where(kept, expert, num_experts), num_experts)


# The name under which `_select` keeps the chosen experts for its backward.
_EXPERTS = "jax_dsrelu.route.experts"


@functools.partial(
    jax.checkpoint, static_argnums=(2, 3), policy=jax.checkpoint_policies.save_only_these_names(_EXPERTS)
)
def _select(
    logits: jax.Array,  # (T, E) float32
    expert_bias: jax.Array | None,  # (E,)
    options: MoEOptions,
    token_count: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(the chosen scores (T, top_k), the chosen experts (T, top_k) int32, each expert's
    mean affinity P_e (E,), each token's logsumexp (T,)).

    Rematerialized: the backward keeps the logits and the chosen experts, and makes the
    scores, the affinities and the softmax of the logits again (a few elementwise passes
    over (T, E)) rather than keeping them beside the logits.
    """
    num_experts = logits.shape[1]
    if options.score == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        probs = jax.nn.sigmoid(logits)
    # The selection is piecewise constant: only the scores of the chosen slots carry a
    # gradient, and the bias none at all.
    choice = lax.stop_gradient(probs)
    if expert_bias is not None:
        choice = choice + lax.stop_gradient(expert_bias).astype(jnp.float32)
    if options.drops_groups:
        choice = _keep_top_groups(choice, options.num_groups, options.top_groups)
    # lax.top_k puts the lower index first among equal values.
    _, experts = lax.top_k(choice, options.top_k)
    experts = checkpoint_name(experts, _EXPERTS)
    slot_prob = _take_slots(num_experts, probs, experts)
    affinity = probs if options.score == "softmax" else probs / jnp.sum(probs, axis=-1, keepdims=True)
    expert_prob = jnp.sum(affinity, axis=0) / token_count
    return slot_prob, experts, expert_prob, jax.nn.logsumexp(logits, axis=-1)


def update_expert_bias(
    expert_bias: jax.Array,  # (E,) float, the selection bias `route` adds to the scores
    group_sizes: jax.Array,  # (E,) int, assignments each expert received (global: see below)
    rate: float | jax.Array,  # the bias update speed (DeepSeek-V3: 1e-3)
) -> jax.Array:  # (E,) float32
    """expert_bias + rate * sign(mean(group_sizes) - group_sizes), in float32.

    The auxiliary-loss-free balancing step: overloaded experts lose `rate` of bias,
    underloaded ones gain it, and experts at the mean keep theirs. Call it once per
    training step, outside the gradient, with the step's group sizes (`MoEAux.group_sizes`
    or `RoutingPlan.chosen_sizes`).

    The sizes must count every token of the step. `moe_layer` and
    `moe_layer_expert_parallel` return the global sizes in `MoEAux.group_sizes`. Under data
    parallelism written by hand (each device routing its own tokens), add the devices'
    sizes first, e.g. `jax.lax.psum(plan.chosen_sizes, data_axes)` inside `shard_map`, so
    that every device applies the same update and the replicated bias stays replicated.
    """
    _check_expert_bias_update(expert_bias, group_sizes, rate)
    sizes = jnp.asarray(group_sizes).astype(jnp.float32)
    step = jnp.sign(jnp.mean(sizes) - sizes)
    return jnp.asarray(expert_bias).astype(jnp.float32) + jnp.asarray(rate, jnp.float32) * step


def dispatch(
    x: jax.Array,  # (T, d) tokens
    plan: RoutingPlan,
) -> jax.Array:  # (T*top_k, d), x.dtype
    """Each token's row once per chosen expert, sorted by expert (the rows `moe_mlp` takes).

    Its gradient gathers the rows back by the inverse order and adds each token's top_k
    slots in slot order, in float32.
    """
    _require_plan(plan)
    _check_token_rows("x", x, plan.num_tokens, "plan.num_tokens (T)")
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
    _require_plan(plan)
    _check_token_rows("y", y, plan.num_tokens * plan.top_k, "plan.num_tokens * plan.top_k")
    return _combine(plan.top_k, np.dtype(y.dtype), y, plan.order, plan.inverse)


def check_expert_bias(expert_bias, num_experts: int) -> None:
    """None, or an (E,) float array: the selection bias of `route` and the layers."""
    if expert_bias is None:
        return
    validation.require_array("expert_bias", expert_bias, "(E,)")
    if tuple(expert_bias.shape) != (num_experts,):
        raise ValueError(
            f"expert_bias must be (E,) with E={num_experts} experts, got expert_bias.shape={tuple(expert_bias.shape)}"
        )
    validation.require_dtype("expert_bias", expert_bias, validation.FLOAT_DTYPES)


def _check_logits(logits) -> None:
    validation.require_array("logits", logits, "(T, E)")
    validation.require_rank("logits", logits, 2, "(T, E)")
    validation.require_dtype("logits", logits, validation.FLOAT_DTYPES)
    if logits.shape[1] == 0:
        raise ValueError(f"logits must have at least one expert (T, E >= 1), got logits.shape={tuple(logits.shape)}")


def _check_token_rows(name: str, array, expected_rows: int, meaning: str) -> None:
    validation.require_array(name, array, "(rows, d)")
    validation.require_rank(name, array, 2, "(rows, d)")
    validation.require_dim(name, array, 0, expected_rows, meaning)


def _check_expert_bias_update(expert_bias, group_sizes, rate) -> None:
    validation.require_array("expert_bias", expert_bias, "(E,)")
    validation.require_array("group_sizes", group_sizes, "(E,)")
    validation.require_rank("expert_bias", expert_bias, 1, "(E,)")
    validation.require_dtype("expert_bias", expert_bias, validation.FLOAT_DTYPES)
    validation.require_rank("group_sizes", group_sizes, 1, "(E,)")
    validation.require_integer("group_sizes", group_sizes)
    validation.require_dim("group_sizes", group_sizes, 0, expert_bias.shape[0], "expert_bias.shape[0] (E)")
    # A traced rate (a schedule under jit) can only be checked for its shape and dtype.
    if isinstance(rate, (bool, np.bool_)) or not (
        isinstance(rate, (int, float, np.integer, np.floating))
        or (hasattr(rate, "shape") and rate.shape == () and jnp.issubdtype(rate.dtype, jnp.floating))
    ):
        raise TypeError(f"rate must be a float or a float scalar array, got {rate!r} ({type(rate).__name__})")
    if isinstance(rate, (int, float, np.integer, np.floating)) and not (np.isfinite(rate) and rate >= 0):
        raise ValueError(f"rate must be finite and >= 0, got {rate!r}")


def _require_plan(plan) -> None:
    if not isinstance(plan, RoutingPlan):
        raise TypeError(f"plan must be a RoutingPlan (from jax_dsrelu.route), got {plan!r} ({type(plan).__name__})")


def _keep_top_groups(choice: jax.Array, num_groups: int, top_groups: int) -> jax.Array:
    """(T, E) biased scores -> the same, with every expert outside the token's top_groups
    best groups set to -inf, so that top_k never picks it."""
    num_tokens, num_experts = choice.shape
    grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
    if grouped.shape[2] == 1:
        group_score = grouped[:, :, 0]
    else:
        best_two, _ = lax.top_k(grouped, 2)
        group_score = best_two[:, :, 0] + best_two[:, :, 1]
    _, kept = lax.top_k(group_score, top_groups)  # (T, top_groups), ties to the lower group
    keep = jnp.any(kept[:, :, None] == jnp.arange(num_groups), axis=1)  # (T, G)
    return jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(num_tokens, num_experts)


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
    # g has x's dtype: dispatch returns rows of x unchanged.
    return gather_sum(g, inverse.reshape(-1, top_k), backend="auto").astype(g.dtype), None, None


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine(top_k, dtype, y, order, inverse):
    return gather_sum(y, inverse.reshape(-1, top_k), backend="auto")


def _combine_fwd(top_k, dtype, y, order, inverse):
    return _combine(top_k, dtype, y, order, inverse), (order, inverse)


def _combine_bwd(top_k, dtype, residuals, g):
    order, inverse = residuals
    return jnp.take(g, order // top_k, axis=0).astype(dtype), None, None


_combine.defvjp(_combine_fwd, _combine_bwd)
