"""The routed experts on another device: sent there, run, sent back and summed per token.

`exchanged_experts` is `block_experts.routed_experts` with an all-to-all on each side of
the experts, inside `jax.shard_map` over the expert axis. One device's tokens in, each
token's top_k expert outputs summed out:

    forward   sent[p]   = tokens[slot_token[p]]                 (D*C, l) send buffer, 0 where empty
              got       = all_to_all(sent)                      the rows for this device's experts
              h, y      = the experts on got, read in local-expert order through local_order
              back      = all_to_all(y in got's order)          the outputs, in the send buffer's order
              out[t]    = sum over slots s of back[token_slots[t, s]], in slot order, float32
    backward  dy        = all_to_all(dout[slot_token])          each row's gradient is its token's
              dh, dprob, db1, dw2, drows, dw1 = the experts' backward, reading got and dy through local_order
              dtokens[t] = sum over slots s of all_to_all(drows in got's order)[token_slots[t, s]]

What the backward keeps is what no device can make without another's help: the rows
received (got, (D*C, l) in w1.dtype, which dw1 reads), the pre-activation h (D*C, f), the
rows' weights and the indices; not the tokens, the send buffer, a sorted copy of the rows
or the outputs. With recompute=True it keeps the tokens (T, l) instead of got and h, and
the backward makes both again, the same bits: one more exchange of the rows and one more
up-projection, for residuals whose D*C part (dropless, D times the rows routed) is the
slots' indices, weights and flags, about 21 bytes a slot, not rows of width l + f.

A dropped row (token_slots = D*C) reads an appended zero row: it adds nothing and gets no
gradient. Both sums over a token's slots are the ordered gather-and-sum, every other row
movement a gather, and all_to_all moves blocks in device order, so deterministic=True
makes every gradient bitwise reproducible, as on one device. A precision (an FP8 recipe)
is passed to the experts' forward and backward, as on one device.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu import jax_internals
from jax_dsrelu.kernels.registry import LayerBackends
from jax_dsrelu.ops import expert_mlp, quantized_expert_mlp
from jax_dsrelu.ops.expert_operands import Experts
from jax_dsrelu.primitives import sharding
from jax_dsrelu.primitives.gather_sum import gather_sum
from jax_dsrelu.quantization.schema import Recipe


class _Static(NamedTuple):
    """The custom VJP's static arguments (hashable)."""

    axis_name: str
    drops: bool
    recompute: bool
    deterministic: bool
    backends: LayerBackends
    tokens_dtype: np.dtype
    precision: Recipe | None


def exchanged_experts(
    tokens: jax.Array,  # (T, l) this device's tokens, the experts' input, any float dtype (cast to w1.dtype)
    w1: jax.Array,  # (E_local, l, f) this device's experts
    w2: jax.Array,  # (E_local, f, l)
    b1: jax.Array | None,  # (E_local, f)
    prob: jax.Array,  # (D*C,) routing weight of each received row, in local-expert order
    group_sizes: jax.Array,  # (E_local,) int32 received rows of each local expert
    local_order: jax.Array,  # (D*C,) int32 received row at each local-expert-sorted position
    local_inverse: jax.Array,  # (D*C,) int32 local-expert-sorted position of each received row
    slot_token: jax.Array,  # (D*C,) int32 token of each send slot
    slot_full: jax.Array,  # (D*C,) bool whether the send slot holds a row
    token_slots: jax.Array,  # (T, top_k) int32 send slots of each token in slot order; D*C where dropped
    *,
    axis_name: str,
    drops: bool,  # whether token_slots may name D*C (a capacity is set)
    recompute: bool,  # the backward exchanges the tokens again and remakes h, instead of keeping got and h
    deterministic: bool,
    backends: LayerBackends,
    precision: Recipe | None,  # None, or the FP8 recipe the experts' GEMMs read their operands by
    quantized=None,  # with a precision: this device's w1 and w2 quantized already (QuantizedExpertWeights)
) -> jax.Array:  # (T, l) float32
    """out[t] = sum over token t's sent slots s of prob * relu(tokens[t] @ w1[e] + b1[e])**2 @ w2[e],
    e the slot's expert on the device it was sent to. Arguments are the caller's to have
    checked (`moe_layer_expert_parallel`), under shard_map over axis_name."""
    tokens, w1, w2, prob, b1 = jax_internals.vary_alike([tokens, w1, w2, prob, b1])
    static = _Static(axis_name, drops, recompute, deterministic, backends, np.dtype(tokens.dtype), precision)
    return _exchanged(static, tokens, w1, w2, b1, prob, group_sizes, local_order, local_inverse, slot_token,
                      slot_full, token_slots, quantized)


def _exchange(a, axis_name):
    return lax.all_to_all(a, axis_name, 0, 0, tiled=True)


def _send(rows, slot_token, slot_full, axis_name):
    """(T, l) -> (D*C, l): each send slot's token row, 0 in empty slots, exchanged."""
    sent = jnp.where(slot_full[:, None], jnp.take(rows, slot_token, axis=0), jnp.zeros((), rows.dtype))
    return _exchange(sent, axis_name)


def _sum_back(rows, local_inverse, token_slots, drops, axis_name, backend):
    """(D*C, l) in local-expert order -> (T, l) float32: sent back, each token's slots summed."""
    back = _exchange(jnp.take(rows, local_inverse, axis=0), axis_name)
    if drops:
        back = jnp.concatenate([back, jnp.zeros((1, back.shape[1]), back.dtype)])
    return gather_sum(back, token_slots, backend=backend)


def _received(static, tokens, w1, w2, b1, prob, group_sizes, local_order, slot_token, slot_full) -> Experts:
    """The experts on the rows this device receives, read in local-expert order."""
    got = _send(tokens.astype(w1.dtype), slot_token, slot_full, static.axis_name)
    return Experts(got, w1, w2, prob, group_sizes, b1, local_order)


def _forward(static, tokens, w1, w2, b1, prob, group_sizes, local_order, local_inverse, slot_token, slot_full,
             token_slots, quantized):
    experts = _received(static, tokens, w1, w2, b1, prob, group_sizes, local_order, slot_token, slot_full)
    y, h = expert_mlp.forward(static.backends, experts, static.precision, quantized)
    out = _sum_back(y, local_inverse, token_slots, static.drops, static.axis_name, static.backends.gather_sum)
    return out, (experts.rows, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchanged(static, tokens, *rest):
    return _forward(static, tokens, *rest)[0]


def _exchanged_fwd(static, tokens, w1, w2, b1, prob, group_sizes, local_order, local_inverse, slot_token,
                   slot_full, token_slots, quantized):
    out, (got, h) = _forward(static, tokens, w1, w2, b1, prob, group_sizes, local_order, local_inverse,
                             slot_token, slot_full, token_slots, quantized)
    # Either the tokens or the rows received and their h: never both.
    kept = (tokens,) if static.recompute else (got, h)
    return out, (kept, w1, w2, b1, prob, group_sizes, local_order, local_inverse, slot_token,
                 slot_full, token_slots, quantized)


def _exchanged_bwd(static, residuals, dout):
    axis_name, drops, backends = static.axis_name, static.drops, static.backends
    (kept, w1, w2, b1, prob, group_sizes, local_order, local_inverse, slot_token, slot_full,
     token_slots, quantized) = residuals
    # Quantized once for every GEMM below that reads a weight (the remade h's included).
    quantized_here = quantized
    if static.precision is not None and quantized is None:
        quantized_here = quantized_expert_mlp.quantize_expert_weights(w1, w2, static.precision, backend=backends.matmul)
    if static.recompute:
        experts = _received(static, *kept, w1, w2, b1, prob, group_sizes, local_order, slot_token, slot_full)
        h = expert_mlp.preactivation(backends, experts, static.precision, quantized_here)
    else:
        got, h = kept
        experts = Experts(got, w1, w2, prob, group_sizes, b1, local_order)
    dy = _send(dout.astype(w1.dtype), slot_token, slot_full, axis_name)
    grads = expert_mlp.backward(static.deterministic, backends, experts, h, dy, dy_index=local_order,
                                precision=static.precision, quantized=quantized_here)
    summed = _sum_back(grads.rows, local_inverse, token_slots, drops, axis_name, backends.gather_sum)
    # Rounded to the rows' dtype first, as the gradient of rows cast from the tokens is.
    dtokens = summed.astype(w1.dtype).astype(static.tokens_dtype)
    dw1, dw2, dprob = (
        sharding.like_primal(cotangent, primal)
        for cotangent, primal in ((grads.w1, w1), (grads.w2, w2), (grads.prob, prob))
    )
    db1 = None if b1 is None else sharding.like_primal(grads.b1, b1)
    # The quantized weights are w1's and w2's: their gradients are w1's and w2's.
    return dtokens, dw1, dw2, db1, dprob, None, None, None, None, None, None, jax.tree.map(jnp.zeros_like, quantized)


_exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)
