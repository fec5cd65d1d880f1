"""A recipe's operands quantized and dequantized to float32: the three ways a GEMM of an
expert MLP step reads one.

    along_k(a)                  activations (rows, K), K the last axis: the recipe's
                                activation blocks (1 x 128 for FP8_BLOCKWISE)
    weights(w)                  weights (..., a, b): the recipe's weight blocks over the last
                                two axes (128 x 128); square blocks that start at 0 on both
                                axes are the same blocks read either way, so one result
                                serves a GEMM that reads w and one that reads it transposed
    along_expert_rows(a, sizes) activations (rows, n) whose K is the rows of each expert
                                (the weight gradients): the activation blocks along the
                                rows, restarting at each expert (`quantization.ragged`)

Each is quantize then dequantize: values the recipe's elements represent, times their
block's float32 scale, as float32 arrays that any float32 GEMM multiplies.
"""

from __future__ import annotations

import jax

from jax_dsrelu.quantization import blockwise, ragged
from jax_dsrelu.quantization.schema import Recipe


def along_k(a: jax.Array, recipe: Recipe) -> jax.Array:
    """(..., rows, K) -> float32, blocks of recipe.activations along K."""
    values, scales = blockwise.quantize_blockwise(a, recipe.activations)
    return blockwise.dequantize_blockwise(values, scales, recipe.activations)


def weights(w: jax.Array, recipe: Recipe) -> jax.Array:
    """(..., a, b) -> float32, blocks of recipe.weights over the last two axes."""
    values, scales = blockwise.quantize_blockwise(square_blocks(w, recipe), recipe.weights)
    return blockwise.dequantize_blockwise(values, scales, recipe.weights)


def square_blocks(w: jax.Array, recipe: Recipe) -> jax.Array:
    """w, once the recipe's weight blocks are known to be square (read either way alike)."""
    if recipe.weights.block[0] != recipe.weights.block[1]:
        raise ValueError(
            f"{recipe.name}: a weight read both ways needs square blocks, got {recipe.weights.block}"
        )
    return w


def along_expert_rows(a: jax.Array, group_sizes: jax.Array, recipe: Recipe) -> jax.Array:
    """(m, n) -> float32, blocks of recipe.activations along the rows, restarting at each
    expert's first row."""
    return ragged.dequantize_ragged_rows(ragged.quantize_ragged_rows(a, group_sizes, recipe.activations))
