"""The public operations and their custom VJPs: `grouped_gemm_dsrelu`, `moe_mlp`, `ragged_dot`."""
