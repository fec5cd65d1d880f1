"""`ragged_dot`: a drop-in for `jax.lax.ragged_dot` on the library's grouped GEMMs."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from jax_dsrelu import jax_internals
from jax_dsrelu.primitives import sharding, validation
from jax_dsrelu.primitives.ragged_contract import ragged_contract
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul


def ragged_dot(
    lhs: jax.Array,  # (m, k)
    rhs: jax.Array,  # (E, k, n)
    group_sizes: jax.Array,  # (E,) int32 rows of lhs per group, in row order
    *,
    preferred_element_type: Any = None,
    backend: str = "auto",
) -> jax.Array:  # (m, n), preferred_element_type or lhs.dtype
    """Row i of group e is lhs[i] @ rhs[e], accumulated in float32, as `jax.lax.ragged_dot` does.

    Not bit for bit `jax.lax.ragged_dot`: the float32 sums run in another order, so results
    may differ from it in their last bits.

    Rows past sum(group_sizes) are 0. Negative group sizes count as 0 and rows past m
    are ignored, so no group_sizes value reads or writes out of bounds. lhs and rhs share
    one dtype (bfloat16, float16 or float32); preferred_element_type (None means
    lhs.dtype) is the output's.

    Differentiable in lhs and rhs (group_sizes gets a float0 cotangent): d lhs is the
    ragged matmul of d out with rhs read transposed in place, d rhs[e] = lhs_e^T d out_e
    over group e's rows, zeros for an empty group. The cotangent is rounded to lhs.dtype
    before both, as the kernels read one operand dtype; the gradients come back in
    lhs.dtype and rhs.dtype. Every output and gradient is bitwise reproducible on every
    backend. backend is "auto", "xla" or "sm90"; see `jax_dsrelu.backends()`.
    """
    group_sizes = _check_arguments(lhs, rhs, group_sizes)
    out_dtype = (
        np.dtype(lhs.dtype)
        if preferred_element_type is None
        else validation.out_dtype(preferred_element_type, name="preferred_element_type")
    )
    backend = validation.backend_name(backend)
    # Inside shard_map, lhs and rhs must vary alike for the custom VJP's cotangents to
    # match their primals' types (see `jax_internals.vary_alike`).
    lhs, rhs = jax_internals.vary_alike([lhs, rhs])
    return _ragged_dot(out_dtype, backend, lhs, rhs, group_sizes)


def _check_arguments(lhs, rhs, group_sizes) -> Any:
    """Raises on a bad call; returns group_sizes as a JAX array."""
    group_sizes = validation.group_sizes_array(group_sizes)
    validation.require_layouts(
        ("lhs", lhs, "(m, k)"), ("rhs", rhs, "(E, k, n)"), ("group_sizes", group_sizes, "(E,)"), experts="rhs"
    )
    validation.require_dtype("lhs", lhs, validation.FLOAT_DTYPES)
    if np.dtype(rhs.dtype) != np.dtype(lhs.dtype):
        raise TypeError(
            f"rhs.dtype must equal lhs.dtype={np.dtype(lhs.dtype).name}, "
            f"got rhs.dtype={np.dtype(rhs.dtype).name}"
        )
    validation.require_integer("group_sizes", group_sizes)
    return group_sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ragged_dot(out_dtype, backend, lhs, rhs, group_sizes):
    return ragged_matmul(lhs, rhs, group_sizes, rhs_layout="kn", out_dtype=out_dtype, backend=backend)


def _ragged_dot_fwd(out_dtype, backend, lhs, rhs, group_sizes):
    out = _ragged_dot(out_dtype, backend, lhs, rhs, group_sizes)
    return out, (lhs, rhs, group_sizes)


def _ragged_dot_bwd(out_dtype, backend, residuals, d_out):
    del out_dtype
    lhs, rhs, group_sizes = residuals
    d_out = d_out.astype(lhs.dtype)
    # rhs (E, k, n) read as (E, n', k') with n' = k, k' = n: d lhs = d out @ rhs[e]^T.
    d_lhs = ragged_matmul(
        d_out, rhs, group_sizes, rhs_layout="nk", out_dtype=lhs.dtype, backend=backend
    )
    d_rhs = ragged_contract(lhs, d_out, group_sizes, out_dtype=rhs.dtype, backend=backend)
    d_lhs, d_rhs = sharding.like_primal(d_lhs, lhs), sharding.like_primal(d_rhs, rhs)
    return d_lhs, d_rhs, np.zeros(group_sizes.shape, dtype=jax.dtypes.float0)


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)
