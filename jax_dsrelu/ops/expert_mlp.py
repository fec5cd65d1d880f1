"""The squared-ReLU expert MLP on the primitives: its forward and its backward, once.

`moe_mlp`'s custom VJP (rows in, rows out) and the MoE block's (`block_experts`: tokens
in, read through the routing's row index, summed per token out) are both built from
these two functions, so the block computes exactly what `moe_mlp` computes on the
gathered rows.

Forward: the up-projection with the squared-ReLU epilogue, then the plain ragged matmul.
Backward: the fused dsReLU kernel (dh, dprob, db1, the regenerated activation), drows on
the ragged matmul reading w1 transposed in place, dw1 and dw2 on the ragged contraction.
No weight is ever transposed in memory, and the activation is never kept: the backward
regenerates it from the pre-activation h.

Under a precision (an FP8 recipe), both run `jax_dsrelu.ops.quantized_expert_mlp`
instead: the same GEMMs on operands quantized by the recipe, on the XLA backend.

Rows may be read through a row index (`row_index`, `dy_index`): row i is then
source[index[i]], and the primitives read it so (`jax_dsrelu.primitives.base`), which on a
backend that loads rows through the index makes no (m, l) copy of the source.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsrelu.kernels.registry import LayerBackends
from jax_dsrelu.ops import quantized_expert_mlp
from jax_dsrelu.ops.expert_operands import Experts, Gradients
from jax_dsrelu.primitives import dsrelu
from jax_dsrelu.primitives.ragged_contract import ragged_contract
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu
from jax_dsrelu.quantization.schema import Recipe


def forward(
    backends: LayerBackends,
    experts: Experts,
    precision: Recipe | None = None,  # None: in w1.dtype; a recipe: its quantized operands
    quantized=None,  # with a recipe: w1 and w2 quantized already (QuantizedExpertWeights)
) -> tuple[jax.Array, jax.Array]:  # y (m, l), h (m, f), both in w1.dtype
    """(y, h); h is the pre-activation rounded to w1.dtype, as the backward reads it.

    The up-projection makes the activation in the same call, from the rounded h.
    """
    if precision is not None:
        return quantized_expert_mlp.forward(precision, backends, experts, quantized)
    h, act = _up(backends, experts)
    y = ragged_matmul(act, experts.w2, experts.group_sizes, rhs_layout="kn", out_dtype=experts.w1.dtype,
                      backend=backends.matmul)
    return y, h


def preactivation(
    backends: LayerBackends,
    experts: Experts,
    precision: Recipe | None = None,  # as for forward
    quantized=None,  # with a recipe: w1 and w2 quantized (QuantizedExpertWeights), which it needs
) -> jax.Array:  # h (m, f) in w1.dtype
    """forward's h, bit for bit, without the down-projection: for a backward that makes
    the pre-activation again rather than keep it (and has the weights quantized for its
    own GEMMs)."""
    if precision is not None:
        return quantized_expert_mlp.preactivation(precision, backends, experts, quantized)
    return _up(backends, experts, with_act=False)[0]


def _up(backends: LayerBackends, experts: Experts, with_act: bool = True) -> tuple[jax.Array, jax.Array | None]:
    """(h, act) of the up-projection with its squared-ReLU epilogue, in w1.dtype (act None
    without with_act: h alone is stored)."""
    rows, w1, _, prob, group_sizes, b1, row_index = experts
    return ragged_matmul_srelu(
        rows, w1, group_sizes, prob, b1, with_act=with_act, rhs_layout="kn", out_dtype=w1.dtype,
        backend=backends.matmul, lhs_index=row_index,
    )


def backward(
    deterministic: bool,
    backends: LayerBackends,
    experts: Experts,
    h: jax.Array,  # (m, f) the forward's pre-activation
    dy: jax.Array,  # (m, l) in w1.dtype, or its source (U, l) with dy_index
    dy_index: jax.Array | None = None,  # (m,) int32: row i of dy is dy[dy_index[i]]
    precision: Recipe | None = None,  # as for forward
    quantized=None,  # as for forward
) -> Gradients:
    """The gradients of forward's y against the cotangent dy."""
    if precision is not None:
        return quantized_expert_mlp.backward(precision, deterministic, backends, experts, h, dy, dy_index, quantized)
    rows, w1, w2, prob, group_sizes, b1, row_index = experts
    dtype = w1.dtype
    num_experts = w1.shape[0]
    # No MXFP8 scales: the layer's operands are bf16 or fp16.
    fused = dsrelu.bind(
        grad=dy, grad_index=dy_index, weight=w2, preact=h, prob=prob, group_sizes=group_sizes,
        alpha=jnp.ones((num_experts,), jnp.float32), grad_scale=None, weight_scale=None,
        with_dbias=b1 is not None, with_act=True, out_dtype=dtype, deterministic=deterministic,
        backend=backends.dsrelu,
    )
    dh, act = fused["dh"], fused["act"]
    # w1 (E, l, f) read as (E, n, k) with n = l, k = f: drows = dh @ w1[e]^T, in place.
    drows = ragged_matmul(dh, w1, group_sizes, rhs_layout="nk", out_dtype=dtype, backend=backends.matmul)
    dw1 = ragged_contract(
        rows, dh, group_sizes, out_dtype=w1.dtype, backend=backends.contract, lhs_index=row_index
    )
    dw2 = ragged_contract(
        act, dy, group_sizes, out_dtype=w2.dtype, backend=backends.contract, rhs_index=dy_index
    )
    db1 = None if b1 is None else fused["dbias"].astype(b1.dtype)
    return Gradients(drows, dw1, dw2, fused["dprob"].astype(prob.dtype), db1)
