"""The layout bridge between the caller's ragged rows and cuDNN's padded expert segments.

cuDNN's kernel reads experts as contiguous row segments whose lengths are multiples of 256
(`padded_offsets[e]` is the exclusive end of expert e's segment), and scale factors in the
tcgen05 MMA's tiled order. The caller has ragged groups (`group_sizes`, rows in order, as
`jax.lax.ragged_dot` has them) and logical scales (rows, k/32). This module converts one
to the other in plain JAX:

    caller row i of expert e   <->   padded row padded_start[e] + (i - start[e])

Padding rows read nothing from the caller: their grad and preact are 0, prob is 0 and their
scales are 1, so every output the kernel computes for them is exactly 0, and dprob and
dbias sums over them add nothing. Rows at or past the clamped total (see
`jax_dsrelu.groups`) belong to no expert and come back as 0.

Everything is a gather (jnp.take), a pad or a reshape: no scatter, so no atomics and no
order-dependent results, and nothing waits on the host for the group sizes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsrelu import groups
from jax_dsrelu.kernels.sm100.config import Sm100Config

# Scale atom of the block-scaled MMA (tcgen05): 128 rows x 4 scale columns in 512 bytes,
# row r and column c at byte (r % 32) * 16 + (r // 32) * 4 + c. Atoms are stored K-atom
# fastest, then row atoms, then experts.
ATOM_ROWS = 128
ATOM_COLS = 4
# E8M0 bits of 1.0: the scale of padding, where a NaN scale (0xFF) would poison the MMA's
# zeros and a tiny one would not matter but is no better.
_UNIT_SCALE_BITS = 127


class RowMap(NamedTuple):
    padded_offsets: jax.Array  # (E,) int32: exclusive end row of each expert's segment
    padded_sizes: jax.Array  # (E,) int32: segment lengths, multiples of segment_rows
    source_rows: jax.Array  # (M_pad,) int32: caller row behind each padded row, m for padding
    padded_rows: jax.Array  # (m,) int32: padded row of each caller row, M_pad for unowned rows


class KernelOperands(NamedTuple):
    """What cuDNN's kernel reads, in the layouts it reads them, under the primitive's
    names (cuDNN's own, a b c sfa sfb, appear only where its kernel is called)."""

    grad: jax.Array  # (M_pad, k) float8: grad rows in padded order
    weight: jax.Array  # (E, n, k) float8: weight, unchanged
    preact: jax.Array  # (M_pad, n): preact rows in padded order
    grad_scale_tiled: jax.Array  # (M_pad / 128 * ceil(k / 128) * 512,) float8_e8m0fnu: grad_scale, MMA-tiled
    weight_scale_tiled: jax.Array  # (E * ceil(n / 128) * ceil(k / 128) * 512,) float8_e8m0fnu: weight_scale, MMA-tiled
    prob: jax.Array  # (M_pad,) float32
    alpha: jax.Array  # (E,) float32
    padded_offsets: jax.Array  # (E,) int32
    padded_sizes: jax.Array  # (E,) int32


def _round_up(x, multiple):
    return (x + multiple - 1) // multiple * multiple


def row_map(group_sizes: jax.Array, num_rows: int, config: Sm100Config) -> RowMap:
    num_experts = group_sizes.shape[0]
    num_padded = config.padded_rows(num_rows, num_experts)
    ends = groups.clamped_group_ends(group_sizes, num_rows)
    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    starts = ends - sizes
    padded_sizes = _round_up(sizes, config.segment_rows)
    # At most num_padded: each clamped size grows by less than segment_rows.
    padded_ends = jnp.cumsum(padded_sizes, dtype=jnp.int32)
    padded_starts = padded_ends - padded_sizes

    expert, owned = groups.row_experts(group_sizes, num_rows)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    padded_rows = jnp.where(owned, padded_starts[expert] + rows - starts[expert], num_padded)

    padded = jnp.arange(num_padded, dtype=jnp.int32)
    # The first segment end strictly past the row; num_experts for rows past every segment.
    segment = jnp.searchsorted(padded_ends, padded, side="right").astype(jnp.int32)
    segment_clamped = jnp.minimum(segment, num_experts - 1)
    local = padded - padded_starts[segment_clamped]
    real = (segment < num_experts) & (local < sizes[segment_clamped])
    source_rows = jnp.where(real, starts[segment_clamped] + local, num_rows)
    return RowMap(padded_ends, padded_sizes, source_rows, padded_rows)


def take_rows(x: jax.Array, rows: jax.Array, fill) -> jax.Array:
    """x[rows] along axis 0; out-of-range rows (the sentinels in RowMap) give `fill`."""
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=fill)


def tile_scales(scale_bits: jax.Array) -> jax.Array:
    """(..., R, k/32) uint8 E8M0 bits -> the flat MMA-tiled float8_e8m0fnu buffer.

    Rows pad to whole 128-row atoms and scale columns to whole 4-column atoms, with unit
    scales; leading dimensions (experts) stay outermost.
    """
    *lead, num_rows, num_cols = scale_bits.shape
    rows, cols = _round_up(num_rows, ATOM_ROWS), _round_up(num_cols, ATOM_COLS)
    padding = [(0, 0)] * len(lead) + [(0, rows - num_rows), (0, cols - num_cols)]
    bits = jnp.pad(scale_bits, padding, constant_values=_UNIT_SCALE_BITS)
    # (..., row atom, r // 32, r % 32, column atom, c) -> (..., row atom, column atom, r % 32, r // 32, c)
    bits = bits.reshape(*lead, rows // ATOM_ROWS, ATOM_ROWS // 32, 32, cols // ATOM_COLS, ATOM_COLS)
    nl = len(lead)
    bits = bits.transpose(*range(nl), nl, nl + 3, nl + 2, nl + 1, nl + 4)
    return lax.bitcast_convert_type(bits.reshape(-1), jnp.float8_e8m0fnu)


def _bits(scales: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(scales, jnp.uint8)


def kernel_operands(
    grad: jax.Array,  # (m, k) float8
    weight: jax.Array,  # (E, n, k) float8
    preact: jax.Array,  # (m, n)
    prob: jax.Array,  # (m,)
    group_sizes: jax.Array,  # (E,) int32
    alpha: jax.Array,  # (E,) float32
    grad_scale: jax.Array,  # (m, k/32) float8_e8m0fnu
    weight_scale: jax.Array,  # (E, n, k/32) float8_e8m0fnu
    config: Sm100Config,
) -> tuple[KernelOperands, RowMap]:
    rows = row_map(group_sizes, grad.shape[0], config)
    operands = KernelOperands(
        grad=take_rows(grad, rows.source_rows, 0),
        weight=weight,
        preact=take_rows(preact, rows.source_rows, 0),
        grad_scale_tiled=tile_scales(take_rows(_bits(grad_scale), rows.source_rows, _UNIT_SCALE_BITS)),
        weight_scale_tiled=tile_scales(_bits(weight_scale)),
        prob=take_rows(prob.astype(jnp.float32), rows.source_rows, 0),
        alpha=alpha.astype(jnp.float32),
        padded_offsets=rows.padded_offsets,
        padded_sizes=rows.padded_sizes,
    )
    return operands, rows


def caller_rows(padded: jax.Array, rows: RowMap) -> jax.Array:
    """The caller's rows of a padded-row output; rows owned by no expert are 0."""
    return take_rows(padded, rows.padded_rows, 0)
