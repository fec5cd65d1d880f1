"""Each kernel of a moe_mlp step against its roofline, from rates measured in the same run.

A kernel's roofline is max(its FLOPs at the dense cuBLAS rate, its bytes at a device copy's rate): what bench_layer's
cublas_dense (cublas_fp8 for the FP8 step) reaches on the step's six GEMMs, and what an elementwise kernel reading and
writing a large bf16 array reaches (`copy_rate`), both timed in the kernels' run. Bytes: every operand read and every
output written once, all E experts' weights, at the rows the experts own (m less the rows token rounding cut). FLOPs:
2 m d f a GEMM. FP8_BLOCKWISE, the design's floor: e4m3 operands, a float32 scale per 128 along K; h, y, dx, dW bf16;
up writes act quantized (today h alone, act by the rows' pass); dsrelu writes dh along f and, like act, along the rows;
x, dy (both ways) and the weights (two layouts) are quantized by no GEMM: those bytes, at the copy's rate, are in the floor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import harness

BF16, F32 = 2, 4
# A copy this large runs at the device's streaming rate (launch and tail effects < 1%).
COPY_BYTES = 1 << 30
STEPS = {"roofline": ("sm90", "cublas_dense", BF16), "roofline_fp8": ("sm90_fp8", "cublas_fp8", 1)}  # ours, dense, element


def step_bytes(m: int, d: int, f: int, num_experts: int, element: int = BF16) -> dict[str, float]:
    """The least bytes each kernel of the step moves, by GEMM, its operands `element` bytes a value (module docstring)."""
    weight, value, fp8 = num_experts * d * f, element + (F32 / 128 if element == 1 else 0), element == 1
    weights_in, weights_out = weight * (element + (F32 / 128**2 if fp8 else 0)), BF16 * weight
    rows_d, rows_f, out_d, out_f = value * m * d, value * m * f, BF16 * m * d, BF16 * m * f
    return {"up": rows_d + weights_in + F32 * m + F32 * num_experts * f + out_f + rows_f,  # x, w1, prob, b1 -> h, act
            "down/dx": rows_f + weights_in + out_d,  # act, w2 -> y (dh, w1 -> dx)
            # dy, w2, h, prob -> dh (FP8: both ways), act, dprob, dbias
            "dsrelu": rows_d + weights_in + out_f + 2 * F32 * m + (3 if fp8 else 2) * rows_f + F32 * num_experts * f,
            "dw1/dw2": rows_d + rows_f + weights_out,  # x, dh -> dw1 (act, dy -> dw2)
            "quantize": 2 * (out_d + 2 * rows_d) + 2 * (BF16 * weight + 2 * weights_in) if fp8 else 0}


def gemm_of_launches(kernels: list[list]) -> list[tuple[str, float]]:
    """(GEMM, ms) of each of our kernels' launches in a step, in launch order. Every other GEMM
    reads what up writes, so it is the first ragged-M launch; down and dx, like the two
    contractions, move the same bytes, so which is which does not matter (XLA orders them freely)."""
    ragged, launches = iter(("up", "down/dx", "down/dx")), []
    for name, ms in kernels:
        gemm = (next(ragged, None) or name) if "RaggedGemmSm90" in name else "dsrelu" if "DsreluSm90" in name else (
            "dw1/dw2" if "ContractSm90" in name else None)
        if gemm == name:
            raise ValueError(f"a step launches three ragged-M GEMMs, got a fourth: {name}")
        launches += [(gemm, ms)] if gemm else []
    return launches


def copy_rate(clock: str, reps: int, size: int = COPY_BYTES) -> dict:
    """A device copy's rate: one elementwise kernel reading and writing a bf16 array."""
    source = jnp.ones((size // BF16,), jnp.bfloat16)
    entry, _ = harness.measure(jax.jit(lambda a: -a), (source,), reps, clock)
    if "ms" in entry:
        entry.update(bytes=2 * size, tb_per_s=2 * size / (entry["ms"] * 1e-3) / 1e12)
    return entry


def roofline(shape, owned: int, step: dict, copy: dict, ours="sm90", dense="cublas_dense", element=BF16) -> dict:
    """Our step's kernels (variant `ours` of `step`, the row's step mode) against their rooflines, the rate of
    `dense` setting the FLOPs' floor, or why none. The step's floor: its six GEMMs' and, in FP8, the quantizing."""
    m, d, f, num_experts = shape
    ours_ms, dense_ms = (step["variants"].get(name, {}).get("ms") for name in (ours, dense))
    if ours_ms is None or dense_ms is None or "tb_per_s" not in copy:
        return {"unavailable": f"needs {ours}, {dense} and the copy rate timed in this run"}
    gemm_rate, byte_rate = 12.0 * m * d * f / (dense_ms * 1e-3), copy["tb_per_s"] * 1e12  # cuBLAS computes every row
    flops, bytes_of = 2.0 * owned * d * f, step_bytes(owned, d, f, num_experts, element)
    floor_ms = {gemm: 1e3 * max(flops * (gemm != "quantize") / gemm_rate, moved / byte_rate) for gemm, moved in bytes_of.items()}
    kernels = [dict(gemm=gemm, ms=ms, flops=flops, bytes=bytes_of[gemm], roofline_ms=floor_ms[gemm], ratio=ms / floor_ms[gemm],
                    bound="bytes" if bytes_of[gemm] / byte_rate > flops / gemm_rate else "flops")
               for gemm, ms in gemm_of_launches(step["variants"][ours]["kernels"])]
    floor = floor_ms["up"] + floor_ms["dsrelu"] + 2 * floor_ms["down/dx"] + 2 * floor_ms["dw1/dw2"] + floor_ms["quantize"]
    outside = ours_ms - sum(k["ms"] for k in kernels)  # time in kernels of no GEMM: XLA's fusions, the quantizing
    return dict(dense_tflops=gemm_rate / 1e12, copy_tb_per_s=copy["tb_per_s"], kernels=kernels, step=dict(
        ms=ours_ms, roofline_ms=floor, ratio=ours_ms / floor, outside_gemms_ms=outside, quantize_roofline_ms=floor_ms["quantize"]))
