"""Block-scaled 8-bit operands: one schema (`schema.py`) for MXFP8 (`mx.py`) and the
blockwise FP8 recipe (`blockwise.py`), and that recipe's GEMM as plain arithmetic
(`emulation.py`); its groups along each expert's rows (`ragged.py`), and its operands
quantized and dequantized as the expert MLP's XLA path reads them (`qdq.py`).

`FP8_BLOCKWISE` is the value of the layers' `precision` option that runs the recipe
(docs/fp8.md).
"""

from jax_dsrelu.quantization.schema import FP8_BLOCKWISE, MXFP8, BlockScaling, Recipe

__all__ = ["FP8_BLOCKWISE", "MXFP8", "BlockScaling", "Recipe"]
