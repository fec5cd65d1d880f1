"""The one clock of every benchmark: CUPTI kernel time per call, or no measurement at all.

A call's time is the sum of its kernels' durations (host gaps not counted), median over
--reps calls after a warm-up; its breakdown, each launch position's median. Where CUPTI
cannot time (jax.experimental.mosaic.gpu.profiler), the run fails and says why: only a --cpu
plumbing test is timed by a wall clock, and its record says WALL CLOCK in its header and entries.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Callable

import jax

CUPTI = "cupti"
WALL_CLOCK = "wall_clock"
DESCRIPTIONS = {CUPTI: "CUPTI kernel time per call (the sum of the kernels it launches), median of reps after warm-up",
                WALL_CLOCK: "WALL CLOCK on the CPU: a test of the script's plumbing, not a measurement"}
KERNEL_NAME_CHARS = 120  # of a mangled CuTe DSL kernel name (hundreds): the head identifies it
# A GEMM kernel, by its name: cuBLAS's (nvjet_sm90_*, sm90_xmma_gemm_*), XLA's Triton GEMM
# fusions, CUTLASS's and QuACK's (GemmDefaultSm90), ours (RaggedGemmSm90, GroupedGemmDsreluSm90,
# RaggedContractSm90, their Gathered* twins) and tokamax's (ragged_dot_sm90,
# ragged_contracting_dim_dot_sm90). Everything else (routing, gathers, casts) is outside the GEMMs.
GEMM_KERNEL = re.compile(r"gemm|nvjet|contract|ragged_dot|DsreluSm90", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Timing:
    ms: float  # median over the calls
    calls_ms: list[float]  # every call's time
    kernels: list[tuple[str, float]]  # per launch position in a call: (kernel name, median ms)
    clock: str

    def record(self) -> dict:
        entry = dict(ms=self.ms, calls_ms=self.calls_ms, kernels=[[name, ms] for name, ms in self.kernels],
                     kernel_summary=kernel_summary(self.kernels), outside_gemms=outside_gemms(self.kernels))
        return entry if self.clock == CUPTI else dict(entry, clock=WALL_CLOCK)


def clock_for(cpu: bool) -> str:
    """CUPTI on a GPU; the wall clock only for a --cpu plumbing test; else the run stops."""
    if cpu:
        return WALL_CLOCK
    if jax.default_backend() != "gpu":
        raise SystemExit(f"no GPU here (JAX platform {jax.default_backend()!r}): a measurement needs CUPTI on a "
                         "GPU; pass --cpu for a plumbing test timed by wall clock")
    return CUPTI


def time_call(fn: Callable, args: tuple, reps: int, clock: str) -> Timing:
    """Times fn(*args) (profiler.measure under CUPTI); the first call compiles and warms up."""
    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    jax.block_until_ready(fn(*args))
    if clock == WALL_CLOCK:
        calls = []
        for _ in range(reps):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            calls.append((time.perf_counter() - start) * 1e3)
        return Timing(statistics.median(calls), calls, [], clock)
    from jax.experimental.mosaic.gpu import profiler

    try:
        _, launches = profiler.measure(fn, aggregate=False, iterations=reps)(*args)
    except RuntimeError as error:
        raise RuntimeError(f"CUPTI could not time the call (jax.experimental.mosaic.gpu.profiler: {error}); "
                           "no other clock is used") from error
    if launches is None:
        raise RuntimeError("CUPTI recorded no kernel launch for this call")
    return _timing([launches] if reps == 1 else launches)  # measure returns one call's launches unwrapped


def time_launches(fn: Callable[[], object], synchronize: Callable[[], None], reps: int) -> Timing:
    """Times fn(), which launches its GPU work itself (a PyTorch library's call; measure jits what it
    times, so cannot take it), in the CUPTI session that profiler.measure opens; after a warm-up."""
    from jax._src.lib import mosaic_gpu

    if reps < 1:
        raise ValueError(f"reps must be at least 1, got {reps}")
    cupti = mosaic_gpu._mosaic_gpu_ext
    fn()
    synchronize()
    cupti._cupti_init()
    try:
        for _ in range(reps):
            fn()
        synchronize()
    finally:
        launches = cupti._cupti_get_timings(True) or []
    if not launches or len(launches) % reps:
        raise RuntimeError(f"CUPTI recorded {len(launches)} kernel launches for {reps} calls; "
                           f"expected a positive multiple of {reps}")
    per_call = len(launches) // reps
    calls = [launches[i * per_call:(i + 1) * per_call] for i in range(reps)]
    # The breakdown takes medians by launch position: every call must launch the same kernels.
    names = [[name for name, _ in call] for call in calls]
    if any(call_names != names[0] for call_names in names):
        raise RuntimeError(f"the {reps} calls launched different kernels: {names[0]} first")
    return _timing(calls)


def _timing(launches: list[list[tuple[str, float]]]) -> Timing:
    """The Timing of calls given as each call's (kernel name, ms) launches."""
    calls = [sum(ms for _, ms in call) for call in launches]
    kernels = [(name[:KERNEL_NAME_CHARS], statistics.median(call[position][1] for call in launches))
               for position, (name, _) in enumerate(launches[0])]
    return Timing(statistics.median(calls), calls, kernels, CUPTI)


def kernel_summary(kernels: list[tuple[str, float]], top: int = 8) -> list[list]:
    """Time per kernel name (launches of one name added), largest first; the rest as one row."""
    by_name = {name: sum(ms for n, ms in kernels if n == name) for name, _ in kernels}
    ranked = sorted(by_name.items(), key=lambda item: -item[1])
    rows = [[name, ms] for name, ms in ranked[:top]]
    if len(ranked) > top:
        rows.append([f"{len(ranked) - top} other kernels", sum(ms for _, ms in ranked[top:])])
    return rows


def outside_gemms(kernels) -> dict:
    """The time of a call's kernels that are not GEMMs (GEMM_KERNEL), and its share of the call's."""
    total = sum(ms for _, ms in kernels)
    other = sum(ms for name, ms in kernels if not GEMM_KERNEL.search(name))
    return dict(ms=other, share=other / total if total else None)


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
