"""The benchmarks' promises that hold without a GPU: every baseline computes in bf16 in both
directions, every variant states its precision, nothing is timed without CUPTI unless a
plumbing test asks for the wall clock, and benchmarks/results holds current records only."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_gemms  # noqa: E402
import bench_layer  # noqa: E402
import bench_moe_block  # noqa: E402
import precision  # noqa: E402
import timing  # noqa: E402

SHAPE = (512, 128, 256, 4)


def dots(fn, *args) -> list[tuple[tuple[str, ...], str]]:
    """(operand dtypes, output dtype) of every dot_general that fn's jaxpr runs, nested calls included."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                found.append((tuple(str(v.aval.dtype) for v in eqn.invars), str(eqn.outvars[0].aval.dtype)))
            for value in eqn.params.values():  # nested calls: jit, custom_vjp, ...
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


@pytest.mark.parametrize("variant", bench_layer.BASELINES)
def test_the_layer_baselines_run_six_bf16_gemms_in_the_step(variant):
    operands = bench_layer.make_operands(*SHAPE, seed=0)
    for mode, count in (("step", 6), ("forward", 2)):
        fn, names = bench_layer.computation(variant, mode)
        assert dots(fn, *(operands[name] for name in names)) == [(("bfloat16", "bfloat16"), "bfloat16")] * count


def test_the_block_s_gemms_alone_are_bf16_but_for_its_float32_router():
    operands = bench_moe_block.make_operands(bench_moe_block.TINY, 0)
    fn, names = bench_moe_block.gemms_step()
    found = dots(fn, *(operands[name] for name in names))
    assert found.count((("bfloat16", "bfloat16"), "bfloat16")) == 12  # routed and shared experts, six each
    assert found.count((("float32", "float32"), "float32")) == 3  # the router's logits, dx and drouter
    assert len(found) == 15


@pytest.mark.parametrize("gemm", [*bench_gemms.MATMULS, "dsrelu"])
def test_the_cublas_baselines_of_each_gemm_are_bf16(gemm):
    operands = bench_gemms.make_operands(*SHAPE, seed=0)
    for variant in bench_gemms.gemm_variants(gemm, bench_gemms.operand_shapes(*SHAPE), np.dtype("bfloat16")):
        if variant.name.startswith("cublas"):
            found = dots(variant.build(), *(operands[name] for name in variant.operands))
            assert found == [(("bfloat16", "bfloat16"), "bfloat16")], (gemm, variant.name)


@pytest.mark.parametrize("benchmark, variants", [
    ("bench_gemms", bench_gemms.VARIANTS + bench_gemms.OPTIONAL_VARIANTS),
    ("bench_layer", bench_layer.VARIANTS), ("bench_moe_block", bench_moe_block.VARIANTS)])
def test_every_variant_states_its_precision(benchmark, variants):
    assert set(variants) <= set(precision.stated(benchmark, variants))
    assert set(precision.SAME_SINCE_WRITTEN[benchmark]) <= set(precision.BY_BENCHMARK[benchmark])


def test_nothing_is_timed_without_cupti_but_a_plumbing_test():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is visible: CUPTI times here")
    with pytest.raises(SystemExit, match="no GPU here .* a measurement needs CUPTI"):
        timing.clock_for(cpu=False)
    assert timing.clock_for(cpu=True) == timing.WALL_CLOCK
    entry = timing.time_call(jax.jit(lambda x: x + 1), (np.ones(4),), 2, timing.WALL_CLOCK).record()
    assert entry["clock"] == timing.WALL_CLOCK and len(entry["calls_ms"]) == 2
    assert "WALL CLOCK" in timing.DESCRIPTIONS[timing.WALL_CLOCK]


def test_results_hold_the_current_records_within_their_budget():
    tracked = subprocess.run(["git", "ls-files", "-z", "benchmarks/results"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split("\0")
    files = [ROOT / name for name in tracked if name and (ROOT / name).exists()]
    assert 0 < len(files) <= 40, len(files)
    assert sum(path.stat().st_size for path in files) <= 2 * 2**20
    # Current records only: no folder of past runs beside them.
    assert all(path.parent == ROOT / "benchmarks" / "results" for path in files)
