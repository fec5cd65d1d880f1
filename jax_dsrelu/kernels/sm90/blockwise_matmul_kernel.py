"""The ragged-M grouped GEMM on FP8_BLOCKWISE operands, for Hopper (sm_90a), in CuTe DSL.

Math, with e(i) the expert owning row i and b the K blocks of 128:

    acc[i, j] = sum over b of (lhs[i, b] . rhs[e(i)][j, b]) * lhs_scale[i, b] * rhs_scale[e(i), j // 128, b]

each block's partial sum of e4m3 products formed by wgmma and promoted to float32 before
it is scaled and added, block after block (`promoted_mainloop.py`); then the epilogues of
the 16-bit kernel (`ragged_matmul_kernel.py`): out = acc, or h = acc (+ bias) and
act = relu(h)^2 prob, or h alone, rounded once to the 16-bit output. With the promotion
beside the next block's wgmma (config.overlap_promotion) or N tiles of 192 columns the
bias is loaded subtile by subtile: held from before the mainloop beside the partial sums,
it spills.

Operands: lhs (m, k) and rhs (E, n, k) e4m3, both K-major as Hopper's FP8 wgmma reads
them; lhs_scale (m, ceil(k / 128)) and rhs_scale (E, ceil(n / 128), ceil(k / 128))
float32, as `quantization.blockwise.quantize_blockwise` makes them (`block_scaled.py`).
A partial last K block is zero-filled by TMA past k, and its scale is its own.

N tiles of 192 columns (`config.WIDE_TILE_N`) span two N blocks of rhs, promoted
between the batches (`promoted_mainloop.mma_k_tiles_promoted`, given `wide`) or, with
config.overlap_promotion, in column halves of 96 (`mma_k_tiles_promoted_in_halves`, given
`wide`); the latter not with act stored beside h, whose epilogue state beside the two
half buffers spills (ptxas: 20 bytes).

Constraints (`config.cannot_implement_gemm`): rhs_layout "nk", n and k multiples of 16
(16-byte TMA rows), 16-bit outputs, 1 <= E <= 512, fewer than 2^30 rows.
"""

from __future__ import annotations

from jax_dsrelu.kernels.sm90.block_scaled import BlockScaledMainloop
from jax_dsrelu.kernels.sm90.config import BLOCK
from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90


class BlockScaledRaggedGemmSm90(BlockScaledMainloop, RaggedGemmSm90):
    """The 16-bit ragged-M GEMM's epilogues over a promoted FP8 mainloop."""

    a_scale = "lhs_scale"
    b_scale = "rhs_scale"
    scaled_flag = "block_scaled"
    wide_tiles = True

    def __init__(self, config, request):
        if config.tile_n > BLOCK and config.overlap_promotion and request.epilogue == "srelu" and request.with_act:
            raise ValueError(f"tile_n={config.tile_n} with overlap_promotion=True stores h alone or out (act beside h "
                             f"spills registers), got epilogue='srelu' with with_act=True")
        super().__init__(config, request)
        # A wide tile's bias (tile_n / 4 values a thread) held from before the mainloop
        # beside its partial sum would crowd the registers: loaded subtile by subtile.
        self.bias_per_subtile = self.with_bias and (config.overlap_promotion or config.tile_n > BLOCK)
