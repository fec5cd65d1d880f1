"""The JAX internals the library relies on, in one place, for the JAX versions it knows.

JAX offers no public way yet for a custom primitive to say how its results vary over
shard_map's manual axes, nor to ask for the device assignment while lowering. What is
used here was checked on every JAX release from `OLDEST_KNOWN_JAX` to `NEWEST_KNOWN_JAX`;
importing the library with any other refuses at once, rather than failing later inside
a trace with an AttributeError from `jax._src`.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

# (major, minor) releases whose internals this module was checked against, both ends
# included; pyproject's `jax` requirement states the same range.
OLDEST_KNOWN_JAX = (0, 10)
NEWEST_KNOWN_JAX = (0, 12)


def check_jax_version(version: str) -> None:
    """Raises ImportError unless `version` (e.g. "0.12.0.1") is a JAX release known here."""
    match = re.match(r"(\d+)\.(\d+)", version)
    known = "jax {}.{} through {}.{}".format(*OLDEST_KNOWN_JAX, *NEWEST_KNOWN_JAX)
    if match is None or not OLDEST_KNOWN_JAX <= (int(match[1]), int(match[2])) <= NEWEST_KNOWN_JAX:
        raise ImportError(
            f"jax_dsrelu relies on JAX internals that it knows for {known}, but jax=={version} "
            f"is installed. Install a supported JAX: pip install 'jax>={OLDEST_KNOWN_JAX[0]}."
            f"{OLDEST_KNOWN_JAX[1]},<{NEWEST_KNOWN_JAX[0]}.{NEWEST_KNOWN_JAX[1] + 1}' "
            f"(or a jax-dsrelu release that supports jax {version})."
        )


# Before anything from jax._src is imported: on an unknown JAX that import may itself fail.
check_jax_version(jax.__version__)

from jax._src import core as jax_core  # noqa: E402
from jax._src import dispatch as jax_dispatch  # noqa: E402


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
