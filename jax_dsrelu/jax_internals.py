"""The JAX internals the library relies on, in one place (tested for jax 0.10 and 0.11).

JAX offers no public way yet for a custom primitive to say how its results vary over
shard_map's manual axes, nor to ask for the device assignment while lowering.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
from jax._src import core as jax_core
from jax._src import dispatch as jax_dispatch
from jax.sharding import NamedSharding, PartitionSpec


def require_devices_while_lowering(primitive: Any) -> None:
    """Makes JAX supply the device assignment when it lowers computations using `primitive`."""
    jax_dispatch.prim_requires_devices_during_lowering.add(primitive)


def result_aval(shape: tuple[int, ...], dtype: Any, operands: Sequence[Any]) -> jax.core.ShapedArray:
    """A result that varies over every manual mesh axis any operand varies over.

    That is what a primitive computing each result from all its operands must declare
    inside `jax.shard_map`, or custom VJPs around it see mismatched cotangent types.
    """
    varying = [x for x in operands if getattr(getattr(x, "mat", None), "varying", None)]
    if not varying:
        return jax.core.ShapedArray(shape, dtype)
    axes = frozenset().union(*(x.mat.varying for x in varying))
    mesh = varying[0].sharding.mesh
    return jax.core.ShapedArray(
        shape,
        dtype,
        sharding=NamedSharding(mesh, PartitionSpec(*([None] * len(shape)))),
        manual_axis_type=jax_core.ManualAxisType(varying=axes),
    )


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes `x` varies over inside `jax.shard_map` (empty outside)."""
    return getattr(getattr(jax.typeof(x), "mat", None), "varying", None) or frozenset()


def vary_alike(arrays: Sequence[Any]) -> list[Any]:
    """Makes every array vary over the union of the manual axes any of them varies over.

    A custom VJP must return each cotangent with its primal's type; casting the inputs
    first lets JAX's own transpose of the cast (a psum) reduce weight gradients over the
    axes the weights are repeated along, as a plain autodiff would.
    """
    union = frozenset().union(*(varying_axes(x) for x in arrays if x is not None))
    return [
        x if x is None or varying_axes(x) == union
        else jax.lax.pcast(x, tuple(sorted(union - varying_axes(x))), to="varying")
        for x in arrays
    ]
