"""What every benchmark shares: its options, shapes and groupings, the loop that measures row after row into one
record (`<benchmark>.json` in --out, or `<benchmark>_<label>.json`) and a plot, the pieces of a measurement
(memory, errors), and the prebuild of its kernels on a machine without a GPU (`lower_for_cuda`). The record is
rewritten after every piece of a row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import time
from typing import Callable
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

import run_record
import timing
from jax_dsrelu import groups
from jax_dsrelu.kernels import registry as backend_choice

# (m, d, f, E): few large experts, then fine-grained MoE (Nemotron-3 Nano's 128 experts of
# width 1856 over d = 2688 first, then 128 and 256 experts of a few hundred rows each).
FEW_EXPERT_SHAPES = [(16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
FINE_GRAINED_SHAPES = [(49152, 2688, 1856, 128), (65536, 2048, 768, 128), (65536, 2048, 512, 128),
                       (32768, 7168, 2048, 32), (65536, 2048, 768, 256)]
SHAPES = FEW_EXPERT_SHAPES + FINE_GRAINED_SHAPES
CPU_SHAPES = [(512, 128, 256, 4)]
# "rounded128": the dirichlet sizes as token rounding with round_to=128 leaves them (each
# cut to a multiple of 128; the cut rows, past the experts' sum, belong to none).
GROUPINGS = ("dirichlet", "equal", "rounded128")
BF16 = np.dtype(jnp.bfloat16)
# XLA fuses a GEMM into a Triton kernel of its own where its autotuner finds one faster,
# and otherwise calls cuBLAS; with the fusion off every GEMM is cuBLAS's.
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}
MEMORY = "XLA memory analysis of the compiled computation: arguments + outputs + temporaries - aliased"


def group_sizes_for(grouping, m, num_experts, seed) -> np.ndarray:
    """(E,) int32 rows per expert: a flat Dirichlet draw summing to m (rounded128: cut to 128s), or equal."""
    if grouping in ("dirichlet", "rounded128"):
        sizes = np.floor(np.random.default_rng(seed).dirichlet(np.ones(num_experts)) * m).astype(np.int64)
        sizes[np.argmax(sizes)] += m - sizes.sum()
        return (sizes // 128 * 128 if grouping == "rounded128" else sizes).astype(np.int32)
    if grouping != "equal" or m % num_experts:
        raise ValueError(f"grouping must be 'dirichlet', 'rounded128', or 'equal' with m % E == 0; got {grouping!r}, "
                         f"m={m}, E={num_experts}")
    return np.full(num_experts, m // num_experts, np.int32)


def operand_shapes(m, d, f, num_experts) -> dict[str, jax.ShapeDtypeStruct]:
    """Every operand a layer benchmark takes at (m, d, f, E), the dense baselines' (one expert's) included."""
    s = jax.ShapeDtypeStruct
    rows_d, rows_f, f32 = s((m, d), BF16), s((m, f), BF16), jnp.float32
    return dict(x=rows_d, dy=rows_d, cotangent=rows_d, h=rows_f, act=rows_f, dh=rows_f,
                w1=s((num_experts, d, f), BF16), w2=s((num_experts, f, d), BF16), w1_dense=s((d, f), BF16),
                w2_dense=s((f, d), BF16), b1=s((num_experts, f), f32), b1_dense=s((f,), f32), prob=s((m,), f32),
                group_sizes=s((num_experts,), jnp.int32))


def parser(description: str, *, reps: int, variants: tuple[str, ...] = (), optional_variants: tuple[str, ...] = (),
           shaped: bool = True, subsets: dict[str, tuple[str, ...]] | None = None) -> argparse.ArgumentParser:
    """The options every benchmark takes. --variants picks among `variants` (its default) and
    `optional_variants`, each of `subsets` (--gemms, say) likewise; one not `shaped` takes no --shapes."""
    parser = argparse.ArgumentParser(description=description)
    parser.subsets = dict(subsets or {}, **(dict(groups=GROUPINGS) if shaped else {}),
                          **({"variants": variants + optional_variants} if variants else {}))
    defaults = dict(groups="dirichlet", variants=",".join(variants))
    for option, allowed in parser.subsets.items():
        parser.add_argument(f"--{option}", default=defaults.get(option, ",".join(allowed)),
                            help=f"comma-separated subset of {','.join(allowed)}")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--label", default="", help="the record is <benchmark>_<label>.json (default <benchmark>.json)")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    if shaped:
        parser.add_argument("--shapes", type=lambda text: [tuple(map(int, s.split(","))) for s in text.split(";")],
                            default=None, help="m,d,f,E;... (default: the benchmark's)")
    parser.add_argument("--prebuild", action="store_true",
                        help="lower the selected kernels for cuda here (no GPU) to fill JAX_DSRELU_KERNEL_CACHE, then stop")
    parser.add_argument("--cpu", action="store_true",
                        help="plumbing test on the CPU at tiny shapes, timed by wall clock (not a measurement)")
    return parser


def parse(parser: argparse.ArgumentParser, argv, shapes=SHAPES):
    """Parses argv; each subset option (--variants, --groups, `subsets`) becomes a list, checked against its values."""
    options = parser.parse_args(argv)
    for option, allowed in parser.subsets.items():
        chosen = getattr(options, option).split(",")
        if unknown := sorted(set(chosen) - set(allowed)):
            parser.error(f"--{option}: unknown {unknown}; expected a subset of {list(allowed)}")
        setattr(options, option, chosen)
    if getattr(options, "shapes", ()) is None:
        options.shapes = CPU_SHAPES if options.cpu else shapes
    return options


def reference_first(variants, references=("xla",)) -> list[str]:
    """The `references` first: the others are checked against their results."""
    return sorted(variants, key=lambda v: v not in references)


def record_name(benchmark: str, label: str) -> str:
    return f"{benchmark}_{label}.json" if label else f"{benchmark}.json"


def png_path(options, benchmark: str) -> str:
    return os.path.join(options.out, record_name(benchmark, options.label).removesuffix(".json") + ".png")


def start_record(options, **fields) -> tuple[dict, str, Callable[[], str]]:
    """(the record, its clock, save): the run's header and `fields`; save() rewrites it."""
    clock, started = timing.clock_for(options.cpu), time.time()
    result = dict(run_record.header(options.commit, timing.DESCRIPTIONS[clock]), clock=clock, **fields)
    name = record_name(fields["benchmark"], options.label)
    def save() -> str:
        result["seconds"] = time.time() - started
        return run_record.write_json(result, options.out, name)
    return result, clock, save


def run(options, measure_row: Callable, plot: Callable, part: str, **fields) -> None:
    """Measures every (shape, grouping) row into the record and its PNG (measure_row(shape, grouping, row,
    clock, save) fills `row`, saving after each piece), then prints each variant's ms (TFLOP/s) by `part`."""
    result, clock, save = start_record(options, **fields)
    rows = result.setdefault("shapes", [])
    for shape, grouping in itertools.product(options.shapes, options.groups):
        rows.append(row := dict(shape=dict(zip("mdfE", shape)), grouping=grouping))
        measure_row(shape, grouping, row, clock, save)
        save()
        plot(rows, png_path(options, fields["benchmark"]), f"{fields['title']}, {result['device']} ({clock})")
    for row in rows:
        print(f"{row_title(row)} {row['grouping']}   ms (TFLOP/s)")
        for name, entry in row[part].items():
            cells = [f"{variant}={result['ms']:.3f} ({result.get('tflops', 0.0):.0f})" if "ms" in result
                     else f"{variant}=error" for variant, result in entry.get("variants", {}).items()]
            print(f"  {name:<8} " + "  ".join(cells))


def row_title(row: dict) -> str:
    return " ".join(f"{key}={value}" for key, value in row["shape"].items())


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
            for xi in x[np.asarray(values) == 0]:
                ax.text(xi, 0, "x", ha="center", va="bottom", fontsize=7)
        ax.set_title(name, fontsize=9)
        ax.set_xticks(np.arange(len(labels)), labels, fontsize=7)
        ax.set_ylabel(ylabel)
    axes[0, 0].legend(fontsize=8, ncol=4)
    fig.suptitle(title + "  (x: failed or not run)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory(compiled) -> dict:
    """Peak device memory of a compiled computation by XLA's memory analysis."""
    if (stats := compiled.memory_analysis()) is None:
        return {"unavailable": "this backend gives no memory analysis"}
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes")
    entry = {field: int(getattr(stats, field)) for field in fields}
    return dict(entry, peak_bytes=sum(entry[field] for field in fields[:3]) - entry["alias_size_in_bytes"])


def measure(fn, args, reps, clock, *, check=None, compiler_options=None, flops=None) -> tuple[dict, object]:
    """(entry, outputs) of one variant: fn compiled, run, checked (check(outputs) -> (record,
    passes); one that fails is not timed), timed; or (the entry of the stage that failed, None)."""
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


def bias_rows(b1, group_sizes, num_rows):
    """Each row's expert's bias, b1[e] (E, n), and 0 for the rows past the experts' sum."""
    expert, owned = groups.row_experts(group_sizes, num_rows)
    return jnp.where(owned[:, None], b1[expert], 0.0)


def digest(tree) -> str:
    """The first 16 hex digits of the SHA-256 of a tree's leaves' bytes: equal for equal bits."""
    return hashlib.sha256(b"".join(np.ascontiguousarray(leaf).tobytes()
                                   for leaf in jax.tree.leaves(jax.device_get(tree)))).hexdigest()[:16]


@jax.jit
def relative_error(ours, reference):
    """Normwise relative error of `ours` against `reference`, in float32."""
    difference = ours.astype(jnp.float32) - reference.astype(jnp.float32)
    scale = jnp.maximum(jnp.linalg.norm(reference.astype(jnp.float32)), np.finfo(np.float32).tiny)
    return jnp.linalg.norm(difference) / scale


# Prebuilding on a machine without a GPU: lowering for cuda compiles every CuTe DSL kernel a
# function calls into the JAX_DSRELU_KERNEL_CACHE directory. Compile keys hold static facts
# only (never m or group sizes), so lowering at a script's shapes builds exactly its kernels.
HOPPER = (9, 0)  # the H200's compute capability, at which backend="auto" is resolved
CACHE_VARIABLE = "JAX_DSRELU_KERNEL_CACHE"


def shapes_of(tree):
    """The ShapeDtypeStructs of a tree of arrays: what a lowering takes."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def lower_for_cuda(name: str, fn: Callable, *shapes) -> bool:
    """Lowers fn at these shapes for cuda into the kernel cache, which must be named; prints and returns
    whether it lowered. A kernel its backend does not serve yet is reported and skipped, so the others are still built."""
    if not os.environ.get(CACHE_VARIABLE):
        raise SystemExit(f"--prebuild needs {CACHE_VARIABLE} set to the kernel cache directory")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # read when CuTe DSL is first imported
    # A function jitted already keeps its own jit options (compiler options may only sit
    # on the outermost jit), so it is lowered as it is.
    jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
    try:
        # backend="auto" resolves as on a Hopper GPU: with none visible it would lower the XLA reference.
        with mock.patch.object(backend_choice, "cuda_compute_capability", lambda: HOPPER):
            jitted.trace(*shapes).lower(lowering_platforms=("cuda",))
    except NotImplementedError as error:
        print(f"prebuild {name}: not built ({str(error)[:200]})", flush=True)
        return False
    print(f"prebuild {name}: lowered", flush=True)
    return True
