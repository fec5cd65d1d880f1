"""How a tensor is block-scaled: one schema for every 8-bit recipe the library knows.

A `BlockScaling` cuts the last two axes of a tensor (rows, K) into blocks of
`block` = (rows, columns) elements that share one scale, and says how that scale is made:

    "power_of_two"  OCP MX v1.0: 2^(floor(log2 amax) - emax_elem), stored as float8_e8m0fnu
                    (`jax_dsrelu.quantization.mx`)
    "amax"          amax / (the element's largest normal), stored as float32
                    (`jax_dsrelu.quantization.blockwise`)

The recipes:

    MXFP8                  Blackwell's block scaling (through cuDNN): 1 x 32 blocks along K
                           of either operand, e4m3 elements, power-of-two scales
    FP8_BLOCKWISE          DeepSeek-V3's fine-grained scaling for Hopper: activations in
                           1 x 128 blocks along K, weights in 128 x 128 blocks, e4m3
                           elements, float32 scales, partial sums promoted to float32
                           every 128 of K (the K block), since Hopper's FP8 accumulation
                           keeps only about 14 bits
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

SCALE_RULES = ("power_of_two", "amax")
E4M3 = np.dtype(jnp.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """Blocks of `block` = (rows, columns) over a tensor's last two axes (rows, K), each
    with one scale made by `rule` (module docstring); elements of `element`."""

    block: tuple[int, int]
    element: np.dtype = E4M3
    rule: str = "amax"

    def __post_init__(self) -> None:
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"block must be two positive ints (rows, columns), got block={self.block!r}")
        if self.rule not in SCALE_RULES:
            raise ValueError(f"rule must be one of {SCALE_RULES}, got rule={self.rule!r}")

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scales' shape for a tensor of `shape`: a partial last block along either
        axis has a scale of its own."""
        rows, cols = self.block
        return (*shape[:-2], -(-shape[-2] // rows), -(-shape[-1] // cols))


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A GEMM's block scaling: of its activations (rows, K) and of its weights (the last
    two axes as the kernels read them: (n, k) for MXFP8, (K, N) for FP8_BLOCKWISE, whose
    square blocks read alike either way), with partial sums promoted to float32 every
    `promotion` of K."""

    name: str
    activations: BlockScaling
    weights: BlockScaling
    promotion: int


MXFP8 = Recipe("MXFP8", BlockScaling((1, 32), E4M3, "power_of_two"), BlockScaling((1, 32), E4M3, "power_of_two"), 32)
FP8_BLOCKWISE = Recipe("FP8_BLOCKWISE", BlockScaling((1, 128)), BlockScaling((128, 128)), 128)
