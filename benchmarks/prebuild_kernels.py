"""Compiles without a GPU, into the disk cache JAX_DSRELU_KERNEL_CACHE names, every sm90 kernel the GPU runs need: those
the tests and sweep_configs.py call directly by request, the rest by lowering the library for cuda at its shapes.

    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/prebuild_kernels.py --jobs 2
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
for folder in ("tests", "examples"):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", folder))

import bench_gemms  # noqa: E402
import bench_layer  # noqa: E402
import bench_moe_block  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import process_digests  # noqa: E402
import sweep_configs  # noqa: E402
import test_sm90  # noqa: E402
import train_moe  # noqa: E402
import harness  # noqa: E402

import jax_dsrelu  # noqa: E402
from jax_dsrelu.ffi import cutlass_bridge  # noqa: E402
from jax_dsrelu.kernels.sm90 import dsrelu_call as lowering  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels.sm90 import ragged_call  # noqa: E402

# examples/train_moe.py's defaults: 2048 tokens, d_model 64, d_ff 128, 8 experts, top-2.
TOKENS, D_MODEL, D_FF, EXPERTS, TOP_K = 2048, 64, 128, 8, 2
# examples/train_lm.py's GPU command (its docstring): batch 64 x seq-len 256 tokens, d_model
# 512, d_ff 1024, 8 experts, top-2, bfloat16 experts; its activations reach the layer in float32.
LM_TOKENS, LM_D_MODEL, LM_D_FF, LM_EXPERTS = 64 * 256, 512, 1024, 8


def lower_tests_and_examples():
    """Lowers for cuda the GPU tests' moe_mlp case and the gradients of examples/train_moe.py's training step (its
    loss against the float32 teacher); expert_parallel.py on one GPU runs moe_mlp at the same static facts."""
    described = bench_layer.operand_shapes(4192, 256, 512, 5)
    params = [jax.eval_shape(lambda dtype=dtype: train_moe.init_moe(jax.random.key(0), D_MODEL, D_FF, EXPERTS, dtype))
              for dtype in (jnp.bfloat16, jnp.float32)]
    for deterministic in (False, True):
        loss = bench_layer.loss_of(bench_layer.moe_mlp_with("auto", deterministic))
        harness.lower_for_cuda(f"tests moe_mlp grads deterministic={deterministic}", jax.grad(loss, argnums=tuple(range(5))),
                               *(described[name] for name in ("x", "w1", "w2", "prob", "b1", "group_sizes", "cotangent")))

        def example(params, teacher, tokens, deterministic=deterministic):
            target = train_moe.moe_layer(teacher, tokens, TOP_K, True)
            return jnp.mean((train_moe.moe_layer(params, tokens, TOP_K, deterministic) - target) ** 2)

        harness.lower_for_cuda(f"examples train step bfloat16 deterministic={deterministic}", jax.grad(example), *params,
                               jax.ShapeDtypeStruct((TOKENS, D_MODEL), jnp.float32))


def lower_determinism_tests():
    """Lowers for cuda what tests/test_determinism_gpu.py runs."""
    import test_determinism_gpu as t

    harness.lower_for_cuda("determinism test ragged_dot", t.ragged_dot_value_and_grads("sm90"), *harness.shapes_of(t.ragged_dot_inputs(0)))
    for deterministic, precision in itertools.product((False, True), t.PRECISIONS):
        harness.lower_for_cuda(f"determinism test {deterministic} fp8={precision is not None}",
                               t.layer_grads(deterministic, precision), *harness.shapes_of(t.layer_inputs(0)))


def lower_moe_block_tests():
    """Lowers for cuda what tests/test_moe_block_gpu.py runs."""
    import test_moe_block_gpu as t

    for deterministic in (False, True):
        harness.lower_for_cuda(f"moe block test {deterministic}", t.block_grads(deterministic), *harness.shapes_of(t.block_inputs(0)))


def lower_language_model():
    """Lowers for cuda the gradients of moe_layer as examples/train_lm.py's MoE module (a thin wrapper,
    so the same kernels without Flax) calls it at its GPU command's shapes, in bf16 and with --fp8."""
    s, f32, bf16, e = jax.ShapeDtypeStruct, jnp.float32, jnp.bfloat16, LM_EXPERTS
    shapes = (s((LM_TOKENS, LM_D_MODEL), f32), s((LM_D_MODEL, e), f32), s((e, LM_D_MODEL, LM_D_FF), bf16),
              s((e, LM_D_FF, LM_D_MODEL), bf16), s((e, LM_D_FF), f32))
    for deterministic, precision in itertools.product((False, True), (None, jax_dsrelu.quantization.FP8_BLOCKWISE)):
        loss = lambda *operands, options=dict(deterministic=deterministic, precision=precision): jnp.sum(  # noqa: E731
            jax_dsrelu.moe_layer(*operands[:4], b1=operands[4], top_k=TOP_K, **options).astype(f32))
        harness.lower_for_cuda(f"train_lm.py {deterministic} fp8={precision is not None}", jax.grad(loss, argnums=(0, 1, 2, 3, 4)), *shapes)


def _layer_tests():
    import test_moe_mlp_sm90

    return [functools.partial(test_moe_mlp_sm90.lowered_text, getattr(jnp, dtype), deterministic, with_b1)
            for dtype, deterministic, with_b1 in itertools.product(("bfloat16", "float16"), (False, True), (False, True))]


def _compiles(module, requests):
    """A job per (request, config, outputs_in_place): its kernel compiled."""
    return [functools.partial(module.compile_kernel, request, config, outputs_in_place=in_place)
            for request, config, in_place in requests]


def _sweeps(kernel, gemm=None):
    builds = sweep_configs.builds(kernel, sm90_config.DEFAULT_SM_COUNT, (gemm,) if gemm else sweep_configs.GEMM_KERNELS)
    return [functools.partial(sweep_configs.compile_candidate, *build) for build in builds]


OURS = ("sm90", "sm90_det")
# Jobs, one process's piece of work each: those of a kind numbered (the kind lists them), and whole ones.
NUMBERED = {
    "dsrelu test": lambda: _compiles(lowering, test_sm90.prebuild_requests()),
    "gemm test": lambda: _compiles(ragged_call, importlib.import_module("test_sm90_gemms").prebuild_requests()),
    "layer test": _layer_tests,
    "fp8 test": lambda: _compiles(ragged_call, importlib.import_module("test_sm90_fp8").prebuild_requests()) + _compiles(
        lowering, [(*built, False) for built in importlib.import_module("test_sm90_fp8").prebuild_fused_requests()]),
    "fp8 copy test": lambda: [job for t in ("contract", "quantize", "weights", "rows") for job in importlib.import_module(f"test_sm90_fp8_{t}").prebuild_copy_jobs()],
    "bench_fp8_gemms": lambda: [functools.partial(importlib.import_module("bench_fp8_gemms").main, ["--prebuild"])],
    "bench_gemms": lambda: [functools.partial(bench_gemms.prebuild, [shape], bench_gemms.GEMMS, OURS, harness.BF16)
                            for shape in harness.SHAPES],
    "bench_layer": lambda: [functools.partial(bench_layer.prebuild, [shape], OURS + ("sm90_fp8",), bench_layer.MODES)
                            for shape in harness.SHAPES],
    "bench_moe_block": lambda: [functools.partial(bench_moe_block.prebuild, [block], bench_moe_block.KERNEL_VARIANTS)
                                for block in bench_moe_block.BLOCKS.values()],
    **{f"sweep gemm {gemm}": functools.partial(_sweeps, "gemm", gemm) for gemm in sweep_configs.GEMM_KERNELS},
    "sweep contract": functools.partial(_sweeps, "contract"),
}
WHOLE_JOBS = {"process_digests": lambda: process_digests.prebuild(("sm90", "xla")),
              "check_gathered": lambda: importlib.import_module("check_gathered").prebuild(),
              "tests moe_mlp and examples": lower_tests_and_examples, "determinism tests": lower_determinism_tests,
              "moe block tests": lower_moe_block_tests, "language model": lower_language_model}


def job_names() -> list[str]:
    return [f"{kind} {i}" for kind, jobs in NUMBERED.items() for i in range(len(jobs()))] + list(WHOLE_JOBS)


def run_job(name: str) -> str:
    kind, _, index = name.rpartition(" ")
    if name in WHOLE_JOBS:
        WHOLE_JOBS[name]()
    elif kind in NUMBERED and index.isdigit():
        NUMBERED[kind]()[int(index)]()
    else:
        raise ValueError(f"unknown job {name!r}")
    return name


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=1, help="parallel processes (one per group of kernels)")
    parser.add_argument("--only", default=None, help="run only the jobs whose names start with one of these comma-separated prefixes")
    options = parser.parse_args()
    if not os.environ.get(cutlass_bridge.CACHE_DIR_VARIABLE):
        raise SystemExit(f"set {cutlass_bridge.CACHE_DIR_VARIABLE} to the cache directory")
    names = [name for name in job_names() if name.startswith(tuple(options.only.split(",")) if options.only else "")]
    if options.jobs > 1:
        os.environ["JAX_PLATFORMS"] = "cpu"  # workers only lower and compile: keep their JAX off any GPU
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(options.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for name in pool.map(run_job, names):
                print("built", name, flush=True)
    else:
        for name in map(run_job, names):
            print("built", name, flush=True)
    cache = os.environ[cutlass_bridge.CACHE_DIR_VARIABLE]
    print(f"{len(os.listdir(cache))} kernels in {cache}")


if __name__ == "__main__":
    main()
