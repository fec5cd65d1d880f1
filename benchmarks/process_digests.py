"""Digests of outputs computed from fixed inputs, to compare bit for bit across processes.

Each process compiles anew, so comparing two processes' digests shows whether anything
chosen at compile time (XLA's GEMM autotuning, a kernel's tile configuration) changes the
bits. Run it twice and compare the JSON lines:

    python benchmarks/process_digests.py --label run1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import train_moe  # noqa: E402

import jax_dsrelu  # noqa: E402

SIZES = [1500, 700, 0, 1024, 1200, 900, 1024, 1844]


def digest(tree) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--backends", default="sm90,xla", help="comma-separated")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    m, k, n = sum(SIZES), 512, 2048
    grad = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((len(SIZES), n, k)) / np.sqrt(k), jnp.bfloat16)
    preact = jnp.asarray(rng.standard_normal((m, n)), jnp.bfloat16)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32)
    sizes = jnp.asarray(SIZES, jnp.int32)
    results = {"label": args.label, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    backends = args.backends.split(",")
    for backend in backends:
        run = jax.jit(
            lambda *a, backend=backend: jax_dsrelu.grouped_gemm_dsrelu(
                *a, with_dbias=True, with_act=True, deterministic=True, backend=backend
            )
        )
        results[f"primitive_{backend}"] = digest(run(grad, weight, preact, prob, sizes))

    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((len(SIZES), k, 1024)) / np.sqrt(k), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((len(SIZES), 1024, k)) / 32, jnp.bfloat16)
    b1 = jnp.zeros((len(SIZES), 1024), jnp.float32)
    for backend in backends:
        grads = jax.jit(
            jax.grad(
                lambda *a, backend=backend: jnp.sum(
                    jax_dsrelu.moe_mlp(*a[:4], sizes, b1=a[4], deterministic=True, backend=backend).astype(
                        jnp.float32
                    )
                    ** 2
                ),
                argnums=(0, 1, 2, 3, 4),
            )
        )(x, w1, w2, prob, b1)
        results[f"moe_mlp_grads_{backend}"] = digest(grads)

    params = train_moe.init_moe(jax.random.key(1), 64, 128, 8, jnp.bfloat16)
    tokens = jax.random.normal(jax.random.key(2), (2048, 64), jnp.float32)
    target = jax.random.normal(jax.random.key(3), (2048, 64), jnp.float32)
    step_grads = jax.jit(
        jax.grad(lambda p: jnp.mean((train_moe.moe_layer(p, tokens, 2, True) - target) ** 2))
    )(params)
    results["example_layer_grads"] = digest(step_grads)
    router = jax.jit(lambda t, r: t @ r)(tokens, params["router"])
    results["router_dot_f32"] = digest(router)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
