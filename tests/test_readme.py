"""The documentation: its benchmark figures are those recorded in benchmarks/results, and
every block of Python in README.md and docs/ runs as written."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_table  # noqa: E402

RUN = dict(device="NVIDIA H200", jax="0.11.2", commit="abc1234", command="python3 bench.py",
           timing="CUPTI kernel time")
README = "intro\n<!-- gemms:start -->\nold\n<!-- gemms:end -->\nmiddle\n<!-- layer:start -->\nold\n<!-- layer:end -->\n"


def test_readme_results_match_the_recorded_json():
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], check=True
    )


def gemms_results():
    not_built = dict(error="NotImplementedError: backend 'sm90' does not serve it", stage="build")
    return dict(RUN, contract_out_dtype="bfloat16", shapes=[dict(
        shape=dict(m=1024, d=256, f=512, E=4),
        gemms={
            "up": dict(variants=dict(sm90=not_built, pallas=dict(error="ValueError: smem", stage="run"),
                                     xla=dict(ms=2.0, tflops=100.0), cublas_dense=dict(ms=0.5, tflops=400.0)),
                       ratios={}),
            "dw1": dict(variants=dict(sm90=dict(ms=1.0, tflops=200.0), pallas=dict(ms=2.0, tflops=100.0),
                                      cublas_dense=dict(ms=0.9, tflops=222.2)),
                        ratios=dict(sm90_vs_cublas_throughput=0.9, sm90_speedup_vs_pallas=2.0)),
        },
    )])


def layer_results():
    def timed(ms, tflops, peak):
        return dict(ms=ms, tflops=tflops, memory=dict(peak_bytes=peak * 2**30),
                    kernel_summary=[["gemm_kernel", ms * 0.75], ["2 other kernels", ms * 0.25]])

    step = dict(variants=dict(xla=timed(8.0, 100.0, 6.0), sm90=timed(2.0, 400.0, 3.0),
                              sm90_det=timed(2.1, 381.0, 3.0),
                              pallas=dict(error="ValueError: smem", stage="compile"),
                              dense_xla=timed(4.0, 200.0, 2.5)),
                ratios=dict(sm90_speedup_vs_xla=4.0, sm90_speedup_vs_dense_xla=2.0, det_overhead=0.05))
    return dict(RUN, flops="12 m d f per step", memory="XLA memory analysis", pallas_in_xla="the epilogues",
                shapes=[dict(shape=dict(m=1024, d=256, f=512, E=4), modes=dict(step=step))])


def write_results(directory, **results):
    for name, value in results.items():
        (directory / name).write_text(json.dumps(value))


DOCUMENT = "docs/performance.md"


def test_gemm_and_layer_tables_come_from_their_json(tmp_path):
    write_results(tmp_path, **{"bench_gemms.json": gemms_results(), "bench_layer.json": layer_results()})
    text = readme_table.updated_document(README, "docs/performance.md", tmp_path)
    assert "old" not in text and text.startswith("intro\n<!-- gemms:start -->\n")
    assert (
        "| 1024, 256, 512, 4 | up: x @ W1[e], squared-ReLU epilogue | not built | failed (run) "
        "| 2.000 ms (100) | 0.500 ms (400) | — | — |"
    ) in text
    assert "| 1024, 256, 512, 4 | dW1: x^T dh per expert | 1.000 ms (200) | 2.000 ms (100) | not run " \
           "| 0.900 ms (222) | 90.0% | 2.00x |" in text
    assert "| 1024, 256, 512, 4 | 8.000 ms (100) | 2.000 ms (400) | 2.100 ms (381) | failed (compile) " \
           "| 4.000 ms (200) |" in text
    assert "| 1024, 256, 512, 4 | 6.00 / 3.00 / 3.00 / — | 4.00x | 2.00x | +5.0% |" in text
    assert "- 1024, 256, 512, 4 (2.000 ms): `gemm_kernel` 1.500 ms, `2 other kernels` 0.500 ms" in text
    # Generating again from the same JSON changes nothing: what --check relies on.
    assert readme_table.updated_document(text, DOCUMENT, tmp_path) == text


def determinism_record(commit, kernel_cache, example_digests, layer_digests, in_process=1):
    def process(layer):
        return dict(results=dict(
            primitive_sm90=dict(digest="p", runs=20, distinct_in_process=1),
            example_layer_grads=dict(digest=layer, runs=20, distinct_in_process=in_process),
        ))

    return dict(device="NVIDIA H200", commit=commit, processes=len(example_digests), xla_flags="default",
                kernel_cache=kernel_cache, digests=[process(d) if d else None for d in layer_digests],
                example_digests=example_digests, example_compiler_options={"xla_gpu_autotune_level": 0})


def test_determinism_table_counts_distinct_digests_per_run(tmp_path):
    (tmp_path / "determinism").mkdir()
    write_results(tmp_path / "determinism", **{
        "determinism_parallel_a.json": determinism_record("aaa1111", "warm", ["x", "y", "x"], ["l", "m", "l"]),
        "determinism_parallel_b.json": determinism_record("bbb2222", "fresh", ["z", "z", None], ["l", None, "l"], 2),
    })
    text = readme_table.updated_document("<!-- determinism:start -->\nold\n<!-- determinism:end -->\n",
                                          "docs/determinism.md", tmp_path)
    header = ("| computation | `aaa1111`: kernels from the disk cache, XLA's default flags "
              "| `bbb2222`: kernels compiled in each process, XLA's default flags |")
    assert header in text
    assert "| `grouped_gemm_dsrelu` on sm90, every output | identical in 3 | identical in 2 (of 3 started) |" in text
    assert ("every gradient, XLA's default compile | **2 distinct** in 3 "
            "| identical in 2 (of 3 started), varies within a process |") in text
    assert ("final parameters | **2 distinct** in 3 (its step compiled with `{\"xla_gpu_autotune_level\": 0}`) "
            "| identical in 2 (of 3 started) (its step compiled") in text
    assert "`moe_mlp` step on the sm90 kernels, every gradient | not run | not run |" in text
    assert readme_table.updated_document(text, "docs/determinism.md", tmp_path) == text


def test_a_table_without_its_json_is_left_alone(tmp_path):
    write_results(tmp_path, **{"bench_layer.json": layer_results()})
    text = readme_table.updated_document(README, "docs/performance.md", tmp_path)
    assert text.split("<!-- gemms:end -->")[0] == "intro\n<!-- gemms:start -->\nold\n"
    assert "2.000 ms (400)" in text


def test_recorded_json_without_markers_is_an_error(tmp_path):
    write_results(tmp_path, **{"bench_gemms.json": gemms_results()})
    with pytest.raises(SystemExit, match="gemms:start"):
        readme_table.updated_document("no markers here\n", "docs/performance.md", tmp_path)
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_the_front_page_and_the_moe_guide_hold_python_to_run():
    # So that the test below cannot pass by finding nothing to run.
    assert python_blocks(ROOT / "README.md") and len(python_blocks(ROOT / "docs" / "moe.md")) >= 4


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_every_python_block_runs_as_written(path):
    """A document's blocks, in order and in one namespace as a reader would run them, in a
    fresh process with 8 host devices (the expert-parallel example needs them; the text
    says so)."""
    blocks = python_blocks(path)
    if not blocks:
        return
    if importlib.util.find_spec("flax") is None and any("from flax import" in b for b in blocks):
        pytest.skip("a block imports flax, which is not installed")
    program = "\n".join(
        f"exec(compile({block!r}, {f'{path.name}, block {i}'!r}, 'exec'), namespace)"
        for i, block in enumerate(blocks)
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", "namespace = {}\n" + program], check=True, cwd=ROOT, env=env, timeout=600)


def test_padding_counts_whole_tiles_per_expert():
    # 129 rows in two experts: 1 tile + 1 tile of 128 rows; 3 tiles of 64; empty experts pad nothing.
    assert readme_table.rows_computed_per_row_stored([128, 1, 0], 128) == 256 / 129
    assert readme_table.rows_computed_per_row_stored([128, 1, 0], 64) == 192 / 129
    assert readme_table.rows_computed_per_row_stored([384] * 4, 128) == 1.0


def test_counters_put_each_kernel_beside_cublas_fastest_algorithm():
    def launch(gemm, variant, microseconds, sm):
        values = [microseconds * 1000, sm, 50.0, 40.0, 1.5e9]
        metrics = {name: dict(unit=unit, value=f"{v:,.2f}") for (_, name, unit, _), v in zip(readme_table.COUNTERS, values)}
        return dict(gemm=gemm, grouping="dirichlet", variant=variant, kernel="k", metrics=metrics)

    results = dict(device="NVIDIA H200", commit="abc1234", command="ncu ...", tool="Nsight Compute",
                   shape=dict(m=1, d=2, f=3, E=4),
                   launches=[launch("up", "sm90", 900, 70.0), launch("up", "cublas_batched", 800, 80.0),
                             launch("up", "cublas_batched", 600, 90.0), launch("dx", "sm90", 700, 85.0)])
    rows = [line for line in readme_table.render_gemm_counters(results, "profile.json").splitlines() if line.startswith("| up")
            or line.startswith("| dx")]
    assert rows == [
        "| up, dirichlet | 0.900 ms | 70% | 50% | 40% | 1.50 GHz | 0.600 ms | 90% | 50% | 40% | 1.50 GHz |",
        "| dx, dirichlet | 0.700 ms | 85% | 50% | 40% | 1.50 GHz | — | — | — | — | — |",
    ]


def test_counters_refuse_a_metric_in_another_unit():
    launch = dict(kernel="k", metrics={readme_table.COUNTERS[0][1]: dict(unit="us", value="900")})
    with pytest.raises(ValueError, match="should be recorded in 'ns'"):
        readme_table.counter(launch, *readme_table.COUNTERS[0][1:])


def test_gemm_ceilings_leave_the_sum_out_when_a_gemm_is_missing():
    timed = dict(variants=dict(sm90=dict(ms=2.0), cublas_batched=dict(ms=1.0), cublas_dense=dict(ms=0.5)))
    results = dict(RUN, shapes=[dict(shape=dict(m=1024, d=256, f=512, E=4), grouping="equal",
                                     group_sizes=[256] * 4, gemms=dict(up=timed))])
    row = [line for line in readme_table.render_gemm_ceilings(results, "ceilings.json").splitlines() if line.startswith("| 1024")][0]
    assert row == "| 1024, 256, 512, 4, equal | 1.000 (1.000) | 2.000 ms (0.50 / 0.25) | — | — | — | — | — | — |"


def test_tile_sweep_puts_the_fastest_of_each_kind_beside_the_chosen_config():
    def row(config, ms, tile_n, tile_k=64, ab_stages=4, store_stages=2, cluster_n=1):
        fields = dict(tile_n=tile_n, tile_k=tile_k, ab_stages=ab_stages, store_stages=store_stages, cluster_n=cluster_n)
        return dict(shape=[1024, 256, 768, 4], gemm="up", config=config, ms=ms, fields=fields)

    results = dict(RUN, rows=[
        row("chosen", 1.0, 256, ab_stages=3), row("128x192 ab4", 0.9, 192), row("128x192 ab5", 0.95, 192, ab_stages=5),
        row("chosen k32 ab7", 0.8, 256, tile_k=32, ab_stages=7), row("128x192 k32 ab9", 0.85, 192, tile_k=32, ab_stages=9),
        row("chosen store1 ab4", 1.1, 256, store_stages=1), row("128x192 ab4 cluster2", 1.2, 192, cluster_n=2),
    ])
    (line,) = [line for line in readme_table.render_gemm_tiles(results, "sweep.json").splitlines() if line.startswith("| 1024")]
    assert line == (
        "| 1024, 256, 768, 4, up | 1.000 ms, 128x256, 3 stages | — | 0.900 ms (0.90), 128x192, 4 stages | — "
        "| 0.800 ms (0.80), 128x256, 7 stages | 1.100 ms (1.10), 128x256, 4 stages | 1.200 ms (1.20), 128x192, 4 stages |"
    )


def test_quack_table_pairs_each_gemm_and_sums_the_contraction():
    def timed(ours, quack, config=(128, 192, True, 2, 1)):
        return dict(variants=dict(sm90=dict(ms=ours), cublas_batched=dict(ms=ours / 2),
                                  quack=dict(ms=quack, config=list(config))))

    gemms = dict(up=dict(variants=dict(sm90=dict(ms=1.0), quack=dict(error="TypeError", stage="run"))),
                 down=timed(1.0, 1.1), dw1=timed(1.0, 2.0), dw2=timed(3.0, 2.0, (128, 256, False, 2, 1)))
    results = dict(RUN, shapes=[dict(shape=dict(m=1024, d=256, f=512, E=4), grouping="dirichlet",
                                     group_sizes=[256] * 4, gemms=gemms)])
    lines = readme_table.render_quack(results, "quack.json").splitlines()
    (row,) = [line for line in lines if line.startswith("| 1024")]
    assert row == ("| 1024, 256, 512, 4, dirichlet | 1.000 ms / failed (run) | 1.000 / 1.100 ms (1.10; 0.50) | "
                   "not run / not run | not run / not run | 1.000 / 2.000 ms (2.00; 0.50) | "
                   "3.000 / 2.000 ms (0.67; 0.50) | 4.000 / 4.000 ms (1.00; 0.50) |")
    assert lines[-1] == "QuACK's fastest configuration: 128x192 ping-pong in 2 cells, 128x256 cooperative in 1 cell."


def test_a_gzipped_record_is_read_as_its_json(tmp_path):
    import gzip

    path = tmp_path / "run.json.gz"
    path.write_bytes(gzip.compress(json.dumps(dict(RUN, shapes=[])).encode()))
    assert readme_table.load_record(path) == dict(RUN, shapes=[])


def test_contraction_choices_put_each_alternative_over_the_chosen_config():
    def row(config, ms, tile_n=256, a_fastest=False, cluster_n=1):
        fields = dict(tile_n=tile_n, tile_k=32, ab_stages=6, store_stages=8, a_fastest=a_fastest, cluster_n=cluster_n)
        return dict(shape=[1024, 256, 768, 256], gemm="dw2", config=config, ms=ms, fields=fields)

    results = dict(RUN, rows=[
        row("chosen", 2.0, a_fastest=True), row("128x192 k32 ab8 whole", 2.2, 192, a_fastest=True),
        row("chosen b-fastest", 1.9), row("chosen cluster2", 2.1, a_fastest=True, cluster_n=2),
        dict(row("chosen", 1.0), gemm="dw1"), dict(row("chosen a-fastest", 1.5, a_fastest=True), gemm="dw1"),
    ])
    # A row whose chosen config is a candidate (here the 192-wide one) lacks that column: the
    # column keeps its place in the sweep's order when a later row brings it.
    first, *rest = readme_table.render_contract_choices(dict(RUN, rows=[
        dict(row("chosen", 1.0, 192), gemm="dw1"), dict(row("128x256 k32 ab6 whole", 1.2), gemm="dw1"),
        row("chosen", 2.0), row("128x192 k32 ab8 whole", 2.2, 192), row("128x256 k32 ab7 ring3", 1.8),
    ]), "sweep.json").splitlines()[2:3]
    assert first == "| (m, d, f, E), GEMM | chosen | 128x192 k32 ab8 whole | 128x256 k32 ab6 whole | 128x256 k32 ab7 ring3 |"
    lines = readme_table.render_contract_choices(results, "sweep.json").splitlines()
    assert lines[2] == ("| (m, d, f, E), GEMM | chosen | 128x192 k32 ab8 whole | chosen tiles, other walk | "
                        "chosen tiles, other cluster size |")
    assert lines[4] == ("| 1024, 256, 768, 256, dw2 | 2.000 ms, 128x256, 32-row stages x 6, 8 store buffers, "
                        "a-block fastest | 1.100 | 0.950 | 1.050 |")
    assert lines[5] == "| 1024, 256, 768, 256, dw1 | 1.000 ms, 128x256, 32-row stages x 6, 8 store buffers | — | 1.500 | — |"


def test_deterministic_rounds_put_each_mode_and_the_contraction_side_by_side():
    def run(round_, default, det):
        def entry(ms):
            return dict(ms=ms, kernels=[["kernel_ragged_matmul", ms / 2], ["kernel_ragged_contract_a", ms / 8],
                                        ["kernel_ragged_contract_b", ms / 8]])
        shape = dict(shape=dict(m=1024, d=256, f=512, E=4),
                     modes=dict(step=dict(variants=dict(sm90=entry(default), sm90_det=entry(det)))))
        return dict(RUN, command=f"python3 bench_layer.py --out /root/out/r{round_} --reps 5", shapes=[shape])

    lines = readme_table.render_det_rounds([run(10, 4.0, 4.4), run(2, 8.0, 8.0)], "rounds_r*.json").splitlines()
    assert "`python3 bench_layer.py --out <dir>/r<round> --reps 5`" in lines[0]
    assert lines[4] == "| 1024, 256, 512, 4 | 2 | 8.000 ms | 8.000 ms | 1.000 | 2.000 / 2.000 ms |"
    assert lines[5] == "| 1024, 256, 512, 4 | 10 | 4.000 ms | 4.400 ms | 1.100 | 1.000 / 1.100 ms |"
