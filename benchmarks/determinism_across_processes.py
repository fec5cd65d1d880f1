"""Bitwise reproducibility across processes: runs fresh processes and compares their digests.

For each kernel-cache mode, --processes fresh processes of each of

    benchmarks/process_digests.py                      every gradient of moe_mlp (sm90 and xla,
                                                       deterministic=True), the primitive, the
                                                       example's layer; --runs calls in-process
    examples/train_moe.py --dtype bfloat16 --deterministic   a whole training run: its final
                                                       parameter digest

with XLA's default flags (XLA_FLAGS and JAX's persistent compilation cache unset, so XLA
compiles and autotunes anew in every process). Cache modes:

    fresh   JAX_DSRELU_KERNEL_CACHE is a new empty directory per process: every CuTe DSL
            kernel is compiled in the process
    warm    JAX_DSRELU_KERNEL_CACHE is --cache (prebuilt): every kernel is read from disk

Every digest goes to determinism.json (with device, commit and command), and a summary
says, for every output, how many distinct digests the processes gave (1: identical).

    python benchmarks/determinism_across_processes.py --out /tmp/det --processes 4 --commit abc1234
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import run_record

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE_VARIABLE = "JAX_DSRELU_KERNEL_CACHE"
MODES = ("fresh", "warm")
PARAMETER_DIGEST = re.compile(r"parameter digest: ([0-9a-f]+)")
FINAL_LOSS = re.compile(r"loss \S+ -> (\S+) in \d+ steps")
DEVICES = re.compile(r"devices: (.*?)  dtype")


def child_environment(kernel_cache: str) -> dict:
    env = dict(os.environ)
    # XLA's defaults: no flags, no persistent compilation cache carried between processes.
    for variable in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE"):
        env.pop(variable, None)
    env[CACHE_VARIABLE] = kernel_cache
    return env


def run_process(command, env, timeout, log) -> tuple[int | None, str, float]:
    started = time.time()
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code, output = None, expired.stdout or ""
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
        output += f"\n(timed out after {timeout} s)"
    seconds = time.time() - started
    log.write(f"== {' '.join(command)}  [{env[CACHE_VARIABLE]}] exit {code} in {seconds:.1f} s\n{output}\n")
    log.flush()
    return code, output, seconds


def digests_process(mode, run, env, options, log) -> dict:
    command = [sys.executable, "benchmarks/process_digests.py", "--label", f"{mode}{run}", "--runs", str(options.runs),
               "--backends", options.backends]
    code, output, seconds = run_process(command, env, options.timeout, log)
    entry = dict(script="process_digests", mode=mode, run=run, exit=code, seconds=seconds)
    lines = [line for line in output.splitlines() if line.startswith("{")]
    if lines:
        entry.update(json.loads(lines[-1]))
    else:
        entry["error"] = output[-run_record.ERROR_CHARS:]
    return entry


def example_process(mode, run, env, options, log) -> dict:
    command = [sys.executable, "examples/train_moe.py", "--dtype", "bfloat16", "--deterministic"]
    if options.example_steps:
        command += ["--steps", str(options.example_steps)]
    code, output, seconds = run_process(command, env, options.timeout, log)
    entry = dict(script="train_moe", mode=mode, run=run, exit=code, seconds=seconds)
    digest, loss, devices = PARAMETER_DIGEST.search(output), FINAL_LOSS.search(output), DEVICES.search(output)
    if devices:
        entry["device"] = devices.group(1)
    if digest:
        entry["results"] = {"train_moe_parameters": dict(digest=digest.group(1))}
        entry["final_loss"] = loss.group(1) if loss else None
    else:
        entry["error"] = output[-run_record.ERROR_CHARS:]
    return entry


def summarize(processes) -> dict:
    """For every computation and output: its distinct digests over processes, per mode and
    over all; and the most distinct results any one process saw in its own repeated calls."""
    summary: dict = {}
    for entry in processes:
        for name, result in entry.get("results", {}).items():
            item = summary.setdefault(name, {"by_output": {}, "max_distinct_in_process": 1, "errors": 0})
            if "error" in result:
                item["errors"] += 1
                continue
            item["max_distinct_in_process"] = max(item["max_distinct_in_process"], result.get("distinct_in_process", 1))
            for output, value in result.get("outputs", {"all": result["digest"]}).items():
                seen = item["by_output"].setdefault(output, {"all": set()})
                seen["all"].add(value)
                seen.setdefault(entry["mode"], set()).add(value)
    for item in summary.values():
        for output, seen in item["by_output"].items():
            item["by_output"][output] = {key: len(values) for key, values in seen.items()}
        counts = [count for seen in item["by_output"].values() for count in seen.values()]
        item["identical_across_processes"] = bool(counts) and max(counts) == 1 and item["errors"] == 0
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--processes", type=int, default=4, help="processes per script and cache mode")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of fresh,warm")
    parser.add_argument("--cache", default=os.environ.get(CACHE_VARIABLE, os.path.join(ROOT, ".kernels", "cache")),
                        help="the prebuilt kernel cache, for the warm mode")
    parser.add_argument("--runs", type=int, default=20, help="calls of each computation within a process")
    parser.add_argument("--scripts", default="process_digests,train_moe", help="comma-separated")
    parser.add_argument("--backends", default="sm90,xla", help="process_digests.py's backends, comma-separated")
    parser.add_argument("--example-steps", type=int, default=None, help="train_moe.py's steps (default: its own)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per process")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--json", default="determinism.json", help="file name of the results under --out")
    options = parser.parse_args()
    modes = options.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected a subset of {list(MODES)}")
    if "warm" in modes and not (os.path.isdir(options.cache) and os.listdir(options.cache)):
        print(f"warning: the warm mode's cache {options.cache} is empty: its processes compile too", flush=True)
    runners = {"process_digests": digests_process, "train_moe": example_process}
    scripts = options.scripts.split(",")
    os.makedirs(options.out, exist_ok=True)
    processes = []
    started = time.time()
    # Runs interleaved (run 1 of every script, then run 2, ...), and the JSON rewritten after
    # every process, so a stage cut short by its time limit still leaves balanced results.
    with open(os.path.join(options.out, options.json.replace(".json", ".log")), "a") as log:
        for mode in modes:
            for run in range(1, options.processes + 1):
                for script in scripts:
                    with tempfile.TemporaryDirectory(prefix="kernel-cache-fresh-") as empty:
                        env = child_environment(empty if mode == "fresh" else options.cache)
                        entry = runners[script](mode, run, env, options, log)
                    processes.append(entry)
                    print(json.dumps({k: entry.get(k) for k in ("script", "mode", "run", "exit", "seconds")}
                                     | {"digests": {n: r.get("digest", r.get("error", "")[:80])
                                                    for n, r in entry.get("results", {}).items()}}), flush=True)
                    summary = write(options, processes, time.time() - started)
    print(json.dumps(summary, indent=1))


def write(options, processes, seconds) -> dict:
    summary = summarize(processes)
    # The device as the children saw it: this process never starts JAX's GPU backend, which
    # would hold most of the GPU's memory while the children run.
    device = next((entry["device"] for entry in processes if "device" in entry), "unknown")
    result = dict(
        run_record.header(options.commit, "not timed", device=device),
        benchmark="digests across fresh processes, XLA's default flags",
        processes_per_mode=options.processes,
        xla_flags="XLA's defaults (XLA_FLAGS unset)",
        runs_in_process=options.runs,
        seconds=seconds,
        summary=summary,
        processes=processes,
    )
    run_record.write_json(result, options.out, options.json)
    return summary


if __name__ == "__main__":
    main()
