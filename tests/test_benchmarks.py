"""The benchmarks' promises that hold without a GPU: every baseline computes in bf16 in both
directions, every variant states its precision, nothing is timed without CUPTI unless a
plumbing test asks for the wall clock, and benchmarks/results holds current records only."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fp8_gemms  # noqa: E402
import bench_gemms  # noqa: E402
import bench_layer  # noqa: E402
import bench_moe_block  # noqa: E402
import harness  # noqa: E402
import precision  # noqa: E402
import readme_table  # noqa: E402
import run_record  # noqa: E402
import timing  # noqa: E402

import jax_dsrelu  # noqa: E402

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
    operands = bench_layer.make_operands(*SHAPE, seed=0, fp8=variant == "cublas_fp8")
    for mode, count in (("step", 6), ("forward", 2)):
        fn, names = bench_layer.computation(variant, mode)
        assert dots(fn, *(operands[name] for name in names)) == [(("bfloat16", "bfloat16"), "bfloat16")] * count


@pytest.mark.parametrize("name", bench_moe_block.BLOCKS)
def test_the_block_s_gemms_alone_are_bf16_but_for_its_float32_router(name):
    block = bench_moe_block.BLOCKS[name].tiny()
    shapes = bench_moe_block.operand_shapes(block)
    fn, names = bench_moe_block.gemms_step(block)
    found = dots(fn, *(shapes[name] for name in names))
    experts = 2 if block.shared else 1  # the routed experts' six, and the shared expert's
    assert found.count((("bfloat16", "bfloat16"), "bfloat16")) == 6 * experts
    assert found.count((("float32", "float32"), "float32")) == 3  # the router's logits, dx and drouter
    assert len(found) == 6 * experts + 3


# Kernel names as CUPTI recorded them on the H200 (benchmarks/results), cut as timing.py cuts them.
GEMM_KERNELS = [
    "nvjet_sm90_tss_128x160_64x5_2x1_v_bz_NTT",  # cuBLAS
    "sm90_xmma_gemm_f32f32_tf32f32_f32_nt_n_tilesize128x128x32_warpgroupsize1x1x1_execute_segment_k_off_k",  # cuBLAS
    "gemm_fusion_dot_general_5",  # XLA's Triton GEMM
    "kernel_cutlass_kernel_jax_dsrelukernelssm90ragged_matmul_kernelRaggedGemmSm90_object_at__CopyAtom_ThrID10_TVLayoutSrc181",
    "kernel_cutlass_kernel_jax_dsrelukernelssm90ragged_contract_kernelRaggedContractSm90_object_at__CopyAtom_ThrID10_TVLayout",
    "kernel_cutlass_kernel_jax_dsrelukernelssm90dsrelu_kernelGroupedGemmDsreluSm90_object_at__CopyAtom_ThrID10_TVLayoutSrc181",
    "kernel_cutlass_kernel_quackgemm_default_epiGemmDefaultSm90_object_at__TiledMMA_ThrLayoutVMNK12811110",  # QuACK
    "kernel_cutlass_kernel_jax_dsrelukernelssm90gathered_kernelsGatheredDsreluSm90_object_at__CopyAtom_ThrID10_TVLay",
    "kernel_cutlass_kernel_jax_dsrelukernelssm90gathered_kernelsGatheredRhsContractSm90_object_at__CopyAtom_ThrID10_",
]
OTHER_KERNELS = [
    "loop_select_fusion_3", "input_add_reduce_fusion", "loop_convert_select_fusion", "sort_22_1__5", "memcpy128",
    "wrapped_transpose_1", "input_scatter_fusion", "loop_and_gather_fusion",
    "kernel_cutlass_kernel_jax_dsrelukernelsslot_reductionSlotReduction_object_at__tensorptrf32gmemalign256odiv15i641_None_te",
    "kernel_cutlass_kernel_jax_dsrelukernelssm90gather_sum_kernelGatherSumSm90_object_at__tensorptrbf16gmemalign16o",
    "_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_14func_wrapper_tIfZNS0_11sum_functorIfffEc",
]


def test_the_gemm_kernels_are_told_from_the_rest_by_name():
    assert [bool(timing.GEMM_KERNEL.search(name)) for name in GEMM_KERNELS + OTHER_KERNELS] == (
        [True] * len(GEMM_KERNELS) + [False] * len(OTHER_KERNELS))
    kernels = [(name, 1.0) for name in GEMM_KERNELS] + [(name, 0.5) for name in OTHER_KERNELS]
    outside = timing.outside_gemms(kernels)
    assert outside["ms"] == 0.5 * len(OTHER_KERNELS)
    assert outside["share"] == pytest.approx(outside["ms"] / (len(GEMM_KERNELS) + outside["ms"]))


def test_the_block_benchmark_runs_its_plumbing_on_the_cpu(tmp_path):
    # The block with every feature (a shared expert, biased sigmoid routing), a variant of
    # each kind (auto and xla_det compile as auto_det and xla do on the CPU, at a few
    # seconds each): compiled, checked against the xla variant, timed by the wall clock that
    # the record names; the tokamax variant runs where tokamax is installed.
    variants = ("xla", "auto_det", "tokamax", "gemms_cublas")
    bench_moe_block.main(["--cpu", "--out", str(tmp_path), "--reps", "1", "--blocks", "nano_8k",
                          "--variants", ",".join(variants)])
    record = run_record.load(tmp_path / "bench_moe_block.json")
    assert record["clock"] == timing.WALL_CLOCK and "WALL CLOCK" in record["timing"]
    assert (tmp_path / "bench_moe_block.png").stat().st_size > 0
    (name,) = record["blocks"]
    entries = dict(record["blocks"][name]["variants"])
    assert set(entries) == set(variants)
    if importlib.util.find_spec("tokamax") is None:
        assert entries.pop("tokamax") == {"skipped": "tokamax not installed"}
    for variant, entry in entries.items():
        assert entry["clock"] == timing.WALL_CLOCK and entry["ms"] > 0, (variant, entry)
        assert entry["memory"]["peak_bytes"] > 0
        if variant not in ("xla", "gemms_cublas"):
            assert set(entry["check"]) == {f"d{g}" for g in bench_moe_block.NANO.gradients}
            assert max(entry["check"].values()) <= bench_moe_block.TOLERANCE, (variant, entry["check"])
    table = readme_table.render_moe_block([("bench_moe_block.json", record)])
    # A row per variant and its deterministic twin: auto, xla, tokamax, the GEMMs alone.
    assert len([line for line in table.splitlines() if line.startswith("| `nano_8k`")]) == 4


@pytest.mark.parametrize("name", bench_moe_block.BLOCKS)
def test_every_variant_of_every_block_differentiates_every_weight(name):
    block = bench_moe_block.BLOCKS[name].tiny()
    shapes = bench_moe_block.operand_shapes(block)
    for variant in bench_moe_block.VARIANTS:
        fn, names = bench_moe_block.computation(block, variant)
        if variant == "tokamax" and importlib.util.find_spec("tokamax") is None:
            continue  # the tokamax layer imports tokamax when traced; the plumbing test covers its absence
        outputs = jax.eval_shape(fn, *(shapes[n] for n in names))
        if variant != "gemms_cublas":
            _, grads = outputs
            assert [(g.shape, g.dtype) for g in grads] == [(shapes[n].shape, shapes[n].dtype) for n in block.gradients]


def test_the_block_table_shows_time_share_outside_gemms_memory_and_the_cost_of_determinism():
    def entry(ms, kernels):
        return dict(ms=ms, tflops=100.0 / ms, kernels=kernels, memory=dict(peak_bytes=3 * 2**29))

    gemm, other = "kernel_RaggedGemmSm90_x", "loop_select_fusion"
    variants = dict(auto=entry(2.0, [[gemm, 1.5], [other, 0.5]]), auto_det=entry(2.5, [[gemm, 2.0], [other, 0.5]]),
                    xla=entry(8.0, [[gemm, 2.0], [other, 6.0]]), gemms_cublas=entry(1.0, [["nvjet_sm90_x", 1.0]]),
                    tokamax=dict(skipped="tokamax not installed"))
    record = dict(device="NVIDIA H200", jax="0.11.2", commit="abc1234", command="python3 bench.py", timing="CUPTI",
                  flops="6 x ...", precision=precision.stated("bench_moe_block", variants),
                  blocks=dict(nano_8k=dict(description="T = 8192", variants=variants)))
    rows = [line for line in readme_table.render_moe_block([("bench_moe_block.json", record)]).splitlines()
            if line.startswith("| `")]
    assert rows == [
        "| `nano_8k` | library, backend auto (sm90) | 2.000 ms (50) | 2.500 ms (40) | 1.25x | 25.0% (0.500 ms) "
        "| 1.50 / 1.50 | 2.00x |",
        "| `nano_8k` | XLA backend | 8.000 ms (12) |  | — | 75.0% (6.000 ms) | 1.50 | 8.00x |",
        "| `nano_8k` | tokamax ragged_dot | tokamax not installed |  | — | — | — | — |",
        "| `nano_8k` | its GEMMs alone, bf16 cuBLAS | 1.000 ms (100) |  | — | 0.0% (0.000 ms) | 1.50 | 1.00x |",
    ]


@pytest.mark.parametrize("gemm", [*bench_gemms.MATMULS, "dsrelu"])
def test_the_cublas_baselines_of_each_gemm_are_bf16(gemm):
    operands = bench_gemms.make_operands(*SHAPE, seed=0)
    for variant in bench_gemms.gemm_variants(gemm, bench_gemms.operand_shapes(*SHAPE), np.dtype("bfloat16")):
        if variant.name.startswith("cublas"):
            found = dots(variant.build(), *(operands[name] for name in variant.operands))
            assert found == [(("bfloat16", "bfloat16"), "bfloat16")], (gemm, variant.name)


@pytest.mark.parametrize("benchmark, variants", [
    ("bench_gemms", bench_gemms.VARIANTS + bench_gemms.OPTIONAL_VARIANTS),
    ("bench_layer", bench_layer.VARIANTS + bench_layer.FP8_VARIANTS), ("bench_moe_block", bench_moe_block.VARIANTS),
    ("bench_fp8_gemms", bench_fp8_gemms.VARIANTS)])
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


def test_benchmark_scripts_and_documents_keep_within_their_budgets():
    # A tool, not a diary: the scripts under 3,000 lines in all, and no document over 400.
    scripts = [path for path in (ROOT / "benchmarks").iterdir() if path.is_file()]
    script_lines = sum(len(path.read_text().splitlines()) for path in scripts)
    assert script_lines < 3000, f"benchmarks/ holds {script_lines} lines of scripts"
    documents = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    long = {path.name: n for path in documents if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"documents over 400 lines: {long}"


def test_the_rounded_grouping_is_the_dirichlet_one_as_token_rounding_cuts_it():
    m, num_experts = 49152, 128
    uncut = harness.group_sizes_for("dirichlet", m, num_experts, 0)
    cut = harness.group_sizes_for("rounded128", m, num_experts, 0)
    assert uncut.sum() == m and cut.sum() < m
    assert not (cut % 128).any() and ((uncut - cut) >= 0).all() and ((uncut - cut) < 128).all()
    # What route(round_to=128) leaves of an expert's assignments, for the same counts.
    logits = np.log(np.repeat(np.eye(3), [300, 129, 5], axis=0) + 1e-3)
    plan = jax_dsrelu.route(jnp.asarray(logits, jnp.float32), 1, round_to=128)
    np.testing.assert_array_equal(plan.group_sizes, np.array([300, 129, 5]) // 128 * 128)


def test_the_roofline_sets_each_kernel_against_the_runs_own_rates():
    import roofline

    m, d, f, num_experts = shape = (1024, 256, 512, 8)
    names = ["RaggedGemmSm90 up", "GroupedGemmDsreluSm90", "RaggedGemmSm90", "input_reduce_fusion",
             "RaggedGemmSm90", "RaggedContractSm90", "RaggedContractSm90"]
    kernels = [[name, 0.5] for name in names]
    # cuBLAS's six dense GEMMs in 1.2 ms: 2 m d f of them take 0.2 ms at its rate.
    step = dict(variants=dict(sm90=dict(ms=3.1, kernels=kernels), cublas_dense=dict(ms=1.2)))
    weights = 2 * num_experts * d * f
    copy = dict(tb_per_s=weights / 0.2e-3 / 1e12)  # the weights stream in 0.2 ms
    result = roofline.roofline(shape, m, step, copy)
    gemms = [k["gemm"] for k in result["kernels"]]
    assert gemms == ["up", "dsrelu", "down/dx", "down/dx", "dw1/dw2", "dw1/dw2"]
    down = result["kernels"][2]
    assert down["bytes"] == 2 * m * f + weights + 2 * m * d
    assert down["bound"] == "bytes" and np.isclose(down["roofline_ms"], 0.2 * down["bytes"] / weights)
    # At a copy rate 1000 times as fast every kernel is bound by its FLOPs.
    slow = roofline.roofline(shape, m, step, dict(tb_per_s=copy["tb_per_s"] * 1000))
    assert all(k["bound"] == "flops" and np.isclose(k["roofline_ms"], 0.2) for k in slow["kernels"])
    assert np.isclose(slow["step"]["ratio"], 3.1 / 1.2)
    # A wrong kernel order or a missing baseline is said, never a ratio of nothing.
    with pytest.raises(ValueError, match="fourth"):
        roofline.gemm_of_launches(kernels + [["RaggedGemmSm90", 0.5]])
    assert "unavailable" in roofline.roofline(shape, m, dict(variants=dict(sm90=step["variants"]["sm90"])), copy)


def test_the_fp8_roofline_counts_e4m3_operands_their_scales_and_the_quantizing():
    import roofline

    m, d, f, num_experts = shape = (1024, 256, 512, 8)
    names = ["BlockScaledRaggedGemmSm90", "BlockScaledDsreluSm90", "BlockScaledRaggedGemmSm90", "BlockScaledRaggedGemmSm90",
             "BlockScaledContractSm90", "BlockScaledContractSm90"]
    step = dict(variants=dict(sm90_fp8=dict(ms=3.1, kernels=[[name, 0.5] for name in names]), cublas_fp8=dict(ms=0.6)))
    copy = dict(tb_per_s=1.0)
    result = roofline.roofline(shape, m, step, copy, "sm90_fp8", "cublas_fp8", 1)
    down = result["kernels"][2]
    # act e4m3 with a float32 scale per 128 of f, w2 e4m3 with one per 128 x 128, y bf16.
    assert down["gemm"] == "down/dx"
    assert np.isclose(down["bytes"], (1 + 4 / 128) * m * f + (1 + 4 / 128**2) * num_experts * d * f + 2 * m * d)
    bf16 = roofline.step_bytes(m, d, f, num_experts)
    assert bf16["quantize"] == 0 and down["bytes"] < bf16["down/dx"]
    # The quantizing moves bytes only, and its floor is part of the step's; the FP8 rate sets the FLOPs' floor.
    quantize = roofline.step_bytes(m, d, f, num_experts, 1)["quantize"]
    assert np.isclose(result["step"]["quantize_roofline_ms"], 1e3 * quantize / 1e12)
    floors = {k["gemm"]: k["roofline_ms"] for k in result["kernels"]}
    assert np.isclose(result["step"]["roofline_ms"], floors["up"] + floors["dsrelu"] + 2 * floors["down/dx"]
                      + 2 * floors["dw1/dw2"] + result["step"]["quantize_roofline_ms"])
    assert np.isclose(result["dense_tflops"], 12 * m * d * f / 0.6e-3 / 1e12)
    assert np.isclose(result["step"]["outside_gemms_ms"], 0.1)
    assert "unavailable" in roofline.roofline(shape, m, step, copy)  # the bf16 variants were not timed


def test_the_fp8_step_record_renders_its_layer_and_roofline_tables(tmp_path):
    import readme_table
    import roofline

    m, d, f, num_experts = shape = (1024, 256, 512, 8)
    names = ["BlockScaledRaggedGemmSm90", "BlockScaledDsreluSm90", "BlockScaledRaggedGemmSm90", "BlockScaledRaggedGemmSm90",
             "BlockScaledContractSm90", "BlockScaledContractSm90"]
    variants = dict(sm90=dict(ms=4.0, tflops=100.0), sm90_fp8=dict(ms=3.1, tflops=130.0, kernels=[[n, 0.4] for n in names]),
                    cublas_fp8=dict(ms=0.6, tflops=600.0))
    step = dict(flops=12.0 * m * d * f, variants=variants)
    step["roofline_fp8"] = roofline.roofline(shape, m, step, dict(tb_per_s=3.0), "sm90_fp8", "cublas_fp8", 1)
    record = dict(device="NVIDIA H200", jax="0.11.2", command="python3 benchmarks/bench_layer.py --label fp8",
                  commit="abc1234", timing="CUPTI", flops="12 m d f", benchmark="bench_layer",
                  precision={v: "stated" for v in variants},
                  shapes=[dict(shape=dict(m=m, d=d, f=f, E=num_experts), grouping="dirichlet", modes=dict(step=step))])
    (tmp_path / "bench_layer_fp8.json").write_text(json.dumps(record))
    text = (ROOT / "docs" / "fp8-kernels.md").read_text()
    updated = readme_table.updated_document(text, "docs/fp8-kernels.md", tmp_path)
    assert "No record yet" not in updated and "dense FP8 cuBLAS TFLOP/s" in updated, updated
    assert "sm90 / sm90 FP8" in updated and "1.29x" in updated  # 4.0 / 3.1: the bf16 step over the FP8 one
    found = step["roofline_fp8"]["step"]
    assert f"{found['ratio']:.2f}x" in updated and f"{found['outside_gemms_ms']:.3f} ms" in updated
