"""The fused grouped GEMM + squared-ReLU backward on FP8_BLOCKWISE operands, for Hopper.

Math: the 16-bit fused kernel's (`dsrelu_kernel.py`), with its accumulator

    acc[i, j] = sum over b of (grad[i, b] . weight[e(i)][j, b]) * grad_block_scale[i, b]
                                                                * weight_block_scale[e(i), j // 128, b]

each 128-deep K block's partial sum of e4m3 products promoted to float32 and scaled
(`promoted_mainloop.py`, `block_scaled.py`). grad (m, k) and weight (E, n, k) e4m3, both
K-major (weight as stored: w2 (E, f, d) for dy w2^T); preact 16-bit; dh and act 16-bit,
as the FP8 step stores them for the next GEMMs to quantize, or float32 (docs/fp8.md).
Both warpgroups multiply every tile (the 16-bit kernel's idle-warpgroup switch is not
taken).

Constraints (`config.cannot_implement`): e4m3 operands, n and k multiples of 16,
1 <= E <= 512, fewer than 2^30 rows.
"""

from __future__ import annotations

from jax_dsrelu.kernels.sm90.block_scaled import BlockScaledMainloop
from jax_dsrelu.kernels.sm90.dsrelu_kernel import GroupedGemmDsreluSm90


class BlockScaledDsreluSm90(BlockScaledMainloop, GroupedGemmDsreluSm90):
    """The 16-bit fused kernel's epilogue over a promoted FP8 mainloop."""

    promotion_by_column_halves = True

    a_scale = "grad_block_scale"
    b_scale = "weight_block_scale"
    scaled_flag = "blockwise_scaled"
