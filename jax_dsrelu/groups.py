"""Expert group sizes as every backend reads them.

Group sizes are runtime values, so they cannot be checked at trace time. Every backend
first clamps them the same way, which is the whole out-of-bounds story for bad sizes:
a negative size counts as 0, and the running row count stops at m, so experts past
that point own no rows. Rows at or past the clamped total belong to no expert.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def clamped_group_ends(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Exclusive end row of every expert after clamping, int32 (E,).

    A saturating scan (min(a + b, m) is associative for non-negative terms) keeps every
    partial sum at most 2 m, so no size, however large, overflows int32.
    """
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, num_rows)
    if sizes.shape[0] == 0:
        return sizes
    return lax.associative_scan(lambda a, b: jnp.minimum(a + b, num_rows), sizes)


def clamped_group_sizes(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """Rows each expert really owns, int32 (E,); they sum to at most num_rows."""
    ends = clamped_group_ends(group_sizes, num_rows)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def local_group_sizes(
    group_sizes: jax.Array, num_rows: int, row_offset: jax.Array, local_rows: int
) -> jax.Array:
    """Group sizes seen by the shard of rows [row_offset, row_offset + local_rows).

    Cut from the clamped global layout, so a shard owns exactly the rows the whole
    array assigns to each expert, and rows past the global total stay unowned.
    """
    ends = clamped_group_ends(group_sizes, num_rows)
    local_ends = jnp.clip(ends - row_offset, 0, local_rows)
    return jnp.diff(local_ends, prepend=jnp.zeros((1,), jnp.int32))


def row_experts(group_sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array]:
    """(expert of each row int32 (m,), whether the row belongs to an expert bool (m,)).

    Rows owned by no expert get expert index 0 and False, so they can index per-expert
    tables safely and be masked afterwards.
    """
    ends = clamped_group_ends(group_sizes, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    # Expert e owns rows [ends[e-1], ends[e]): the first end strictly past the row.
    expert = jnp.searchsorted(ends, rows, side="right").astype(jnp.int32)
    owned = expert < group_sizes.shape[0]
    return jnp.where(owned, expert, 0), owned
