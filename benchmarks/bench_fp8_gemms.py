"""Times the FP8 ragged-M GEMMs against our bf16 ones and dense cuBLAS GEMMs of the same FLOPs.

At each layer shape (m, d, f, E), on one set of inputs: up (h = x W1[e] + b1[e], K = d, N = f;
act = srelu(h) beside it in bf16, h alone in FP8, as the layers run them) and down (act W2[e], K =
f, N = d, as dx = dh W1[e]^T), each by sm90 (ours, bf16), sm90_fp8 (ours on FP8_BLOCKWISE operands
quantized beforehand), sm90_fp8_between, _overlap, _pairs, _wide and _wide_halves (sm90_fp8 promoted
between the wgmma batches, beside the next block's, in CTA pairs along N sharing A by multicast, or over
192-column tiles between the batches or in column halves beside each other's),
quantize (quantize_blockwise of the rows, which the step pays where no epilogue writes them
quantized), cublas_bf16, cublas_fp8 (XLA's dot of scaled e4m3 operands, which its GEMM rewriter
hands cuBLASLt: `hlo_fp8_call` says whether the compiled HLO holds that call) and torch_fp8
(torch._scaled_mm); precision.py states each. sm90_fp8 is checked against the XLA backend's
product of the dequantized operands (normwise 2^-7; tests/test_sm90_fp8.py bounds it elementwise).

    python benchmarks/bench_fp8_gemms.py --commit $(git rev-parse --short HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_fp8_gemms.py --prebuild
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import harness
import precision
import run_record
import timing
from harness import BF16, group_sizes_for
from jax_dsrelu.kernels.request import RaggedMatmulRequest
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu
from jax_dsrelu.quantization.blockwise import quantize_blockwise
from jax_dsrelu.quantization.schema import E4M3, FP8_BLOCKWISE

VARIANTS = ("sm90", "sm90_fp8", "sm90_fp8_between", "sm90_fp8_overlap", "sm90_fp8_pairs", "sm90_fp8_wide", "sm90_fp8_wide_halves", "sm90_fp8_whole", "quantize", "cublas_bf16", "cublas_fp8", "torch_fp8")
GEMMS = ("up", "down")
SHAPES = [(16384, 4096, 2048, 8), (49152, 2688, 1856, 128), (65536, 2048, 768, 256)]
TOLERANCE = 2.0**-7
ACT, WEIGHT = FP8_BLOCKWISE.activations, FP8_BLOCKWISE.weights


def operands(m, k, n, num_experts, seed, grouping):
    keys = jax.random.split(jax.random.key(seed), 4)
    rows = jax.random.normal(keys[0], (m, k), jnp.float32).astype(BF16)
    weight_nk = (jax.random.normal(keys[1], (num_experts, n, k), jnp.float32) / np.sqrt(k)).astype(BF16)
    lhs, lhs_scale = jax.jit(quantize_blockwise, static_argnums=1)(rows, ACT)
    rhs, rhs_scale = jax.jit(quantize_blockwise, static_argnums=1)(weight_nk, WEIGHT)
    return dict(rows=rows, weight_kn=jnp.swapaxes(weight_nk, 1, 2), lhs=lhs, lhs_scale=lhs_scale, rhs=rhs,
                rhs_scale=rhs_scale, prob=jax.random.uniform(keys[2], (m,), jnp.float32, 0.05, 1.0),
                bias=0.1 * jax.random.normal(keys[3], (num_experts, n), jnp.float32),
                group_sizes=jnp.asarray(group_sizes_for(grouping, m, num_experts, seed)), dense_bf16=weight_nk[0].T,
                dense_fp8=rhs[0], dense_scale=jnp.max(rhs_scale[0]), lhs_scale_max=jnp.max(lhs_scale))


def dequantized_product(lhs, lhs_scale, rhs, rhs_scale, sizes, with_bias, bias):
    """The library's XLA backend's float32 product of the values the quantized operands
    represent (+ b1[e] for up): a dense GEMM per expert, never an (m, E, n) intermediate."""
    out = ragged_matmul(lhs, rhs, sizes, rhs_layout="nk", out_dtype=jnp.float32, backend="xla", lhs_scale=lhs_scale,
                        rhs_scale=rhs_scale)
    return out + harness.bias_rows(bias, sizes, lhs.shape[0]) if with_bias else out


def checked_against(reference, outputs):
    error = float(harness.relative_error(outputs, reference))
    return dict(relative_error=error), error <= TOLERANCE


def gemm_functions(gemm):
    """{variant: (fn, argument names)} for `gemm`."""
    srelu = gemm == "up"

    def ours(lhs, rhs, sizes, prob, bias, lhs_scale=None, rhs_scale=None, layout="kn"):
        kw = dict(rhs_layout=layout, out_dtype=BF16, backend="sm90", lhs_scale=lhs_scale, rhs_scale=rhs_scale)
        # The FP8 layer's up-projection stores h alone, the bf16 layer's act beside it.
        return ragged_matmul_srelu(lhs, rhs, sizes, prob, bias, with_act=lhs_scale is None, **kw)[0] if srelu \
            else ragged_matmul(lhs, rhs, sizes, **kw)

    def cublas_fp8(a, b, a_scale, b_scale):
        up = lambda x, s: x.astype(BF16) * s.astype(BF16)  # noqa: E731
        return lax.dot_general(up(a, a_scale), up(b, b_scale), (((1,), (1,)), ((), ())), preferred_element_type=BF16)

    def configured(**fields):
        """sm90_fp8's GEMM at 128 columns with the configuration's `fields` as named, then as many stages as fit."""
        def run(lhs, rhs, sizes, prob, bias, lhs_scale, rhs_scale):
            from jax_dsrelu.kernels.sm90 import config, ragged_call  # CuTe DSL: the 'gpu' extra

            request = RaggedMatmulRequest(num_experts=rhs.shape[0], k=lhs.shape[1], n=rhs.shape[1], rhs_layout="nk", operand_dtype=E4M3,
                                          out_dtype=BF16, block_scaled=True, epilogue="srelu" if srelu else "none", with_bias=srelu, with_act=not srelu)
            chosen, asked = ragged_call.choose_config(request), {"tile_n": config.fp8_tile_n(request.n), "whole_tile_store": False, **fields}  # 128 columns, whichever width the rules take
            stores = asked["tile_n"] // chosen.epi_n if asked.get("whole_tile_store") else 2  # whole_tile_store: a buffer per subtile
            chosen = config.with_most_gemm_stages(dataclasses.replace(chosen, store_stages=stores, **asked), request)
            named = dict(lhs=lhs, rhs=rhs, group_sizes=sizes, lhs_scale=lhs_scale, rhs_scale=rhs_scale, **(dict(prob=prob, bias=bias) if srelu else {}))
            return ragged_call.implementation(request, chosen)(**named)["h" if srelu else "out"]
        return run
    fp8_names = ("lhs", "rhs", "group_sizes", "prob", "bias", "lhs_scale", "rhs_scale")
    return {"sm90": (ours, ("rows", "weight_kn", "group_sizes", "prob", "bias")),
        "sm90_fp8": (lambda *a: ours(*a, layout="nk"), fp8_names), "sm90_fp8_pairs": (configured(cluster_n=2), fp8_names),
        "sm90_fp8_between": (configured(overlap_promotion=False), fp8_names), "sm90_fp8_overlap": (configured(overlap_promotion=True), fp8_names),
        "sm90_fp8_wide": (configured(tile_n=192, overlap_promotion=False), fp8_names), "sm90_fp8_wide_halves": (configured(tile_n=192, overlap_promotion=True), fp8_names),
        "sm90_fp8_whole": (configured(whole_tile_store=True), fp8_names),
        "quantize": (lambda rows: quantize_blockwise(rows, ACT), ("rows",)), "cublas_bf16": (lambda a, b: a @ b, ("rows", "dense_bf16")),
        "cublas_fp8": (cublas_fp8, ("lhs", "dense_fp8", "lhs_scale_max", "dense_scale")),
    }


def torch_fp8(t, reps, flops):
    """torch._scaled_mm's entry: the dense FP8 GEMM of the same FLOPs, per-tensor scales."""
    try:
        import torch

        a = torch.from_dlpack(t["lhs"].view(jnp.uint8)).view(torch.float8_e4m3fn)
        b = torch.from_dlpack(t["dense_fp8"].view(jnp.uint8)).view(torch.float8_e4m3fn).t()  # (K, N) column-major
        one = torch.ones((), dtype=torch.float32, device=a.device)
        entry = timing.time_launches(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                                     torch.cuda.synchronize, reps).record()
        return dict(entry, scaling="per-tensor float32 scales (cuBLASLt)", torch=torch.__version__,
                    tflops=timing.tflops(flops, entry["ms"]))
    except Exception as error:  # recorded; the other variants stand
        return run_record.error_entry(error, "torch")


def measure_row(options, shape, grouping, row, clock, save):
    m, d, f, num_experts = shape
    row["gemms"] = {}
    for gemm in options.gemms:
        k, n = (d, f) if gemm == "up" else (f, d)
        t = operands(m, k, n, num_experts, options.seed, grouping)
        flops = 2.0 * m * k * n
        entry = row["gemms"][gemm] = dict(flops=flops, variants={})
        reference = jax.jit(dequantized_product, static_argnums=5)(
            t["lhs"], t["lhs_scale"], t["rhs"], t["rhs_scale"], t["group_sizes"], gemm == "up", t["bias"])
        for variant, (fn, names) in gemm_functions(gemm).items():
            if variant not in options.variants:
                continue
            args, fp8 = tuple(t[name] for name in names), variant.startswith("sm90_fp8")
            result, _ = harness.measure(fn, args, options.reps, clock, compiler_options=harness.CUBLAS_ONLY, flops=flops,
                                        check=functools.partial(checked_against, reference) if fp8 else None)
            if variant == "cublas_fp8" and "error" not in result:
                hlo = jax.jit(fn, compiler_options=harness.CUBLAS_ONLY).lower(*args).compile().as_text()
                result["hlo_fp8_call"] = "f8e4m3" in hlo and "cublas" in hlo
            entry["variants"][variant] = result
            save()
        if "torch_fp8" in options.variants and clock == timing.CUPTI:
            entry["variants"]["torch_fp8"] = torch_fp8(t, options.reps, flops)
        times = {v: r["ms"] for v, r in entry["variants"].items() if "ms" in r}
        entry["ratios"] = {f"{a}/{b}": times[a] / times[b] for a, b in (
            ("sm90_fp8", "sm90"), ("sm90_fp8_overlap", "sm90_fp8_between"), ("sm90_fp8_pairs", "sm90_fp8"), ("sm90_fp8_wide", "sm90_fp8"), ("sm90_fp8_wide_halves", "sm90_fp8"), ("sm90_fp8_whole", "sm90_fp8_overlap"), ("sm90_fp8", "cublas_fp8"), ("sm90_fp8", "torch_fp8"),
            ("cublas_fp8", "cublas_bf16"), ("quantize", "sm90_fp8")) if a in times and b in times}
        save()


def plot(rows, path, title):
    panels = [(f"{gemm}: ms", [harness.row_title(r) for r in rows],
               {v: [r["gemms"].get(gemm, {}).get("variants", {}).get(v, {}).get("ms", 0.0) for r in rows] for v in VARIANTS})
              for gemm in GEMMS]
    harness.plot_bars(panels, path, title, "ms")


def main(argv=None):
    options = harness.parse(harness.parser(__doc__.splitlines()[0], reps=20, variants=VARIANTS,
                                           subsets={"gemms": GEMMS}), argv, SHAPES)
    if options.prebuild:  # our variants lowered at the operands' shapes, which builds their kernels
        for (m, d, f, num_experts), gemm in itertools.product(options.shapes, options.gemms):
            k, n = (d, f) if gemm == "up" else (f, d)
            shapes = jax.eval_shape(lambda: operands(m, k, n, num_experts, 0, "dirichlet"))
            for variant, (fn, names) in gemm_functions(gemm).items():
                if variant.startswith("sm90") and variant in options.variants:
                    harness.lower_for_cuda(f"{gemm} {variant} {(m, d, f, num_experts)}", fn, *(shapes[x] for x in names))
        return
    harness.run(options, functools.partial(measure_row, options), plot, "gemms", benchmark="bench_fp8_gemms",
                title="FP8 ragged-M GEMMs", tolerance=TOLERANCE, shapes_asked=[list(s) for s in options.shapes],
                precision=precision.stated("bench_fp8_gemms", options.variants))


if __name__ == "__main__":
    main()
