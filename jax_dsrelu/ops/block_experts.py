"""The MoE block's experts, keeping for the backward only what it cannot recompute.

`routed_experts`: tokens in, each token's top_k expert outputs summed out. It computes
what dispatch -> `moe_mlp` -> combine computes, with the expert MLP's own forward and
backward (`jax_dsrelu.ops.expert_mlp`), but reads the rows through the routing's indices
instead of taking them as a (T * top_k, l) array:

    forward   h, act = up-projection of tokens[row_token]    (the primitive gathers)
              y      = act @ w2
              out[t] = sum over slots s of y[inverse[t * top_k + s]], in slot order, float32
    backward  dy     = dout (T, l), read per row through row_token (the primitives gather)
              dh, dprob, db1, act = fused dsReLU kernel;   dw2 = act^T dy[row_token]
              drows  = dh @ w1^T;   dw1 = tokens[row_token]^T dh
              dtokens[t] = sum over slots s of drows[inverse[t * top_k + s]], in slot order

with row_token = order // top_k. The backward keeps the tokens (T, l), the pre-activation
h, the routing (order, inverse, the rows' weights, the group sizes) and the weights as
given: no row copy of the tokens, no copy of a weight, no copy of the tokens in another
dtype (the cast to w1.dtype is made again in the backward). Both sums over a token's
slots are the ordered gather-and-sum (`jax_dsrelu.primitives.gather_sum`): one writer
per output, a fixed order, no scatter-add, so they are bitwise reproducible.

`shared_expert`: one expert owning every token, on the same kernels, with its weights
given as the (d, fs) and (fs, d) matrices they are: the backward keeps x, its weights as
given and its pre-activation, and makes the expert axis and the unit weights again.

Both take the layer's precision (None, or an FP8 recipe) and pass it to the expert MLP's
forward and backward, which then read their operands quantized by the recipe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_dsrelu import jax_internals
from jax_dsrelu.kernels.registry import LayerBackends
from jax_dsrelu.ops import expert_mlp
from jax_dsrelu.ops.expert_operands import Experts
from jax_dsrelu.primitives import sharding
from jax_dsrelu.primitives.gather_sum import gather_sum
from jax_dsrelu.quantization.schema import Recipe


def routed_experts(
    tokens: jax.Array,  # (T, l) the experts' input, any float dtype (cast to w1.dtype)
    w1: jax.Array,  # (E, l, f)
    w2: jax.Array,  # (E, f, l)
    b1: jax.Array | None,  # (E, f)
    prob: jax.Array,  # (T * top_k,) routing weight of each expert-sorted row
    group_sizes: jax.Array,  # (E,) int32 rows of each expert
    order: jax.Array,  # (T * top_k,) int32 assignment t * top_k + s at each expert-sorted row
    inverse: jax.Array,  # (T * top_k,) int32 expert-sorted row of each assignment
    *,
    top_k: int,
    deterministic: bool,
    backends: LayerBackends,
    precision: Recipe | None,  # None, or the FP8 recipe the experts' GEMMs read their operands by
    quantized=None,  # with a precision: w1 and w2 quantized already (QuantizedExpertWeights)
) -> jax.Array:  # (T, l) float32
    """out[t] = sum over token t's slots s of prob * relu(tokens[t] @ w1[e] + b1[e])**2 @ w2[e]
    with e the slot's expert, as combine(moe_mlp(dispatch(tokens))) computes it, bit for
    bit. Arguments are the caller's to have checked (the MoE layer's)."""
    tokens, w1, w2, prob, b1 = jax_internals.vary_alike([tokens, w1, w2, prob, b1])
    return _routed((top_k, precision), deterministic, backends, tokens, w1, w2, b1, prob, group_sizes, order, inverse,
                   quantized)


def _slots(inverse, top_k):
    """(T * top_k,) -> (T, top_k): the expert-sorted rows of each token, in slot order."""
    return inverse.reshape(-1, top_k)


def _routed_forward(static, backends, tokens, w1, w2, b1, prob, group_sizes, order, inverse, quantized):
    top_k, precision = static
    experts = Experts(tokens.astype(w1.dtype), w1, w2, prob, group_sizes, b1, row_index=order // top_k)
    y, h = expert_mlp.forward(backends, experts, precision, quantized)
    return gather_sum(y, _slots(inverse, top_k), backend=backends.gather_sum), h


# static: (top_k, precision), the layer's facts that the steps need beside the backends.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _routed(static, deterministic, backends, tokens, w1, w2, b1, prob, group_sizes, order, inverse, quantized):
    del deterministic
    return _routed_forward(static, backends, tokens, w1, w2, b1, prob, group_sizes, order, inverse, quantized)[0]


def _routed_fwd(static, deterministic, backends, tokens, w1, w2, b1, prob, group_sizes, order, inverse, quantized):
    del deterministic
    out, h = _routed_forward(static, backends, tokens, w1, w2, b1, prob, group_sizes, order, inverse, quantized)
    return out, (tokens, w1, w2, b1, prob, group_sizes, order, inverse, h, quantized)


def _routed_bwd(static, deterministic, backends, residuals, dout):
    top_k, precision = static
    tokens, w1, w2, b1, prob, group_sizes, order, inverse, h, quantized = residuals
    row_token = order // top_k
    # Each row's gradient is its token's, in the rows' dtype: read through row_token.
    dy = dout.astype(w1.dtype)
    experts = Experts(tokens.astype(w1.dtype), w1, w2, prob, group_sizes, b1, row_index=row_token)
    grads = expert_mlp.backward(deterministic, backends, experts, h, dy, dy_index=row_token, precision=precision,
                                quantized=quantized)
    summed = gather_sum(grads.rows, _slots(inverse, top_k), backend=backends.gather_sum)
    # Rounded to the rows' dtype first, as the gradient of rows cast from the tokens is.
    dtokens = summed.astype(w1.dtype).astype(tokens.dtype)
    dtokens, dw1, dw2, dprob = (
        sharding.like_primal(cotangent, primal)
        for cotangent, primal in ((dtokens, tokens), (grads.w1, w1), (grads.w2, w2), (grads.prob, prob))
    )
    db1 = None if b1 is None else sharding.like_primal(grads.b1, b1)
    # The quantized weights are w1's and w2's: their gradients are w1's and w2's.
    return dtokens, dw1, dw2, db1, dprob, None, None, None, jax.tree.map(jnp.zeros_like, quantized)


def shared_expert(
    x: jax.Array,  # (T, d) any float dtype (cast to w1.dtype)
    w1: jax.Array,  # (d, fs)
    w2: jax.Array,  # (fs, d)
    *,
    deterministic: bool,
    backends: LayerBackends,
    precision: Recipe | None,  # None, or the FP8 recipe the experts' GEMMs read their operands by
) -> jax.Array:  # (T, d) in w1.dtype
    """relu(x @ w1)**2 @ w2 on every token: `moe_mlp` with one expert owning all T rows
    with weight 1, bit for bit."""
    x, w1, w2 = jax_internals.vary_alike([x, w1, w2])
    return _shared(deterministic, backends, precision, x, w1, w2)


def _one_expert(x, w1, w2) -> Experts:
    """moe_mlp's operands for one expert owning every row with weight 1, no bias."""
    num_tokens = x.shape[0]
    return Experts(x.astype(w1.dtype), w1[None], w2[None], jnp.ones((num_tokens,), jnp.float32),
                   jnp.full((1,), num_tokens, jnp.int32), None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _shared(deterministic, backends, precision, x, w1, w2):
    del deterministic
    return expert_mlp.forward(backends, _one_expert(x, w1, w2), precision)[0]


def _shared_fwd(deterministic, backends, precision, x, w1, w2):
    del deterministic
    y, h = expert_mlp.forward(backends, _one_expert(x, w1, w2), precision)
    return y, (x, w1, w2, h)


def _shared_bwd(deterministic, backends, precision, residuals, dy):
    x, w1, w2, h = residuals
    grads = expert_mlp.backward(deterministic, backends, _one_expert(x, w1, w2), h, dy.astype(w1.dtype),
                                precision=precision)
    dx = grads.rows.astype(x.dtype)
    return tuple(
        sharding.like_primal(cotangent, primal)
        for cotangent, primal in ((dx, x), (grads.w1[0], w1), (grads.w2[0], w2))
    )


_routed.defvjp(_routed_fwd, _routed_bwd)
_shared.defvjp(_shared_fwd, _shared_bwd)
