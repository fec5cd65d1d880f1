"""The ragged-M grouped GEMM primitives: row i of expert e is lhs[i] @ rhs[e].

Two primitives share the GEMM and differ in their epilogue (`schema.RAGGED_MATMUL` and
`schema.RAGGED_MATMUL_SRELU`):

- `ragged_matmul`: out (m, n) = acc in out_dtype;
- `ragged_matmul_srelu`, the up-projection of a squared-ReLU expert MLP with its
  activation: h = acc (+ bias[e]) rounded to out_dtype, and act = relu(h)**2 * prob
  computed from the rounded h, exactly as the backward regenerates it; with
  with_act=False h alone (for a caller that forms act itself, or needs only h).

lhs (m, k); rhs stored (E, k, n) (rhs_layout "kn", as W1 and W2 are for the forward) or
(E, n, k) ("nk": a weight read transposed, as for dx = dh @ W1[e]^T). Kernels read either
layout in place; only the XLA reference swaps the axes of an "nk" rhs. Accumulation is
float32; rows owned by no expert come out 0, and bad group sizes are clamped
(`jax_dsrelu.groups`). One writer per output element and a fixed summation order make
every backend bitwise reproducible, so there is no deterministic flag.

lhs and rhs may be FP8_BLOCKWISE-quantized (`jax_dsrelu.quantization`): e4m3 values with
lhs_scale (m, ceil(k / 128)) and rhs_scale (E, ceil(n / 128), ceil(k / 128)) float32,
rhs stored "nk" (Hopper's FP8 wgmma reads both operands K-major). The product is that of
the values the operands represent, each K block's partial sum promoted to float32 and
scaled (`quantization.emulation`); the XLA reference dequantizes first.

lhs may be gathered: with lhs_index (m,) int32, lhs is a source (T, k) and row i of the
GEMM reads lhs[lhs_index[i]] (the up-projection reading its tokens through the routing,
with no (m, k) copy of them where the backend loads rows through the index; see
`jax_dsrelu.primitives.base`).
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu.primitives import reference, validation
from jax_dsrelu.primitives.base import GroupedPrimitive
from jax_dsrelu.kernels.request import RaggedMatmulRequest
from jax_dsrelu.primitive_schema import RAGGED_MATMUL, RAGGED_MATMUL_SRELU

RHS_LAYOUTS = ("kn", "nk")


def _request_of(epilogue: str):
    def request(named: Mapping[str, Any], params: Mapping[str, Any]) -> RaggedMatmulRequest:
        lhs, rhs = named["lhs"], named["rhs"]
        num_experts = rhs.shape[0]
        n = rhs.shape[2] if params["rhs_layout"] == "kn" else rhs.shape[1]
        return RaggedMatmulRequest(
            num_experts=num_experts,
            k=lhs.shape[1],
            n=n,
            rhs_layout=params["rhs_layout"],
            operand_dtype=np.dtype(lhs.dtype),
            out_dtype=np.dtype(params["out_dtype"]),
            epilogue=epilogue,
            with_bias=bool(params.get("with_bias", False)),
            block_scaled=bool(params["block_scaled"]),
            # ragged_matmul's parameters name no act: its epilogue stores what it makes.
            with_act=bool(params.get("with_act", True)),
        )

    return request


ragged_matmul_primitive = GroupedPrimitive(RAGGED_MATMUL, reference.ragged_matmul_reference, _request_of("none"))
ragged_matmul_srelu_primitive = GroupedPrimitive(
    RAGGED_MATMUL_SRELU, reference.ragged_matmul_srelu_reference, _request_of("srelu")
)


def _check_layout(rhs_layout: str) -> None:
    if rhs_layout not in RHS_LAYOUTS:
        raise ValueError(f"rhs_layout must be one of {RHS_LAYOUTS}, got {rhs_layout!r}")


def _block_scaled(lhs_scale, rhs_scale, rhs_layout: str, lhs_index) -> bool:
    """Whether the call's operands are block-scaled: both scales given, or neither."""
    if not validation.together("lhs_scale", lhs_scale, "rhs_scale", rhs_scale):
        return False
    if rhs_layout != "nk":
        raise ValueError(f"block-scaled operands need rhs stored (E, n, k), rhs_layout 'nk', got {rhs_layout!r}")
    if lhs_index is not None:
        raise ValueError("block-scaled operands are read in row order: lhs_index must be None with lhs_scale")
    return True


def ragged_matmul(
    lhs: jax.Array,  # (m, k), or (T, k) with lhs_index
    rhs: jax.Array,  # (E, k, n) for "kn", (E, n, k) for "nk"
    group_sizes: jax.Array,  # (E,) int
    *,
    rhs_layout: str,
    out_dtype: Any,
    backend: str,
    lhs_index: jax.Array | None = None,  # (m,) int32: row i of the GEMM is lhs[lhs_index[i]]
    lhs_scale: jax.Array | None = None,  # (m, ceil(k / 128)) float32, FP8_BLOCKWISE operands
    rhs_scale: jax.Array | None = None,  # (E, ceil(n / 128), ceil(k / 128)) float32
    epilogue: Mapping[str, Any] | None = None,  # the squared-ReLU epilogue's (ragged_matmul_srelu)
) -> jax.Array | tuple[jax.Array, jax.Array | None]:  # out (m, n) out_dtype; with the epilogue (h, act), each so
    """The plain ragged matmul, or with `epilogue` {prob, bias, with_act} the squared-ReLU
    one (which `ragged_matmul_srelu` names; act None without with_act); shapes and dtypes
    are the caller's to have checked."""
    _check_layout(rhs_layout)
    params = dict(rhs_layout=rhs_layout, out_dtype=np.dtype(out_dtype), with_lhs_index=lhs_index is not None,
                  block_scaled=_block_scaled(lhs_scale, rhs_scale, rhs_layout, lhs_index))
    named = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, lhs_index=lhs_index, lhs_scale=lhs_scale,
                 rhs_scale=rhs_scale)
    if epilogue is None:
        return ragged_matmul_primitive.bind(named, backend=backend, **params)["out"]
    prob, bias = epilogue["prob"], epilogue["bias"]
    # The kernel's epilogue reads prob and bias as float32 whatever their dtype.
    named.update(prob=prob.astype(jnp.float32), bias=None if bias is None else bias.astype(jnp.float32))
    results = ragged_matmul_srelu_primitive.bind(named, backend=backend, with_bias=bias is not None,
                                                 with_act=bool(epilogue["with_act"]), **params)
    return results["h"], results.get("act")


def ragged_matmul_srelu(
    lhs: jax.Array,  # (m, k), or (T, k) with lhs_index
    rhs: jax.Array,  # (E, k, n) for "kn", (E, n, k) for "nk"
    group_sizes: jax.Array,  # (E,) int
    prob: jax.Array,  # (m,)
    bias: jax.Array | None,  # (E, n)
    *,
    with_act: bool = True,  # False: h alone, no act made or stored
    **gemm,  # ragged_matmul's keywords
) -> tuple[jax.Array, jax.Array | None]:  # h, act: (m, n) out_dtype; act None without with_act
    """The ragged matmul with the squared-ReLU forward epilogue."""
    return ragged_matmul(lhs, rhs, group_sizes, epilogue=dict(prob=prob, bias=bias, with_act=with_act), **gemm)
