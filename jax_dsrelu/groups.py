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

from jax_dsrelu import jax_internals


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


def _expert_row_masks(sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows (m, 1), first row (E,), end row (E,)) of every expert, from clamped sizes."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    return rows, ends - sizes, ends


def ragged_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """Row i of expert e is lhs[i] @ rhs[e]: (m, k), (E, k, n) -> (m, n) float32.

    `sizes` must already be clamped. Rows owned by no expert are 0.

    Expert by expert, a dense product of which only the expert's rows are kept, by a
    select: lax.ragged_dot multiplies by a 0/1 mask on the CPU, and 0 * NaN = NaN would
    carry a NaN or Inf of one expert's weights into every row. Each expert's product is
    one dense GEMM and the rows are selected, never added, so the result is bitwise
    reproducible; the scan keeps a single (m, n) product live however many experts.
    """
    rows, starts, ends = _expert_row_masks(sizes, lhs.shape[0])

    def keep_expert_rows(out, expert):
        weight, start, end = expert
        product = jnp.matmul(lhs, weight, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return jnp.where((rows >= start) & (rows < end), product, out), None

    # Inside shard_map the carry must vary over the mesh axes its updates vary over.
    out = jax_internals.vary_alike([jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32), lhs, rhs, sizes])[0]
    return lax.scan(keep_expert_rows, out, (rhs, starts, ends))[0]


def per_expert_outer(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """sum over each expert's rows of lhs[i]^T rhs[i]: (m, a), (m, b) -> (E, a, b) float32.

    `sizes` must already be clamped. A dot per expert over the expert's own rows, both
    operands' other rows replaced by 0 with a select (so a NaN elsewhere never meets a
    0 * NaN), never a scatter-add: its order is fixed.
    """
    rows, starts, ends = _expert_row_masks(sizes, lhs.shape[0])

    def expert_sum(_, expert):
        start, end = expert
        in_expert = (rows >= start) & (rows < end)
        own_lhs, own_rhs = (jnp.where(in_expert, x, jnp.zeros((), x.dtype)) for x in (lhs, rhs))
        product = lax.dot_general(
            own_lhs, own_rhs, (((0,), (0,)), ((), ())),
            precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        )
        return None, product

    return lax.scan(expert_sum, None, (starts, ends))[1]
