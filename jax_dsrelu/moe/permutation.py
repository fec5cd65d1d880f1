"""Moving rows by permutations, with gradients that are gathers too.

JAX differentiates a gather `x[index]` into a scatter-add, and XLA's GPU scatter-add adds
with atomics, in an order the GPU chooses. Where `index` is a permutation (or a one-to-one
map onto some rows), the scatter-add is the gather by the inverse map, where every place
receives exactly one value: that is what these gradients compute, so they are bitwise
reproducible and lower to no scatter at all.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class GroupOrder(NamedTuple):
    """Rows sorted by group. Rows whose group is outside 0..G-1 (padding) sort after every
    group and are counted in no size."""

    order: jax.Array  # (n,) int32, the row at each sorted position
    inverse: jax.Array  # (n,) int32, each row's sorted position
    sizes: jax.Array  # (G,) int32, rows of each group 0..G-1, in order


def sort_by_group(group: jax.Array, num_groups: int) -> GroupOrder:
    """Sorts rows by `group` (n,) int32, keeping row order within a group.

    The sort key (group, row) is unique, so the order is fully determined whatever
    algorithm the backend sorts with: stable and deterministic by construction.
    """
    n = group.shape[0]
    rows = lax.iota(jnp.int32, n)
    group = jnp.where((group >= 0) & (group < num_groups), group, num_groups).astype(jnp.int32)
    sorted_group, order = lax.sort((group, rows), num_keys=2)
    # Sorting the permutation itself yields its inverse without a scatter.
    _, inverse = lax.sort((order, rows), num_keys=1)
    ends = jnp.searchsorted(sorted_group, jnp.arange(num_groups, dtype=jnp.int32), side="right")
    sizes = jnp.diff(ends.astype(jnp.int32), prepend=jnp.zeros((1,), jnp.int32))
    return GroupOrder(order, inverse, sizes)


def sort_choices(choices: jax.Array, num_groups: int) -> GroupOrder:
    """`sort_by_group(choices.reshape(-1), num_groups)` for choices (T, k) int32 whose k
    groups per token are distinct and in 0..G-1 (each token's top_k experts), with one
    sort instead of two.

    The sorted position of row a = t * k + s, of group g, is the first position of group
    g plus the number of tokens before t that chose g: with each group chosen at most
    once per token, rows of one group sort by token. Those counts are a cumulative sum
    over tokens of the (T, G) choice mask, so the inverse permutation comes without a
    sort, and one sort of that permutation (unique keys: its order is fully determined)
    gives the order. The group sizes are the mask's column sums.
    """
    chosen = _choice_mask(choices, num_groups)
    before = jnp.cumsum(chosen, axis=0) - chosen  # (T, G): earlier tokens in each group
    sizes = jnp.sum(chosen, axis=0)
    starts = jnp.cumsum(sizes) - sizes
    inverse = (jnp.take_along_axis(before, choices, axis=1) + starts[choices]).reshape(-1)
    _, order = lax.sort((inverse, lax.iota(jnp.int32, inverse.shape[0])), num_keys=1)
    return GroupOrder(order, inverse, sizes)


def choice_counts(choices: jax.Array, num_groups: int) -> jax.Array:
    """(G,) int32: how many of choices (T, k) name each group 0..G-1; `sort_choices`'s sizes
    without its sort."""
    return jnp.sum(_choice_mask(choices, num_groups), axis=0)


def _choice_mask(choices: jax.Array, num_groups: int) -> jax.Array:
    """(T, G) int32: how many of each token's k choices name each group."""
    num_tokens, top_k = choices.shape
    groups = lax.iota(jnp.int32, num_groups)
    chosen = jnp.zeros((num_tokens, num_groups), jnp.int32)
    for slot in range(top_k):
        chosen = chosen + (choices[:, slot, None] == groups).astype(jnp.int32)
    return chosen


def gather_rows(
    x: jax.Array,  # (n, ...) rows
    index: jax.Array,  # (m,) int32 row of x for each output row
    back_index: jax.Array,  # (n,) int32 output row that reads each row of x
    valid: jax.Array | None = None,  # (m,) bool; output rows with False are 0
    back_valid: jax.Array | None = None,  # (n,) bool; rows of x with False are read by none
) -> jax.Array:  # (m, ...)
    """out[j] = x[index[j]] where valid[j] (else 0), with the gradient of a gather.

    Precondition: over the valid output rows, j -> index[j] is one-to-one onto the rows i
    of x with back_valid[i], and back_index is its inverse (index[back_index[i]] = i). Then
    the gradient is dx[i] = g[back_index[i]] where back_valid[i] (else 0): a gather again,
    since no row of x is read twice.
    """
    return _gather_rows(x, index, back_index, valid, back_valid)


def _take(x, index, valid):
    out = jnp.take(x, index, axis=0, mode="clip")
    if valid is None:
        return out
    return jnp.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), out, jnp.zeros((), x.dtype))


@jax.custom_vjp
def _gather_rows(x, index, back_index, valid, back_valid):
    return _take(x, index, valid)


def _gather_rows_fwd(x, index, back_index, valid, back_valid):
    return _take(x, index, valid), (index, back_index, valid, back_valid)


def _gather_rows_bwd(residuals, g):
    index, back_index, valid, back_valid = residuals
    # The transpose is the same operation with the maps swapped, so it differentiates again.
    return _gather_rows(g, back_index, index, back_valid, valid), None, None, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)
