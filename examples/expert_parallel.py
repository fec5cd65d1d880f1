"""Expert-parallel MoE training: experts spread over a device mesh, tokens moved by all-to-all.

The mesh has a "data" axis and an "expert" axis. Tokens are split over both; the experts'
weights are split over "expert" (each device holds E / n_expert of them) and repeated over
"data". Inside `jax.shard_map` each device routes its tokens (top-k), sends every
(token, expert) assignment to the device owning that expert with `all_to_all`, sorts what
it receives by local expert, runs `jax_dsrelu.moe_mlp` on its own experts, and sends the
results back to be combined by routing weight. Gradients flow back through the same
all-to-alls; JAX sums the replicated weights' gradients over "data".

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/expert_parallel.py
    python examples/expert_parallel.py --deterministic     # on however many GPUs there are

With --deterministic the digest of the final parameters is identical from run to run on
CPU devices; across processes on a GPU it is not yet (see the README's Determinism section).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from train_moe import train, training_arguments

import jax_dsrelu

TOKENS = P(("data", "expert"))  # tokens split over every device
EXPERTS = P("expert")  # expert weights split over the expert axis, repeated over data


def make_mesh(num_experts: int) -> jax.sharding.Mesh:
    """Experts over as many devices as divide both counts, keeping a data axis of at least
    2 where there are 4 devices or more."""
    num_devices = len(jax.devices())
    expert_axis = math.gcd(num_devices, num_experts)
    if expert_axis == num_devices and num_devices >= 4:
        expert_axis //= 2
    return jax.make_mesh(
        (num_devices // expert_axis, expert_axis), ("data", "expert"), axis_types=(AxisType.Auto,) * 2
    )


def _dispatch_plan(destination: jax.Array, num_destinations: int, capacity: int):
    """How assignments travel: (source, used, return_slot).

    Assignments are sorted stably by destination, so each destination's slots hold its
    assignments in their original order and slots past its count are padding.
    source (destinations, capacity): which assignment each send slot carries.
    used (destinations, capacity): whether the slot carries one.
    return_slot (assignments,): the flat send slot each assignment went to, where its
    result comes back (gathers only: no scatter, so the backward is deterministic too).
    """
    order = jnp.argsort(destination, stable=True)
    counts = jnp.sum(destination[:, None] == jnp.arange(num_destinations), axis=0)
    starts = jnp.cumsum(counts) - counts
    slot = jnp.arange(capacity)
    used = slot[None, :] < counts[:, None]
    source = order[jnp.minimum(starts[:, None] + slot[None, :], destination.shape[0] - 1)]
    rank = jnp.argsort(order)  # each assignment's position in the sorted order
    return_slot = destination * capacity + rank - starts[destination]
    return source, used, return_slot


def expert_parallel_layer(params, x, *, mesh, top_k: int, deterministic: bool):
    """The MoE layer of train_moe.moe_layer, with experts sharded over mesh axis "expert"."""

    @functools.partial(
        jax.shard_map,
        mesh=mesh,
        in_specs=(P(), EXPERTS, EXPERTS, EXPERTS, TOKENS),
        out_specs=TOKENS,
    )
    def layer(router, w1, w2, b1, x):
        local_tokens, d_model = x.shape
        local_experts = w1.shape[0]
        num_shards = jax.lax.axis_size("expert")
        probs = jax.nn.softmax(x.astype(jnp.float32) @ router, axis=-1)
        top_prob, top_expert = jax.lax.top_k(probs, top_k)

        # Send: one slot per (destination device, assignment); every assignment fits, so
        # nothing is dropped (a production layer would bound this with a capacity factor).
        flat_expert = top_expert.reshape(-1)
        capacity = flat_expert.shape[0]
        source, used, return_slot = _dispatch_plan(flat_expert // local_experts, num_shards, capacity)
        rows = jnp.repeat(x, top_k, axis=0)[source]  # (shards, capacity, d)
        local_expert = jnp.where(used, flat_expert[source] % local_experts, local_experts)
        row_prob = jnp.where(used, top_prob.reshape(-1)[source], 0.0)
        received = [
            jax.lax.all_to_all(a, "expert", split_axis=0, concat_axis=0, tiled=True)
            for a in (rows, local_expert, row_prob)
        ]
        rows, local_expert, row_prob = (a.reshape(-1, *a.shape[2:]) for a in received)

        # Group what arrived by local expert; padding (index local_experts) sorts last and
        # belongs to no expert, so moe_mlp leaves it at 0.
        order = jnp.argsort(local_expert, stable=True)
        group_sizes = jnp.sum(local_expert[:, None] == jnp.arange(local_experts), axis=0, dtype=jnp.int32)
        out = jax_dsrelu.moe_mlp(
            rows[order].astype(w1.dtype), w1, w2, row_prob[order], group_sizes, b1=b1,
            deterministic=deterministic,
        )
        out = out[jnp.argsort(order)].reshape(num_shards, capacity, d_model)

        # Return each result to its token's device and slot, then combine the top-k.
        out = jax.lax.all_to_all(out, "expert", split_axis=0, concat_axis=0, tiled=True)
        per_assignment = out.reshape(num_shards * capacity, d_model)[return_slot]
        return per_assignment.reshape(local_tokens, top_k, d_model).astype(jnp.float32).sum(axis=1)

    return layer(params["router"], params["w1"], params["w2"], params["b1"], x)


def shard_params(params, mesh):
    specs = {"router": P(), "w1": EXPERTS, "w2": EXPERTS, "b1": EXPERTS}
    return {name: jax.device_put(value, NamedSharding(mesh, specs[name])) for name, value in params.items()}


def main() -> None:
    args = training_arguments(__doc__.splitlines()[0], steps=200).parse_args()
    mesh = make_mesh(args.experts)
    print(f"mesh: {dict(mesh.shape)} over {jax.devices()[0].platform} devices; "
          f"{args.experts // mesh.shape['expert']} experts per device")
    train(
        args,
        functools.partial(expert_parallel_layer, mesh=mesh, top_k=args.top_k, deterministic=args.deterministic),
        place_params=functools.partial(shard_params, mesh=mesh),
        place_tokens=lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, TOKENS)),
    )


if __name__ == "__main__":
    main()
