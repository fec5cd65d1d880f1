"""The float32 value of stored 8-bit float elements (e4m3, e8m0), read through their bits.

A plain conversion `values.astype(float32)` is not enough on every platform: XLA:GPU, with
its default `xla_allow_excess_precision`, folds a chain of float conversions
x -> e4m3 -> float32 into x -> float32 (its simplify-fp-conversions pass), so where the
values were made in the same program their rounding to e4m3 silently disappears and the
XLA path computes on unquantized operands. Reading the values through a 256-entry table
indexed by their bits is a bitcast and a gather, not a conversion, so the chain is broken
and every platform computes on the values as stored.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def _table(dtype: np.dtype) -> jax.Array:
    """float32 value of each of the 256 bit patterns of an 8-bit float (NaN ones NaN), made
    in the program (a traced value, not a captured constant, which custom_partitioning
    refuses): one conversion from bits, whose operand is no conversion."""
    return lax.bitcast_convert_type(lax.iota(jnp.uint8, 256), dtype).astype(jnp.float32)


def to_float32(values: jax.Array) -> jax.Array:
    """values (an 8-bit float dtype) as float32, exactly, by their bits."""
    dtype = np.dtype(values.dtype)
    if dtype.itemsize != 1 or not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"values must be an 8-bit float dtype (float8_e4m3fn, float8_e8m0fnu), got {dtype.name}")
    bits = lax.bitcast_convert_type(values, jnp.uint8).astype(jnp.int32)
    # Every index is in [0, 256): the bounds clip is free of any effect.
    return jnp.take(_table(dtype), bits, axis=0, mode="clip")
