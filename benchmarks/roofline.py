"""Each kernel of a moe_mlp step against its roofline, from rates measured in the same run.

A kernel's roofline is max(its FLOPs at the dense bf16 cuBLAS rate, its bytes at a device copy's rate): what
bench_layer's cublas_dense variant reaches on the step's six GEMMs, and what an elementwise kernel reading and
writing one large bf16 array reaches (`copy_rate`), both timed in the run that times the kernels. Bytes are the
least each kernel must move: every operand read once and every output written once, all E experts' weights
included, at the rows the experts own (m, less the rows token rounding cut). FLOPs: 2 m d f per GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import harness

BF16, F32 = 2, 4
# A copy this large runs at the device's streaming rate (launch and tail effects < 1%).
COPY_BYTES = 1 << 30


def step_bytes(m: int, d: int, f: int, num_experts: int) -> dict[str, int]:
    """The least bytes each kernel of the step moves, by GEMM (module docstring)."""
    weights = BF16 * num_experts * d * f
    rows_d, rows_f = BF16 * m * d, BF16 * m * f
    return {
        "up": rows_d + weights + F32 * m + F32 * num_experts * f + 2 * rows_f,  # x, w1, prob, b1 -> h, act
        "down/dx": rows_f + weights + rows_d,  # act, w2 -> y (dh, w1 -> dx)
        "dsrelu": rows_d + weights + rows_f + 2 * F32 * m + 2 * rows_f + F32 * num_experts * f,  # dy, w2, h, prob -> dh, act, dprob, dbias
        "dw1/dw2": rows_d + rows_f + weights,  # x, dh -> dw1 (act, dy -> dw2)
    }


def gemm_of_launches(kernels: list[list]) -> list[tuple[str, float]]:
    """(GEMM, ms) of each of our kernels' launches in a step, in launch order. Every other GEMM
    reads what up writes, so it is the first ragged-M launch; down and dx, like the two
    contractions, move the same bytes, so which is which does not matter (XLA orders them freely)."""
    ragged = iter(("up", "down/dx", "down/dx"))
    launches = []
    for name, ms in kernels:
        if "RaggedGemmSm90" in name:
            if (gemm := next(ragged, None)) is None:
                raise ValueError(f"a step launches three ragged-M GEMMs, got a fourth: {name}")
            launches.append((gemm, ms))
        elif "DsreluSm90" in name or "ContractSm90" in name:
            launches.append(("dsrelu" if "DsreluSm90" in name else "dw1/dw2", ms))
    return launches


def copy_rate(clock: str, reps: int, size: int = COPY_BYTES) -> dict:
    """A device copy's rate: one elementwise kernel reading and writing a bf16 array."""
    source = jnp.ones((size // BF16,), jnp.bfloat16)
    entry, _ = harness.measure(jax.jit(lambda a: -a), (source,), reps, clock)
    if "ms" in entry:
        entry.update(bytes=2 * size, tb_per_s=2 * size / (entry["ms"] * 1e-3) / 1e12)
    return entry


def roofline(shape, owned: int, step: dict, copy: dict) -> dict:
    """The sm90 step's kernels (`step`: the row's step mode) against their rooflines, or why none."""
    m, d, f, num_experts = shape
    ours, dense = step["variants"].get("sm90", {}), step["variants"].get("cublas_dense", {})
    if "ms" not in ours or "ms" not in dense or "tb_per_s" not in copy:
        return {"unavailable": "needs sm90, cublas_dense and the copy rate timed in this run"}
    gemm_rate = 12.0 * m * d * f / (dense["ms"] * 1e-3)  # cuBLAS computes every row
    byte_rate = copy["tb_per_s"] * 1e12
    flops, bytes_of = 2.0 * owned * d * f, step_bytes(owned, d, f, num_experts)
    kernels = []
    for gemm, ms in gemm_of_launches(ours["kernels"]):
        moved = bytes_of.get(gemm, 0)
        floor_ms = 1e3 * max(flops / gemm_rate, moved / byte_rate)
        kernels.append(dict(gemm=gemm, ms=ms, flops=flops, bytes=moved, roofline_ms=floor_ms,
                            bound="bytes" if moved / byte_rate > flops / gemm_rate else "flops", ratio=ms / floor_ms))
    floor = sum(k["roofline_ms"] for k in kernels)
    return dict(dense_tflops=gemm_rate / 1e12, copy_tb_per_s=copy["tb_per_s"], kernels=kernels,
                step=dict(ms=ours["ms"], roofline_ms=floor, ratio=ours["ms"] / floor))
