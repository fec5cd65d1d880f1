"""Block-scaled 8-bit operands: one schema (`schema.py`) for MXFP8 (`mx.py`) and the
blockwise FP8 recipe (`blockwise.py`), and that recipe's GEMM as plain arithmetic
(`emulation.py`)."""
