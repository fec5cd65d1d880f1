"""The blockwise FP8 GEMM as arithmetic any backend runs: the oracle of the FP8 kernels.

    out[m, n] = sum over K blocks b of  (sum over k in b of a[m, k] * w[k, n])
                                        * (a_scale[m, b] * w_scale[b, n // P])

with P = the recipe's promotion interval (its K block): each block's partial sum of e4m3
products is formed in float32 (the products are exact there: two 4-bit significands), then
multiplied by the product of its two scales, as a kernel promotes it, and added to the
float32 total, block after block. Hopper's FP8 tensor cores keep
about 14 bits while summing within a block; the float64 test's bound covers both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_dsrelu.quantization import stored
from jax_dsrelu.quantization.schema import Recipe


def blockwise_matmul(
    a: jax.Array,  # (M, K) e4m3, activations
    a_scales: jax.Array,  # (M, ceil(K / P)) float32
    w: jax.Array,  # (K, N) e4m3, weights
    w_scales: jax.Array,  # (ceil(K / P), ceil(N / P)) float32
    recipe: Recipe,
) -> jax.Array:  # (M, N) float32
    """a @ w on block-scaled operands, promoted every recipe.promotion of K (module doc)."""
    interval = recipe.promotion
    if recipe.activations.block != (1, interval) or recipe.weights.block != (interval, interval):
        raise ValueError(
            f"{recipe.name}: the emulation needs 1 x {interval} activation blocks and {interval} x {interval} "
            f"weight blocks, got {recipe.activations.block} and {recipe.weights.block}"
        )
    (m, k), n = a.shape, w.shape[1]
    if w.shape[0] != k:
        raise ValueError(f"w.shape[0] must be a.shape[1]={k}, got w.shape={w.shape}")
    for name, array in (("a", a), ("w", w)):
        if array.dtype != recipe.activations.element:
            raise TypeError(f"{name}.dtype must be {recipe.activations.element}, got {array.dtype}")
    blocks = -(-k // interval)
    for name, scales, expected in (("a_scales", a_scales, (m, blocks)), ("w_scales", w_scales, (blocks, -(-n // interval)))):
        if scales.shape != expected:
            raise ValueError(f"{name}.shape must be {expected} for a {a.shape} and w {w.shape}, got {scales.shape}")
    pad = blocks * interval - k
    a_blocks = jnp.pad(stored.to_float32(a), ((0, 0), (0, pad))).reshape(m, blocks, interval)
    w_blocks = jnp.pad(stored.to_float32(w), ((0, pad), (0, 0))).reshape(blocks, interval, n)
    partials = jnp.einsum("mbk,bkn->bmn", a_blocks, w_blocks, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    w_columns = jnp.repeat(w_scales, interval, axis=1)[:, :n]  # (blocks, N)
    scaled = partials * (a_scales.T[:, :, None] * w_columns[:, None, :])
    total = jnp.zeros((m, n), jnp.float32)
    for block in range(blocks):  # block after block, as the kernels promote
        total = total + scaled[block]
    return total
