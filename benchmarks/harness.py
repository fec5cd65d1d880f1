"""What bench_gemms.py and bench_layer.py share: their options, their shapes and groupings,
and the loop that measures row after row into one JSON and a plot.

A benchmark supplies its variants and how to measure one row (a shape under one
grouping); the harness does the rest: the common options, the run's header (device,
commit, command, clock: run_record.py), the refusal to time on a machine without a GPU
unless --cpu says so (timing.py), and the JSON rewritten after every GEMM or mode of a
row, so that a run cut short by its time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import numpy as np

import run_record
import timing
from bench_dsrelu import dirichlet_sizes

# (m, d, f, E): few large experts, then fine-grained MoE (Nemotron-3 Nano's 128 experts of
# width 1856 over d = 2688 first, then 128 and 256 experts of a few hundred rows each).
FEW_EXPERT_SHAPES = [(16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
FINE_GRAINED_SHAPES = [
    (49152, 2688, 1856, 128), (65536, 2048, 768, 128), (65536, 2048, 512, 128),
    (32768, 7168, 2048, 32), (65536, 2048, 768, 256),
]
SHAPES = FEW_EXPERT_SHAPES + FINE_GRAINED_SHAPES
CPU_SHAPES = [(512, 128, 256, 4)]
GROUPINGS = ("dirichlet", "equal")


def group_sizes_for(grouping, m, num_experts, seed) -> np.ndarray:
    """(E,) int32 rows per expert summing to m: Dirichlet-drawn or equal (m % E == 0)."""
    if grouping == "dirichlet":
        return dirichlet_sizes(np.random.default_rng(seed), m, num_experts)
    if grouping != "equal" or m % num_experts:
        raise ValueError(f"grouping must be 'dirichlet', or 'equal' with m % E == 0; got {grouping!r}, m={m}, E={num_experts}")
    return np.full(num_experts, m // num_experts, np.int32)


def parse_shapes(text):
    return [tuple(int(v) for v in s.split(",")) for s in text.split(";")]


def parser(description: str, *, reps: int, variants: tuple[str, ...],
           optional_variants: tuple[str, ...] = ()) -> argparse.ArgumentParser:
    """The options every layer benchmark takes; a benchmark adds its own. --variants runs
    `variants` unless it names a subset, which may include `optional_variants`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--reps", type=int, default=reps)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--shapes", type=parse_shapes, default=None, help="m,d,f,E;... (default: harness.SHAPES)")
    parser.add_argument("--groups", default="dirichlet", help=f"comma-separated subset of {','.join(GROUPINGS)}")
    parser.add_argument("--variants", default=",".join(variants),
                        help=f"comma-separated subset of {','.join(variants + optional_variants)}")
    parser.add_argument("--prebuild", action="store_true",
                        help="lower the selected variants for cuda here (no GPU) to fill "
                             "JAX_DSRELU_KERNEL_CACHE, then stop")
    parser.add_argument("--cpu", action="store_true",
                        help="plumbing test on the CPU at tiny shapes, timed by wall clock (not a measurement)")
    return parser


def parse(parser: argparse.ArgumentParser, argv, subsets: dict[str, tuple[str, ...]]):
    """Parses argv; each option named in `subsets` becomes a list checked against its
    allowed values (--groups and --variants always are)."""
    options = parser.parse_args(argv)
    for option, allowed in dict(subsets, groups=GROUPINGS).items():
        chosen = getattr(options, option).split(",")
        unknown = sorted(set(chosen) - set(allowed))
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; expected a subset of {list(allowed)}")
        setattr(options, option, chosen)
    if options.shapes is None:
        options.shapes = CPU_SHAPES if options.cpu else SHAPES
    return options


def run(options, json_name: str, title: str, measure_row: Callable, plot: Callable, summarize: Callable,
        **fields) -> None:
    """Measures every (shape, grouping) row into options.out/json_name and its PNG.

    measure_row(shape, grouping, row, clock, save) fills `row` (its group sizes and its
    results) and calls save() after each piece, which rewrites the JSON.
    """
    clock = timing.default_clock()
    if clock != timing.CUPTI and not options.cpu:
        raise SystemExit(f"no GPU here (timing clock {clock!r}): pass --cpu for a plumbing test")
    started = time.time()
    rows = []
    result = dict(run_record.header(options.commit, timing.DESCRIPTIONS[clock]), clock=clock, **fields,
                  seconds=0.0, shapes=rows)

    def save() -> str:
        result["seconds"] = time.time() - started
        return run_record.write_json(result, options.out, json_name)

    for shape in options.shapes:
        for grouping in options.groups:
            m, d, f, num_experts = shape
            row = dict(shape=dict(m=m, d=d, f=f, E=num_experts), grouping=grouping)
            rows.append(row)
            measure_row(shape, grouping, row, clock, save)
            path = save()
            plot(rows, path.replace(".json", ".png"), f"{title}, {result['device']} ({clock})")
    summarize(rows)


# XLA fuses a GEMM into a Triton kernel of its own where its autotuner finds one faster,
# and otherwise calls cuBLAS; with the fusion off every GEMM is cuBLAS's. A ceiling variant
# is measured both ways, since neither is faster at every shape.
CUBLAS_ONLY = {"xla_gpu_enable_triton_gemm": False}
