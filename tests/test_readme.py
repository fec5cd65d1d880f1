"""The documentation's benchmark tables are rendered from the records in benchmarks/results
(tests/test_docs_run.py runs its Python blocks)."""

from __future__ import annotations

import gzip
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import readme_table  # noqa: E402
import run_record  # noqa: E402

RUN = dict(device="NVIDIA H200", jax="0.11.2", commit="abc1234", command="python3 bench.py",
           timing="CUPTI kernel time")
SHAPE = dict(m=1024, d=256, f=512, E=4)


def test_every_table_matches_its_records():
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "readme_table.py"), "--check"], check=True)


def timed(ms, **extra):
    return dict(ms=ms, tflops=100.0 / ms, kernel_summary=[["kernel_RaggedGemmSm90_x", ms * 0.75], ["copy", ms * 0.25]],
                **extra)


def layer_record(step: dict, precision: dict | None = None) -> dict:
    record = dict(RUN, flops="12 m d f per step", shapes=[dict(shape=SHAPE, grouping="dirichlet",
                                                               modes=dict(step=dict(variants=step)))])
    return record if precision is None else dict(record, precision=precision)


def gemms_record(variants_by_gemm: dict) -> dict:
    gemms = {gemm: dict(variants=variants) for gemm, variants in variants_by_gemm.items()}
    return dict(RUN, flops="2 m d f per GEMM", contract_out_dtype="bfloat16",
                shapes=[dict(shape=SHAPE, grouping="dirichlet", gemms=gemms)])


def rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| 1024")]


def test_a_baseline_without_a_stated_precision_is_not_shown():
    # A record from before the precision field: its float32-output dense MLP is left out,
    # ours and the library's XLA backend are shown (they have always computed alike).
    old = layer_record(dict(sm90=timed(2.0), sm90_det=timed(2.1), xla=timed(8.0), dense_xla=timed(4.0)))
    (row,) = rows(readme_table.render_layer([("bench_layer.json", old)]))
    assert row == "| 1024, 256, 512, 4, dirichlet | 2.000 ms (50) | 2.100 ms (48) | 8.000 ms (12) | +5.0% |"
    new = layer_record(dict(sm90=timed(2.0), dense_mlp=timed(4.0, )), precision=dict(sm90="bf16", dense_mlp="bf16 too"))
    text = readme_table.render_layer([("bench_layer.json", new)])
    assert rows(text) == ["| 1024, 256, 512, 4, dirichlet | 2.000 ms (50) | 4.000 ms (25) | — | 0.50x |"]
    assert "Precision: sm90: bf16; dense bf16 MLP: bf16 too." in text
    assert "- 1024, 256, 512, 4, dirichlet (2.000 ms): sm90 ragged GEMM 1.500, all else 0.500 ms" in text


def test_the_summary_sets_the_step_beside_bf16_cublas_and_says_where_ours_is_slower():
    step = layer_record(dict(sm90=timed(2.0), cublas_dense=timed(1.6), cublas_batched=timed(2.5)),
                        precision=dict(sm90="bf16", cublas_dense="bf16", cublas_batched="bf16"))
    text = readme_table.render_summary([("bench_layer.json", step)])
    assert rows(text) == ["| 1024, 256, 512, 4 | 2.000 ms (50) | — | 1.600 ms (62) | 2.500 ms (40) | 1.25x | 0.80x |"]
    assert ("Our step is slower than the six dense GEMMs at 1 of the 1 shapes where they were timed (1.25x-1.25x "
            "their time) and than the batched GEMMs at 0 of the 1 shapes") in text
    # A ceiling the record did not time (or of unknown precision) is pending, never borrowed.
    step = layer_record(dict(sm90=timed(2.0), sm90_det=timed(2.0), cublas_dense=timed(1.6)))
    text = readme_table.render_summary([("bench_layer.json", step)])
    assert rows(text) == ["| 1024, 256, 512, 4 | 2.000 ms (50) | 2.000 ms (50) | pending | pending | — | — |"]
    assert "Our step is slower" not in text


def test_the_gemm_table_sums_the_six_gemms_only_where_all_were_timed():
    failed = dict(error="NotImplementedError: backend 'sm90' does not serve it", stage="build")
    record = gemms_record({gemm: dict(sm90=dict(ms=1.0, tflops=1.0), cublas_dense=dict(ms=0.5, tflops=2.0))
                           for gemm in readme_table.GEMMS})
    text = readme_table.render_gemms([("bench_gemms.json", record)])
    assert rows(text)[-1] == "| 1024, 256, 512, 4, dirichlet | all six | 6.000 ms | 3.000 ms | 2.00x |"
    record["shapes"][0]["gemms"]["up"]["variants"]["sm90"] = failed
    lines = rows(readme_table.render_gemms([("bench_gemms.json", record)]))
    assert lines[0] == "| 1024, 256, 512, 4, dirichlet | up | not built | 0.500 ms (2) | — |"
    assert lines[-1] == "| 1024, 256, 512, 4, dirichlet | all six | — | 3.000 ms | — |"


def test_quack_sentence_counts_the_ragged_m_cases_and_sums_the_contraction():
    pairs = dict(up=(1.0, 1.1), down=(1.0, 0.9), dsrelu=(1.0, 2.0), dx=(None, 1.0), dw1=(1.0, 1.0), dw2=(3.0, 2.0))
    record = gemms_record({gemm: {k: dict(ms=v) for k, v in zip(("sm90", "quack"), times) if v}
                           for gemm, times in pairs.items()})
    text = readme_table.render_quack([("bench_gemms_quack.json", record)])
    assert "ours took less time in 2 of the 3 ragged-M and fused-backward cases" in text
    assert "(dW1 + dW2) took 1.333x-1.333x QuACK's varlen-K time" in text


def determinism_record(commit, kernel_cache, example_digests, layer_digests):
    def process(layer):
        return dict(results=dict(primitive_sm90=dict(digest="p"), example_layer_grads=dict(digest=layer)))

    return dict(device="NVIDIA H200", commit=commit, processes=len(example_digests), xla_flags="default",
                kernel_cache=kernel_cache, digests=[process(d) if d else None for d in layer_digests],
                example_digests=example_digests)


def test_the_determinism_table_counts_distinct_digests_per_run():
    runs = [("warm.json", determinism_record("aaa1111", "warm", ["x", "y", "x"], ["l", "m", "l"])),
            ("fresh.json", determinism_record("bbb2222", "fresh", ["z", "z", None], ["l", None, "l"]))]
    text = readme_table.render_determinism(runs)
    assert ("| computation | `aaa1111`: kernels from the disk cache | `bbb2222`: kernels compiled in each process |"
            in text)
    assert "| `grouped_gemm_dsrelu` on sm90, every output | identical in 3 | identical in 2 (of 3 started) |" in text
    assert "every gradient, XLA's default compile | **2 distinct** in 3 | identical in 2 (of 3 started) |" in text
    assert "final parameters | **2 distinct** in 3 | identical in 2 (of 3 started) |" in text
    assert "`moe_mlp` step on the sm90 kernels, every gradient | not run | not run |" in text


def test_the_tuning_table_holds_every_decision():
    from jax_dsrelu.kernels.sm90 import tuning

    text = readme_table.render_tuning([])
    assert [line.split(" | ")[0] for line in text.splitlines()[4:]] == [f"| `{d.name}`" for d in tuning.DECISIONS]


def write(directory, name, record, gzipped=False):
    data = json.dumps(record).encode()
    (directory / (name + ".gz" if gzipped else name)).write_bytes(gzip.compress(data) if gzipped else data)


DOCUMENT = "intro\n<!-- gemms:start -->\nold\n<!-- gemms:end -->\nmiddle\n<!-- layer:start -->\nold\n<!-- layer:end -->\n"


def test_tables_are_rendered_between_their_markers_from_plain_or_gzipped_records(tmp_path):
    write(tmp_path, "bench_layer.json", layer_record(dict(sm90=timed(2.0))), gzipped=True)
    text = readme_table.updated_document(DOCUMENT, "docs/performance.md", tmp_path)
    # No bench_gemms record: its table is left as it is.
    assert text.startswith("intro\n<!-- gemms:start -->\nold\n<!-- gemms:end -->\nmiddle\n<!-- layer:start -->\n")
    assert "| 1024, 256, 512, 4, dirichlet | 2.000 ms (50) | — |" in text
    # Rendering again from the same records changes nothing: what --check relies on.
    assert readme_table.updated_document(text, "docs/performance.md", tmp_path) == text
    with pytest.raises(SystemExit, match="layer:start"):
        readme_table.updated_document("no markers here\n", "docs/performance.md", tmp_path)


def test_a_large_record_is_written_gzipped_and_replaces_the_plain_one(tmp_path):
    small, large = dict(RUN, shapes=[]), dict(RUN, shapes=["x" * run_record.GZIP_BYTES])
    assert run_record.write_json(small, str(tmp_path), "bench.json").endswith("bench.json")
    path = run_record.write_json(large, str(tmp_path), "bench.json")
    assert path.endswith("bench.json.gz") and not (tmp_path / "bench.json").exists()
    assert run_record.load(path) == large
    run_record.write_json(small, str(tmp_path), "bench.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
