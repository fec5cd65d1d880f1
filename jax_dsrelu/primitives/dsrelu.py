"""The `grouped_gemm_dsrelu` primitive: its schema, reference and backend request.

Operands and results are those of `schema.GROUPED_GEMM_DSRELU`: grad (m, k), weight
(E, n, k), preact (m, n), prob (m,) float32, group_sizes (E,) int32, alpha (E,) float32,
and for MXFP8 operands (block_scaled) grad_scale (m, k/32) and weight_scale (E, n, k/32)
float8_e8m0fnu, or for FP8_BLOCKWISE operands (blockwise_scaled: e4m3 grad and weight)
grad_block_scale (m, ceil(k/128)) and weight_block_scale (E, ceil(n/128), ceil(k/128))
float32; results dh, dprob, [dbias], [act], amax, the bracketed ones only when
asked for. grad may be gathered: with grad_index (m,) int32, grad is a source (T, k) and
row i reads grad[grad_index[i]] (the layer's dy read by token through the routing; see
`jax_dsrelu.primitives.base`); not with MXFP8 operands, whose scales would need the same
index. Abstract evaluation, lowering per platform, batching and partitioning are
`jax_dsrelu.primitives.base`'s. On CUDA a kernel backend's implementation emits one
custom call that runs the kernel and, in deterministic mode, the fixed-order reduction
pass.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from jax_dsrelu.kernels import request as request_facts
from jax_dsrelu.primitives import validation
from jax_dsrelu.primitives.base import GroupedPrimitive
from jax_dsrelu.primitives.reference import grouped_gemm_dsrelu_reference
from jax_dsrelu.primitive_schema import GROUPED_GEMM_DSRELU


def _reference(*, with_dbias, with_act, out_dtype, deterministic, block_scaled, blockwise_scaled, **operands):
    del deterministic, block_scaled, blockwise_scaled  # the reference is always deterministic; scales are operands
    return grouped_gemm_dsrelu_reference(**operands, with_dbias=with_dbias, with_act=with_act, out_dtype=out_dtype)


def _request(named: Mapping[str, Any], params: Mapping[str, Any]) -> request_facts.Request:
    return request_facts.request_from_avals(
        (named["grad"], named["weight"], named["preact"], named["prob"]),
        block_scaled=params["block_scaled"],
        blockwise_scaled=params["blockwise_scaled"],
        out_dtype=params["out_dtype"],
        with_dbias=params["with_dbias"],
        with_act=params["with_act"],
        deterministic=params["deterministic"],
    )


grouped_gemm_dsrelu = GroupedPrimitive(GROUPED_GEMM_DSRELU, _reference, _request)
grouped_gemm_dsrelu_p = grouped_gemm_dsrelu.primitive


def bind(
    *,
    with_dbias: bool,
    with_act: bool,
    out_dtype: np.dtype,
    deterministic: bool,
    backend: str,
    **operands: jax.Array | None,
) -> dict[str, jax.Array | None]:
    """Operands by schema name (grad_scale and weight_scale None unless MXFP8,
    grad_block_scale and weight_block_scale None unless FP8_BLOCKWISE; grad_index None
    unless grad is read through it)."""
    block_scaled, blockwise_scaled = (
        validation.together(grad_side, operands.get(grad_side), weight_side, operands.get(weight_side))
        for grad_side, weight_side in (("grad_scale", "weight_scale"), ("grad_block_scale", "weight_block_scale")))
    gathered = operands.get("grad_index") is not None
    if (block_scaled or blockwise_scaled) and gathered:
        raise NotImplementedError(
            "grad_index cannot be combined with scaled operands (grad_scale, grad_block_scale): gather grad "
            "and its scales first, or pass unscaled operands"
        )
    if block_scaled and blockwise_scaled:
        raise ValueError("grad_scale (MXFP8) and grad_block_scale (FP8_BLOCKWISE) are two recipes: pass one")
    return grouped_gemm_dsrelu.bind(
        operands,
        with_dbias=with_dbias,
        with_act=with_act,
        out_dtype=np.dtype(out_dtype),
        deterministic=deterministic,
        block_scaled=block_scaled,
        blockwise_scaled=blockwise_scaled,
        with_grad_index=gathered,
        backend=backend,
    )
