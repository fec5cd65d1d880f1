"""Expert-parallel MoE training: experts spread over a device mesh, tokens moved by all-to-all.

The mesh has a "data" axis and an "expert" axis. Tokens are split over both; the experts'
weights are split over "expert" (each device holds E / n_expert of them) and repeated over
"data". `jax_dsrelu.moe_layer_expert_parallel` does the rest inside `jax.shard_map`: each
device routes its tokens (top-k), sends every (token, expert) assignment to the device
owning that expert with `all_to_all`, sorts what it receives by local expert, runs
`jax_dsrelu.moe_mlp` on its own experts, and sends the results back to be combined by
routing weight. Gradients flow back through the same all-to-alls; JAX sums the
replicated weights' gradients over "data".

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/expert_parallel.py
    python examples/expert_parallel.py --deterministic     # on however many GPUs there are

With --deterministic the digest of the final parameters is identical from run to run on
CPU devices; across processes on a GPU it also takes XLA's own GEMM autotuning off
(docs/determinism.md). --recompute-exchanged makes the backward exchange the rows again
and remake their pre-activations instead of keeping them: the same digest, for less memory.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from train_moe import precision_of, train, training_arguments

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


def expert_parallel_layer(params, x, *, mesh, top_k: int, deterministic: bool, precision=None,
                          recompute_exchanged: bool = False):
    """The MoE layer of train_moe.moe_layer, with experts sharded over mesh axis "expert"."""
    return jax_dsrelu.moe_layer_expert_parallel(
        x,
        params["router"],
        params["w1"],
        params["w2"],
        b1=params["b1"],
        mesh=mesh,
        expert_axis="expert",
        data_axis="data",
        top_k=top_k,
        deterministic=deterministic,
        precision=precision,
        recompute_exchanged=recompute_exchanged,
    )


def shard_params(params, mesh):
    specs = {"router": P(), "w1": EXPERTS, "w2": EXPERTS, "b1": EXPERTS}
    return {name: jax.device_put(value, NamedSharding(mesh, specs[name])) for name, value in params.items()}


def main() -> None:
    parser = training_arguments(__doc__.splitlines()[0], steps=200)
    parser.add_argument("--recompute-exchanged", action="store_true",
                        help="remake the exchanged rows and their pre-activations in the backward instead of keeping them")
    args = parser.parse_args()
    mesh = make_mesh(args.experts)
    print(f"mesh: {dict(mesh.shape)} over {jax.devices()[0].platform} devices; "
          f"{args.experts // mesh.shape['expert']} experts per device")
    train(
        args,
        functools.partial(expert_parallel_layer, mesh=mesh, top_k=args.top_k, deterministic=args.deterministic,
                          precision=precision_of(args), recompute_exchanged=args.recompute_exchanged),
        place_params=functools.partial(shard_params, mesh=mesh),
        place_tokens=lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, TOKENS)),
    )


if __name__ == "__main__":
    main()
