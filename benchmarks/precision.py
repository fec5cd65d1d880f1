"""How each benchmark variant computes, stated in its record ("precision") and beside its times.

A record older than that field gets `SAME_SINCE_WRITTEN`: the variants that computed alike in
every version of their script (not the layer's and block's GEMM baselines, once float32 out).
"""

from __future__ import annotations

BF16_GEMM = "bf16 operands and outputs, float32 accumulation"
BY_BENCHMARK = {
    "bench_gemms": {
        "sm90": f"{BF16_GEMM} (dW in the record's contract_out_dtype)", "sm90_det": "as sm90",
        "xla": "bf16 operands, float32 accumulation (preferred_element_type), rounded to bf16",
        "pallas": f"{BF16_GEMM}; up and dsrelu add their epilogue in XLA in float32",
        "cublas_dense": f"{BF16_GEMM}: XLA's dot on bf16 with no preferred type, one GEMM of the same FLOPs",
        "cublas_batched": "as cublas_dense, batched over E equal batches", "quack": BF16_GEMM,
    },
    "bench_layer": {
        "xla": f"{BF16_GEMM} and epilogue (the library's XLA backend)",
        "sm90": f"{BF16_GEMM} and epilogue", "sm90_det": "as sm90",
        "pallas": f"GEMMs {BF16_GEMM} (Pallas); epilogue, dprob and db1 in XLA in float32",
        "dense_mlp": f"{BF16_GEMM} in both directions: jnp.dot on bf16 with preferred_element_type=bf16, "
                     "gradients by autodiff",
        "batched_mlp": "as dense_mlp, jnp.einsum over E equal batches",
        "cublas_dense": f"{BF16_GEMM}, each GEMM on cuBLAS (Triton GEMM fusion off)",
        "cublas_batched": "as cublas_dense, batched over E equal batches",
        "sm90_fp8_det": "as sm90_fp8", "sm90_fp8_rows": "as sm90_fp8", "sm90_fp8_weights": "as sm90_fp8", "sm90_fp8_reused": "as sm90_fp8, the weights' FP8 copies made before the step, untimed",
        "xla_fp8": "FP8_BLOCKWISE e4m3 operands and float32 scales, dequantized, float32 GEMMs", "sm90_fp8": "FP8_BLOCKWISE:"
        " e4m3, float32 scales, float32 promotion every 128 of K", "cublas_fp8": "dense e4m3, per-tensor scales (cuBLASLt)",
    },
    "bench_moe_block": {
        "auto": f"experts {BF16_GEMM} and epilogue; router float32", "auto_det": "as auto",
        "xla": "as auto, on the library's XLA backend", "xla_det": "as xla",
        "tokamax": f"experts {BF16_GEMM} (tokamax.ragged_dot), epilogue and combine float32; router float32",
        "gemms_cublas": f"{BF16_GEMM} in both directions, each GEMM on cuBLAS (Triton GEMM fusion off); the "
                        "router's GEMMs float32, as the block's",
        "gathered": "as auto, its GEMMs reading rows through the routing index, its ordered "
                    "gather-and-sums on the sm90 kernel", "gathered_det": "as gathered",
    },
    "bench_fp8_gemms": {"sm90": BF16_GEMM, "quantize": "bf16 rows to e4m3 and float32 scales (1 x 128)", "sm90_fp8":
                        "e4m3 operands, FP8_BLOCKWISE float32 scales, float32 promotion every 128 of K, bf16 out",
                        "sm90_fp8_between": "as sm90_fp8", "sm90_fp8_overlap": "as sm90_fp8", "sm90_fp8_pairs": "as sm90_fp8", "sm90_fp8_wide": "as sm90_fp8", "sm90_fp8_wide_halves": "as sm90_fp8", "sm90_fp8_whole": "as sm90_fp8",
                        "cublas_fp8": "e4m3, per-tensor float32 scales, bf16 out (XLA's dot, cuBLASLt)",
                        "torch_fp8": "as cublas_fp8 (torch._scaled_mm)", "cublas_bf16": BF16_GEMM},
}
SAME_SINCE_WRITTEN = {"bench_gemms": tuple(BY_BENCHMARK["bench_gemms"]), "bench_layer": ("xla", "sm90", "sm90_det", "pallas"),
                      "bench_moe_block": ("auto", "auto_det", "xla"), "bench_fp8_gemms": ("sm90", "sm90_fp8", "quantize", "cublas_fp8",
                                                                                     "torch_fp8", "cublas_bf16")}


def stated(benchmark: str, variants) -> dict[str, str]:
    """The precision a run of `benchmark` records for `variants`."""
    return {variant: BY_BENCHMARK[benchmark][variant] for variant in variants}


def of(benchmark: str, record: dict) -> dict[str, str]:
    """Each variant's precision as `record` states it, or, for a record older than the field, SAME_SINCE_WRITTEN's."""
    return record.get("precision") or stated(benchmark, SAME_SINCE_WRITTEN[benchmark])
