"""The ragged-contraction primitive, for weight gradients (`schema.RAGGED_CONTRACT`):

    out[e] (a, b) = sum over expert e's rows i of lhs[i]^T rhs[i]; lhs (m, a), rhs (m, b)

accumulated in float32 and returned in out_dtype. An expert with no rows gets zeros;
rows owned by no expert are never read into a sum; bad group sizes are clamped
(`jax_dsrelu.groups`). Each output element has one writer summing its expert's rows in a
fixed order, so every backend is bitwise reproducible. Under row-sharded jit each device
contributes its rows' partial (E, a, b), and the partials are added in shard order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_dsrelu import backend_choice, groups
from jax_dsrelu.grouped_primitive import GroupedPrimitive
from jax_dsrelu.request import RaggedContractRequest
from jax_dsrelu.schema import RAGGED_CONTRACT


def _reference(lhs, rhs, group_sizes, *, out_dtype):
    sizes = groups.clamped_group_sizes(group_sizes, lhs.shape[0])
    return (groups.per_expert_outer(lhs, rhs, sizes).astype(out_dtype),)


def _request(operand_avals: Sequence[Any], params: Mapping[str, Any]) -> RaggedContractRequest:
    lhs, rhs, group_sizes = operand_avals[:3]
    return RaggedContractRequest(
        num_experts=group_sizes.shape[0],
        a=lhs.shape[1],
        b=rhs.shape[1],
        operand_dtype=np.dtype(lhs.dtype),
        out_dtype=np.dtype(params["out_dtype"]),
    )


ragged_contract_primitive = GroupedPrimitive(RAGGED_CONTRACT, _reference, _request)


def ragged_contract(
    lhs: jax.Array,  # (m, a)
    rhs: jax.Array,  # (m, b)
    group_sizes: jax.Array,  # (E,) int
    *,
    out_dtype: Any,
    backend: str,
) -> jax.Array:  # (E, a, b) out_dtype
    """The per-expert contraction over rows; shapes and dtypes are the caller's to have checked."""
    params = dict(out_dtype=np.dtype(out_dtype))
    backend_choice.check_explicit_backend(backend, _request((lhs, rhs, group_sizes), params))
    named = dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes.astype(jnp.int32))
    return ragged_contract_primitive.bind(named, backend=backend, **params)["out"]
