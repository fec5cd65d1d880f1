"""The ordered gather-and-sum primitive (`schema.GATHER_SUM`): each token adds its rows.

    out[t] (n,) = sum over s = 0..k-1, in that order, of rows[index[t, s]]   in float32

rows (m, n) in any float dtype, index (T, k) int32, out (T, n) float32. It is the MoE
layer's combine (each token's top_k expert outputs, read in slot order) and the input
gradient of its dispatch (each token's top_k row gradients): a gather where each output
has one writer and a fixed order of additions, so it is bitwise reproducible on every
backend, with no scatter-add. Indices outside [0, m) are clamped into it.

Its request (`jax_dsrelu.kernels.request.GatherSumRequest`) holds n, the slots and the
rows' dtype; the MoE layer asks "auto" for it under every backend
(`registry.layer_backends`), so a kernel serves it where one can and XLA elsewhere.
Under sharded jit the tokens may be split and n too; the rows are kept whole, since a
token reads any of them.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from jax_dsrelu.kernels.request import GatherSumRequest, gather_sum_request
from jax_dsrelu.primitives import reference
from jax_dsrelu.primitives.base import GroupedPrimitive
from jax_dsrelu.primitive_schema import GATHER_SUM


def _request(named: Mapping[str, Any], params: Mapping[str, Any]) -> GatherSumRequest:
    del params
    return gather_sum_request(named["rows"], named["index"])


gather_sum_primitive = GroupedPrimitive(GATHER_SUM, reference.gather_sum_reference, _request)


def gather_sum(
    rows: jax.Array,  # (m, n)
    index: jax.Array,  # (T, k) int: the rows of each token, in the order they are added
    *,
    backend: str,
) -> jax.Array:  # (T, n) float32
    """out[t] = rows[index[t, 0]] + ... + rows[index[t, k-1]] in float32, in that order;
    shapes and dtypes are the caller's to have checked."""
    named = dict(rows=rows, index=index.astype(jnp.int32))
    return gather_sum_primitive.bind(named, backend=backend)["out"]
