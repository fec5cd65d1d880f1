"""The XLA backend: the contract written in plain JAX, and the oracle for every kernel.

It runs wherever XLA does. Every output is computed in one fixed order, so it is bitwise
reproducible on a GPU as well: the column reduction for dbias is a dot against the
expert's own rows, never a scatter-add (XLA's GPU scatter-add uses atomics and
its sums change from run to run).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax_dsrelu import groups, mx


def grouped_gemm_dsrelu_reference(
    grad: jax.Array,  # (m, k)
    weight: jax.Array,  # (E, n, k)
    preact: jax.Array,  # (m, n)
    prob: jax.Array,  # (m,)
    group_sizes: jax.Array,  # (E,) int32
    alpha: jax.Array,  # (E,) float32
    grad_scale: jax.Array | None = None,  # (m, k/32) float8_e8m0fnu, MXFP8 operands only
    weight_scale: jax.Array | None = None,  # (E, n, k/32) float8_e8m0fnu
    *,
    with_dbias: bool,
    with_act: bool,
    out_dtype: jnp.dtype,
) -> tuple[jax.Array, ...]:
    """Returns (dh, dprob, [dbias], [act], amax), the optional ones when asked for.

    Block-scaled (MXFP8) operands are dequantized to float32 first, so every backend is
    held to the contract on the values the operands represent.
    """
    if grad_scale is not None:
        grad = mx.dequantize_mx(grad, grad_scale)
        weight = mx.dequantize_mx(weight, weight_scale)
    num_rows = grad.shape[0]
    num_experts = weight.shape[0]
    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    expert, owned = groups.row_experts(group_sizes, num_rows)

    # ragged_matmul leaves rows past sum(sizes) at zero; the float32 accumulation is the
    # contract's, whatever the operand dtype.
    acc = groups.ragged_matmul(grad, jnp.swapaxes(weight, 1, 2), sizes)
    g = acc * alpha.astype(jnp.float32)[expert][:, None]
    r = jnp.maximum(preact.astype(jnp.float32), 0.0)
    p = prob.astype(jnp.float32)[:, None]
    owned_col = owned[:, None]

    dh_f32 = jnp.where(owned_col, 2.0 * g * r * p, 0.0)
    dprob = jnp.where(owned, jnp.sum(r * r * g, axis=1), 0.0)
    outputs = [dh_f32.astype(out_dtype), dprob]

    if with_dbias:
        # Each expert's rows are masked with a select before the sum, so a NaN stays in
        # its own expert's row of dbias.
        ones = jnp.ones((num_rows, 1), jnp.float32)
        outputs.append(groups.per_expert_outer(dh_f32, ones, sizes)[:, :, 0])
    if with_act:
        outputs.append(jnp.where(owned_col, r * r * p, 0.0).astype(out_dtype))
    row_amax = _max_with_nan(jnp.abs(dh_f32), axis=1)
    membership = expert[None, :] == jnp.arange(num_experts, dtype=jnp.int32)[:, None]
    membership &= owned[None, :]
    outputs.append(_max_with_nan(jnp.where(membership, row_amax[None, :], 0.0), axis=1))
    return tuple(outputs)


def _max_with_nan(x: jax.Array, axis: int) -> jax.Array:
    """max over `axis` (0 when empty), NaN wherever a NaN is reduced.

    max is exact, so any order gives the same bits. The NaN is made explicit because
    XLA's CPU max reduction drops it at some shapes (its vectorized min/max is not
    NaN-propagating), and the contract lets NaN propagate.
    """
    return jnp.where(jnp.isnan(x).any(axis=axis), jnp.nan, jnp.max(x, axis=axis, initial=0.0))
