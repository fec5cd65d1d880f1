"""`grouped_gemm_dsrelu`: the fused backward of a squared-ReLU expert MLP."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dsrelu.primitives import dsrelu, validation


class DsreluOutputs(NamedTuple):
    """What `grouped_gemm_dsrelu` returns; `dbias` and `act` are None unless asked for."""

    dh: jax.Array  # (m, n) out_dtype
    dprob: jax.Array  # (m,) float32
    dbias: jax.Array | None  # (E, n) float32
    act: jax.Array | None  # (m, n) out_dtype
    amax: jax.Array  # (E,) float32


def grouped_gemm_dsrelu(
    grad: jax.Array,  # (m, k) dy, the upstream gradient
    weight: jax.Array,  # (E, n, k) W2 as stored for the forward, contracted on k
    preact: jax.Array,  # (m, n) h, the saved forward pre-activation
    prob: jax.Array,  # (m,) routing probability
    group_sizes: jax.typing.ArrayLike,  # (E,) integer rows per expert, in row order
    *,
    alpha: jax.Array | None = None,  # (E,) per-expert scale of the GEMM result
    grad_scale: jax.Array | None = None,  # (m, k/32) float8_e8m0fnu, MXFP8 operands only
    weight_scale: jax.Array | None = None,  # (E, n, k/32) float8_e8m0fnu
    with_dbias: bool = False,
    with_act: bool = False,
    out_dtype=jnp.bfloat16,
    deterministic: bool = False,
    backend: str = "auto",
) -> DsreluOutputs:
    """Grouped GEMM `grad @ weight[e]^T` with the squared-ReLU backward fused after it.

    With e(i) the expert owning row i, g = alpha[e] * (grad[i] . weight[e, j]) accumulated
    in float32 and r = relu(preact[i, j]) in float32:

        dh[i, j]  = 2 g r prob[i]               rounded once to out_dtype
        dprob[i]  = sum_j r^2 g
        dbias[e]  = sum over expert e's rows of the unrounded dh       (with_dbias)
        act[i, j] = r^2 prob[i]                                         (with_act)
        amax[e]   = max |dh| over expert e's rows, 0 for an empty expert

    MXFP8 operands: grad and weight as float8_e4m3fn or float8_e5m2 with grad_scale and
    weight_scale, one power-of-two scale per 32 elements along k (see `quantize_mx`); the
    values above are then those of the dequantized operands.

    Rows past sum(group_sizes) belong to no expert and get 0. Negative group sizes count as
    0 and rows past m are ignored, so no group_sizes value reads or writes out of bounds.

    deterministic=True makes every output bitwise reproducible from run to run on the same
    device model; deterministic=False lets the kernels reduce with atomics, which may
    change the last bits of dprob and dbias. backend is "auto", "xla", "sm90" or "sm100";
    see `jax_dsrelu.backends()` for what runs here.
    """
    group_sizes = validation.check_grouped_gemm_dsrelu(
        grad, weight, preact, prob, group_sizes, alpha, grad_scale, weight_scale
    )
    for name, flag in (
        ("with_dbias", with_dbias),
        ("with_act", with_act),
        ("deterministic", deterministic),
    ):
        validation.require_bool(name, flag)
    dtype = validation.out_dtype(out_dtype)
    backend = validation.backend_name(backend)

    if alpha is None:
        alpha = jnp.ones((weight.shape[0],), jnp.float32)
    results = dsrelu.bind(
        grad=grad,
        weight=weight,
        preact=preact,
        prob=prob,
        group_sizes=group_sizes,
        alpha=alpha.astype(jnp.float32),
        grad_scale=grad_scale,
        weight_scale=weight_scale,
        with_dbias=bool(with_dbias),
        with_act=bool(with_act),
        out_dtype=dtype,
        deterministic=bool(deterministic),
        backend=backend,
    )
    return DsreluOutputs(**results)
