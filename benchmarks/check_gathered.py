"""The gathered fused dsReLU kernel run again and again beside the verified kernel on the same
rows, at the GPU tier's case where it once gave wrong rows (tests/test_sm90_gathered.py,
"nano_widths"): what goes wrong, and where (docs/sm90.md, "The preact ring").

Every output is NaN-filled before each run and held to the float64 contract; a failure names
its blocks (expert, tile, N-tile, subtile), the entries never written, and whose values they
hold. Four kernels per mode: the verified one on rows gathered in memory, the gathered one,
and the gathered one as at 13cf1f7, without the preact fence (`UnfencedGatheredDsrelu`) and
also with its copies waited for (`WaitedGatheredDsrelu`): which go wrong says which signal fails.

    python benchmarks/check_gathered.py --runs 20 --commit C --out DIR
    JAX_DSRELU_KERNEL_CACHE=.kernels/cache python benchmarks/check_gathered.py --prebuild
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
from unittest import mock

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_sm90_gathered as cases  # noqa: E402, I001  (first: it sets CUTE_DSL_ARCH before CuTe DSL loads)
import contract_numpy  # noqa: E402
import harness  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import run_record  # noqa: E402

from jax_dsrelu.kernels.sm90 import dsrelu_call  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels.sm90.gathered_kernels import GatheredDsreluSm90  # noqa: E402
from jax_dsrelu.kernels.operands import ROWS, SOURCE_ROWS  # noqa: E402

CASE = "nano_widths"
OUTPUTS = ("dh", "dprob", "dbias", "act", "amax")
KERNELS = ("in_memory", "gathered", "gathered_unfenced", "gathered_waited")
SAMPLED = 20_000  # wrong entries placed in blocks, at most (the counts are of these)


class WaitedGatheredDsrelu(GatheredDsreluSm90):
    """Each gathering thread waits for its copies, fences them and arrives plainly (no
    cp.async.mbarrier.arrive.noinc); preact released unfenced as at 13cf1f7: one signal changed."""

    epilogue_input_fenced = False

    @staticmethod
    def signal_copies_landed(ab_pipeline, state) -> None:
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.mbarrier_arrive(ab_pipeline.producer_get_barrier(state))


class UnfencedGatheredDsrelu(GatheredDsreluSm90):
    """Each preact buffer released right after it is read, with no proxy fence."""

    epilogue_input_fenced = False


VARIANTS = {"gathered_unfenced": UnfencedGatheredDsrelu, "gathered_waited": WaitedGatheredDsrelu}


def variant_kernel(name: str):
    """A context in which dsrelu_call builds (and keys) variant `name` for its gathered calls."""
    kernel, key = dsrelu_call._kernel, dsrelu_call._compile_key
    return mock.patch.multiple(dsrelu_call, _compile_key=lambda *a: key(*a) + (name,), _kernel=lambda request, config,
                               gathered=None: VARIANTS[name](config, request) if gathered else kernel(request, config))


def problem(deterministic: bool):
    """The tier's case: its inputs (as the test draws them) and the request and config."""
    rng, dy, index, rows, k, n, sizes = cases.gathered_case(CASE)
    num_experts = len(sizes)
    weight = jnp.asarray(rng.standard_normal((num_experts, n, k)) / np.sqrt(k), jnp.bfloat16)
    preact = jnp.asarray(rng.standard_normal((index.size, n)), jnp.bfloat16)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, index.size), jnp.float32)
    alpha = jnp.asarray(rng.uniform(-2.0, 2.0, num_experts), jnp.float32)
    request = cases.dsrelu_request(num_experts, k, n, deterministic)
    config = sm90_config.choose_config(dsrelu_call.kernel_request(request))
    return dict(dy=jnp.asarray(dy), index=jnp.asarray(index), rows=jnp.asarray(rows), weight=weight, preact=preact,
                prob=prob, sizes=jnp.asarray(sizes, jnp.int32), alpha=alpha), request, config


def runner(kernel: str, request, config):
    """A jitted (inputs, NaN-filled outputs) -> outputs of one kernel, with its context."""
    run = dsrelu_call.implementation(request, config, outputs_in_place=True)
    def fn(i, filled):
        rows = dict(grad=i["rows"]) if kernel == "in_memory" else dict(grad=i["dy"], grad_index=i["index"])
        results = run(**rows, weight=i["weight"], preact=i["preact"], prob=i["prob"], group_sizes=i["sizes"],
                      alpha=i["alpha"], filled=filled)
        return {name: results[name] for name in OUTPUTS}

    context = (lambda: variant_kernel(kernel)) if kernel in VARIANTS else contextlib.nullcontext
    return jax.jit(fn), context


def poisoned(request, config, kernel: str, inputs) -> dict:
    gathered = None if kernel == "in_memory" else "grad"
    if gathered:  # as dsrelu_call runs a gathered kernel: alone, not in cluster pairs
        config = dataclasses.replace(config, cluster_n=1)
    counts = {ROWS: inputs["preact"].shape[0], SOURCE_ROWS: inputs["dy"].shape[0]}
    return {o.name: jnp.full(o.shape_for(counts), jnp.nan, o.dtype)
            for o in dsrelu_call.operands(request, config, gathered=gathered) if o.role == "output"}


def tile_starts(sizes, num_rows: int, tile_m: int) -> list[tuple[int, int, int, int]]:
    """(expert, tile within it, first row, rows) of every expert tile."""
    return [(e, t, start + t * tile_m, min(tile_m, end - start - t * tile_m))
            for e, (start, end) in enumerate(contract_numpy.expert_rows(sizes, num_rows))
            for t in range(-(-(end - start) // tile_m))]


def blocks_of(bad: np.ndarray, tiles, config) -> list[dict]:
    """The (expert tile, N-tile, subtile) blocks holding the wrong entries, most first."""
    counter = collections.Counter()
    rows, columns = np.nonzero(bad)
    for row, column in zip(rows[:SAMPLED], columns[:SAMPLED]):
        e, t, first, _ = next(tile for tile in tiles if tile[2] <= row < tile[2] + tile[3])
        counter[(e, t, first, column // config.tile_n, (column % config.tile_n) // config.epi_n)] += 1
    return [dict(expert=int(e), tile=int(t), first_row=int(f), n_tile=int(nt), subtile=int(s), wrong=int(c))
            for (e, t, f, nt, s), c in counter.most_common(8)]


def sources(block: dict, got: dict, inputs, verified_dh: np.ndarray, tiles, config) -> dict:
    """Whose values a wrong block holds: where relu(preact)^2 prob matches its act, and where the verified
    dh equals its dh, best first."""
    rows = slice(block["first_row"], block["first_row"] + next(t[3] for t in tiles if t[2] == block["first_row"]))
    column0, n = block["n_tile"] * config.tile_n + block["subtile"] * config.epi_n, verified_dh.shape[1]
    columns = slice(column0, min(column0 + config.epi_n, n))
    height, width = rows.stop - rows.start, columns.stop - columns.start
    prob = np.asarray(inputs["prob"], np.float64)
    relu2 = np.maximum(np.asarray(inputs["preact"], np.float64), 0.0) ** 2
    implied = np.asarray(got["act"][rows, columns], np.float64) / prob[rows, None]
    dh = np.asarray(got["dh"][rows, columns])
    act_matches, dh_matches = [], []
    for _, _, first, count in tiles:
        if count < height:
            continue
        for c0 in range(0, n - width + 1, config.epi_n):
            candidate = relu2[first:first + height, c0:c0 + width]
            act_matches.append((float(np.mean(np.isclose(implied, candidate, rtol=2**-6, atol=1e-6))), first, c0))
            dh_matches.append((float(np.mean(verified_dh[first:first + height, c0:c0 + width] == dh)), first, c0))
    best = lambda found: [dict(share=s, first_row=f, column=c) for s, f, c in sorted(found, reverse=True)[:3]]  # noqa: E731
    return dict(rows=[rows.start, rows.stop], columns=[columns.start, columns.stop], act_from_preact_at=best(act_matches),
                dh_equals_verified_at=best(dh_matches))


def check(deterministic: bool, runs: int) -> dict:
    inputs, request, config = problem(deterministic)
    expected = contract_numpy.grouped_gemm_dsrelu(inputs["rows"], inputs["weight"], inputs["preact"], inputs["prob"],
                                                  inputs["sizes"], alpha=inputs["alpha"], out_dtype=jnp.bfloat16)
    tiles = tile_starts(np.asarray(inputs["sizes"]), inputs["preact"].shape[0], config.tile_m)
    # The outputs the same in every run and every kernel: with atomics dprob and dbias vary.
    exact = OUTPUTS if deterministic else ("dh", "act", "amax")
    found, verified = {}, None
    for kernel in KERNELS:
        fn, context = runner(kernel, request, config)
        entry = dict(runs=runs, outside_contract=0, unlike_in_memory=0, digests=collections.Counter(), failures=[])
        with context():
            for run in range(runs):
                got = {name: np.asarray(out) for name, out in fn(inputs, poisoned(request, config, kernel, inputs)).items()}
                entry["digests"][harness.digest([got[name] for name in exact])] += 1
                verified = verified or got  # the first run of the verified kernel
                entry["unlike_in_memory"] += any(not np.array_equal(got[name], verified[name], equal_nan=True)
                                                 for name in exact)
                bad = {name: contract_numpy.outside_bound(got[name], getattr(expected, name),
                                                          getattr(expected, f"{name}_bound")) for name in OUTPUTS}
                if not any(b.any() for b in bad.values()):
                    continue
                entry["outside_contract"] += 1
                if len(entry["failures"]) < 4:
                    blocks = blocks_of(bad["dh"] | bad["act"], tiles, config)
                    entry["failures"].append(dict(
                        run=run, wrong={name: int(b.sum()) for name, b in bad.items()},
                        unwritten={name: int(np.isnan(got[name]).sum()) for name in ("dh", "act")}, blocks=blocks,
                        first_block=sources(blocks[0], got, inputs, verified["dh"], tiles, config) if blocks else None))
        entry.update(distinct=len(entry["digests"]), digests=dict(entry["digests"]))
        print(f"  {'deterministic' if deterministic else 'default'} {kernel}: {entry['outside_contract']} of {runs} "
              f"runs outside the contract, {entry['unlike_in_memory']} unlike the verified kernel's first, "
              f"{entry['distinct']} distinct results of {', '.join(exact)}", flush=True)
        found[kernel] = entry
    return dict(config=str(config), kernels=found)


def prebuild() -> None:
    for deterministic in (False, True):
        inputs, request, config = problem(deterministic)
        for kernel in KERNELS:
            fn, context = runner(kernel, request, config)
            with context():
                harness.lower_for_cuda(f"check_gathered {kernel} deterministic={deterministic}", fn,
                                       harness.shapes_of(inputs), harness.shapes_of(poisoned(request, config, kernel, inputs)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--commit")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--prebuild", action="store_true", help="build the kernels into the disk cache and stop")
    args = parser.parse_args()
    if args.prebuild:
        return prebuild()
    result = dict(run_record.header(args.commit, "none: a correctness check"), case=CASE,
                  modes={mode: check(mode == "deterministic", args.runs) for mode in ("deterministic", "default")})
    print(run_record.write_json(result, args.out, "check_gathered.json"))


if __name__ == "__main__":
    main()
