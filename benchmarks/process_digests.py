"""Digests of results computed from fixed inputs, to compare bit for bit across processes.

One process computes each of `computations` --runs times (the library's primitive and step, the examples' layer, the
block of tests/test_moe_block_gpu.py, in both modes and compiles) and prints one JSON line: each one's digest and how
many distinct results its calls gave; benchmarks/determinism_parallel.sh compares the lines of several processes.

    python benchmarks/process_digests.py --label run1
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/process_digests.py --prebuild
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

for folder in ("examples", "tests"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", folder))

import harness  # noqa: E402
import test_moe_block_gpu  # noqa: E402
import train_moe  # noqa: E402

import jax_dsrelu  # noqa: E402
from jax_dsrelu.kernels.sm90 import backend as sm90_backend  # noqa: E402

SIZES = [1500, 700, 0, 1024, 1200, 900, 1024, 1844]
GRADIENTS = ("x", "w1", "w2", "prob", "b1")


def computations(backends):
    """(name, jitted function, operands, its outputs' names, whether the unverified kernels are on) of each."""
    rng = np.random.default_rng(0)
    m, k, n = sum(SIZES), 512, 2048
    grad = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((len(SIZES), n, k)) / np.sqrt(k), jnp.bfloat16)
    preact = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    for backend in backends:
        run = jax.jit(lambda *a, backend=backend: jax_dsrelu.grouped_gemm_dsrelu(
            *a, with_dbias=True, with_act=True, deterministic=True, backend=backend))
        yield f"primitive_{backend}", run, (grad, weight, preact, prob, sizes), jax_dsrelu.DsreluOutputs._fields, False

    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((len(SIZES), k, 1024)) / np.sqrt(k), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(SIZES), 1024, k)) / 32, jnp.bfloat16)
    b1 = jnp.zeros((len(SIZES), 1024), jnp.float32)
    for backend, fp8 in [(backend, False) for backend in backends] + [("auto", True)]:  # FP8: sm90's on Hopper
        options = dict(deterministic=True, backend=backend, precision=jax_dsrelu.quantization.FP8_BLOCKWISE if fp8 else None)
        grads = jax.jit(jax.grad(lambda x, w1, w2, prob, b1, sizes, options=options: jnp.sum(jax_dsrelu.moe_mlp(
            x, w1, w2, prob, sizes, b1=b1, **options).astype(jnp.float32) ** 2), argnums=(0, 1, 2, 3, 4)))
        yield f"moe_mlp_grads_{backend}{'_fp8' * fp8}", grads, (x, w1, w2, prob, b1, sizes), GRADIENTS, False

    params = train_moe.init_moe(jax.random.key(1), 64, 128, 8, jnp.bfloat16)
    tokens = jax.random.normal(jax.random.key(2), (2048, 64), jnp.float32)
    target = jax.random.normal(jax.random.key(3), (2048, 64), jnp.float32)
    layer_grads = jax.grad(lambda p, tokens, target: jnp.mean((train_moe.moe_layer(p, tokens, 2, True) - target) ** 2))
    yield "example_layer_grads", jax.jit(layer_grads), (params, tokens, target), sorted(params), False
    reproducible = jax.jit(layer_grads, compiler_options=train_moe.REPRODUCIBLE_COMPILATION)
    yield "example_layer_grads_reproducible", reproducible, (params, tokens, target), sorted(params), False
    yield "router_dot_f32", jax.jit(lambda t, r: t @ r), (tokens, params["router"]), ("logits",), False

    block = test_moe_block_gpu.block_inputs(3)
    names = ("x",) + tuple(sorted(block[1]))  # the gradients' leaves: x's, then the parameters' by name
    for (mode, deterministic), kernels in itertools.product((("default", False), ("deterministic", True)),
                                                            ("verified", "unverified")):
        yield (f"block_grads_{mode}_{kernels}_kernels", test_moe_block_gpu.block_grads(deterministic), block,
               names, kernels == "unverified")
    # XLA times candidate algorithms for its own GEMMs (the router's, the latent projections')
    # once per process: with autotuning off, their choice, and so their bits, is fixed.
    reproducible = jax.jit(test_moe_block_gpu.block_grads(True), compiler_options=train_moe.REPRODUCIBLE_COMPILATION)
    yield "block_grads_deterministic_reproducible", reproducible, block, names, False


def digests_of(fn, operands, output_names, unverified, runs) -> dict:
    """Digests of one computation's outputs, and how many distinct results `runs` calls gave."""
    whole, outputs = set(), None
    with sm90_backend.unverified_enabled(on=unverified):  # where the first call traces
        for _ in range(runs):
            outputs = fn(*operands)
            whole.add(harness.digest(outputs))
    # A parameter tree's leaves go by name, in sorted key order.
    leaves = [outputs[name] for name in output_names] if isinstance(outputs, dict) else jax.tree.leaves(outputs)
    named = {name: harness.digest(leaf) for name, leaf in zip(output_names, leaves)}
    return dict(digest=sorted(whole)[0], outputs=named, runs=runs, distinct_in_process=len(whole))


def prebuild(backends) -> None:
    """Lowers every computation for cuda, building the kernels they call (small operands, made here)."""
    for name, fn, operands, _, unverified in computations(backends):
        with sm90_backend.unverified_enabled(on=unverified):
            harness.lower_for_cuda(f"process_digests {name}", fn, *harness.shapes_of(operands))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="")
    parser.add_argument("--backends", default="sm90,xla", help="comma-separated")
    parser.add_argument("--runs", type=int, default=20, help="calls of each computation in this process")
    parser.add_argument("--prebuild", action="store_true",
                        help="lower every computation for cuda here (no GPU) to fill JAX_DSRELU_KERNEL_CACHE, then stop")
    args = parser.parse_args()
    backends = args.backends.split(",")
    if args.prebuild:
        return prebuild(backends)
    results = {}
    for name, fn, operands, output_names, unverified in computations(backends):
        try:
            results[name] = digests_of(fn, operands, output_names, unverified, args.runs)
        except Exception as error:  # recorded; the other computations still run
            results[name] = dict(error=f"{type(error).__name__}: {str(error)[:400]}")
    bridge = sys.modules.get("jax_dsrelu.ffi.cutlass_bridge")  # CuTe DSL kernels compiled here, not read from the cache
    line = dict(label=args.label, device=jax.devices()[0].device_kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
                kernel_cache=os.environ.get(harness.CACHE_VARIABLE, ""),
                kernels_compiled_in_process=None if bridge is None else bridge.compile_count(), results=results)
    print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
