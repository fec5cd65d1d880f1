"""What the XLA path of a recipe reads quantized and dequantized, and a weight's blocks.

    along_expert_rows(a, sizes) activations (rows, n) whose K is the rows of each expert
                                (the weight gradients'): the activation blocks along the
                                rows, restarting at each expert (`quantization.ragged`),
                                dequantized to float32, as the block-scaled contraction's
                                XLA reference reads them
    square_blocks(w, recipe)    w, once the recipe's weight blocks are known to be square:
                                blocks that start at 0 on both axes are the same blocks
                                read either way, so one quantization of a weight serves a
                                GEMM that reads w and one that reads it transposed

The GEMMs of `jax_dsrelu.ops.quantized_expert_mlp` take their operands quantized (values
and scales) and dequantize them in their XLA references.
"""

from __future__ import annotations

import jax

from jax_dsrelu.quantization import ragged
from jax_dsrelu.quantization.schema import Recipe


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
