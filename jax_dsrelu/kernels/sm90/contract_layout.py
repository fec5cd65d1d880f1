"""The FP8 weight gradients' operands as the sm90 kernel reads them
(`blockwise_contract_kernel.py`): K-major copies of the row-major block-scaled lhs (m, a)
and rhs (m, b), in which each group of 128 rows has 128 rows of its own.

Padded row p holds row `quantization.ragged.padded_sources`[p] (each group's 128 rows, in
order, gathered); the rows a partial group leaves are zeros, which add nothing to any sum. Each
expert's padded size is its size rounded up to 128, so its k-tiles are its groups and the
scales the primitive was given index them as they are. Rows owned by no expert are
copied too, past every expert's rows, where no expert reads them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsrelu import groups
from jax_dsrelu.kernels.sm90.config import BLOCK
from jax_dsrelu.quantization import ragged


def padded_rows(num_rows: int, num_experts: int) -> int:
    """R: 128 rows for each of the most groups m rows of E experts make."""
    return BLOCK * ragged.max_groups(num_rows, num_experts, BLOCK)


def k_major_operands(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> dict[str, jax.Array]:
    """{lhs_k_major (a, R), rhs_k_major (b, R), padded_sizes (E,) int32} for the kernel."""
    num_rows = lhs.shape[0]
    sources = ragged.padded_sources(group_sizes, num_rows, BLOCK)

    def k_major(x: jax.Array) -> jax.Array:
        # Moved as bytes: the copy is a gather of e4m3 rows, empty places 0.
        padded = ragged.gather_padded(lax.bitcast_convert_type(x, jnp.uint8), sources)
        return lax.bitcast_convert_type(padded.T, x.dtype)

    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    padded_sizes = (-(-sizes // BLOCK) * BLOCK).astype(jnp.int32)
    return dict(lhs_k_major=k_major(lhs), rhs_k_major=k_major(rhs), padded_sizes=padded_sizes)
