"""Writes the README's Hopper results from the recorded benchmark JSON; no figure by hand.

    python benchmarks/readme_table.py            # rewrites README.md between the sm90 markers
    python benchmarks/readme_table.py --check    # fails if README.md is out of date
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "bench_dsrelu.json"
README = ROOT / "README.md"
START, END = "<!-- sm90:start -->", "<!-- sm90:end -->"
VARIANTS = [
    ("xla", "XLA backend"),
    ("pallas+xla", "Pallas ragged_dot_mgpu + XLA epilogue"),
    ("sm90", "sm90"),
    ("sm90_det", "sm90, deterministic"),
    ("cublas_dense", "dense cuBLAS GEMM, same FLOPs"),
]


def render(results: dict) -> str:
    lines = [
        f"Measured on an {results['device']} (JAX {results['jax']}), commit `{results['commit']}`, "
        f"bf16, ragged (Dirichlet) group sizes, all variants on the same inputs in one process: "
        f"`{results['command']}` ({results['timing']}). Raw results: "
        "`benchmarks/results/bench_dsrelu.json`; this table is generated from them by "
        "`benchmarks/readme_table.py`.",
        "",
        "| shape (m, k, n, E) | " + " | ".join(name for _, name in VARIANTS) + " |",
        "| --- |" + " --- |" * len(VARIANTS),
    ]
    for entry in results["shapes"]:
        shape = entry["shape"]
        cells = [
            f"{entry['ms'][key]:.3f} ms ({entry['tflops'][key]:.0f} TFLOP/s)" for key, _ in VARIANTS
        ]
        lines.append(f"| {shape['m']}, {shape['k']}, {shape['n']}, {shape['E']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| shape | sm90 / cuBLAS throughput | deterministic / cuBLAS | cost of determinism | "
        "sm90 vs Pallas + XLA | sm90 vs XLA |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for entry in results["shapes"]:
        shape, r = entry["shape"], entry["ratios"]
        lines.append(
            f"| {shape['m']}, {shape['k']}, {shape['n']}, {shape['E']} "
            f"| {r['sm90_vs_cublas_throughput']:.1%} | {r['sm90_det_vs_cublas_throughput']:.1%} "
            f"| {r['det_overhead']:+.1%} | {r['speedup_vs_pallas']:.2f}x | {r['speedup_vs_xla']:.1f}x |"
        )
    lines += ["", "![sm90 benchmark](benchmarks/results/bench_dsrelu.png)"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    readme = README.read_text()
    head, rest = readme.split(START)
    _, tail = rest.split(END)
    updated = f"{head}{START}\n{render(json.loads(RESULTS.read_text()))}\n{END}{tail}"
    if args.check:
        if updated != readme:
            sys.exit("README.md's sm90 results differ from benchmarks/results: run benchmarks/readme_table.py")
        return
    README.write_text(updated)


if __name__ == "__main__":
    main()
