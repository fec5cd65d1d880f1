"""Compiles, on a machine without a GPU, every sm90 kernel the GPU tests and benchmarks use.

The object code goes to the on-disk cache named by JAX_DSRELU_KERNEL_CACHE (see
jax_dsrelu.ffi.cutlass_bridge), which the GPU machine then reads instead of compiling:
the same static facts give the same code on either machine. With --cubins DIR it also
writes the benchmark kernels' cubins there, for disassembly on the GPU machine.

    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/prebuild_kernels.py --cubins .kernels/cubin
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import sweep_configs  # noqa: E402
import test_sm90  # noqa: E402
from bench_dsrelu import SHAPES  # noqa: E402

from jax_dsrelu.ffi import cutlass_bridge  # noqa: E402
from jax_dsrelu.ffi import sm90 as lowering  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402


def requests():
    """(request, outputs_in_place) for every kernel the GPU tier and the benchmark run."""
    request_for = test_sm90.request_for
    for name in test_sm90.GROUPINGS:
        _, k, n, sizes = test_sm90.grouping(name)
        for dtype in (jnp.bfloat16, jnp.float16):
            for deterministic in (False, True):
                yield request_for(k, n, len(sizes), dtype=np.dtype(dtype), deterministic=deterministic), True
    for deterministic in (False, True):
        for with_dbias in (False, True):
            for with_act in (False, True):
                yield request_for(
                    256, 512, 5, deterministic=deterministic, with_dbias=with_dbias, with_act=with_act
                ), False
        yield request_for(512, 2048, len(test_sm90.DETERMINISM_SIZES), deterministic=deterministic), False
        yield request_for(256, 512, 5, deterministic=deterministic), False  # moe_mlp
        for _, k, n, num_experts in SHAPES:
            yield request_for(k, n, num_experts, deterministic=deterministic), False
    yield request_for(128, 256, 2), False  # NaN/Inf propagation
    # examples/train_moe.py and expert_parallel.py in bfloat16 with their default sizes
    # (d_model 64 is k, d_ff 128 is n, 8 experts), in both modes.
    for deterministic in (False, True):
        yield request_for(64, 128, 8, deterministic=deterministic), False


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cubins", default=None, help="also write the benchmark kernels' cubins here")
    options = parser.parse_args()
    if not os.environ.get(cutlass_bridge.CACHE_DIR_VARIABLE):
        raise SystemExit(f"set {cutlass_bridge.CACHE_DIR_VARIABLE} to the cache directory")
    seen = set()
    for request, in_place in requests():
        config = sm90_config.choose_config(request, sm90_config.DEFAULT_SM_COUNT)
        key = (lowering.kernel_request(request), config, in_place)
        if key in seen:
            continue
        seen.add(key)
        lowering.compile_kernel(request, config, outputs_in_place=in_place)
        print("built", request.k, request.n, request.num_experts, request.operand_dtype,
              "det" if request.deterministic else "atomic", "in-place" if in_place else "", flush=True)
    for _, k, n, num_experts in SHAPES:
        for config in sweep_configs.candidates(sm90_config.DEFAULT_SM_COUNT).values():
            request = sweep_configs.request_for(k, n, num_experts)
            lowering.compile_kernel(request, config)
            seen.add((lowering.kernel_request(request), config, False))
    if options.cubins:
        os.makedirs(options.cubins, exist_ok=True)
        for _, k, n, num_experts in SHAPES:
            for deterministic in (False, True):
                request = test_sm90.request_for(k, n, num_experts, deterministic=deterministic)
                config = sm90_config.choose_config(request, sm90_config.DEFAULT_SM_COUNT)
                compiled = lowering.compile_kernel(request, config, keep=True)
                name = f"k{k}_n{n}_e{num_experts}_{'det' if deterministic else 'atomic'}.cubin"
                with open(os.path.join(options.cubins, name), "wb") as file:
                    file.write(compiled.cubin)
    print(f"{len(seen)} kernels in {os.environ[cutlass_bridge.CACHE_DIR_VARIABLE]}")


if __name__ == "__main__":
    main()
