"""`moe_mlp`: a squared-ReLU expert MLP whose backward runs on `grouped_gemm_dsrelu`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu import api, groups, jax_internals, validation


def moe_mlp(
    x: jax.Array,  # (m, d) tokens, sorted by expert
    w1: jax.Array,  # (E, d, f)
    w2: jax.Array,  # (E, f, d)
    prob: jax.Array,  # (m,) routing probability of each row
    group_sizes: jax.Array,  # (E,) int32 rows per expert, in row order
    *,
    b1: jax.Array | None = None,  # (E, f)
    deterministic: bool = False,
    backend: str = "auto",
) -> jax.Array:  # (m, d), x.dtype
    """y = (relu(x @ w1[e] + b1[e])**2 * prob) @ w2[e], expert by expert.

    Differentiable in x, w1, w2, prob and b1. The backward regenerates the activation
    from the saved pre-activation instead of keeping it, runs the fused
    `grouped_gemm_dsrelu` for dh, dprob and db1, and grouped GEMMs for dx, dw1 and dw2.
    With deterministic=True every gradient is bitwise reproducible from run to run.
    Rows past sum(group_sizes) belong to no expert: their output and gradients are 0.
    """
    validation.check_moe_mlp(x, w1, w2, prob, group_sizes, b1)
    validation.require_bool("deterministic", deterministic)
    backend = validation.backend_name(backend)
    x, w1, w2, prob, b1 = jax_internals.vary_alike([x, w1, w2, prob, b1])
    return _moe_mlp(bool(deterministic), backend, x, w1, w2, prob, group_sizes.astype(jnp.int32), b1)


def _forward(x, w1, w2, prob, group_sizes, b1):
    """Returns (y, h); h is the pre-activation rounded to x.dtype, as the backward reads it."""
    num_rows = x.shape[0]
    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    h = groups.ragged_matmul(x, w1, sizes)
    if b1 is not None:
        expert, owned = groups.row_experts(group_sizes, num_rows)
        h = h + jnp.where(owned[:, None], b1.astype(jnp.float32)[expert], 0.0)
    h = h.astype(x.dtype)
    # The activation is computed from the rounded h, exactly as the backward regenerates it.
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    a = (r * r * prob.astype(jnp.float32)[:, None]).astype(x.dtype)
    y = groups.ragged_matmul(a, w2, sizes).astype(x.dtype)
    return y, h


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _moe_mlp(deterministic, backend, x, w1, w2, prob, group_sizes, b1):
    del deterministic, backend
    return _forward(x, w1, w2, prob, group_sizes, b1)[0]


def _moe_mlp_fwd(deterministic, backend, x, w1, w2, prob, group_sizes, b1):
    del deterministic, backend
    y, h = _forward(x, w1, w2, prob, group_sizes, b1)
    return y, (x, w1, w2, prob, group_sizes, b1, h)


def _moe_mlp_bwd(deterministic, backend, residuals, dy):
    x, w1, w2, prob, group_sizes, b1, h = residuals
    fused = api.grouped_gemm_dsrelu(
        dy.astype(x.dtype),
        w2,
        h,
        prob,
        group_sizes,
        with_dbias=b1 is not None,
        with_act=True,
        out_dtype=x.dtype,
        deterministic=deterministic,
        backend=backend,
    )
    sizes = groups.clamped_group_sizes(group_sizes, x.shape[0])
    dx = groups.ragged_matmul(fused.dh, jnp.swapaxes(w1, 1, 2), sizes).astype(x.dtype)
    dw1 = groups.per_expert_outer(x, fused.dh, sizes).astype(w1.dtype)
    dw2 = groups.per_expert_outer(fused.act, dy.astype(x.dtype), sizes).astype(w2.dtype)
    db1 = None if b1 is None else fused.dbias.astype(b1.dtype)
    dprob = fused.dprob.astype(prob.dtype)
    dgroup_sizes = np.zeros(group_sizes.shape, dtype=jax.dtypes.float0)
    return dx, dw1, dw2, dprob, dgroup_sizes, db1


_moe_mlp.defvjp(_moe_mlp_fwd, _moe_mlp_bwd)
