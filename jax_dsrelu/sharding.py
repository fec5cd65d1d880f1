"""How `grouped_gemm_dsrelu` partitions under `jax.jit` with sharded operands.

Every backend's lowering is wrapped in `jax.experimental.custom_partitioning`, so the SPMD
partitioner runs the kernel on each device's shard instead of gathering the operands:

- rows (m) sharded over any mesh axes (data parallel): each device runs its rows with
  its local group sizes, cut from the global ones at its row offset; dh, dprob and act stay
  sharded like the rows; dbias and amax are reduced across the row shards;
- columns (n, the expert hidden dimension) sharded over other axes (tensor parallel):
  `weight` and `preact` are split along n; dh, act and dbias stay sharded along n; dprob
  is reduced across the column shards.

The contraction dimension k and the expert dimension E are kept whole: splitting k would
put a cross-device sum before the nonlinear epilogue, and splitting the experts of a
ragged, row-ordered layout is not a sharding of its rows. Operands sharded that way are
gathered by the partitioner. Expert parallelism (experts on different devices, tokens
moved by all-to-all) is expressed with `jax.shard_map`, where each device calls the
primitive on its own experts' rows; there this wrapper steps aside.

Cross-shard sums gather the per-shard partials and add them in shard order, so they are
bitwise reproducible whatever the collective's algorithm; max is exact, so amax uses pmax.
Outside a multi-device partitioned computation (one device, or inside a fully manual
shard_map) custom_partitioning runs the local computation as it is.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jax_dsrelu import groups

# Dimension names of the operands, in operand order; "m" rows, "n" columns, "k" the
# contraction, "e" experts, "b" the k/32 scale blocks of MXFP8 operands.
OPERAND_DIMS = ("m k", "e n k", "m n", "m", "e", "e")
SCALE_DIMS = ("m b", "e n b")
_KEPT_WHOLE = ("k", "e", "b")  # see the module docstring


def result_dims(with_dbias: bool, with_act: bool) -> list[str]:
    dims = ["m n", "m"]
    if with_dbias:
        dims.append("e n")
    if with_act:
        dims.append("m n")
    dims.append("e")
    return dims


LocalImplementation = Callable[[Sequence[Any]], Callable[..., Sequence[jax.Array]]]


def partitioned(
    local_implementation: LocalImplementation,
    operand_avals: Sequence[Any],
    with_dbias: bool,
    with_act: bool,
) -> Callable[..., Sequence[jax.Array]]:
    """The primitive's computation, partitionable by the SPMD partitioner.

    `local_implementation(avals)` returns the function that computes the outputs for
    operands of those shapes on one device; it is asked again for each shard's shapes,
    so a backend can decide on the shapes it really gets.
    """
    num_rows = operand_avals[0].shape[0]
    operand_dims = OPERAND_DIMS + (SCALE_DIMS if len(operand_avals) > len(OPERAND_DIMS) else ())
    outputs = result_dims(with_dbias, with_act)
    dbias_index = 2 if with_dbias else None

    @custom_partitioning
    def computation(*operands):
        return tuple(local_implementation([jax.typeof(x) for x in operands])(*operands))

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        preact_spec = _spec(arg_shapes[2].sharding, 2)
        factor_axes = {"m": preact_spec[0], "n": preact_spec[1]}
        row_axes, col_axes = _axes(factor_axes["m"]), _axes(factor_axes["n"])

        def sharding_of(dims: str) -> NamedSharding:
            return NamedSharding(mesh, PartitionSpec(*(factor_axes.get(d) for d in dims.split())))

        arg_shardings = tuple(sharding_of(dims) for dims in operand_dims)
        result_shardings = tuple(sharding_of(dims) for dims in outputs)

        def lower_fn(*operands):
            local = list(operands)
            local_rows = local[0].shape[0]
            if row_axes:
                offset = lax.axis_index(row_axes) * local_rows
                local[4] = groups.local_group_sizes(local[4], num_rows, offset, local_rows)
            results = list(local_implementation([jax.typeof(x) for x in local])(*local))
            if col_axes:
                results[1] = _sum_in_shard_order(results[1], col_axes)
            if dbias_index is not None and row_axes:
                results[dbias_index] = _sum_in_shard_order(results[dbias_index], row_axes)
            if row_axes + col_axes:
                results[-1] = lax.pmax(results[-1], row_axes + col_axes)
            return tuple(results)

        return mesh, lower_fn, result_shardings, arg_shardings

    computation.def_partition(
        partition=partition,
        sharding_rule=", ".join(operand_dims) + " -> " + ", ".join(outputs),
        need_replication_factors=tuple(f for f in _KEPT_WHOLE if f in " ".join(operand_dims).split()),
    )
    return computation


def _spec(sharding: Any, rank: int) -> tuple:
    spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
    return spec + (None,) * (rank - len(spec))


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _sum_in_shard_order(partial: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """Sum of every shard's partial, added in shard order on every device."""
    return jnp.sum(lax.all_gather(partial, axes), axis=0)
