"""Hardware counters of the grouped GEMMs of a layer step beside cuBLAS's batched GEMM.

Where bench_gemms.py says how long each kernel takes, this says what bounds it: Nsight
Compute's speed-of-light, compute and memory sections for one launch of each kernel (ours
on bench_gemms.py's operands, `make_operands`, one set per grouping). Two steps, on the
GPU machine:

    ncu --clock-control none --kernel-name 'regex:^(kernel_cutlass|nvjet|sm90_xmma)' \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \\
        --csv --page details python3 benchmarks/profile_gemms.py run --groups dirichlet,equal > counters.csv
    python3 benchmarks/profile_gemms.py record counters.csv --commit C --out DIR

`run` calls each selected variant of each GEMM once (sm90, then cuBLAS batched over equal
experts), in the order grouping, GEMM, variant. `record` writes DIR/profile_gemms.json:
each profiled launch with its metrics, labelled by that order (an sm90 kernel opens a
GEMM's entry; the cuBLAS kernels after it are its batched GEMM's). The cuBLAS launches in
the report are those of XLA's autotuner, every algorithm it tries, twice each, on its own
buffers, once per GEMM shape; the compiled program's own launch of the chosen one does not
appear. The fastest of them is the one XLA compiles, the one bench_gemms.py times.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import subprocess
import sys

NANO = (49152, 2688, 1856, 128)
SM90_KERNEL_PREFIX = "kernel_cutlass"


def run(options) -> None:
    import jax

    import bench_gemms

    shape = options.shape
    shapes = bench_gemms.operand_shapes(*shape)
    out_dtype = bench_gemms.BF16
    for grouping in options.groups.split(","):
        operands = bench_gemms.make_operands(*shape, 0, grouping)
        for gemm in options.gemms.split(","):
            for variant in bench_gemms.gemm_variants(gemm, shapes, out_dtype):
                if variant.name not in ("sm90", "cublas_batched"):
                    continue
                print(f"{grouping} {gemm} {variant.name}", file=sys.stderr, flush=True)
                outputs = variant.build()(*(operands[name] for name in variant.operands))
                jax.block_until_ready(outputs)
                del outputs


def launches(csv_path: pathlib.Path) -> list[dict]:
    """The profiled launches of an ncu --csv --page details report, in launch order."""
    by_id: dict[str, dict] = {}
    with open(csv_path, newline="") as handle:
        # ncu prints its own progress lines before the table: skip to the header.
        lines = handle.readlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f"{csv_path}: no table with a header starting '\"ID\"' (ncu --csv --page details); "
                         "ncu did not run, failed, or profiled no kernel")
    for row in csv.DictReader(lines[start:]):
        launch = by_id.setdefault(row["ID"], dict(kernel=row["Kernel Name"], grid=row["Grid Size"],
                                                  block=row["Block Size"], metrics={}))
        launch["metrics"][f"{row['Section Name']}: {row['Metric Name']}"] = dict(
            unit=row["Metric Unit"], value=row["Metric Value"])
    return [by_id[key] for key in sorted(by_id, key=int)]


def labelled(profiled: list[dict], groups: list[str], gemms: list[str]) -> list[dict]:
    """Each launch with the (grouping, GEMM, variant) that ran it (see the module doc)."""
    slots = [(grouping, gemm) for grouping in groups for gemm in gemms]
    ours = sum(launch["kernel"].startswith(SM90_KERNEL_PREFIX) for launch in profiled)
    if ours != len(slots):
        raise ValueError(f"the report has {ours} launches of our kernels, expected one per GEMM run: "
                         f"{len(slots)} ({groups} x {gemms}); a truncated report or another run's")
    slot = -1
    for launch in profiled:
        if launch["kernel"].startswith(SM90_KERNEL_PREFIX):
            slot += 1
            variant = "sm90"
        else:
            variant = "cublas_batched"
        if not 0 <= slot < len(slots):
            raise ValueError(f"launch {launch['kernel'][:60]!r} falls outside the {len(slots)} GEMMs run "
                             f"({groups} x {gemms}): the report does not match the run")
        launch.update(grouping=slots[slot][0], gemm=slots[slot][1], variant=variant)
    return profiled


def record(options) -> None:
    try:
        device = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:  # recorded on another machine than the one profiled
        device = "unknown: nvidia-smi not found where the report was recorded"
    result = dict(
        device=device, commit=options.commit, shape=dict(zip(("m", "d", "f", "E"), options.shape)),
        command=options.command, tool="Nsight Compute, one launch per kernel, clocks not locked",
        launches=labelled(launches(options.csv), options.groups.split(","), options.gemms.split(",")),
    )
    out = pathlib.Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_gemms.json").write_text(json.dumps(result, separators=(",", ":")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "record"))
    parser.add_argument("csv", nargs="?", type=pathlib.Path, help="record: ncu's CSV report")
    parser.add_argument("--shape", type=lambda text: tuple(int(v) for v in text.split(",")), default=NANO)
    parser.add_argument("--groups", default="dirichlet,equal")
    parser.add_argument("--gemms", default="up,down,dsrelu,dx,dw1,dw2")
    parser.add_argument("--commit", default=None, help="record: the commit profiled")
    parser.add_argument("--command", default=None, help="record: the ncu command that wrote the CSV")
    parser.add_argument("--out", default="benchmarks/results")
    options = parser.parse_args(argv)
    if options.mode == "run":
        run(options)
    else:
        missing = [name for name in ("csv", "commit", "command") if getattr(options, name) is None]
        if missing:
            parser.error(f"record needs {', '.join(missing)}: the CSV report and what produced it")
        record(options)


if __name__ == "__main__":
    main()
