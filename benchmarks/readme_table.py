"""Writes the documentation's benchmark results from the recorded JSON; no figure by hand.

Each table sits between its markers in its document and is generated from the JSON in
benchmarks/results/ that `TABLES` names (a name with a * takes every match, in a list);
its renderer is given that name, which the table's provenance line cites. A table whose
JSON has not been recorded yet is left as it is.

    python benchmarks/readme_table.py            # rewrites the documents between the markers
    python benchmarks/readme_table.py --check    # fails if a document is out of date
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import pathlib
import sys
from typing import Callable

import contract_alternatives

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
VARIANTS = [
    ("xla", "XLA backend"),
    ("pallas+xla", "Pallas ragged_dot_mgpu + XLA epilogue"),
    ("sm90", "sm90"),
    ("sm90_det", "sm90, deterministic"),
    ("cublas_dense", "dense cuBLAS GEMM, same FLOPs"),
]
GEMM_VARIANTS = [
    ("sm90", "sm90"),
    ("pallas", "Pallas"),
    ("xla", "XLA ragged_dot"),
    ("cublas_dense", "dense cuBLAS, same FLOPs"),
]
GEMM_ROWS = {
    "up": "up: x @ W1[e], squared-ReLU epilogue",
    "down": "down: act @ W2[e]",
    "dsrelu": "dsReLU backward (fused)",
    "dx": "dx: dh @ W1[e]^T",
    "dw1": "dW1: x^T dh per expert",
    "dw2": "dW2: act^T dy per expert",
}
LAYER_VARIANTS = [
    ("xla", "XLA backend"),
    ("sm90", "sm90"),
    ("sm90_det", "sm90, deterministic"),
    ("pallas", "Pallas MLP"),
    ("dense_xla", "XLA dense MLP, same FLOPs"),
]
# Kernel names in the breakdown: enough to tell the kernels apart.
# CuTe DSL kernel names carry the class name deep inside a long mangled string.
KERNEL_CLASSES = {
    "RaggedGemmSm90": "sm90 ragged GEMM",
    "RaggedContractSm90": "sm90 ragged contraction",
    "GroupedGemmDsreluSm90": "sm90 fused dsReLU",
    "SlotReduction": "slot reduction",
}
KERNEL_NAME_CHARS = 48


def kernel_label(name: str) -> str:
    """A kernel's name as a reader knows it: our kernels by class, others by XLA's name."""
    for cls, label in KERNEL_CLASSES.items():
        if cls in name:
            return label
    return name[:KERNEL_NAME_CHARS]
GIB = 2**30


def provenance(results: dict, json_name: str, what: str) -> str:
    return (
        f"Measured on an {results['device']} (JAX {results['jax']}), commit `{results['commit']}`, "
        f"{what}, all variants on the same inputs in one process: `{results['command']}` "
        f"({results['timing']}). Raw results: `benchmarks/results/{json_name}`; this table is generated "
        "from them by `benchmarks/readme_table.py`."
    )


def sweeps_provenance(results: list, json_name: str, what: str) -> str:
    """`provenance` for a table drawn from several JSON, each a run of its own command."""
    commits = list(dict.fromkeys(f"`{run['commit']}`" for run in results))
    commands = "; ".join(f"`{run['command']}`" for run in results)
    return (
        f"Measured on an {results[0]['device']} (JAX {results[0]['jax']}), commit{'s' * (len(commits) > 1)} "
        f"{', '.join(commits)}, {what}, all variants on the same inputs in one process: {commands} "
        f"({results[0]['timing']}). Raw results: `benchmarks/results/{json_name}`; this table is generated "
        "from them by `benchmarks/readme_table.py`."
    )


def shape_text(shape: dict, keys: str) -> str:
    return ", ".join(str(shape[key]) for key in keys)


def cell(entry: dict | None, with_tflops: bool = True) -> str:
    """One variant's time, or why there is none."""
    if entry is None:
        return "not run"
    if "ms" in entry:
        return f"{entry['ms']:.3f} ms ({entry['tflops']:.0f})" if with_tflops else f"{entry['ms']:.3f} ms"
    if entry.get("stage") == "build" and entry.get("error", "").startswith("NotImplementedError"):
        return "not built"
    return f"failed ({entry.get('stage', 'error')})"


def signed_percent(value: float) -> str:
    """+x.x%, with a change that rounds to zero written +0.0% whatever its sign."""
    return f"{value if round(value, 3) else 0.0:+.1%}"


def ratio(value: float | None, style: str) -> str:
    if value is None:
        return "—"
    return f"{value:.1%}" if style == "percent" else f"{value:.2f}x"


def render_dsrelu(results: dict, source: str) -> str:
    lines = [
        provenance(results, source, "bf16, ragged (Dirichlet) group sizes"),
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
    lines += ["", "![sm90 benchmark](benchmarks/results/" + source.removesuffix(".json") + ".png)"]
    return "\n".join(lines)


def render_gemms(results: dict, source: str) -> str:
    lines = [
        provenance(results, source,
                   f"bf16 operands, ragged (Dirichlet) group sizes, dW in {results['contract_out_dtype']}"),
        "Each cell: time per GEMM (TFLOP/s at 2 m d f). Pallas: ragged_dot_mgpu, or "
        "transposed_ragged_dot_mgpu for dW1 and dW2, best of its block configurations; the up "
        "and dsReLU rows add their epilogue in XLA. The dsReLU row's sm90 is "
        "`deterministic=False`.",
        "",
        "| shape (m, d, f, E) | GEMM | " + " | ".join(name for _, name in GEMM_VARIANTS)
        + " | sm90 / cuBLAS throughput | sm90 vs Pallas |",
        "| --- | --- |" + " --- |" * (len(GEMM_VARIANTS) + 2),
    ]
    for row in results["shapes"]:
        shape = shape_text(row["shape"], "mdfE")
        for gemm, entry in row["gemms"].items():
            variants, ratios = entry.get("variants", {}), entry.get("ratios", {})
            cells = [cell(variants.get(key)) for key, _ in GEMM_VARIANTS]
            if "error" in entry:  # the XLA reference itself failed
                cells = [f"failed ({entry['stage']})"] * len(GEMM_VARIANTS)
            lines.append(
                f"| {shape} | {GEMM_ROWS.get(gemm, gemm)} | " + " | ".join(cells)
                + f" | {ratio(ratios.get('sm90_vs_cublas_throughput'), 'percent')}"
                + f" | {ratio(ratios.get('sm90_speedup_vs_pallas'), 'times')} |"
            )
    lines += ["", "![grouped GEMM benchmark](benchmarks/results/" + source.removesuffix(".json") + ".png)"]
    return "\n".join(lines)


def render_layer(results: dict, source: str) -> str:
    lines = [
        provenance(results, source,
                   "bf16 with b1, ragged (Dirichlet) group sizes; a step is `jax.value_and_grad` in "
                   "x, w1, b1, w2 and prob"),
        f"Throughput counts {results['flops']}. Peak memory: {results['memory']}. The Pallas MLP "
        f"runs its GEMMs on Pallas kernels and these parts in XLA: {results['pallas_in_xla']}.",
    ]
    modes = list(results["shapes"][0]["modes"]) if results["shapes"] else []
    for mode in modes:
        lines += [
            "",
            f"| {mode}: shape (m, d, f, E) | " + " | ".join(name for _, name in LAYER_VARIANTS) + " |",
            "| --- |" + " --- |" * len(LAYER_VARIANTS),
        ]
        for row in results["shapes"]:
            variants = row["modes"][mode]["variants"]
            lines.append(
                f"| {shape_text(row['shape'], 'mdfE')} | "
                + " | ".join(cell(variants.get(key)) for key, _ in LAYER_VARIANTS) + " |"
            )
    if "step" in modes:
        lines += [
            "",
            "| step: shape | peak memory (GiB): " + " / ".join(name for _, name in LAYER_VARIANTS[:4])
            + " | sm90 vs XLA | sm90 vs dense MLP | cost of determinism |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in results["shapes"]:
            step = row["modes"]["step"]
            peaks = [
                f"{step['variants'][key]['memory']['peak_bytes'] / GIB:.2f}"
                if "peak_bytes" in step["variants"].get(key, {}).get("memory", {}) else "—"
                for key, _ in LAYER_VARIANTS[:4]
            ]
            r = step["ratios"]
            det = r.get("det_overhead")
            lines.append(
                f"| {shape_text(row['shape'], 'mdfE')} | {' / '.join(peaks)} "
                f"| {ratio(r.get('sm90_speedup_vs_xla'), 'times')} "
                f"| {ratio(r.get('sm90_speedup_vs_dense_xla'), 'times')} "
                f"| {'—' if det is None else f'{det:+.1%}'} |"
            )
        breakdown = []
        for row in results["shapes"]:
            entry = row["modes"]["step"]["variants"].get("sm90", {})
            if entry.get("kernel_summary"):
                parts = [f"`{kernel_label(name)}` {ms:.3f} ms" for name, ms in entry["kernel_summary"][:5]]
                breakdown.append(f"- {shape_text(row['shape'], 'mdfE')} ({entry['ms']:.3f} ms): " + ", ".join(parts))
        if breakdown:
            lines += ["", "Where the sm90 step's time goes (CUPTI, per kernel name, largest first):", "", *breakdown]
    lines += ["", "![layer benchmark](benchmarks/results/" + source.removesuffix(".json") + ".png)"]
    return "\n".join(lines)


# What benchmarks/process_digests.py digests, as the determinism table names it: its row,
# and a short name.
DIGESTED = {
    "primitive_sm90": ("`grouped_gemm_dsrelu` on sm90, every output", "the primitive"),
    "moe_mlp_grads_sm90": ("`moe_mlp` step on the sm90 kernels, every gradient", "the `moe_mlp` step"),
    "example_layer_grads": ("train_moe's layer (router, routing, `moe_mlp`, combine), every gradient, XLA's "
                            "default compile", "the layer with XLA's default compile"),
    "example_layer_grads_reproducible": ("the same, compiled with `train_moe.REPRODUCIBLE_COMPILATION`",
                                         "the layer with autotuning off"),
    "router_dot_f32": ("the router's float32 GEMM alone (XLA's own)", "the router's GEMM"),
}
EXAMPLE_ROW = ("`train_moe.py --dtype bfloat16 --deterministic`: final parameters", "train_moe's final parameters")


def render_determinism(records: list[dict], source: str) -> str:
    """One column per recorded run of determinism_parallel.sh: for each computation, how
    many distinct results its processes gave (1: bitwise identical), and whether any
    process saw its own repeated calls differ."""

    def kernel_source(record):
        # Runs recorded before the script took a mode say it through their digests alone.
        if "kernel_cache" in record:
            return record["kernel_cache"]
        compiled = [d.get("kernels_compiled_in_process") for d in record["digests"] if d]
        return "warm" if compiled and not any(compiled) else "fresh"

    def label(record):
        flags = "XLA's default flags" if record["xla_flags"] == "default" else f"`XLA_FLAGS={record['xla_flags']}`"
        kernels = "from the disk cache" if kernel_source(record) == "warm" else "compiled in each process"
        return f"`{record['commit']}`: kernels {kernels}, {flags}"

    def across(values, processes):
        reported = [v for v in values if v is not None]
        if not reported:
            return "not run"
        distinct = len(set(reported))
        text = f"identical in {len(reported)}" if distinct == 1 else f"**{distinct} distinct** in {len(reported)}"
        return text + ("" if len(reported) == processes else f" (of {processes} started)")

    def entries(record, name):
        """Each process's result for one computation (None where it reported none)."""
        return [(d or {}).get("results", {}).get(name) for d in record["digests"]]

    def digests(record, name):
        """Each process's digest for one row (None where it reported none)."""
        if name == EXAMPLE_ROW:
            return record["example_digests"]
        return [e["digest"] if e and "digest" in e else None for e in entries(record, name)]

    def digest_cell(record, name):
        text = across(digests(record, name), record["processes"])
        if any(e and e.get("distinct_in_process", 1) > 1 for e in entries(record, name)):
            text += ", varies within a process"
        return text

    def example_cell(record):
        options = record.get("example_compiler_options")
        compiled = f" (its step compiled with `{json.dumps(options)}`)" if options else ""
        return across(digests(record, EXAMPLE_ROW), record["processes"]) + compiled

    runs = sorted({d["results"][n]["runs"] for r in records for d in r["digests"] if d
                   for n in d["results"] if "runs" in d["results"][n]})
    lines = [
        f"Measured on an {records[0]['device']} by `benchmarks/determinism_parallel.sh`: fresh processes side by "
        "side, each computing the same inputs' results and its digest (`benchmarks/process_digests.py`, "
        f"{' or '.join(map(str, runs))} calls per process), and as many whole training runs of "
        "`examples/train_moe.py`. Each cell: how many distinct digests the processes gave. Raw results: "
        "`benchmarks/results/determinism/`; this table is generated from them by `benchmarks/readme_table.py`.",
        "",
        "| computation | " + " | ".join(label(r) for r in records) + " |",
        "| --- |" + " --- |" * len(records),
    ]
    for name, (text, _) in DIGESTED.items():
        lines.append(f"| {text} | " + " | ".join(digest_cell(r, name) for r in records) + " |")
    lines.append(f"| {EXAMPLE_ROW[0]} | " + " | ".join(example_cell(r) for r in records) + " |")

    # Columns of one commit compared with each other: the same digests in every process?
    for commit in dict.fromkeys(r["commit"] for r in records):
        group = [r for r in records if r["commit"] == commit]
        if len(group) < 2:
            continue
        rows = [*DIGESTED, EXAMPLE_ROW]
        agreeing = [name for name in rows
                    if all(any(digests(r, name)) for r in group)
                    and len({d for r in group for d in digests(r, name) if d}) == 1]
        processes = sum(r["processes"] for r in group)
        named = ", ".join(DIGESTED.get(name, EXAMPLE_ROW)[1] for name in agreeing) or "none"
        lines += ["", f"At `{commit}` the {len(group)} columns together ({processes} processes) give one digest "
                      f"for: {named}."]
    return "\n".join(lines)


def render_summary(results: dict, source: str) -> str:
    """The front page's table: the moe_mlp step on the kernels, both modes, against XLA's dense and batched GEMMs."""
    lines = [
        f"A `moe_mlp` training step (`jax.value_and_grad`, bf16 with b1, ragged group sizes) on an "
        f"{results['device']}, CUPTI kernel time, commit `{results['commit']}` "
        f"([docs/performance.md](docs/performance.md) has every table and how each was measured):",
        "",
        "| shape (m, d, f, E) | sm90 | sm90, deterministic | cost of determinism | vs XLA dense MLP, same FLOPs "
        "| vs XLA's batched GEMMs over equal experts (the faster build) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["shapes"]:
        c = step_cells(row)
        lines.append(f"| {c['shape']} | {c['sm90']} | {c['sm90_det']} | {c['det']} | {c['vs_dense']} | {c['vs_batched']} |")
    return "\n".join(lines)


def step_breakdown(entry: dict) -> str:
    """Where a step's time goes: our kernels by class, then everything else together."""
    ours = [(kernel_label(name), ms) for name, ms in entry["kernel_summary"] if kernel_label(name) != name[:KERNEL_NAME_CHARS]]
    rest = entry["ms"] - sum(ms for _, ms in ours)
    return ", ".join(f"{label} {ms:.3f}" for label, ms in ours) + f", all else {rest:.3f} ms"


def best_batched_speedup(ratios: dict) -> float | None:
    """sm90's speedup over the faster of XLA's two batched ceilings."""
    found = [ratios[k] for k in ("sm90_speedup_vs_batched_xla", "sm90_speedup_vs_batched_cublas") if k in ratios]
    return min(found) if found else None


def step_cells(row: dict) -> dict[str, str]:
    """The cells of one shape's moe_mlp step, as both step tables write them."""
    step = row["modes"]["step"]
    variants, r = step["variants"], step["ratios"]
    det = r.get("det_overhead")
    cells = {key: cell(variants.get(key)) for key in ("sm90", "sm90_det", "dense_xla", "batched_xla", "batched_cublas")}
    return dict(
        cells,
        shape=shape_text(row["shape"], "mdfE"),
        det="—" if det is None else signed_percent(det),
        vs_dense=ratio(r.get("sm90_speedup_vs_dense_xla"), "times"),
        vs_batched=ratio(best_batched_speedup(r), "times"),
    )


def render_layer_steps(results: dict, source: str) -> str:
    """The moe_mlp step at every benchmark shape, against the dense and the batched XLA ceilings."""
    lines = [
        provenance(results, source,
                   "bf16 with b1; a step is `jax.value_and_grad` in x, w1, b1, w2 and prob"),
        f"Throughput counts {results['flops']}. XLA dense MLP: one (m, d) x (d, f) MLP of the same FLOPs; "
        "XLA batched: the experts as E equal batches of m / E rows, batched GEMMs with no ragged edges, "
        "as XLA compiles them and with every GEMM on cuBLAS (Triton GEMM fusion off).",
        "",
        "| step: shape (m, d, f, E), groups | sm90 | sm90, deterministic | cost of determinism "
        "| XLA dense MLP | XLA batched, equal experts | the same on cuBLAS | sm90 vs dense | sm90 vs best batched |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["shapes"]:
        c = step_cells(row)
        lines.append(
            f"| {c['shape']}, {row.get('grouping', 'dirichlet')} | {c['sm90']} | {c['sm90_det']} | {c['det']} "
            f"| {c['dense_xla']} | {c['batched_xla']} | {c['batched_cublas']} | {c['vs_dense']} | {c['vs_batched']} |"
        )
    lines += ["", "Where the sm90 step's time goes (CUPTI, ms):", ""]
    for row in results["shapes"]:
        entry = row["modes"]["step"]["variants"].get("sm90", {})
        if entry.get("kernel_summary"):
            lines.append(f"- {shape_text(row['shape'], 'mdfE')} ({entry['ms']:.3f} ms): {step_breakdown(entry)}")
    return "\n".join(lines)


def render_moe_block(results: dict, source: str) -> str:
    """The Nemotron-3-Nano block's step: ours in both modes, on XLA, and its GEMMs alone."""
    block = results["block"]
    names = dict(auto="library, backend auto (sm90)", auto_det="the same, deterministic",
                 xla="library, backend xla", gemms="its GEMMs alone in XLA (batched over equal experts)")
    lines = [
        f"Measured on an {results['device']} (JAX {results['jax']}), commit `{results['commit']}`: "
        f"`{results['command']}` ({results['timing']}). Raw results: `benchmarks/results/{source}`; "
        "this table is generated from them by `benchmarks/readme_table.py`. The block: "
        f"T = {block['tokens']} tokens, d = {block['d']}, {block['experts']} experts of f = {block['f']}, "
        f"top-{block['top_k']}, sigmoid scores with a selection bias, normalized, scale {block['scale']}, "
        f"a shared expert of {block['shared']}; a step is `jax.value_and_grad`; "
        f"throughput counts {results['flops']}.",
        "",
        "| variant | step | where the time goes (CUPTI, ms) |",
        "| --- | --- | --- |",
    ]
    for key, entry in results["variants"].items():
        detail = step_breakdown(entry) if key.startswith("auto") and "kernel_summary" in entry else ""
        lines.append(f"| {names.get(key, key)} | {cell(entry)} | {detail} |")
    return "\n".join(lines)


def rows_computed_per_row_stored(group_sizes: list[int], tile_rows: int) -> float:
    """What a ragged-M kernel computes per row it stores: every expert's rows are cut into
    whole tiles of `tile_rows`, the last one partly empty."""
    computed = sum(-(-size // tile_rows) * tile_rows for size in group_sizes if size > 0)
    return computed / sum(size for size in group_sizes if size > 0)


def gemm_times(row: dict, gemm: str, variants: tuple[str, ...]) -> dict:
    """Each named variant's time (ms) for one GEMM of a bench_gemms row; None where it has none."""
    recorded = row["gemms"].get(gemm, {}).get("variants", {})
    return {name: recorded.get(name, {}).get("ms") for name in variants}


def render_gemm_ceilings(results: dict, source: str) -> str:
    """Each GEMM of a layer step against cuBLAS on the same operands (a dense GEMM of the
    same FLOPs, and E equal batches), with what the ragged-M kernels' 128-row tiles pad."""
    gemms = list(GEMM_ROWS)
    lines = [
        provenance(results, source, "bf16"),
        "Each cell: sm90's time per call, then sm90's speed as a share of cuBLAS batched over E equal "
        "experts / of one dense cuBLAS GEMM of the same FLOPs (1.00: as fast). Padding: the rows the "
        "ragged-M kernels (up, down, dsrelu, dx) compute per row they store, with the 128-row tiles "
        "they use and with 64-row tiles.",
        "",
        "| shape (m, d, f, E), groups | padding, 128-row tiles (64-row) | " + " | ".join(gemms) + " | all six |",
        "| --- | --- |" + " --- |" * (len(gemms) + 1),
    ]
    compared = ("sm90", "cublas_batched", "cublas_dense")

    def share_cell(ms: dict) -> str:
        return f"{ms['sm90']:.3f} ms ({ms['cublas_batched'] / ms['sm90']:.2f} / {ms['cublas_dense'] / ms['sm90']:.2f})"

    for row in results["shapes"]:
        timed = {}
        for gemm in gemms:
            ms = gemm_times(row, gemm, compared)
            if all(ms.values()):
                timed[gemm] = ms
        cells = [share_cell(timed[gemm]) if gemm in timed else "—" for gemm in gemms]
        # The sum only where every GEMM was timed: a partial sum would compare unlike things.
        cells.append(share_cell({name: sum(ms[name] for ms in timed.values()) for name in compared})
                     if len(timed) == len(gemms) else "—")
        sizes = row["group_sizes"]
        padding = f"{rows_computed_per_row_stored(sizes, 128):.3f} ({rows_computed_per_row_stored(sizes, 64):.3f})"
        lines.append(f"| {shape_text(row['shape'], 'mdfE')}, {row['grouping']} | {padding} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_quack(results: dict, source: str) -> str:
    """Each GEMM of a layer step, ours beside QuACK's (quack_gemms.py) on the same operands,
    and the weight-gradient contraction's two GEMMs together."""
    gemms = list(GEMM_ROWS)
    lines = [
        provenance(results, source, "bf16"),
        "Each cell: sm90's time per call / QuACK's (the fastest of its configurations that passed its "
        "check), then QuACK's time over sm90's (above 1.00: sm90 faster), and sm90's share of cuBLAS "
        "batched over E equal experts.",
        "",
        "| shape (m, d, f, E), groups | " + " | ".join(gemms) + " | dw1 + dw2 |",
        "| --- |" + " --- |" * (len(gemms) + 1),
    ]
    winners: dict[str, int] = {}

    def pair_cell(ms: dict) -> str:
        return (f"{ms['sm90']:.3f} / {ms['quack']:.3f} ms ({ms['quack'] / ms['sm90']:.2f}; "
                f"{ms['cublas_batched'] / ms['sm90']:.2f})")

    for row in results["shapes"]:
        cells, contraction = [], {}
        for gemm in gemms:
            variants = row["gemms"].get(gemm, {}).get("variants", {})
            ms = gemm_times(row, gemm, ("sm90", "quack", "cublas_batched"))
            if all(ms.values()):
                cells.append(pair_cell(ms))
                label = "x".join(map(str, variants["quack"]["config"][:2])) + (
                    " ping-pong" if variants["quack"]["config"][2] else " cooperative")
                winners[label] = winners.get(label, 0) + 1
                if gemm in ("dw1", "dw2"):
                    contraction[gemm] = ms
            else:
                cells.append(f"{cell(variants.get('sm90'), False)} / {cell(variants.get('quack'), False)}")
        cells.append(pair_cell({name: sum(ms[name] for ms in contraction.values()) for name in contraction["dw1"]})
                     if len(contraction) == 2 else "—")
        lines.append(f"| {shape_text(row['shape'], 'mdfE')}, {row['grouping']} | " + " | ".join(cells) + " |")
    lines += ["", "QuACK's fastest configuration: " + ", ".join(
        f"{label} in {count} cell{'s' * (count > 1)}" for label, count in winners.items()) + "."]
    return "\n".join(lines)


COUNTERS = [  # (column, Nsight Compute section: metric, the unit recorded, scale to the column's unit)
    ("time", "GPU Speed Of Light Throughput: Duration", "ns", 1e-6),
    ("SM", "GPU Speed Of Light Throughput: Compute (SM) Throughput", "%", 1.0),
    ("L2", "GPU Speed Of Light Throughput: L2 Cache Throughput", "%", 1.0),
    ("DRAM", "GPU Speed Of Light Throughput: DRAM Throughput", "%", 1.0),
    ("clock", "GPU Speed Of Light Throughput: SM Frequency", "hz", 1e-9),
]


def counter(launch: dict, name: str, unit: str, scale: float) -> float:
    """One recorded metric of a profiled launch, in the column's unit."""
    entry = launch["metrics"].get(name)
    if entry is None or entry["unit"] != unit:
        raise ValueError(f"{launch['kernel'][:60]}: metric {name!r} should be recorded in {unit!r}, got {entry}")
    try:
        return float(entry["value"].replace(",", "")) * scale
    except ValueError:
        raise ValueError(f"{launch['kernel'][:60]}: metric {name!r} has no number: {entry['value']!r}") from None


def counter_cells(launch: dict) -> str:
    time, sm, l2, dram, clock = (counter(launch, name, unit, scale) for _, name, unit, scale in COUNTERS)
    return f"{time:.3f} ms | {sm:.0f}% | {l2:.0f}% | {dram:.0f}% | {clock:.2f} GHz"


def render_gemm_counters(results: dict, source: str) -> str:
    """Nsight Compute's speed of light for each GEMM: ours beside cuBLAS batched's fastest
    algorithm (profile_gemms.py)."""
    shape = results["shape"]
    lines = [
        f"Measured on an {results['device']}, commit `{results['commit']}`, shape (m, d, f, E) = "
        f"({shape['m']}, {shape['d']}, {shape['f']}, {shape['E']}): `{results['command']}` "
        f"({results['tool']}). Raw results: `benchmarks/results/{source}`; "
        "this table is generated from them by `benchmarks/readme_table.py`. SM, L2, DRAM: Nsight Compute's "
        "throughputs as a share of their peak (SM: the busiest of the SM's units); clock: the SM "
        "clock it measured. cuBLAS batched: the fastest of the algorithms XLA's autotuner ran (E equal "
        "batches; the same kernel for either grouping).",
        "",
        "| GEMM, groups | sm90 | SM | L2 | DRAM | clock | cuBLAS batched | SM | L2 | DRAM | clock |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    tried = {}
    for launch in results["launches"]:
        if launch["variant"] == "cublas_batched":
            tried.setdefault(launch["gemm"], []).append(launch)
    cublas = {gemm: min(launches, key=lambda launch: counter(launch, *COUNTERS[0][1:])) for gemm, launches in tried.items()}
    for launch in results["launches"]:
        if launch["variant"] != "sm90":
            continue
        theirs = counter_cells(cublas[launch["gemm"]]) if launch["gemm"] in cublas else "— | — | — | — | —"
        lines.append(f"| {launch['gemm']}, {launch['grouping']} | {counter_cells(launch)} | {theirs} |")
    return "\n".join(lines)


def contract_config_label(fields: dict) -> str:
    mode = "ping-pong" if fields.get("pingpong") else "cooperative"
    walk = (", a-block fastest" if fields.get("a_fastest") else "") + (", pairs" if fields.get("cluster_n", 1) == 2 else "")
    return (f"{mode} {fields.get('tile_m', 128)}x{fields['tile_n']}, {fields['tile_k']}-row stages x "
            f"{fields['ab_stages']}, {fields['store_stages']} store buffers{walk}")


def render_contract_modes(results: dict, source: str) -> str:
    """The contraction under each consumer mode, tile configuration and walk, as
    sweep_configs.py --kernel contract timed them (at 7cd5117 with the ping-pong variants
    since removed): time, and the ratio to the fastest cooperative config of its row."""
    labels, times = [], {}
    for row in results["rows"]:
        label = contract_config_label(row["fields"])
        if label not in labels:
            labels.append(label)
        times[(tuple(row["shape"]), row["gemm"], label)] = row["ms"]
    lines = [
        provenance(results, source,
                   "bf16 operands and output, Dirichlet group sizes")
        + " Each cell: ms (time over the fastest cooperative config of the row).",
        "",
        "| (m, d, f, E), GEMM | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
    ]
    for shape, gemm in dict.fromkeys((key[0], key[1]) for key in times):
        cooperative = min(ms for (s, g, label), ms in times.items()
                          if (s, g) == (shape, gemm) and label.startswith("cooperative"))
        cells = [f"{times[(shape, gemm, label)]:.3f} ({times[(shape, gemm, label)] / cooperative:.2f})"
                 if (shape, gemm, label) in times else "—" for label in labels]
        lines.append(f"| {', '.join(map(str, shape))}, {gemm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_contract_choices(results: dict, source: str) -> str:
    """The contraction's chosen config beside sweep_configs.py's alternatives (since
    d133ba6 each walked as the chosen one is): per shape and GEMM, the chosen config and
    its time, then each alternative's time over it, columns named as the sweep names its
    candidates. A candidate equal to the chosen config is timed once, as the chosen."""
    other_walk, other_cluster = "chosen tiles, other walk", "chosen tiles, other cluster size"

    def column(name):
        if name.startswith("chosen ") and name.endswith("-fastest"):
            return other_walk
        if name.startswith("chosen cluster"):
            return other_cluster
        return name
    rows = {}
    for row in results["rows"]:
        rows.setdefault((tuple(row["shape"]), row["gemm"]), {})[column(row["config"])] = row
    # The sweep's order (a row lacks the candidates equal to its chosen config, so no row need
    # hold them all); a name the sweep no longer has goes last.
    order = [*contract_alternatives.ALTERNATIVES, other_walk, other_cluster]
    names = {name for timed in rows.values() for name in timed} - {"chosen"}
    columns = sorted(names, key=lambda name: (order.index(name) if name in order else len(order), name))
    lines = [
        provenance(results, source, "bf16 operands and output, Dirichlet group sizes")
        + " Each cell: an alternative's time over the chosen config's (below 1.00: faster); — where it is"
        " the chosen config or does not fit.",
        "",
        "| (m, d, f, E), GEMM | chosen | " + " | ".join(columns) + " |",
        "| --- | --- |" + " --- |" * len(columns),
    ]
    for (shape, gemm), timed in rows.items():
        chosen = timed["chosen"]
        cells = [f"{timed[name]['ms'] / chosen['ms']:.3f}" if name in timed else "—" for name in columns]
        lines.append(f"| {', '.join(map(str, shape))}, {gemm} | {chosen['ms']:.3f} ms, "
                     f"{contract_config_label(chosen['fields']).removeprefix('cooperative ')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_det_rounds(results: list, source: str) -> str:
    """A moe_mlp step in both modes, round after round in one device call (bench_layer.py
    --variants sm90,sm90_det, one process per round): each mode's step per round, the
    deterministic over the default one, and the contraction's two launches in each."""
    def contraction(entry):
        return sum(ms for name, ms in entry["kernels"] if "ragged_contract" in name)

    def round_of(run):  # each round writes to --out .../r<round>
        return int(re.search(r"--out \S*/r(\d+)\b", run["command"]).group(1))

    runs = sorted(results, key=round_of)
    pattern = re.sub(r"--out \S+", "--out <dir>/r<round>", runs[0]["command"])
    lines = [
        f"Measured on an {runs[0]['device']} (JAX {runs[0]['jax']}), commit `{runs[0]['commit']}`, "
        f"{len(runs)} rounds in one device call, each `{pattern}` ({runs[0]['timing']}). "
        f"Raw results: `benchmarks/results/{source}`; this table is generated from them by "
        "`benchmarks/readme_table.py`.",
        "",
        "| shape (m, d, f, E) | round | sm90 step | sm90_det step | sm90_det / sm90 | contraction, sm90 / sm90_det |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        round_ = round_of(run)
        for row in run["shapes"]:
            variants = row["modes"]["step"]["variants"]
            default, det = variants["sm90"], variants["sm90_det"]
            lines.append(
                f"| {shape_text(row['shape'], 'mdfE')} | {round_} | {default['ms']:.3f} ms | {det['ms']:.3f} ms | "
                f"{det['ms'] / default['ms']:.3f} | {contraction(default):.3f} / {contraction(det):.3f} ms |")
    return "\n".join(lines)


def dsrelu_config_label(fields: dict) -> str:
    beside = fields.get("overlap_k_tiles", 0)
    overlap = f", epilogue beside {beside} k-tile{'s' * (beside > 1)}" if beside else ""
    return (f"{fields.get('tile_m', 128)}x{fields['tile_n']}, {fields['ab_stages']} stages, "
            f"{fields['store_stages']} store buffers{overlap}")


def render_epilogue_overlap(results: list, source: str) -> str:
    """The fused kernel with its epilogue beside the next tile's mainloop, as sweep_configs.py
    timed it at 0defe86 (the overlap since removed): at the few-expert shapes (--kernel
    dsrelu) and the fine-grained ones (--kernel gemm, its dsrelu rows); time, and the ratio
    to the fastest config of the row whose epilogue follows its mainloop."""
    order, times = {}, {}  # order: label -> its sort key, widest tiles first
    for run in results:
        for row in run["rows"]:
            if row.get("gemm", "dsrelu") != "dsrelu" or row["fields"]["epi_n"] != 32:
                continue
            label = dsrelu_config_label(row["fields"])
            order[label] = (-row["fields"]["tile_n"], label)
            times[(tuple(row["shape"]), label)] = (row["ms"], row["fields"].get("overlap_k_tiles", 0))
    labels = sorted(order, key=order.get)
    lines = [
        sweeps_provenance(results, source, "bf16, with dbias and act, Dirichlet group sizes")
        + " Each cell: ms (time over the fastest config of the row without the overlap).",
        "",
        "| (m, d, f, E) | " + " | ".join(labels) + " |",
        "| --- |" + " --- |" * len(labels),
    ]
    for shape in dict.fromkeys(key[0] for key in times):
        plain = min(ms for (s, _), (ms, beside) in times.items() if s == shape and not beside)
        cells = [f"{times[(shape, label)][0]:.3f} ({times[(shape, label)][0] / plain:.2f})"
                 if (shape, label) in times else "—" for label in labels]
        lines.append(f"| {', '.join(map(str, shape))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_cluster_pairs(results: list, source: str) -> str:
    """Each kernel's tile configs alone and in clusters of two CTAs along N (A multicast),
    as sweep_configs.py timed them (--kernel gemm and --kernel contract): time alone,
    time in pairs, and their ratio; the config chosen at that shape marked."""
    times, chosen = {}, {}
    for number, run in enumerate(results, 1):
        for row in run["rows"]:
            fields = row["fields"]
            tiles = f"128x{fields['tile_n']}, k {fields['tile_k']}, {fields['ab_stages']} stages"
            key = (f"{number}: `{run['commit']}`", tuple(row["shape"]), row["gemm"], tiles)
            times.setdefault(key, {})[fields.get("cluster_n", 1)] = row["ms"]
            if row["config"] == "chosen":
                chosen[key] = fields.get("cluster_n", 1)
    lines = [
        sweeps_provenance(results, source, "bf16, Dirichlet group sizes")
        + " Run: the JSON, in name order. Chosen: the size the config rules picked when the sweep ran. At "
        "these commits a kernel alone was launched as a cluster of one.",
        "",
        "| run | (m, d, f, E), kernel | tiles | alone | pairs | pairs / alone | chosen |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (run, shape, gemm, tiles), by_size in times.items():
        if 1 in by_size and 2 in by_size:
            mark = {1: "alone", 2: "pairs"}.get(chosen.get((run, shape, gemm, tiles)), "")
            lines.append(f"| {run} | {', '.join(map(str, shape))}, {gemm} | {tiles} | {by_size[1]:.3f} ms | "
                         f"{by_size[2]:.3f} ms | {by_size[2] / by_size[1]:.3f} | {mark} |")
    return "\n".join(lines)


def render_gemm_tiles(results: dict, source: str) -> str:
    """The ragged-M kernels' tile configs as sweep_configs.py --kernel gemm timed them: per
    shape and kernel, the config chosen when the sweep ran, and the fastest of each kind
    beside it: alone with 64-deep k-tiles by tile width, with 32-deep k-tiles, with one
    store buffer per output, in cluster pairs."""
    kinds = ("128-wide", "192-wide", "256-wide", "32-deep k-tiles", "one store buffer", "pairs")

    def kind(fields: dict) -> str:
        if fields.get("cluster_n", 1) == 2:
            return "pairs"
        if fields["tile_k"] == 32:
            return "32-deep k-tiles"
        if fields["store_stages"] == 1:
            return "one store buffer"
        return f"{fields['tile_n']}-wide"

    def tiles(fields: dict) -> str:
        preact = f", {fields['preact_stages']} preact" if "preact_stages" in fields else ""
        return f"128x{fields['tile_n']}, {fields['ab_stages']} stages{preact}"

    rows = {}
    for row in results["rows"]:
        rows.setdefault((tuple(row["shape"]), row["gemm"]), []).append(row)
    lines = [
        provenance(results, source, "bf16, Dirichlet group sizes")
        + " Each cell: the fastest config of its kind, its time over the chosen one's, and its tiles "
        "(operand stages of 64-deep k-tiles unless the column says 32); — where the sweep had none.",
        "",
        "| (m, d, f, E), kernel | chosen | " + " | ".join(kinds) + " |",
        "| --- | --- |" + " --- |" * len(kinds),
    ]
    for (shape, gemm), candidates in rows.items():
        (chosen,) = [row for row in candidates if row["config"] == "chosen"]
        best = {}
        for row in candidates:
            if row is chosen:
                continue
            key = kind(row["fields"])
            if key not in best or row["ms"] < best[key]["ms"]:
                best[key] = row
        cells = [f"{best[key]['ms']:.3f} ms ({best[key]['ms'] / chosen['ms']:.2f}), {tiles(best[key]['fields'])}"
                 if key in best else "—" for key in kinds]
        lines.append(f"| {', '.join(map(str, shape))}, {gemm} | {chosen['ms']:.3f} ms, {tiles(chosen['fields'])}"
                     f"{', pairs' if chosen['fields'].get('cluster_n', 1) == 2 else ''} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_step_ab(results: list, source: str) -> str:
    """Two commits' moe_mlp steps on one machine (benchmarks/step_ab.sh: the older commit's
    tree beside the newer one, rounds alternating the commits): per shape, each commit's
    step in each round, the newer over the older per round, and the kernel classes at the
    shape where they moved most."""
    steps, summary = {}, {}
    for run in results:
        # step_ab.sh writes round r of a commit to --out .../<commit>-<r>.
        round_ = re.search(r"--out \S+-(\d+)\b", run["command"]).group(1)
        for row in run["shapes"]:
            shape = shape_text(row["shape"], "mdfE")
            for variant, entry in row["modes"]["step"]["variants"].items():
                steps.setdefault((shape, variant), {})[(run["commit"], round_)] = entry["ms"]
                if variant == "sm90" and entry.get("kernel_summary"):
                    summary.setdefault(shape, {})[(run["commit"], round_)] = entry
    # The JSON names say which commit is the newer: bench_layer_step_ab_<newer>_<commit>_r<round>.json.
    new = source.split("_ab_")[1].split("_")[0]
    (old,) = {run["commit"] for run in results} - {new}
    rounds = sorted({round_ for times in steps.values() for _, round_ in times})
    pattern = re.sub(r"--out \S+", "--out <dir>/<commit>-<round>",
                     re.sub(r"--commit \S+", "--commit <commit>", results[0]["command"]))
    lines = [
        f"Measured on an {results[0]['device']} (JAX {results[0]['jax']}), commits `{old}` and `{new}` on one "
        f"machine in one device call, rounds {', '.join(rounds)} alternating them (`benchmarks/step_ab.sh`; "
        f"each round `{pattern}`, {results[0]['timing']}). "
        f"Raw results: `benchmarks/results/{source}`; this table is generated from them by `benchmarks/readme_table.py`.",
        "",
        "| step: shape (m, d, f, E), variant | " + " | ".join(f"`{c}` round {r}" for c in (old, new) for r in rounds)
        + f" | `{new}` / `{old}`, per round |",
        "| --- |" + " --- |" * (2 * len(rounds) + 1),
    ]
    for (shape, variant), times in steps.items():
        cells = [f"{times[(c, r)]:.3f} ms" for c in (old, new) for r in rounds]
        ratios = ", ".join(f"{times[(new, r)] / times[(old, r)]:.3f}" for r in rounds)
        lines.append(f"| {shape}, {variant} | " + " | ".join(cells) + f" | {ratios} |")
    lines += ["", "Where the sm90 step's time goes (CUPTI, ms, round 1):", ""]
    for shape, entries in summary.items():
        lines.append(f"- {shape}: `{old}` {step_breakdown(entries[(old, rounds[0])])}; "
                     f"`{new}` {step_breakdown(entries[(new, rounds[0])])}")
    return "\n".join(lines)


# (document, marker name, recorded JSON, how its table is written); a JSON name with a *
# takes every matching JSON, in a list.
TABLES: list[tuple[str, str, str, Callable]] = [
    ("README.md", "summary", "fine_grained/bench_layer_step_177529d.json.gz", render_summary),
    ("docs/performance.md", "sm90", "bench_dsrelu.json", render_dsrelu),
    ("docs/performance.md", "gemms", "bench_gemms.json", render_gemms),
    ("docs/performance.md", "layer", "bench_layer.json", render_layer),
    ("docs/performance.md", "steps", "fine_grained/bench_layer_step_177529d.json.gz", render_layer_steps),
    ("docs/performance.md", "moe_block", "bench_moe_block.json", render_moe_block),
    ("docs/sm90.md", "gemm_ceilings", "fine_grained/bench_gemms_fine_d50fca1.json", render_gemm_ceilings),
    ("docs/sm90.md", "gemm_ceilings_1171e21", "fine_grained/bench_gemms_fine_1171e21.json", render_gemm_ceilings),
    ("docs/sm90.md", "gemm_counters", "fine_grained/profile_gemms_nano_527754c.json", render_gemm_counters),
    ("docs/sm90.md", "contract_modes", "fine_grained/sweep_contract_pingpong_7cd5117.json", render_contract_modes),
    ("docs/sm90.md", "epilogue_overlap", "fine_grained/sweep_*_overlap_0defe86.json", render_epilogue_overlap),
    ("docs/sm90.md", "cluster_pairs", "fine_grained/sweep_*_cluster_*.json", render_cluster_pairs),
    ("docs/sm90.md", "cluster_launch_ab", "fine_grained/bench_layer_step_ab_da0e55b_*.json", render_step_ab),
    ("docs/sm90.md", "cluster_pairs_ab", "fine_grained/bench_layer_step_ab_680d6e6_*.json", render_step_ab),
    ("docs/sm90.md", "last_tile_ab", "fine_grained/bench_layer_step_ab_a7bead4_*.json", render_step_ab),
    ("docs/sm90.md", "last_tile_fused_ab", "fine_grained/bench_layer_step_ab_1171e21_*.json", render_step_ab),
    ("docs/sm90.md", "fused_tile_192_ab", "fine_grained/bench_layer_step_ab_d0ff3db_*.json", render_step_ab),
    ("docs/sm90.md", "tile_sweep_b938ae4", "fine_grained/sweep_gemm_b938ae4.json", render_gemm_tiles),
    ("docs/sm90.md", "tile_192_ab", "fine_grained/bench_layer_step_ab_b34e26a_*.json", render_step_ab),
    ("docs/sm90.md", "tile_sweep_70248d4", "fine_grained/sweep_gemm_70248d4.json", render_gemm_tiles),
    ("docs/sm90.md", "tile_stages_ab", "fine_grained/bench_layer_step_ab_20001df_*.json", render_step_ab),
    ("docs/sm90.md", "gemm_ceilings_e65b77e", "fine_grained/bench_gemms_fine_e65b77e.json", render_gemm_ceilings),
    ("docs/sm90.md", "contract_walk_9cce2d9", "fine_grained/sweep_contract_9cce2d9.json", render_contract_modes),
    ("docs/sm90.md", "contract_walk_177529d", "fine_grained/sweep_contract_177529d.json", render_contract_modes),
    ("docs/sm90.md", "contract_walk_ab", "fine_grained/bench_layer_step_ab_2ce9332_*.json", render_step_ab),
    ("docs/sm90.md", "quack_e0e05d1", "fine_grained/bench_gemms_quack_e0e05d1.json", render_quack),
    ("docs/sm90.md", "quack_177529d", "fine_grained/bench_gemms_quack_177529d.json", render_quack),
    ("docs/sm90.md", "contract_many_d133ba6", "fine_grained/sweep_contract_d133ba6.json", render_contract_choices),
    ("docs/sm90.md", "contract_many_57b5df0", "fine_grained/sweep_contract_57b5df0.json", render_contract_choices),
    ("docs/sm90.md", "quack_7b55101", "fine_grained/bench_gemms_quack_7b55101.json", render_quack),
    ("docs/sm90.md", "det_rounds_0a777f1", "fine_grained/bench_layer_step_det_0a777f1_r*.json", render_det_rounds),
    ("docs/determinism.md", "determinism", "determinism/determinism_parallel*.json", render_determinism),
]
DOCUMENTS = list(dict.fromkeys(document for document, *_ in TABLES))


def load_record(path: pathlib.Path) -> dict:
    """A recorded JSON; gzipped (.json.gz) where the run timed XLA's own path, whose
    per-kernel lists run to a megabyte."""
    data = path.read_bytes()
    return json.loads(gzip.decompress(data) if path.suffix == ".gz" else data)


def updated_document(text: str, document: str, results_dir: pathlib.Path = RESULTS) -> str:
    """`document`'s text with every table of it whose JSON exists regenerated between its markers."""
    for table_document, marker, json_name, render in TABLES:
        if table_document != document:
            continue
        paths = sorted(results_dir.glob(json_name))
        if not paths:
            continue
        path = results_dir / json_name
        start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
        if text.count(start) != 1 or text.count(end) != 1:
            raise SystemExit(
                f"{path} is recorded but {document} does not hold exactly one {start} ... {end} pair "
                "to put its table between"
            )
        head, rest = text.split(start)
        _, tail = rest.split(end)
        recorded = [load_record(p) for p in paths]
        table = render(recorded if "*" in json_name else recorded[0], json_name)
        # Renderers link from the repository's root; a document in a folder links from there.
        depth = document.count("/")
        table = table.replace("](benchmarks/", "](" + "../" * depth + "benchmarks/")
        table = table.replace("](docs/", "](" + "../" * depth + "docs/")
        text = f"{head}{start}\n{table}\n{end}{tail}"
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    stale = []
    for document in DOCUMENTS:
        path = ROOT / document
        text = path.read_text()
        updated = updated_document(text, document)
        if updated == text:
            continue
        if args.check:
            stale.append(document)
        else:
            path.write_text(updated)
    if stale:
        sys.exit(f"{', '.join(stale)}: results differ from benchmarks/results: run benchmarks/readme_table.py")


if __name__ == "__main__":
    main()
