"""`moe_layer_expert_parallel`: `moe_layer` with its experts split over a mesh axis.

Each device holds E / D of the experts (D devices along `expert_axis`) and a shard of the
tokens (tokens are split over the data axes and the expert axis together). Inside
`jax.shard_map` every device runs `moe_layer`'s own steps (`jax_dsrelu.moe.layer`) on its
tokens: it routes them, sends each (token, slot) row to the device that owns its expert
with `all_to_all`, sorts what it receives by local expert, runs its experts, sends the
results back the same way and combines them. Only the two exchanges are written here.

The send buffer of each device holds D * (T_local * top_k) rows: every destination has
room for all of the device's rows, so no token is ever dropped, at the price of padding
rows (memory and all-to-all bandwidth) that belong to no expert and come out 0.

The shared expert, the latent projections and the selection bias are replicated: every
device runs the shared expert and the projections on its own tokens, and routes them
with the same bias.

Every row movement is a gather whose gradient is a gather (`jax_dsrelu.moe.permutation`),
and all_to_all's transpose is an all_to_all, so, as on one device, nothing adds two
values into one place in an order the hardware chooses. The auxiliary losses are made
from per-shard statistics gathered to every device and added in shard order. The
gradients of the replicated router and of the weights repeated over the data axes are
summed across devices by JAX's own transposes of shard_map (all-reduces).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsrelu import groups
from jax_dsrelu.moe import layer, permutation, routing
from jax_dsrelu.moe.layer import MoEAux
from jax_dsrelu.moe.entry_points import UNSET, entry_point
from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.moe.weights import MoEWeights
from jax_dsrelu.primitives import validation


@entry_point
def moe_layer_expert_parallel(
    x: jax.Array,  # (T, d) tokens, split over (*data_axis, expert_axis)
    router: jax.Array | None = None,  # (d, E), replicated
    w1: jax.Array | None = None,  # (E, l, f), split on E over expert_axis; l = d without latent projections
    w2: jax.Array | None = None,  # (E, f, l), split on E over expert_axis
    *,
    mesh: jax.sharding.Mesh,
    expert_axis: str = "expert",
    data_axis: str | tuple[str, ...] | None = None,
    weights: MoEWeights | None = None,  # all of the block's weights, instead of the arrays
    options: MoEOptions | None = None,  # all of its options, instead of the option keywords
    b1: jax.Array | None = None,  # (E, f), split on E over expert_axis
    top_k: int = UNSET,
    score: str = UNSET,
    expert_bias: jax.Array | None = None,  # (E,), replicated
    num_groups: int = UNSET,
    top_groups: int | None = UNSET,
    normalize: bool = UNSET,
    scale: float = UNSET,
    round_to: int | None = UNSET,  # refused: see below
    shared_w1: jax.Array | None = None,  # (d, fs), replicated
    shared_w2: jax.Array | None = None,  # (fs, d), replicated
    latent_in: jax.Array | None = None,  # (d, l), replicated
    latent_out: jax.Array | None = None,  # (l, d), replicated
    deterministic: bool = UNSET,
    backend: str = UNSET,
    return_aux: bool = False,
) -> jax.Array | tuple[jax.Array, MoEAux]:  # (T, d) x.dtype, split like x [, MoEAux]
    """The values of `moe_layer(x, router, w1, w2, ...)`, computed with experts split over
    `expert_axis` of `mesh` and tokens over `data_axis` (none, one or several mesh axes)
    and `expert_axis`. Axes of the mesh named in neither repeat the whole computation.

    The weights (the arrays, or one `MoEWeights` as weights=) and the options are
    `moe_layer`'s. E must be a multiple of the size of expert_axis, and T of the number
    of token shards. MoEAux holds the losses and group sizes of all T tokens, as on one
    device: its group_sizes are the global ones that `update_expert_bias` takes. Call it
    under `jax.jit`; the arguments are resharded as above if they are not already.

    Token rounding (round_to) is refused: each token shard routes its own tokens, so
    rounding its counts would not round the rows each expert runs over all shards, and
    rounding the global counts needs every shard's scores before any row is sent.

    {MoEOptions}
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh) with an axis named "
            f"expert_axis={expert_axis!r}, got {mesh!r} ({type(mesh).__name__})"
        )
    weights.check(x)
    num_experts = weights.num_experts
    options.check_experts(num_experts)
    if options.rounds:
        raise ValueError(
            f"round_to must be None or 1 under expert parallelism (each token shard routes its own tokens, so "
            f"its counts are not the rows an expert runs), got round_to={options.round_to}; use moe_layer on one device"
        )
    validation.require_bool("return_aux", return_aux)
    data_axes = _data_axes(mesh, expert_axis, data_axis)
    token_axes = (*data_axes, expert_axis)
    expert_shards = mesh.shape[expert_axis]
    token_shards = 1
    for name in token_axes:
        token_shards *= mesh.shape[name]
    if num_experts % expert_shards:
        raise ValueError(
            f"the number of experts E=w1.shape[0]={num_experts} must be a multiple of "
            f"mesh.shape[{expert_axis!r}]={expert_shards}"
        )
    if x.shape[0] % token_shards:
        raise ValueError(
            f"the number of tokens T=x.shape[0]={x.shape[0]} must be a multiple of the "
            f"{token_shards} token shards (mesh axes {token_axes})"
        )

    tokens, weight_specs = P(token_axes), _weight_specs(weights, expert_axis)
    shard = functools.partial(_expert_parallel_shard, expert_axis=expert_axis, options=options)
    out, group_sizes, expert_prob, z_loss = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(tokens, weight_specs),
        out_specs=(tokens, tokens, tokens, tokens),
    )(_placed(x, mesh, tokens), jax.tree.map(lambda a, spec: _placed(a, mesh, spec), weights, weight_specs))
    if not return_aux:
        return out

    # One row of statistics per token shard, gathered to every device and added there
    # in shard order (not by an all-reduce, whose order is the collective library's).
    group_sizes, expert_prob, z_loss = (_placed(a, mesh, P()) for a in (group_sizes, expert_prob, z_loss))
    total_sizes = jnp.sum(group_sizes, axis=0)
    # Every shard has T / token_shards tokens, so the global means are means of means.
    fraction = total_sizes.astype(jnp.float32) / max(x.shape[0] * options.top_k, 1)
    mean_prob = jnp.sum(expert_prob, axis=0) / token_shards
    load_balancing_loss = num_experts * jnp.sum(fraction * mean_prob)
    return out, MoEAux(load_balancing_loss, jnp.sum(z_loss) / token_shards, total_sizes)


def _expert_parallel_shard(x, weights: MoEWeights, *, expert_axis: str, options: MoEOptions):
    """One device's part: its tokens in, their outputs and routing statistics out.

    `moe_layer`'s steps, with the rows sent to the devices that hold their experts
    between `expert_rows` and `run_experts`, and back before they are combined. weights
    holds this device's share of the experts (w1, w2 and b1) and every other weight whole.
    """
    plan = layer.route_tokens(x, weights, options)
    rows = layer.expert_rows(x, weights, plan)  # (n, l), sorted by global expert
    num_rows = rows.shape[0]
    num_shards = lax.axis_size(expert_axis)
    local_experts = weights.num_experts

    # Rows sorted by expert are sorted by destination device too. Destination j's rows
    # fill slots [j * n, j * n + count_j) of the send buffer; its other slots are padding.
    send_counts = jnp.sum(plan.group_sizes.reshape(num_shards, local_experts), axis=1)
    send_ends = jnp.cumsum(send_counts)
    send_starts = send_ends - send_counts
    slot = jnp.arange(num_rows, dtype=jnp.int32)
    fill_index = (send_starts[:, None] + slot[None, :]).reshape(-1)  # (D * n,)
    fill_valid = (slot[None, :] < send_counts[:, None]).reshape(-1)
    destination = jnp.searchsorted(send_ends, slot, side="right").astype(jnp.int32)
    slot_of_row = destination * num_rows + slot - send_starts[destination]  # (n,)

    row_expert, _ = groups.row_experts(plan.group_sizes, num_rows)
    send_expert = jnp.where(fill_valid, jnp.take(row_expert, fill_index, mode="clip") % local_experts, local_experts)
    send_rows = permutation.gather_rows(rows, fill_index, slot_of_row, fill_valid)
    send_prob = permutation.gather_rows(plan.row_prob, fill_index, slot_of_row, fill_valid)
    exchange = functools.partial(lax.all_to_all, axis_name=expert_axis, split_axis=0, concat_axis=0, tiled=True)
    got_rows, got_prob, got_expert = (exchange(a) for a in (send_rows, send_prob, send_expert))

    # What arrived is grouped by source device; group it by local expert for the experts.
    # Padding has expert index local_experts: it sorts last and belongs to no expert.
    local = permutation.sort_by_group(got_expert, local_experts)
    y = layer.run_experts(
        permutation.gather_rows(got_rows, local.order, local.inverse),
        permutation.gather_rows(got_prob, local.order, local.inverse),
        local.sizes,
        weights,
        options,
    )
    returned = exchange(permutation.gather_rows(y, local.inverse, local.order))
    y_rows = permutation.gather_rows(returned, slot_of_row, fill_index, None, fill_valid)
    out = layer.block_output(routing.combine(y_rows, plan), x, weights, options)
    return out, plan.chosen_sizes[None], plan.expert_prob[None], plan.router_z_loss[None]


def _weight_specs(weights: MoEWeights, expert_axis: str) -> MoEWeights:
    """The weights' partition specs: the per-expert ones split on E over expert_axis, the
    others replicated; a weight the block lacks stays None, a pytree without leaves."""
    return MoEWeights(**{
        field.name: None if getattr(weights, field.name) is None
        else P(expert_axis) if field.name in MoEWeights.PER_EXPERT else P()
        for field in dataclasses.fields(MoEWeights)
    })


def _data_axes(mesh, expert_axis, data_axis) -> tuple[str, ...]:
    names = tuple(mesh.axis_names)
    if expert_axis not in names:
        raise ValueError(f"expert_axis={expert_axis!r} is not an axis of the mesh, whose axes are {names}")
    data_axes = () if data_axis is None else (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    for name in data_axes:
        if name not in names:
            raise ValueError(f"data_axis={data_axis!r} names {name!r}, not an axis of the mesh, whose axes are {names}")
        if name == expert_axis:
            raise ValueError(f"data_axis={data_axis!r} must not include expert_axis={expert_axis!r}")
    return data_axes


def _placed(array, mesh, spec):
    """The array with sharding `spec`: jax.reshard on Explicit mesh axes, a sharding
    constraint on Auto ones (each refuses the other kind)."""
    sharding = NamedSharding(mesh, spec)
    if all(kind == AxisType.Explicit for kind in mesh.axis_types):
        return jax.reshard(array, sharding)
    return lax.with_sharding_constraint(array, sharding)
