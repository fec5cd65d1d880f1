"""The XLA backend: every primitive's contract written in plain JAX, and the oracle for every kernel.

It runs wherever XLA does. Every output is computed in one fixed order, so it is bitwise
reproducible on a GPU as well: the column reduction for dbias is a dot against the
expert's own rows, never a scatter-add (XLA's GPU scatter-add uses atomics and
its sums change from run to run). Each reference takes its primitive's operands by the
schema's names (`Schema.call_arguments`) and returns its present results by name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsrelu import groups, jax_internals
from jax_dsrelu.quantization import blockwise, mx, ragged
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE


def grouped_gemm_dsrelu_reference(
    grad: jax.Array,  # (m, k)
    weight: jax.Array,  # (E, n, k)
    preact: jax.Array,  # (m, n)
    prob: jax.Array,  # (m,)
    group_sizes: jax.Array,  # (E,) int32
    alpha: jax.Array,  # (E,) float32
    grad_scale: jax.Array | None = None,  # (m, k/32) float8_e8m0fnu, MXFP8 operands only
    weight_scale: jax.Array | None = None,  # (E, n, k/32) float8_e8m0fnu
    grad_block_scale: jax.Array | None = None,  # (m, ceil(k/128)) float32, FP8_BLOCKWISE operands only
    weight_block_scale: jax.Array | None = None,  # (E, ceil(n/128), ceil(k/128)) float32
    *,
    with_dbias: bool,
    with_act: bool,
    out_dtype: jnp.dtype,
) -> dict[str, jax.Array]:
    """Returns {dh, dprob, [dbias], [act], amax}, the optional ones when asked for.

    Block-scaled (MXFP8, FP8_BLOCKWISE) operands are dequantized to float32 first, so every backend is
    held to the contract on the values the operands represent.
    """
    if grad_scale is not None:
        grad = mx.dequantize_mx(grad, grad_scale)
        weight = mx.dequantize_mx(weight, weight_scale)
    if grad_block_scale is not None:
        grad = blockwise.dequantize_blockwise(grad, grad_block_scale, FP8_BLOCKWISE.activations)
        weight = blockwise.dequantize_blockwise(weight, weight_block_scale, FP8_BLOCKWISE.weights)
    num_rows = grad.shape[0]
    num_experts = weight.shape[0]
    sizes = groups.clamped_group_sizes(group_sizes, num_rows)
    expert, owned = groups.row_experts(group_sizes, num_rows)

    # ragged_matmul leaves rows past sum(sizes) at zero; the float32 accumulation is the
    # contract's, whatever the operand dtype.
    acc = expert_rows_matmul(grad, jnp.swapaxes(weight, 1, 2), sizes)
    g = acc * alpha.astype(jnp.float32)[expert][:, None]
    r = jnp.maximum(preact.astype(jnp.float32), 0.0)
    p = prob.astype(jnp.float32)[:, None]
    owned_col = owned[:, None]

    dh_f32 = jnp.where(owned_col, 2.0 * g * r * p, 0.0)
    dprob = jnp.where(owned, jnp.sum(r * r * g, axis=1), 0.0)
    outputs = dict(dh=dh_f32.astype(out_dtype), dprob=dprob)

    if with_dbias:
        # Each expert's rows are masked with a select before the sum, so a NaN stays in
        # its own expert's row of dbias.
        ones = jnp.ones((num_rows, 1), jnp.float32)
        outputs["dbias"] = per_expert_outer(dh_f32, ones, sizes)[:, :, 0]
    if with_act:
        outputs["act"] = jnp.where(owned_col, r * r * p, 0.0).astype(out_dtype)
    row_amax = _max_with_nan(jnp.abs(dh_f32), axis=1)
    membership = expert[None, :] == jnp.arange(num_experts, dtype=jnp.int32)[:, None]
    membership &= owned[None, :]
    outputs["amax"] = _max_with_nan(jnp.where(membership, row_amax[None, :], 0.0), axis=1)
    return outputs


def _max_with_nan(x: jax.Array, axis: int) -> jax.Array:
    """max over `axis` (0 when empty), NaN wherever a NaN is reduced.

    max is exact, so any order gives the same bits. The NaN is made explicit because
    XLA's CPU max reduction drops it at some shapes (its vectorized min/max is not
    NaN-propagating), and the contract lets NaN propagate.
    """
    return jnp.where(jnp.isnan(x).any(axis=axis), jnp.nan, jnp.max(x, axis=axis, initial=0.0))


def _accumulate(lhs, rhs, group_sizes, rhs_layout, lhs_scale, rhs_scale):
    """The float32 product of every expert's rows; block-scaled (FP8_BLOCKWISE) operands
    are dequantized to float32 first, so the product is of the values they represent."""
    if lhs_scale is not None:
        lhs = blockwise.dequantize_blockwise(lhs, lhs_scale, FP8_BLOCKWISE.activations)
        rhs = blockwise.dequantize_blockwise(rhs, rhs_scale, FP8_BLOCKWISE.weights)
    rhs_kn = rhs if rhs_layout == "kn" else jnp.swapaxes(rhs, 1, 2)
    return expert_rows_matmul(lhs, rhs_kn, groups.clamped_group_sizes(group_sizes, lhs.shape[0]))


def ragged_matmul_reference(lhs, rhs, group_sizes, lhs_scale=None, rhs_scale=None, *, rhs_layout, out_dtype,
                            block_scaled):
    del block_scaled  # the scales are None without it
    return dict(out=_accumulate(lhs, rhs, group_sizes, rhs_layout, lhs_scale, rhs_scale).astype(out_dtype))


def ragged_matmul_srelu_reference(lhs, rhs, group_sizes, prob, bias=None, lhs_scale=None, rhs_scale=None, *,
                                  rhs_layout, out_dtype, with_bias, block_scaled, with_act):
    del with_bias, block_scaled  # bias and the scales are None without them
    acc = _accumulate(lhs, rhs, group_sizes, rhs_layout, lhs_scale, rhs_scale)
    if bias is not None:
        expert, owned = groups.row_experts(group_sizes, lhs.shape[0])
        acc = acc + jnp.where(owned[:, None], bias.astype(jnp.float32)[expert], 0.0)
    h = acc.astype(out_dtype)
    if not with_act:
        return dict(h=h)
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    act = (r * r * prob.astype(jnp.float32)[:, None]).astype(out_dtype)
    return dict(h=h, act=act)


def ragged_contract_reference(lhs, rhs, group_sizes, lhs_scale=None, rhs_scale=None, *, out_dtype, block_scaled,
                              quantize):
    del block_scaled  # the scales are None without it
    if quantize:
        # FP8_BLOCKWISE quantizing of both sides first, in groups of rows restarting at each expert.
        (lhs, lhs_scale, _), (rhs, rhs_scale, _) = (
            ragged.quantize_ragged_rows(side, group_sizes, FP8_BLOCKWISE.activations) for side in (lhs, rhs))
    if lhs_scale is not None:
        # FP8_BLOCKWISE operands: dequantized to float32, each row by its group's scales.
        row_group = ragged.row_groups(group_sizes, lhs.shape[0], FP8_BLOCKWISE.activations.block[1])
        lhs = ragged.dequantize_ragged_rows(ragged.RaggedQuantized(lhs, lhs_scale, row_group))
        rhs = ragged.dequantize_ragged_rows(ragged.RaggedQuantized(rhs, rhs_scale, row_group))
    sizes = groups.clamped_group_sizes(group_sizes, lhs.shape[0])
    return dict(out=per_expert_outer(lhs, rhs, sizes).astype(out_dtype))


def _expert_row_masks(sizes: jax.Array, num_rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(rows (m, 1), first row (E,), end row (E,)) of every expert, from clamped sizes."""
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    rows = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    return rows, ends - sizes, ends


def expert_rows_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """Row i of expert e is lhs[i] @ rhs[e]: (m, k), (E, k, n) -> (m, n) float32.

    `sizes` must already be clamped. Rows owned by no expert are 0.

    Expert by expert, a dense product of which only the expert's rows are kept, by a
    select: lax.ragged_dot multiplies by a 0/1 mask on the CPU, and 0 * NaN = NaN would
    carry a NaN or Inf of one expert's weights into every row. Each expert's product is
    one dense GEMM and the rows are selected, never added, so the result is bitwise
    reproducible; the scan keeps a single (m, n) product live however many experts.
    """
    rows, starts, ends = _expert_row_masks(sizes, lhs.shape[0])

    def keep_expert_rows(out, expert):
        weight, start, end = expert
        product = jnp.matmul(lhs, weight, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        return jnp.where((rows >= start) & (rows < end), product, out), None

    # Inside shard_map the carry must vary over the mesh axes its updates vary over.
    out = jax_internals.vary_alike([jnp.zeros((lhs.shape[0], rhs.shape[2]), jnp.float32), lhs, rhs, sizes])[0]
    return lax.scan(keep_expert_rows, out, (rhs, starts, ends))[0]


def per_expert_outer(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """sum over each expert's rows of lhs[i]^T rhs[i]: (m, a), (m, b) -> (E, a, b) float32.

    `sizes` must already be clamped. A dot per expert over the expert's own rows, both
    operands' other rows replaced by 0 with a select (so a NaN elsewhere never meets a
    0 * NaN), never a scatter-add: its order is fixed.
    """
    rows, starts, ends = _expert_row_masks(sizes, lhs.shape[0])

    def expert_sum(_, expert):
        start, end = expert
        in_expert = (rows >= start) & (rows < end)
        own_lhs, own_rhs = (jnp.where(in_expert, x, jnp.zeros((), x.dtype)) for x in (lhs, rhs))
        product = lax.dot_general(
            own_lhs, own_rhs, (((0,), (0,)), ((), ())),
            precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        )
        return None, product

    return lax.scan(expert_sum, None, (starts, ends))[1]


def gather_sum_reference(rows: jax.Array, index: jax.Array) -> dict[str, jax.Array]:
    """out[t] = rows[index[t, 0]] + rows[index[t, 1]] + ... in float32, slot by slot:
    (m, n), (T, k) int32 -> (T, n) float32.

    The slots are added by an explicit loop, one elementwise add after another, so the
    order is written in the program rather than left to a reduction whose order XLA
    picks. Indices are clamped into [0, m).
    """
    num_tokens, top_k = index.shape
    slot_rows = [jnp.take(rows, index[:, s], axis=0, mode="clip").astype(jnp.float32) for s in range(top_k)]
    if not slot_rows:
        return dict(out=jnp.zeros((num_tokens, rows.shape[1]), jnp.float32))
    total = slot_rows[0]
    for row in slot_rows[1:]:
        total = total + row
    return dict(out=total)
