"""What every benchmark shares: its options, its shapes and groupings, the loop that measures
row after row into one record and a plot, and the pieces of a measurement (memory, errors).

A benchmark supplies its variants and how to measure one row (a shape under one grouping);
the harness does the rest: the options, the run's header (run_record.py), the clock
(timing.py), and the record rewritten after every piece of a row, so that a run cut short
keeps what it measured: `<benchmark>.json` in --out (`<benchmark>_<label>.json` with
--label), the current record of that benchmark, which its next run overwrites.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import run_record
import timing

# (m, d, f, E): few large experts, then fine-grained MoE (Nemotron-3 Nano's 128 experts of
# width 1856 over d = 2688 first, then 128 and 256 experts of a few hundred rows each).
FEW_EXPERT_SHAPES = [(16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
FINE_GRAINED_SHAPES = [
    (49152, 2688, 1856, 128), (65536, 2048, 768, 128), (65536, 2048, 512, 128),
    (32768, 7168, 2048, 32), (65536, 2048, 768, 256),
]
SHAPES = FEW_EXPERT_SHAPES + FINE_GRAINED_SHAPES
CPU_SHAPES = [(512, 128, 256, 4)]
# "rounded128": the dirichlet sizes as token rounding with round_to=128 leaves them (each
# cut to a multiple of 128; the cut rows, past the experts' sum, belong to none).
GROUPINGS = ("dirichlet", "equal", "rounded128")
BF16 = np.dtype(jnp.bfloat16)
# XLA fuses a GEMM into a Triton kernel of its own where its autotuner finds one faster,
# and otherwise calls cuBLAS; with the fusion off every GEMM is cuBLAS's.
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}


def group_sizes_for(grouping, m, num_experts, seed) -> np.ndarray:
    """(E,) int32 rows per expert: summing to m, from a flat Dirichlet draw, or equal
    (m % E == 0); or the Dirichlet draw cut to multiples of 128 (summing to less)."""
    if grouping in ("dirichlet", "rounded128"):
        sizes = np.floor(np.random.default_rng(seed).dirichlet(np.ones(num_experts)) * m).astype(np.int64)
        sizes[np.argmax(sizes)] += m - sizes.sum()
        if grouping == "rounded128":
            sizes = sizes // 128 * 128
        return sizes.astype(np.int32)
    if grouping != "equal" or m % num_experts:
        raise ValueError(f"grouping must be 'dirichlet', 'rounded128', or 'equal' with m % E == 0; got {grouping!r}, "
                         f"m={m}, E={num_experts}")
    return np.full(num_experts, m // num_experts, np.int32)


def parse_shapes(text):
    return [tuple(int(v) for v in s.split(",")) for s in text.split(";")]


def parser(description: str, *, reps: int, variants: tuple[str, ...] = (),
           optional_variants: tuple[str, ...] = (), shaped: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes; a benchmark adds its own. --variants runs
    `variants` unless it names a subset, which may include `optional_variants`; a
    benchmark of one fixed problem (not `shaped`) takes no --shapes and --groups."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--label", default="", help="the record is <benchmark>_<label>.json (default <benchmark>.json)")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    if shaped:
        parser.add_argument("--shapes", type=parse_shapes, default=None, help="m,d,f,E;... (default: the benchmark's)")
        parser.add_argument("--groups", default="dirichlet", help=f"comma-separated subset of {','.join(GROUPINGS)}")
    if variants:
        parser.add_argument("--variants", default=",".join(variants),
                            help=f"comma-separated subset of {','.join(variants + optional_variants)}")
    parser.add_argument("--prebuild", action="store_true",
                        help="lower the selected kernels for cuda here (no GPU) to fill JAX_DSRELU_KERNEL_CACHE, then stop")
    parser.add_argument("--cpu", action="store_true",
                        help="plumbing test on the CPU at tiny shapes, timed by wall clock (not a measurement)")
    return parser


def parse(parser: argparse.ArgumentParser, argv, subsets: dict[str, tuple[str, ...]], shapes=SHAPES):
    """Parses argv; each option named in `subsets` becomes a list checked against its
    allowed values (--groups always is, where there is one)."""
    options = parser.parse_args(argv)
    if hasattr(options, "groups"):
        subsets = dict(subsets, groups=GROUPINGS)
    for option, allowed in subsets.items():
        chosen = getattr(options, option).split(",")
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; expected a subset of {list(allowed)}")
        setattr(options, option, chosen)
    if getattr(options, "shapes", ()) is None:
        options.shapes = CPU_SHAPES if options.cpu else shapes
    return options


def record_name(benchmark: str, label: str) -> str:
    return f"{benchmark}_{label}.json" if label else f"{benchmark}.json"


def start_record(options, **fields) -> tuple[dict, str, Callable[[], str]]:
    """(the record, its clock, save): the run's header and `fields`; save() rewrites it."""
    clock = timing.clock_for(options.cpu)
    started = time.time()
    result = dict(run_record.header(options.commit, timing.DESCRIPTIONS[clock]), clock=clock, **fields)
    name = record_name(fields["benchmark"], options.label)

    def save() -> str:
        result["seconds"] = time.time() - started
        return run_record.write_json(result, options.out, name)

    return result, clock, save


def run(options, measure_row: Callable, plot: Callable, summarize: Callable, **fields) -> None:
    """Measures every (shape, grouping) row into the benchmark's record and its PNG.

    measure_row(shape, grouping, row, clock, save) fills `row` (its group sizes and its
    results) and calls save() after each piece, which rewrites the record.
    """
    result, clock, save = start_record(options, **fields)
    rows = result.setdefault("shapes", [])
    for shape in options.shapes:
        for grouping in options.groups:
            m, d, f, num_experts = shape
            row = dict(shape=dict(m=m, d=d, f=f, E=num_experts), grouping=grouping)
            rows.append(row)
            measure_row(shape, grouping, row, clock, save)
            path = save()
            plot(rows, os.path.join(options.out, record_name(fields["benchmark"], options.label)[:-5] + ".png"),
                 f"{fields['title']}, {result['device']} ({clock})")
    summarize(rows)


def summarize(rows: list[dict], part: str) -> None:
    """Prints each row's times: per GEMM or mode (`part`), every variant's ms (TFLOP/s)."""
    for row in rows:
        s = row["shape"]
        print(f"m={s['m']} d={s['d']} f={s['f']} E={s['E']} {row['grouping']}   ms (TFLOP/s)")
        for name, entry in row[part].items():
            cells = [f"{variant}={result['ms']:.3f} ({result.get('tflops', 0.0):.0f})" if "ms" in result
                     else f"{variant}=error" for variant, result in entry.get("variants", {}).items()]
            print(f"  {name:<8} " + "  ".join(cells))


def plot_bars(panels: list[tuple[str, list[str], dict[str, list[float]]]], path: str, title: str, ylabel: str) -> None:
    """One bar chart per panel (title, x labels, {series: values}); 0 marks a failed or missing value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (name, labels, series) in zip(axes[:, 0], panels):
        width = 0.8 / max(len(series), 1)
        for index, (variant, values) in enumerate(series.items()):
            x = np.arange(len(labels)) + (index - (len(series) - 1) / 2) * width
            ax.bar(x, values, width, label=variant)
            for xi, value in zip(x, values):
                if not value:
                    ax.text(xi, 0, "x", ha="center", va="bottom", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(np.arange(len(labels)))
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel(ylabel)
    axes[0, 0].legend(fontsize=8, ncol=4)
    fig.suptitle(title + "  (x: failed or not run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory(compiled) -> dict:
    """Peak device memory of a compiled computation by XLA's memory analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return {"unavailable": "this backend gives no memory analysis"}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    entry = {field: int(getattr(stats, field)) for field in fields}
    entry["peak_bytes"] = (entry["argument_size_in_bytes"] + entry["output_size_in_bytes"]
                           + entry["temp_size_in_bytes"] - entry["alias_size_in_bytes"])
    return entry


MEMORY = "XLA memory analysis of the compiled computation: arguments + outputs + temporaries - aliased"


def measure(fn, args, reps, clock, *, check=None, compiler_options=None, flops=None) -> tuple[dict, object]:
    """(entry, outputs) of one variant: fn compiled, run, checked, timed; or (the entry of
    the stage that failed, None). check(outputs) -> (record, passes); a check that does not
    pass stops the variant before it is timed."""
    stage, entry = "compile", {}
    try:
        compiled = jax.jit(fn, compiler_options=compiler_options).lower(*args).compile()
        entry["memory"] = memory(compiled)
        stage = "run"
        outputs = compiled(*args)
        if check is not None:
            stage = "check"
            entry["check"], passes = check(outputs)
            if not passes:
                print(f"  outside the tolerance of the reference: {entry['check']}", flush=True)
                raise ValueError("result outside the tolerance of the reference: not timed")
        stage = "timing"
        entry.update(timing.time_call(compiled, args, reps, clock).record())
        if flops is not None:
            entry["tflops"] = timing.tflops(flops, entry["ms"])
        return entry, outputs
    except Exception as error:  # recorded; the next variant runs
        return dict(entry, **run_record.error_entry(error, stage)), None


@jax.jit
def relative_error(ours, reference):
    """Normwise relative error of `ours` against `reference`, in float32."""
    difference = ours.astype(jnp.float32) - reference.astype(jnp.float32)
    scale = jnp.maximum(jnp.linalg.norm(reference.astype(jnp.float32)), np.finfo(np.float32).tiny)
    return jnp.linalg.norm(difference) / scale
