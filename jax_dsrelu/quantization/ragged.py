"""Quantizing along rows that belong to experts: the weight gradients' K = tokens.

In dW1[e] = x_e^T dh_e and dW2[e] = act_e^T dy_e the GEMM's K runs over expert e's rows,
so the recipe's 1 x r activation blocks (r = scaling.block[1], 128 for FP8_BLOCKWISE)
lie along the rows: each column of (m, n) is cut into groups of r consecutive rows, and

    the groups start at each expert's first row and never hold rows of two experts:
    an expert's last group is partial, and an expert of fewer than r rows is one
    partial group. Rows at or past sum(group_sizes) (no expert's) are grouped the same
    way from the first of them, as one more expert's would be.

Each group's scale and values follow `quantization.blockwise`'s rule (its amax over the
group's finite values, exact in any order), so an expert's part equals
`quantize_blockwise` of its own rows, transposed, with 1 x r blocks. Group sizes are
clamped as every backend clamps them (`jax_dsrelu.groups`).

The groups are numbered in row order: group g's scales are scales[g], and row_group[i]
says which group row i is in. At most ceil(m / r) + E groups exist (each expert adds at
most one partial group); the scales of numbers no group takes are 1.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu import groups
from jax_dsrelu.quantization import blockwise, stored
from jax_dsrelu.quantization.schema import BlockScaling


class RaggedQuantized(NamedTuple):
    values: jax.Array  # (m, n) in the scaling's element dtype
    scales: jax.Array  # (ceil(m / r) + E, n) float32: group g's scale of each column
    row_group: jax.Array  # (m,) int32: the group of each row


def row_groups(group_sizes: jax.Array, num_rows: int, rows_per_group: int) -> jax.Array:
    """(m,) int32: the group of each row (module doc), numbered from 0 in row order."""
    ends = groups.clamped_group_ends(group_sizes, num_rows)
    if num_rows == 0:
        return jnp.zeros((0,), jnp.int32)
    expert, owned = groups.row_experts(group_sizes, num_rows)
    total = ends[-1] if ends.shape[0] else jnp.zeros((), jnp.int32)
    starts = ends - groups.clamped_group_sizes(group_sizes, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    first = jnp.where(owned, starts[expert], total)
    opens = (rows - first) % rows_per_group == 0
    # Row 0 always opens a group (it is its expert's first row, or the first unowned one).
    return jnp.cumsum(opens.astype(jnp.int32)) - 1


def group_first_rows(group_sizes: jax.Array, num_rows: int, rows_per_group: int) -> jax.Array:
    """(G + 1,) int32, G = `max_groups`: the first row of each group, m for a number no
    group takes (and at the end): groups hold consecutive rows in row order, so group g's
    rows are [first[g], first[g + 1]). From the group sizes alone: each segment of rows
    (each expert's, then the unowned rows') opens ceil(rows / r) groups, r rows apart from
    its first row, so group g is segment s's (g - opened before s)-th, s the first segment
    whose groups reach past g. G x (E + 1) comparisons in one fusion, where reading
    `row_groups`' answer took a sum over the m rows and a binary search of them, a loop of
    log2(m) steps on the GPU."""
    num_experts = group_sizes.shape[0]
    count = max_groups(num_rows, num_experts, rows_per_group)
    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    total = jnp.sum(sizes)
    segment_rows = jnp.concatenate([sizes, (num_rows - total)[None]])
    segment_starts = jnp.cumsum(segment_rows) - segment_rows
    opened = -(-segment_rows // rows_per_group)
    opened_through = jnp.cumsum(opened)  # groups of segments 0 .. s
    numbers = jnp.arange(count + 1, dtype=jnp.int32)
    segment = jnp.sum(opened_through[None, :] <= numbers[:, None], axis=1, dtype=jnp.int32)
    taken = segment <= num_experts
    segment = jnp.minimum(segment, num_experts)
    within = numbers - (opened_through[segment] - opened[segment])
    return jnp.where(taken, segment_starts[segment] + rows_per_group * within, num_rows).astype(jnp.int32)


def padded_sources(group_sizes: jax.Array, num_rows: int, rows_per_group: int) -> jax.Array:
    """(G r,) int32, G = `max_groups`: the row each place holds in the layout that gives
    each group r places of its own, group g's rows from g * r on in row order (a partial
    group's other places left empty), m where a place is empty. Gathering rows
    through it (`gather_padded`) builds the layout (the FP8 weight gradients' kernel reads
    its K-major copies in it) and lines each group up as one r-row block; every place is
    written once, by a gather, with no scatter."""
    first = group_first_rows(group_sizes, num_rows, rows_per_group)
    offset = jnp.arange(rows_per_group, dtype=jnp.int32)
    rows = first[:-1, None] + offset
    return jnp.where(offset < (first[1:] - first[:-1])[:, None], rows, num_rows).reshape(-1)


def gather_padded(x: jax.Array, sources: jax.Array) -> jax.Array:
    """x's rows at the places of the padded layout (`padded_sources`), zeros where empty."""
    if x.shape[0] == 0:  # every place empty (jnp.take refuses an empty axis)
        return jnp.zeros((sources.shape[0], *x.shape[1:]), x.dtype)
    return jnp.take(x, sources, axis=0, mode="fill", fill_value=0)


def max_groups(num_rows: int, num_experts: int, rows_per_group: int) -> int:
    """The most groups m rows of E experts make: ceil(m / r) over the rows, plus at most
    one partial group per expert (the unowned rows' partial group is covered by the
    ceiling, since E + 1 segments of rows lose less than E + 1 whole groups)."""
    return -(-num_rows // rows_per_group) + num_experts


def quantize_ragged_rows(
    x: jax.Array,  # (m, n) bfloat16, float16 or float32
    group_sizes: jax.Array,  # (E,) int: rows of each expert, in row order
    scaling: BlockScaling,  # 1 x r blocks: r rows of a column share a scale here
) -> RaggedQuantized:
    """x quantized in groups of r rows per column that restart at each expert (module doc)."""
    x = jnp.asarray(x)
    if scaling.rule != "amax" or scaling.block[0] != 1:
        raise ValueError(
            f"scaling must be 1 x r blocks with amax scales (an activation scaling), got block={scaling.block} "
            f"and rule={scaling.rule!r}"
        )
    if x.ndim != 2:
        raise ValueError(f"x must be (m, n), got x.shape={x.shape}")
    if np.dtype(x.dtype) not in blockwise.INPUT_DTYPES:
        raise TypeError(f"x.dtype must be bfloat16, float16 or float32, got x.dtype={np.dtype(x.dtype).name}")
    num_rows, rows_per_group = x.shape[0], scaling.block[1]
    row_group = row_groups(group_sizes, num_rows, rows_per_group)
    count = max_groups(num_rows, group_sizes.shape[0], rows_per_group)
    # Each group lined up as one r-row block (empty places 0), so its maxima are a dense
    # reduction: a scatter-max of every element into its group's row contends 128 ways on
    # the GPU's atomics. Maxima are exact in any order.
    sources = padded_sources(group_sizes, num_rows, rows_per_group)
    blocks = gather_padded(x, sources).reshape(count, rows_per_group, x.shape[1]).astype(jnp.float32)
    amax, special = blockwise.finite_amax(blocks, axis=1)
    x = x.astype(jnp.float32)
    scales = blockwise.scales_from_amax(amax, special, scaling.element)
    values = blockwise.scaled_values(x, jnp.take(scales, row_group, axis=0), scaling.element)
    return RaggedQuantized(values, scales, row_group)


def dequantize_ragged_rows(quantized: RaggedQuantized, dtype=jnp.float32) -> jax.Array:
    """values * their group's scale, in float32, cast to dtype: (m, n)."""
    values, scales, row_group = quantized
    return (stored.to_float32(values) * jnp.take(scales, row_group, axis=0)).astype(dtype)
