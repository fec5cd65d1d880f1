"""Times the fused backward against its alternatives, side by side, on one GPU.

For each shape (m, k, n, E), with ragged Dirichlet group sizes and the same bf16 inputs
for every variant (with_dbias=True, with_act=True):

    xla            backend="xla": ragged_dot plus the epilogue in XLA
    pallas+xla     Pallas ragged_dot_mgpu for the GEMM (best of a few block configs),
                   the epilogue in XLA
    sm90           our kernel, deterministic=False
    sm90_det       our kernel, deterministic=True
    cublas_dense   jnp.dot of (m, k) by (k, n) in bf16: the same 2 m n k FLOPs, no groups

Each variant is timed with CUPTI (jax.experimental.mosaic.gpu.profiler.measure): the
summed duration of the kernels one call launches, median over --reps calls after a
warm-up. Every input is larger than the 50 MB L2, so repeated calls do not run from
cache. The kernel's outputs are checked against the XLA path before its time is recorded.

    python benchmarks/bench_dsrelu.py --commit $(git rev-parse HEAD) --out benchmarks/results
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/bench_dsrelu.py --prebuild   # no GPU

writes bench_dsrelu.json and bench_dsrelu.png there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

import jax_dsrelu
from jax_dsrelu import groups
from jax_dsrelu.primitives import reference

import run_record

SHAPES = [(16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
PALLAS_CONFIGS = [
    dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=2),
    dict(block_m=128, block_n=256, block_k=64, max_concurrent_steps=3, grid_block_n=1),
    dict(block_m=64, block_n=256, block_k=64, max_concurrent_steps=4, grid_block_n=2),
]


def dirichlet_sizes(rng, m, num_experts):
    sizes = np.floor(rng.dirichlet(np.ones(num_experts)) * m).astype(np.int64)
    sizes[np.argmax(sizes)] += m - sizes.sum()
    return sizes.astype(np.int32)


def make_inputs(m, k, n, num_experts, seed):
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 4)
    grad = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    weight = (jax.random.normal(keys[1], (num_experts, n, k), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    preact = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    prob = jax.random.uniform(keys[3], (m,), jnp.float32, 0.05, 1.0)
    sizes = jnp.asarray(dirichlet_sizes(rng, m, num_experts))
    return grad, weight, preact, prob, sizes


def fused(backend, deterministic=False):
    return jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
            *a, with_dbias=True, with_act=True, deterministic=deterministic, backend=backend
        )
    )


def pallas_then_xla(config):
    """Pallas' grouped GEMM, then the same epilogue in XLA (as jax_dsrelu.primitives.reference has it)."""

    @jax.jit
    def run(grad, weight, preact, prob, group_sizes):
        m = grad.shape[0]
        acc = ragged_dot_mgpu.ragged_dot(
            grad, weight, group_sizes=group_sizes, transpose_rhs=True, **config
        ).astype(jnp.float32)
        sizes = groups.clamped_group_sizes(group_sizes, m)
        expert, owned = groups.row_experts(group_sizes, m)
        r = jnp.maximum(preact.astype(jnp.float32), 0.0)
        p = prob[:, None]
        dh = jnp.where(owned[:, None], 2.0 * acc * r * p, 0.0)
        dprob = jnp.where(owned, jnp.sum(r * r * acc, axis=1), 0.0)
        dbias = reference.per_expert_outer(dh, jnp.ones((m, 1), jnp.float32), sizes)[:, :, 0]
        act = jnp.where(owned[:, None], r * r * p, 0.0)
        row_amax = jnp.max(jnp.abs(dh), axis=1)
        membership = (expert[None, :] == jnp.arange(weight.shape[0])[:, None]) & owned[None, :]
        amax = jnp.max(jnp.where(membership, row_amax[None, :], 0.0), axis=1)
        return dh.astype(jnp.bfloat16), dprob, dbias, act.astype(jnp.bfloat16), amax

    return run


def dense_gemm():
    return jax.jit(
        lambda grad, weight: jax.lax.dot_general(grad, weight[0], (((1,), (1,)), ((), ())))
    )


def cupti_ms(fn, args, reps):
    """Median CUPTI time of one call; wall-clock over a queue of calls where CUPTI fails."""
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    try:
        _, times = profiler.measure(fn, iterations=reps)(*args)
    except RuntimeError as error:
        print(f"CUPTI unavailable ({error}); timing {reps} queued calls by wall clock")
        times = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(reps):
                result = fn(*args)
            jax.block_until_ready(result)
            times.append((time.perf_counter() - start) * 1e3 / reps)
    return statistics.median(times), times


def kernel_breakdown(fn, args):
    _, per_kernel = profiler.measure(fn, aggregate=False)(*args)
    return [(name, ms) for name, ms in per_kernel]


def relative_error(ours, reference):
    ours = np.asarray(ours, np.float64)
    reference = np.asarray(reference, np.float64)
    return float(np.linalg.norm(ours - reference) / max(np.linalg.norm(reference), 1e-30))


def bench_shape(shape, reps, seed):
    m, k, n, num_experts = shape
    args = make_inputs(m, k, n, num_experts, seed)
    flops = 2.0 * m * n * k
    row = dict(shape=dict(m=m, k=k, n=n, E=num_experts), group_sizes=np.asarray(args[4]).tolist())
    times = {}

    reference = fused("xla")(*args)
    for name, backend, deterministic in (("sm90", "sm90", False), ("sm90_det", "sm90", True)):
        out = fused(backend, deterministic)(*args)
        errors = {
            field: relative_error(getattr(out, field), getattr(reference, field))
            for field in ("dh", "dprob", "dbias", "act", "amax")
        }
        row[f"{name}_relative_error_vs_xla"] = errors
        if max(errors.values()) > 2e-2:
            raise AssertionError(f"{name} disagrees with the XLA path at {shape}: {errors}")
        times[name], _ = cupti_ms(fused(backend, deterministic), args, reps)
        row[f"{name}_kernels"] = kernel_breakdown(fused(backend, deterministic), args)

    times["xla"], _ = cupti_ms(fused("xla"), args, max(5, reps // 4))

    best = None
    for config in PALLAS_CONFIGS:
        try:
            ms, _ = cupti_ms(pallas_then_xla(config), args, reps)
        except Exception as error:  # a block config that does not fit shared memory
            row.setdefault("pallas_failed_configs", []).append(dict(config=config, error=str(error)[:300]))
            continue
        row.setdefault("pallas_configs_ms", []).append(dict(config=config, ms=ms))
        if best is None or ms < best[0]:
            best = (ms, config)
    if best is not None:
        times["pallas+xla"] = best[0]
        row["pallas_best_config"] = best[1]

    times["cublas_dense"], _ = cupti_ms(dense_gemm(), (args[0], args[1]), reps)

    row["ms"] = times
    row["tflops"] = {name: flops / (ms * 1e-3) / 1e12 for name, ms in times.items()}
    row["ratios"] = {
        "sm90_vs_cublas_throughput": times["cublas_dense"] / times["sm90"],
        "sm90_det_vs_cublas_throughput": times["cublas_dense"] / times["sm90_det"],
        "det_overhead": times["sm90_det"] / times["sm90"] - 1.0,
        "speedup_vs_xla": times["xla"] / times["sm90"],
    }
    if "pallas+xla" in times:
        row["ratios"]["speedup_vs_pallas"] = times["pallas+xla"] / times["sm90"]
        row["ratios"]["det_speedup_vs_pallas"] = times["pallas+xla"] / times["sm90_det"]
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = ["xla", "pallas+xla", "sm90", "sm90_det", "cublas_dense"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.16
    for index, variant in enumerate(variants):
        values = [row["tflops"].get(variant, 0.0) for row in rows]
        ax.bar(np.arange(len(rows)) + (index - 2) * width, values, width, label=variant)
    ax.set_xticks(np.arange(len(rows)))
    ax.set_xticklabels([f"m={r['shape']['m']} k={r['shape']['k']}\nn={r['shape']['n']} E={r['shape']['E']}" for r in rows])
    ax.set_ylabel("TFLOP/s (2 m n k / time)")
    ax.set_title(f"grouped GEMM + dsReLU backward, bf16, {jax.devices()[0].device_kind}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def prebuild(shapes):
    """Lowers both sm90 variants at these shapes for cuda (builds and caches their kernels)."""
    import cuda_lowering

    cuda_lowering.prepare()
    for m, k, n, num_experts in shapes:
        described = (
            jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((num_experts, n, k), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((m,), jnp.float32),
            jax.ShapeDtypeStruct((num_experts,), jnp.int32),
        )
        for deterministic in (False, True):
            cuda_lowering.lower_for_cuda(
                f"bench_dsrelu {m, k, n, num_experts} deterministic={deterministic}",
                fused("sm90", deterministic), *described,
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--shapes", default=None, help="m,k,n,E;... (default: the three few-expert shapes)")
    parser.add_argument("--prebuild", action="store_true",
                        help="lower the sm90 variants for cuda here (no GPU) to fill JAX_DSRELU_KERNEL_CACHE, then stop")
    options = parser.parse_args()
    shapes = SHAPES
    if options.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in options.shapes.split(";")]
    if options.prebuild:
        prebuild(shapes)
        return

    started = time.time()
    rows = [bench_shape(shape, options.reps, options.seed) for shape in shapes]
    result = dict(
        device=jax.devices()[0].device_kind,
        commit=options.commit,
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        jax=jax.__version__,
        python=platform.python_version(),
        timing="CUPTI kernel time per call, median of reps after warm-up",
        seconds=time.time() - started,
        shapes=rows,
    )
    run_record.write_json(result, options.out, "bench_dsrelu.json")
    plot(rows, os.path.join(options.out, "bench_dsrelu.png"))
    header = f"{'shape':>24} " + " ".join(f"{v:>12}" for v in ["xla", "pallas+xla", "sm90", "sm90_det", "cublas_dense"])
    print(header)
    for row in rows:
        s = row["shape"]
        print(f"{s['m']:>7},{s['k']:>5},{s['n']:>5},{s['E']:>3} (ms) " + " ".join(
            f"{row['ms'].get(v, float('nan')):12.3f}" for v in ["xla", "pallas+xla", "sm90", "sm90_det", "cublas_dense"]
        ))
        print(f"{'':>24} ratios " + json.dumps({k: round(v, 3) for k, v in row["ratios"].items()}))


if __name__ == "__main__":
    main()
