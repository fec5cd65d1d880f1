"""Compiles, on a machine without a GPU, every sm90 kernel the GPU runs need.

The object code goes to the on-disk cache named by JAX_DSRELU_KERNEL_CACHE, which the GPU
machine reads instead of compiling (the same static facts give the same code). Kernels the
GPU tests and sweep_configs.py call directly are compiled by request; everything that goes
through the library (the benchmarks, process_digests.py, the examples, the GPU tests'
layers) is lowered for cuda at the shapes it runs (cuda_lowering.py), which builds
whatever kernels it calls.

    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/prebuild_kernels.py --jobs 2
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
for folder in ("tests", "examples"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", folder))

import bench_gemms  # noqa: E402
import bench_layer  # noqa: E402
import bench_moe_block  # noqa: E402
import cuda_lowering  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import process_digests  # noqa: E402
import sweep_configs  # noqa: E402
import test_sm90  # noqa: E402
import train_moe  # noqa: E402
import harness  # noqa: E402

import jax_dsrelu  # noqa: E402
from jax_dsrelu.ffi import cutlass_bridge  # noqa: E402
from jax_dsrelu.kernels.sm90 import dsrelu_call as lowering  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402


def requests():
    """(request, outputs_in_place) for every kernel tests/test_sm90.py runs directly."""
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
    yield request_for(128, 256, 2), False  # NaN/Inf propagation


def lower_tests_and_examples():
    """Lowers for cuda the GPU tests' moe_mlp case and the examples' training step."""
    for deterministic in (False, True):
        rows, d, f, num_experts = 4192, 256, 512, 5
        described = bench_layer.operand_shapes(rows, d, f, num_experts)
        cuda_lowering.lower_for_cuda(
            f"tests moe_mlp grads deterministic={deterministic}",
            jax.grad(bench_layer.loss_of(bench_layer.moe_mlp_with("auto", deterministic)), argnums=tuple(range(5))),
            *(described[name] for name in ("x", "w1", "w2", "prob", "b1", "group_sizes", "cotangent")),
        )
        cuda_lowering.lower_for_cuda(
            f"examples train step bfloat16 deterministic={deterministic}", example_gradients(deterministic),
            *example_shapes(),
        )


def lower_determinism_tests():
    """Lowers for cuda what tests/test_determinism_gpu.py runs."""
    import test_determinism_gpu as t

    described = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in t.ragged_dot_inputs(0)]
    t.ragged_dot_value_and_grads("sm90").trace(*described).lower(lowering_platforms=("cuda",))
    described = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in t.layer_inputs(0)]
    for deterministic in (False, True):
        t.layer_grads(deterministic).trace(*described).lower(lowering_platforms=("cuda",))


def lower_moe_block_tests():
    """Lowers for cuda what tests/test_moe_block_gpu.py runs."""
    import test_moe_block_gpu as t

    described = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t.block_inputs(0))
    for deterministic in (False, True):
        cuda_lowering.lower_for_cuda(f"tests moe block deterministic={deterministic}", t.block_grads(deterministic),
                                     *described)


def example_gradients(deterministic):
    """The gradients of examples/train_moe.py's training step (its loss against the
    float32 teacher). expert_parallel.py on one GPU runs moe_mlp at these same static
    facts (all 8 experts local), so the same kernels serve it."""

    def loss(params, teacher, tokens):
        target = train_moe.moe_layer(teacher, tokens, TOP_K, True)
        return jnp.mean((train_moe.moe_layer(params, tokens, TOP_K, deterministic) - target) ** 2)

    return jax.grad(loss)


# examples/train_moe.py's defaults: 2048 tokens, d_model 64, d_ff 128, 8 experts, top-2.
TOKENS, D_MODEL, D_FF, EXPERTS, TOP_K = 2048, 64, 128, 8, 2


def example_shapes():
    def params(dtype):
        return jax.eval_shape(lambda: train_moe.init_moe(jax.random.key(0), D_MODEL, D_FF, EXPERTS, dtype))

    return params(jnp.bfloat16), params(jnp.float32), jax.ShapeDtypeStruct((TOKENS, D_MODEL), jnp.float32)


# examples/train_lm.py's GPU command (its docstring): batch 64 x seq-len 256 tokens, d_model
# 512, d_ff 1024, 8 experts, top-2, bfloat16 experts; its activations reach the layer in float32.
LM_TOKENS, LM_D_MODEL, LM_D_FF, LM_EXPERTS = 64 * 256, 512, 1024, 8


def lower_language_model():
    """Lowers for cuda the gradients of the layer that examples/train_lm.py's MoE module
    calls at its GPU command's shapes (the module is a thin wrapper over moe_layer, so
    the same static facts give the same kernels, without needing Flax here)."""
    f32, bf16 = jnp.float32, jnp.bfloat16
    shapes = dict(
        x=jax.ShapeDtypeStruct((LM_TOKENS, LM_D_MODEL), f32),
        router=jax.ShapeDtypeStruct((LM_D_MODEL, LM_EXPERTS), f32),
        w1=jax.ShapeDtypeStruct((LM_EXPERTS, LM_D_MODEL, LM_D_FF), bf16),
        w2=jax.ShapeDtypeStruct((LM_EXPERTS, LM_D_FF, LM_D_MODEL), bf16),
        b1=jax.ShapeDtypeStruct((LM_EXPERTS, LM_D_FF), f32),
    )
    for deterministic in (False, True):
        def loss(x, router, w1, w2, b1, deterministic=deterministic):
            out = jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=TOP_K, deterministic=deterministic)
            return jnp.sum(out.astype(f32))

        cuda_lowering.lower_for_cuda(
            f"examples/train_lm.py layer deterministic={deterministic}",
            jax.grad(loss, argnums=tuple(range(5))),
            *shapes.values(),
        )


def job_names() -> list[str]:
    """Independent pieces of work, each small enough to be one process's job: a kernel by
    request, or the lowering of one script's functions at one shape."""
    names = [f"dsrelu test {i}" for i in range(len(_dsrelu_requests()))]
    names += [f"gemm test {i}" for i in range(len(_gemm_requests()))]
    names += [f"layer test {i}" for i in range(len(LAYER_TEST_CASES))]
    names += [f"bench_gemms {i}" for i in range(len(harness.SHAPES))]
    names += [f"bench_layer {i}" for i in range(len(harness.SHAPES))]
    names += [f"bench_moe_block {i}" for i in range(len(bench_moe_block.BLOCKS))] + list(WHOLE_JOBS)
    for gemm in sweep_configs.GEMM_KERNELS:
        names += [f"sweep gemm {gemm} {i}" for i in range(len(sweep_builds("gemm", gemm)))]
    names += [f"sweep contract {i}" for i in range(len(sweep_builds("contract")))]
    return names


# Jobs that are one piece of work each, by name.
WHOLE_JOBS = {"process_digests": lambda: process_digests.prebuild(("sm90", "xla")),
              "check_gathered": lambda: __import__("check_gathered").prebuild(),
              "tests moe_mlp and examples": lower_tests_and_examples, "determinism tests": lower_determinism_tests,
              "moe block tests": lower_moe_block_tests, "language model": lower_language_model}


def sweep_builds(kernel, gemm=None):
    return sweep_configs.builds(kernel, sm90_config.DEFAULT_SM_COUNT, (gemm,) if gemm else sweep_configs.GEMM_KERNELS)


LAYER_TEST_CASES = list(itertools.product(("bfloat16", "float16"), (False, True), (False, True)))  # dtype, det, b1


def cluster_requests():
    """(request, config) of tests/test_sm90.py's calls in clusters of a given size."""
    for _, k, n, sizes in test_sm90.CLUSTER_CASES.values():
        for deterministic in (False, True):
            request = test_sm90.request_for(k, n, len(sizes), deterministic=deterministic)
            for cluster_n in (1, 2):
                yield request, test_sm90.in_clusters(request, cluster_n)


def _dsrelu_requests():
    """The distinct (request, config, in place) of tests/test_sm90.py's direct calls."""
    seen = {}
    chosen = [(request, sm90_config.choose_config(request, sm90_config.DEFAULT_SM_COUNT), in_place)
              for request, in_place in requests()]
    for request, config, in_place in chosen + [(request, config, True) for request, config in cluster_requests()]:
        seen.setdefault((lowering.kernel_request(request), config, in_place), (request, config, in_place))
    return list(seen.values())


def _gemm_requests():
    import test_sm90_gemms

    return test_sm90_gemms.prebuild_requests()


def run_job(name: str) -> str:
    kind, _, index = name.rpartition(" ")
    if not index.isdigit():
        kind, index = name, "0"
    index = int(index)
    if kind.startswith("sweep "):
        _, kernel, *gemm = kind.split(" ")
        sweep_configs.compile_candidate(*sweep_builds(kernel, *gemm)[index])
        return name
    if kind == "dsrelu test":
        request, config, in_place = _dsrelu_requests()[index]
        lowering.compile_kernel(request, config, outputs_in_place=in_place)
    elif kind == "gemm test":
        from jax_dsrelu.kernels.sm90 import ragged_call as sm90_gemm

        request, config, in_place = _gemm_requests()[index]
        sm90_gemm.compile_kernel(request, config, outputs_in_place=in_place)
    elif kind == "layer test":
        import test_moe_mlp_sm90

        dtype, deterministic, with_b1 = LAYER_TEST_CASES[index]
        test_moe_mlp_sm90.lowered_text(getattr(jnp, dtype), deterministic, with_b1)
    elif kind == "bench_gemms":
        bench_gemms.prebuild(harness.SHAPES[index:index + 1], bench_gemms.GEMMS, ("sm90", "sm90_det"), np.dtype(jnp.bfloat16))
    elif kind == "bench_layer":
        bench_layer.prebuild(harness.SHAPES[index:index + 1], ("sm90", "sm90_det"), bench_layer.MODES)
    elif kind == "bench_moe_block":
        bench_moe_block.prebuild([list(bench_moe_block.BLOCKS.values())[index]],
                                 ("auto", "auto_det", "gathered", "gathered_det"))
    elif kind in WHOLE_JOBS:
        WHOLE_JOBS[kind]()
    else:
        raise ValueError(f"unknown job {name!r}")
    return name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1, help="parallel processes (one per group of kernels)")
    parser.add_argument("--only", default=None,
                        help="run only the jobs whose names start with one of these comma-separated prefixes")
    options = parser.parse_args()
    if not os.environ.get(cutlass_bridge.CACHE_DIR_VARIABLE):
        raise SystemExit(f"set {cutlass_bridge.CACHE_DIR_VARIABLE} to the cache directory")
    prefixes = None if options.only is None else tuple(options.only.split(","))
    names = [name for name in job_names() if prefixes is None or name.startswith(prefixes)]
    if options.jobs > 1:
        # Workers only lower and compile: keep their JAX off any GPU.
        os.environ["JAX_PLATFORMS"] = "cpu"
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(options.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for name in pool.map(run_job, names):
                print("built", name, flush=True)
    else:
        for name in names:
            run_job(name)
            print("built", name, flush=True)
    print(f"{len(os.listdir(os.environ[cutlass_bridge.CACHE_DIR_VARIABLE]))} kernels in "
          f"{os.environ[cutlass_bridge.CACHE_DIR_VARIABLE]}")


if __name__ == "__main__":
    main()
