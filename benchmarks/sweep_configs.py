"""Times the sm90 kernel at issue 3's shapes under a few tile configurations.

The measurements behind `choose_config` (docs/sm90.md): deterministic=False, with_dbias and
with_act, bf16, same inputs as bench_dsrelu.py, CUPTI time of the custom call's kernels,
median of --reps calls. Writes sweep_configs.json to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from bench_dsrelu import SHAPES, cupti_ms, make_inputs

from jax_dsrelu.kernels import request as request_facts
from jax_dsrelu.kernels.sm90 import dsrelu_call as lowering
from jax_dsrelu.kernels.sm90 import config as sm90_config


def candidates(sm_count):
    common = dict(tile_k=64, max_ctas=sm_count)
    return {
        "128x256 epi32 ab3": sm90_config.TileConfig(
            tile_n=256, ab_stages=3, epi_n=32, preact_stages=4, store_stages=2, **common
        ),
        "128x256 epi64 ab3": sm90_config.TileConfig(
            tile_n=256, ab_stages=3, epi_n=64, preact_stages=2, store_stages=1, **common
        ),
        "128x128 epi32 ab4": sm90_config.TileConfig(
            tile_n=128, ab_stages=4, epi_n=32, preact_stages=4, store_stages=2, **common
        ),
    }


def request_for(k, n, num_experts):
    bf16 = jnp.dtype(jnp.bfloat16)
    return request_facts.Request(
        num_experts=num_experts, n=n, k=k, operand_dtype=bf16, preact_dtype=bf16,
        prob_dtype=jnp.dtype(jnp.float32), out_dtype=bf16, with_dbias=True, with_act=True,
        deterministic=False,
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=20)
    options = parser.parse_args()
    rows = []
    for m, k, n, num_experts in SHAPES:
        grad, weight, preact, prob, sizes = make_inputs(m, k, n, num_experts, 0)
        alpha = jnp.ones((num_experts,), jnp.float32)
        request = request_for(k, n, num_experts)
        for name, config in candidates(lowering.sm_count()).items():
            run = jax.jit(lowering.implementation(request, config))
            ms, _ = cupti_ms(run, (grad, weight, preact, prob, sizes, alpha), options.reps)
            rows.append(dict(shape=[m, k, n, num_experts], config=name, ms=ms,
                             tflops=2.0 * m * n * k / (ms * 1e-3) / 1e12,
                             fields=dataclasses.asdict(config)))
            print(f"{m:>6} {k:>5} {n:>5} {num_experts:>3}  {name:<20} {ms:8.3f} ms", flush=True)
    os.makedirs(options.out, exist_ok=True)
    with open(os.path.join(options.out, "sweep_configs.json"), "w") as file:
        json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), file, indent=1)


if __name__ == "__main__":
    main()
