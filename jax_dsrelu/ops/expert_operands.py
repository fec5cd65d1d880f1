"""What the expert MLP's forward and backward take and give, on either path (`expert_mlp`,
`quantized_expert_mlp`): one bundle of its operands and one of its gradients."""

from __future__ import annotations

from typing import NamedTuple

import jax


class Experts(NamedTuple):
    """The expert MLP's operands. Row i of its GEMMs is rows[row_index[i]] (rows[i] without
    an index), owned by the experts in turn as group_sizes counts them, weighted by prob[i]."""

    rows: jax.Array  # (m, l) in w1.dtype, or its source (T, l) with row_index
    w1: jax.Array  # (E, l, f)
    w2: jax.Array  # (E, f, l)
    prob: jax.Array  # (m,)
    group_sizes: jax.Array  # (E,) int32
    b1: jax.Array | None  # (E, f)
    row_index: jax.Array | None = None  # (m,) int32: row i is rows[row_index[i]]


class Gradients(NamedTuple):
    """What the backward returns: the rows' gradient and the parameters'."""

    rows: jax.Array  # (m, l) in w1.dtype, in row order (not summed by token)
    w1: jax.Array  # (E, l, f) w1.dtype
    w2: jax.Array  # (E, f, l) w2.dtype
    prob: jax.Array  # (m,) prob.dtype
    b1: jax.Array | None  # (E, f) b1.dtype
