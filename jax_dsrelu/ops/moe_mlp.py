"""`moe_mlp`: a squared-ReLU expert MLP on the library's grouped-GEMM primitives.

Its forward and backward are `jax_dsrelu.ops.expert_mlp`'s, on rows in place: the
up-projection with the squared-ReLU epilogue and the plain ragged matmul; backward the
fused `grouped_gemm_dsrelu` kernel (dh, dprob, db1, the regenerated activation), dx on
the ragged matmul reading w1 transposed in place, dw1 and dw2 on the ragged contraction.
No weight is ever transposed in memory. With a precision (an FP8 recipe) the same
GEMMs read their operands quantized by the recipe (`jax_dsrelu.ops.quantized_expert_mlp`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu import jax_internals
from jax_dsrelu.kernels import registry
from jax_dsrelu.ops import expert_mlp, quantized_expert_mlp
from jax_dsrelu.ops.expert_operands import Experts
from jax_dsrelu.ops.quantized_expert_mlp import QuantizedExpertWeights
from jax_dsrelu.primitives import sharding, validation
from jax_dsrelu.quantization.schema import Recipe


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
    precision: Recipe | None = None,
    quantized_weights: QuantizedExpertWeights | None = None,  # quantize_expert_weights(w1, w2, precision)
) -> jax.Array:  # (m, d), x.dtype
    """y = (relu(x @ w1[e] + b1[e])**2 * prob) @ w2[e], expert by expert.

    Differentiable in x, w1, w2, prob and b1. The forward keeps x, h, prob, the group
    sizes and the weights (and b1); the backward regenerates the activation from the
    saved pre-activation instead of keeping it, runs the fused `grouped_gemm_dsrelu` for
    dh, dprob and db1, and grouped GEMMs for dx, dw1 and dw2, all on `backend`.
    With deterministic=True every gradient is bitwise reproducible from run to run.
    Rows past sum(group_sizes) belong to no expert: their output and gradients are 0.

    precision=None computes in x.dtype. precision=jax_dsrelu.quantization.FP8_BLOCKWISE
    runs DeepSeek-V3's blockwise FP8 recipe: each of the six GEMMs reads its operands
    quantized along its own K (1 x 128 activation blocks, 128 x 128 weight blocks,
    float32 scales; along the tokens, the blocks restart at each expert's first row),
    accumulating in float32; the weights stay in their dtype, and the output and the
    gradients come in the arguments' dtypes (docs/fp8.md). backend="xla" runs it as
    quantize-dequantize arithmetic; "auto" runs every GEMM of the step, the weights'
    quantizing pass and the weight gradients' on sm90's FP8 kernels on Hopper, and what
    no kernel serves on that XLA path; "sm90" or "sm100" raise NotImplementedError (a
    recipe's step is chosen GEMM by GEMM).

    quantized_weights: w1 and w2 already quantized by `precision`
    (`quantize_expert_weights(w1, w2, precision)`, which must be of these w1 and w2), for
    a training loop that makes them once per weight update and reuses them over the
    micro-steps of gradient accumulation: the GEMMs read them instead of quantizing w1 and
    w2 again; the gradients are w1's and w2's as without them.
    """
    group_sizes = _check_arguments(x, w1, w2, prob, group_sizes, b1)
    validation.require_bool("deterministic", deterministic)
    precision = validation.precision(precision)
    backends = registry.layer_backends(validation.backend_name(backend), precision)
    quantized_expert_mlp.check_quantized_weights(quantized_weights, w1, w2, precision)
    x, w1, w2, prob, b1 = jax_internals.vary_alike([x, w1, w2, prob, b1])
    quantized = None if quantized_weights is None else jax.lax.stop_gradient(quantized_weights)
    return _moe_mlp(bool(deterministic), backends, precision, x, w1, w2, prob, group_sizes, b1, quantized)


def _check_arguments(x, w1, w2, prob, group_sizes, b1) -> Any:
    """Raises on a bad call; returns group_sizes as a JAX array."""
    group_sizes = validation.group_sizes_array(group_sizes)
    layouts = [("x", x, "(m, d)"), ("w1", w1, "(E, d, f)"), ("w2", w2, "(E, f, d)"), ("prob", prob, "(m,)"),
               ("group_sizes", group_sizes, "(E,)")]
    if b1 is not None:
        layouts.append(("b1", b1, "(E, f)"))
    validation.require_layouts(*layouts, experts="w1")
    validation.require_dtype("x", x, validation.FLOAT_DTYPES)
    for name, array in (("w1", w1), ("w2", w2)):
        if np.dtype(array.dtype) != np.dtype(x.dtype):
            raise TypeError(
                f"{name}.dtype must equal x.dtype={np.dtype(x.dtype).name}, "
                f"got {name}.dtype={np.dtype(array.dtype).name}"
            )
    validation.require_dtype("prob", prob, validation.FLOAT_DTYPES)
    validation.require_integer("group_sizes", group_sizes)
    if b1 is not None:
        validation.require_dtype("b1", b1, validation.FLOAT_DTYPES)
    return group_sizes


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _moe_mlp(deterministic, backends, precision, x, w1, w2, prob, group_sizes, b1, quantized):
    del deterministic
    return expert_mlp.forward(backends, Experts(x, w1, w2, prob, group_sizes, b1), precision, quantized)[0]


def _moe_mlp_fwd(deterministic, backends, precision, x, w1, w2, prob, group_sizes, b1, quantized):
    del deterministic
    y, h = expert_mlp.forward(backends, Experts(x, w1, w2, prob, group_sizes, b1), precision, quantized)
    # The activation is regenerated by the backward's fused kernel, so it is not kept.
    return y, (x, w1, w2, prob, group_sizes, b1, h, quantized)


def _moe_mlp_bwd(deterministic, backends, precision, residuals, dy):
    x, w1, w2, prob, group_sizes, b1, h, quantized = residuals
    grads = expert_mlp.backward(deterministic, backends, Experts(x, w1, w2, prob, group_sizes, b1), h,
                                dy.astype(x.dtype), precision=precision, quantized=quantized)
    dx, dw1, dw2, dprob = (
        sharding.like_primal(cotangent, primal)
        for cotangent, primal in ((grads.rows, x), (grads.w1, w1), (grads.w2, w2), (grads.prob, prob))
    )
    db1 = None if b1 is None else sharding.like_primal(grads.b1, b1)
    dgroup_sizes = np.zeros(group_sizes.shape, dtype=jax.dtypes.float0)
    # The quantized weights are w1's and w2's: their gradients are w1's and w2's.
    dquantized = jax.tree.map(jnp.zeros_like, quantized)
    return dx, dw1, dw2, dprob, dgroup_sizes, db1, dquantized


_moe_mlp.defvjp(_moe_mlp_fwd, _moe_mlp_bwd)
