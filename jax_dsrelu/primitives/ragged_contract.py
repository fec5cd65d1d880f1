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
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from jax_dsrelu.primitives import reference
from jax_dsrelu.primitives.base import GroupedPrimitive
from jax_dsrelu.kernels.request import RaggedContractRequest
from jax_dsrelu.primitives.schema import RAGGED_CONTRACT


def _request(named: Mapping[str, Any], params: Mapping[str, Any]) -> RaggedContractRequest:
    lhs, rhs, group_sizes = named["lhs"], named["rhs"], named["group_sizes"]
    return RaggedContractRequest(
        num_experts=group_sizes.shape[0],
        a=lhs.shape[1],
        b=rhs.shape[1],
        operand_dtype=np.dtype(lhs.dtype),
        out_dtype=np.dtype(params["out_dtype"]),
    )


ragged_contract_primitive = GroupedPrimitive(RAGGED_CONTRACT, reference.ragged_contract_reference, _request)


def ragged_contract(
    lhs: jax.Array,  # (m, a), or (T, a) with lhs_index
    rhs: jax.Array,  # (m, b), or (U, b) with rhs_index
    group_sizes: jax.Array,  # (E,) int
    *,
    out_dtype: Any,
    backend: str,
    lhs_index: jax.Array | None = None,  # (m,) int32: row i of lhs is lhs[lhs_index[i]]
    rhs_index: jax.Array | None = None,  # (m,) int32: row i of rhs is rhs[rhs_index[i]]
) -> jax.Array:  # (E, a, b) out_dtype
    """The per-expert contraction over rows; shapes and dtypes are the caller's to have checked."""
    params = dict(
        out_dtype=np.dtype(out_dtype), with_lhs_index=lhs_index is not None, with_rhs_index=rhs_index is not None
    )
    named = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, lhs_index=lhs_index, rhs_index=rhs_index)
    return ragged_contract_primitive.bind(named, backend=backend, **params)["out"]
