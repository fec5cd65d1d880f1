"""`moe_layer_expert_parallel`: `moe_layer` with its experts split over a mesh axis.

Each device holds E / D of the experts (D devices along `expert_axis`) and a shard of the
tokens (tokens are split over the data axes and the expert axis together). Inside
`jax.shard_map` every device runs `moe_layer`'s own steps (`jax_dsrelu.moe.layer`) on its
tokens, with its routed experts replaced by those of the devices that hold them
(`jax_dsrelu.ops.exchanged_experts`): each (token, slot) row is sent with `all_to_all` to
its expert's device, read there through the indices of a sort by local expert, and sent
back to be added in slot order, as on one device. Only the exchanges are new: the send
buffer's layout is `jax_dsrelu.moe.exchange`'s.

The send buffer of each device holds D blocks of C rows, one per destination. Dropless
(capacity_factor=None), C = T_local * top_k: any one device may own every expert the
tokens chose, so each block has room for all of them, and the exchange moves D times the
rows routed, the rest padding. With capacity_factor, C = ceil(capacity_factor * T_local
* top_k / D) and the rows past a destination's C are dropped (`jax_dsrelu.moe.exchange`
says which); MoEAux.dropped counts them.

The shared expert, the latent projections and the selection bias are replicated: every
device runs the shared expert and the projections on its own tokens, and routes them
with the same bias.

Every row movement is a gather whose gradient is a gather (`jax_dsrelu.moe.permutation`)
or an ordered gather-and-sum, and all_to_all's transpose is an all_to_all, so, as on one
device, nothing adds two values into one place in an order the hardware chooses. The
auxiliary losses are made from per-shard statistics gathered to every device and added
in shard order. The gradients of the replicated router and of the weights repeated over
the data axes are summed across devices by JAX's own transposes of shard_map (all-reduces).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dsrelu import jax_internals
from jax_dsrelu.kernels import registry
from jax_dsrelu.moe import exchange, layer, permutation
from jax_dsrelu.moe.layer import MoEAux
from jax_dsrelu.moe.entry_points import UNSET, entry_point
from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.moe.weights import MoEWeights
from jax_dsrelu.ops import exchanged_experts, quantized_expert_mlp
from jax_dsrelu.ops.quantized_expert_mlp import QuantizedExpertWeights
from jax_dsrelu.primitives import validation
from jax_dsrelu.quantization.schema import Recipe


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
    capacity_factor: float | None = UNSET,
    recompute_exchanged: bool = UNSET,
    shared_w1: jax.Array | None = None,  # (d, fs), replicated
    shared_w2: jax.Array | None = None,  # (fs, d), replicated
    latent_in: jax.Array | None = None,  # (d, l), replicated
    latent_out: jax.Array | None = None,  # (l, d), replicated
    deterministic: bool = UNSET,
    backend: str = UNSET,
    precision: Recipe | None = UNSET,
    return_aux: bool = False,
    quantized_weights: QuantizedExpertWeights | None = None,  # quantize_expert_weights(w1, w2, precision)
) -> jax.Array | tuple[jax.Array, MoEAux]:  # (T, d) x.dtype, split like x [, MoEAux]
    """The values of `moe_layer(x, router, w1, w2, ...)`, computed with experts split over
    `expert_axis` of `mesh` and tokens over `data_axis` (none, one or several mesh axes)
    and `expert_axis`. Axes of the mesh named in neither repeat the whole computation.

    The weights (the arrays, or one `MoEWeights` as weights=) and the options are
    `moe_layer`'s. E must be a multiple of the size of expert_axis, and T of the number
    of token shards. MoEAux holds the losses and group sizes of all T tokens, as on one
    device: its group_sizes are the global ones that `update_expert_bias` takes (the
    router's choice, before any drop), and its dropped the rows capacity_factor dropped.
    Call it under `jax.jit`; the arguments are resharded as above if they are not already.

    capacity_factor (None: dropless) bounds the rows each device sends each other device
    to C = ceil(capacity_factor * T_local * top_k / D), T_local = T / token shards: a
    destination offered more takes the C rows of largest routing weight, ties to the lower
    token, then the earlier slot. A dropped row adds nothing to its token's output, and
    neither its weight nor its token gets a gradient through it.

    recompute_exchanged=True trades compute for memory: the backward keeps each device's
    tokens (T_local, l) rather than the rows it received and their pre-activations (D * C
    rows of width l + f, D times the rows routed when dropless), and makes those again, the
    same bits, with one more exchange of the rows and one more up-projection per step.

    quantized_weights: as `moe_layer` takes them, all E experts' (split on E like w1 and w2).

    Token rounding (round_to) is refused: each token shard routes its own tokens, so
    rounding its counts would not round the rows each expert runs over all shards, and
    rounding the global counts needs every shard's scores before any row is sent.

    {MoEOptions}
    """
    weights.check(x)
    num_experts = weights.num_experts
    token_axes = check_mesh(mesh, expert_axis, data_axis, num_experts, options)
    quantized_expert_mlp.check_quantized_weights(quantized_weights, weights.w1, weights.w2, options.precision)
    validation.require_bool("return_aux", return_aux)
    token_shards = 1
    for name in token_axes:
        token_shards *= mesh.shape[name]
    if x.shape[0] % token_shards:
        raise ValueError(
            f"the number of tokens T=x.shape[0]={x.shape[0]} must be a multiple of the "
            f"{token_shards} token shards (mesh axes {token_axes})"
        )

    tokens, weight_specs = P(token_axes), _weight_specs(weights, expert_axis)
    # Quantized weights are per expert: each device takes its experts' blocks and scales.
    quantized_specs = jax.tree.map(lambda _: P(expert_axis), quantized_weights)
    shard = functools.partial(_expert_parallel_shard, expert_axis=expert_axis, options=options)
    out, group_sizes, expert_prob, z_loss, dropped = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(tokens, weight_specs, quantized_specs),
        out_specs=(tokens,) * 5,
    )(_placed(x, mesh, tokens), jax.tree.map(lambda a, spec: _placed(a, mesh, spec), weights, weight_specs),
      jax.tree.map(lambda a, spec: _placed(a, mesh, spec), quantized_weights, quantized_specs))
    if not return_aux:
        return out

    # One row of statistics per token shard, gathered to every device and added there
    # in shard order (not by an all-reduce, whose order is the collective library's).
    group_sizes, expert_prob, z_loss, dropped = (
        _placed(a, mesh, P()) for a in (group_sizes, expert_prob, z_loss, dropped)
    )
    total_sizes = jnp.sum(group_sizes, axis=0)
    # Every shard has T / token_shards tokens, so the global means are means of means.
    fraction = total_sizes.astype(jnp.float32) / max(x.shape[0] * options.top_k, 1)
    mean_prob = jnp.sum(expert_prob, axis=0) / token_shards
    load_balancing_loss = num_experts * jnp.sum(fraction * mean_prob)
    return out, MoEAux(load_balancing_loss, jnp.sum(z_loss) / token_shards, total_sizes, jnp.sum(dropped))


def check_mesh(mesh, expert_axis: str, data_axis, num_experts: int, options: MoEOptions) -> tuple[str, ...]:
    """The token axes (*data_axes, expert_axis) of experts split over `expert_axis` of
    `mesh` and tokens over data_axis and expert_axis; raises unless the mesh, its axes,
    the number of experts and the options fit (token rounding is refused: see
    `moe_layer_expert_parallel`). What needs the tokens is checked where they are."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(
            f"mesh must be a jax.sharding.Mesh (e.g. from jax.make_mesh) with an axis named "
            f"expert_axis={expert_axis!r}, got {mesh!r} ({type(mesh).__name__})"
        )
    options.check_experts(num_experts)
    if options.rounds:
        raise ValueError(
            f"round_to must be None or 1 under expert parallelism (each token shard routes its own tokens, so "
            f"its counts are not the rows an expert runs), got round_to={options.round_to}; use moe_layer on one device"
        )
    data_axes = _data_axes(mesh, expert_axis, data_axis)
    expert_shards = mesh.shape[expert_axis]
    if num_experts % expert_shards:
        raise ValueError(
            f"the number of experts E={num_experts} (w1.shape[0]) must be a multiple of "
            f"mesh.shape[{expert_axis!r}]={expert_shards}"
        )
    return (*data_axes, expert_axis)


def _expert_parallel_shard(x, weights: MoEWeights, quantized, *, expert_axis: str, options: MoEOptions):
    """One device's part: its tokens in, their outputs and routing statistics out.

    `moe_layer`'s steps, with the routed experts of the devices that hold them
    (`exchanged_experts`) in place of `block_experts.routed_experts`. weights holds this
    device's share of the experts (w1, w2 and b1) and every other weight whole; quantized
    (or None) its experts' quantized w1 and w2.
    """
    plan = layer.route_tokens(x, weights, options)
    routed, dropped = _routed(x, weights, plan, expert_axis, options, quantized)
    out = layer.block_output(routed, x, weights, options)
    return out, plan.chosen_sizes[None], plan.expert_prob[None], plan.router_z_loss[None], dropped[None]


def _routed(x, weights: MoEWeights, plan, expert_axis: str, options: MoEOptions, quantized=None):
    """(T, l) float32 outputs of the routed experts, each token's rows run on the devices
    that hold their experts and summed; and how many rows the capacity dropped."""
    if x.shape[0] == 0:  # every shard is as long, so no device has a row to send or to run
        routed, dropped, _ = jax_internals.vary_alike(
            [jnp.zeros((0, weights.w1.shape[1]), jnp.float32), jnp.zeros((), jnp.int32), x])
        return routed, dropped
    num_peers = lax.axis_size(expert_axis)
    local_experts = weights.num_experts
    capacity = options.per_peer_capacity(plan.order.shape[0], num_peers)
    sends = exchange.plan_exchange(plan, num_peers, capacity)

    # What arrives is grouped by source device; the experts read it by local expert.
    # Empty slots carry expert index local_experts: they sort last and belong to no expert.
    got_expert = lax.all_to_all(sends.slot_expert, expert_axis, 0, 0, tiled=True)
    local = permutation.sort_by_group(got_expert, local_experts)
    # The routing weights travel with their rows, by gathers and all_to_all, whose transposes are
    # gathers and all_to_all: the router's gradient comes back the same way.
    sent_prob = permutation.gather_rows(plan.row_prob, sends.slot_row, sends.row_slot, sends.slot_full, sends.row_sent)
    got_prob = lax.all_to_all(sent_prob, expert_axis, 0, 0, tiled=True)
    routed = exchanged_experts.exchanged_experts(
        layer.expert_tokens(x, weights), weights.w1, weights.w2, weights.b1,
        permutation.gather_rows(got_prob, local.order, local.inverse), local.sizes, local.order, local.inverse,
        sends.slot_token, sends.slot_full, sends.token_slots,
        axis_name=expert_axis, drops=capacity < plan.order.shape[0], recompute=options.recompute_exchanged,
        deterministic=options.deterministic,
        backends=registry.layer_backends(options.backend, options.precision), precision=options.precision,
        quantized=None if quantized is None else lax.stop_gradient(quantized),
    )
    return routed, sends.dropped


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
