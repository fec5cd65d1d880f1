"""The ragged-contraction primitive, for weight gradients (`schema.RAGGED_CONTRACT`):

    out[e] (a, b) = sum over expert e's rows i of lhs[i]^T rhs[i]; lhs (m, a), rhs (m, b)

accumulated in float32 and returned in out_dtype. An expert with no rows gets zeros;
rows owned by no expert are never read into a sum; bad group sizes are clamped
(`jax_dsrelu.groups`). Each output element has one writer summing its expert's rows in a
fixed order, so every backend is bitwise reproducible. Under row-sharded jit each device
contributes its rows' partial (E, a, b), and the partials are added in shard order.

Either side may be gathered: with lhs_index (m,) int32, lhs is a source (T, a) and row i
reads lhs[lhs_index[i]] (dW1 reading x through the routing), and likewise rhs with
rhs_index (dW2 reading dy); see `jax_dsrelu.primitives.base`.

Block-scaled operands (FP8_BLOCKWISE, the weight gradients of the FP8 recipe): lhs and
rhs e4m3, quantized in groups of 128 rows that restart at each expert
(`jax_dsrelu.quantization.ragged.quantize_ragged_rows`), with lhs_scale (G, a) and
rhs_scale (G, b) float32, G = ceil(m / 128) + E; the math is the above on the values they
represent. They are read in row order (no row index), and their rows are never split
across devices, since the groups are numbered over all of them.

Quantized here (precision=FP8_BLOCKWISE): lhs and rhs 16- or 32-bit floats, no scales;
each side is quantized as above first (`quantize_ragged_rows`), then contracted as
block-scaled operands. The quantized values are read by the contraction alone, so a
kernel may quantize them straight into the layout it reads (sm90:
`kernels/sm90/k_major_quantize_kernel.py`). Its rows stay whole across devices too, so
under row-sharded jit the 16- or 32-bit rows are gathered where the block-scaled form
gathers 8-bit ones.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from jax_dsrelu.primitives import reference, validation
from jax_dsrelu.primitives.base import GroupedPrimitive
from jax_dsrelu.kernels.request import RaggedContractRequest
from jax_dsrelu.primitive_schema import RAGGED_CONTRACT
from jax_dsrelu.quantization import blockwise, ragged
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE, Recipe

ELEMENT = np.dtype(FP8_BLOCKWISE.activations.element)
ROWS_PER_GROUP = FP8_BLOCKWISE.activations.block[1]


def _request(named: Mapping[str, Any], params: Mapping[str, Any]) -> RaggedContractRequest:
    lhs, rhs, group_sizes = named["lhs"], named["rhs"], named["group_sizes"]
    quantize = bool(params["quantize"])
    return RaggedContractRequest(
        num_experts=group_sizes.shape[0],
        a=lhs.shape[1],
        b=rhs.shape[1],
        operand_dtype=ELEMENT if quantize else np.dtype(lhs.dtype),
        out_dtype=np.dtype(params["out_dtype"]),
        block_scaled=bool(params["block_scaled"]) or quantize,
        quantized_from=(np.dtype(lhs.dtype), np.dtype(rhs.dtype)) if quantize else None,
    )


ragged_contract_primitive = GroupedPrimitive(RAGGED_CONTRACT, reference.ragged_contract_reference, _request)


def _check_block_scaled(lhs, rhs, group_sizes, lhs_scale, rhs_scale, lhs_index, rhs_index) -> bool:
    """Whether the operands are block-scaled (both scales given, or neither), checked."""
    if not validation.together("lhs_scale", lhs_scale, "rhs_scale", rhs_scale):
        return False
    if lhs_index is not None or rhs_index is not None:
        raise ValueError("block-scaled operands are read in row order: lhs_index and rhs_index must be None with scales")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(x.dtype) != ELEMENT:
            raise TypeError(f"block-scaled {name} must be {ELEMENT.name}, got {name}.dtype={np.dtype(x.dtype).name}")
    num_groups = ragged.max_groups(lhs.shape[0], group_sizes.shape[0], ROWS_PER_GROUP)
    for name, scale, x in (("lhs_scale", lhs_scale, lhs), ("rhs_scale", rhs_scale, rhs)):
        expected = (num_groups, x.shape[1])
        if tuple(scale.shape) != expected or np.dtype(scale.dtype) != np.float32:
            raise ValueError(f"{name} must be float32 of shape {expected} (ceil(m / {ROWS_PER_GROUP}) + E groups of "
                             f"rows, by column), got {np.dtype(scale.dtype).name} {tuple(scale.shape)}")
    return True


def _check_quantized_here(precision, lhs, rhs, lhs_scale, rhs_scale, lhs_index, rhs_index) -> bool:
    """Whether the call asks for its operands quantized here (a precision given), checked."""
    if validation.precision(precision) is None:
        return False
    given = [name for name, x in (("lhs_scale", lhs_scale), ("rhs_scale", rhs_scale), ("lhs_index", lhs_index),
                                  ("rhs_index", rhs_index)) if x is not None]
    if given:
        raise ValueError(f"precision={precision.name} quantizes lhs and rhs, read in row order: {given} must be None "
                         f"with it")
    for name, x in (("lhs", lhs), ("rhs", rhs)):
        if np.dtype(x.dtype) not in blockwise.INPUT_DTYPES:  # the quantizer's
            raise TypeError(f"with precision={precision.name}, {name} must be float32, bfloat16 or float16 (it is "
                            f"quantized here), got {name}.dtype={np.dtype(x.dtype).name}")
    return True


def ragged_contract(
    lhs: jax.Array,  # (m, a), or (T, a) with lhs_index
    rhs: jax.Array,  # (m, b), or (U, b) with rhs_index
    group_sizes: jax.Array,  # (E,) int
    *,
    out_dtype: Any,
    backend: str,
    lhs_index: jax.Array | None = None,  # (m,) int32: row i of lhs is lhs[lhs_index[i]]
    rhs_index: jax.Array | None = None,  # (m,) int32: row i of rhs is rhs[rhs_index[i]]
    lhs_scale: jax.Array | None = None,  # (ceil(m / 128) + E, a) float32, FP8_BLOCKWISE operands
    rhs_scale: jax.Array | None = None,  # (ceil(m / 128) + E, b) float32
    precision: Recipe | None = None,  # FP8_BLOCKWISE: lhs and rhs quantized here (module doc)
) -> jax.Array:  # (E, a, b) out_dtype
    """The per-expert contraction over rows; shapes and dtypes of the 16-bit form are the
    caller's to have checked, the block-scaled and quantized-here forms' are checked here."""
    quantize = _check_quantized_here(precision, lhs, rhs, lhs_scale, rhs_scale, lhs_index, rhs_index)
    block_scaled = _check_block_scaled(lhs, rhs, group_sizes, lhs_scale, rhs_scale, lhs_index, rhs_index)
    params = dict(
        out_dtype=np.dtype(out_dtype), with_lhs_index=lhs_index is not None, with_rhs_index=rhs_index is not None,
        block_scaled=block_scaled, quantize=quantize,
    )
    named = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, lhs_index=lhs_index, rhs_index=rhs_index,
                 lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    return ragged_contract_primitive.bind(named, backend=backend, **params)["out"]
