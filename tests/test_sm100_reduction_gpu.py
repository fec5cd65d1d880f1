"""The deterministic reduction pass on the slot layout cuDNN's Blackwell kernel writes.

Runs on any CUDA GPU: the pass (`jax_dsrelu.kernels.slot_reduction`, driven through
`jax_dsrelu.kernels.sm100.slots`) is plain CuTe DSL, compiled for the visible device, so
the team's H200 checks what cuDNN's kernel cannot be run here to check. The slots are
synthetic but laid out exactly as the kernel leaves them: float32 dprob slots (M_pad, S_p)
with one slot per 256-column N-tile, bfloat16 dbias slots (M_pad / 128, n) with one slot
per absolute 128-row M-tile, experts in 256-row padded segments from the bridge's
`row_map`. Rows and tiles past the last segment, which the kernel never writes, hold NaN
here so that reading one fails the test.

Checked: against a float64 sum; bit for bit against the documented order (slots
0, 1, ... and tiles T_e, T_e + 1, ..., each added to a float32 running sum); bitwise equal
across repeated runs.

The pass runs in a child process (this file as a script) so that CUTE_DSL_ARCH can be set
for the visible GPU before CuTe DSL is imported, whatever other test modules did in this
process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from test_sm100_compile import child_env

from jax_dsrelu.kernels import software

_MISSING = software.missing("cutlass", "gpu")
pytestmark = pytest.mark.skipif(_MISSING is not None, reason=f"{_MISSING}: the pass is CuTe DSL code")

CASES = {
    # name: (caller rows m, n, group sizes, with dbias)
    "ragged_with_dbias": (3000, 1024, [700, 0, 1, 256, 900, 300, 0, 500], True),
    "dprob_only": (1000, 320, [5, 600, 0], False),
}
RUNS = 5


def _run_pass(path: str) -> None:
    """In the child: build each case's slots, run the pass RUNS times, save everything."""
    import jax

    major, minor = str(jax.devices("cuda")[0].compute_capability).split(".")
    os.environ["CUTE_DSL_ARCH"] = f"sm_{major}{minor}a"

    import cutlass
    import cutlass.cute as cute
    from cutlass.jax import cutlass_call

    from jax_dsrelu.kernels.sm100 import layout
    from jax_dsrelu.kernels.sm100 import slots
    from jax_dsrelu.kernels.slot_reduction import SlotReduction
    from jax_dsrelu.kernels.sm100.config import CONFIG

    @cute.jit
    def run(stream, dprob_acc, dbias_acc, padded_sizes, dprob, *dbias, reduction):
        dbias_out = dbias[0] if cutlass.const_expr(dbias_acc is not None) else None
        slots.reduce_cudnn_slots(dprob_acc, dbias_acc, padded_sizes, dprob, dbias_out, reduction, stream)

    saved = {}
    for index, (name, (num_rows, n, sizes, with_dbias)) in enumerate(CASES.items()):
        rng = np.random.default_rng(index)
        rows = layout.row_map(jnp.asarray(sizes, jnp.int32), num_rows, CONFIG)
        padded_sizes = np.asarray(rows.padded_sizes)
        num_padded = rows.source_rows.shape[0]
        written = int(padded_sizes.sum())
        # Magnitudes spread over many binades, so that the order of the additions matters.
        dprob_acc = rng.standard_normal((num_padded, CONFIG.dprob_slots(n)))
        dprob_acc *= np.exp2(rng.integers(-8, 9, dprob_acc.shape))
        dprob_acc[written:] = np.nan
        dprob_acc = dprob_acc.astype(np.float32)
        dbias_acc = None
        outputs = [jax.ShapeDtypeStruct((num_padded,), jnp.float32)]
        if with_dbias:
            dbias_acc = rng.standard_normal((CONFIG.dbias_slots(num_padded), n))
            dbias_acc *= np.exp2(rng.integers(-8, 9, dbias_acc.shape))
            dbias_acc[written // CONFIG.cta_tile_m :] = np.nan
            dbias_acc = dbias_acc.astype(jnp.bfloat16)
            outputs.append(jax.ShapeDtypeStruct((len(sizes), n), jnp.float32))

        call = jax.jit(
            cutlass_call(
                run,
                output_shape_dtype=tuple(outputs),
                reduction=SlotReduction(num_experts=len(sizes), tile_m=CONFIG.cta_tile_m),
            )
        )
        args = (
            jnp.asarray(dprob_acc),
            None if dbias_acc is None else jnp.asarray(dbias_acc),
            jnp.asarray(padded_sizes),
        )
        for run_index in range(RUNS):
            results = call(*args)
            saved[f"{name}.dprob.{run_index}"] = np.asarray(results[0])
            if with_dbias:
                saved[f"{name}.dbias.{run_index}"] = np.asarray(results[1])
        saved[f"{name}.dprob_acc"] = dprob_acc
        saved[f"{name}.padded_sizes"] = padded_sizes
        if with_dbias:
            saved[f"{name}.dbias_acc"] = np.asarray(dbias_acc, np.float32)  # exact
    np.savez(path, **saved)


@pytest.fixture(scope="module")
def passes(tmp_path_factory) -> dict:
    path = str(tmp_path_factory.mktemp("sm100_slots") / "results.npz")
    # This process's JAX may already hold most of the GPU's memory; the child takes what
    # it uses.
    env = dict(child_env(), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    done = subprocess.run([sys.executable, __file__, path], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return dict(np.load(path))


def _expected(passes: dict, name: str):
    """(float64 sums, float32 sums in the documented order) for dprob and dbias."""
    num_rows, n, sizes, with_dbias = CASES[name]
    slots_p = passes[f"{name}.dprob_acc"]
    padded_sizes = passes[f"{name}.padded_sizes"]
    written = int(padded_sizes.sum())
    live = slots_p[:written]
    dprob64 = np.zeros(slots_p.shape[0])
    dprob64[:written] = live.astype(np.float64).sum(axis=1)
    dprob32 = np.zeros(slots_p.shape[0], np.float32)
    running = np.zeros(written, np.float32)
    for s in range(live.shape[1]):
        running = (running + live[:, s]).astype(np.float32)
    dprob32[:written] = running
    terms_p = np.zeros(slots_p.shape[0])
    terms_p[:written] = np.abs(live.astype(np.float64)).sum(axis=1)
    if not with_dbias:
        return (dprob64, dprob32, terms_p), None
    slots_b = passes[f"{name}.dbias_acc"]
    dbias64 = np.zeros((len(sizes), n))
    dbias32 = np.zeros((len(sizes), n), np.float32)
    terms_b = np.zeros((len(sizes), n))
    first = 0
    for e, size in enumerate(padded_sizes):
        tiles = slots_b[first : first + size // 128]
        first += size // 128
        dbias64[e] = tiles.astype(np.float64).sum(axis=0)
        terms_b[e] = np.abs(tiles.astype(np.float64)).sum(axis=0)
        running = np.zeros(n, np.float32)
        for tile in tiles:
            running = (running + tile).astype(np.float32)
        dbias32[e] = running
    return (dprob64, dprob32, terms_p), (dbias64, dbias32, terms_b)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_pass_sums_cudnns_slots_in_the_documented_order(passes, name):
    (dprob64, dprob32, terms_p), dbias = _expected(passes, name)
    got = passes[f"{name}.dprob.0"]
    slots_per_row = passes[f"{name}.dprob_acc"].shape[1]
    u32 = np.finfo(np.float32).eps / 2
    np.testing.assert_array_less(np.abs(got - dprob64), slots_per_row * u32 * terms_p + 1e-30)
    np.testing.assert_array_equal(got, dprob32)
    if dbias is not None:
        dbias64, dbias32, terms_b = dbias
        got = passes[f"{name}.dbias.0"]
        tiles = max(int(size) // 128 for size in passes[f"{name}.padded_sizes"])
        np.testing.assert_array_less(np.abs(got - dbias64), tiles * u32 * terms_b + 1e-30)
        np.testing.assert_array_equal(got, dbias32)
        empty = passes[f"{name}.padded_sizes"] == 0
        assert empty.any() and not np.any(got[empty])


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_pass_is_bitwise_stable_across_runs(passes, name):
    outputs = ["dprob", "dbias"] if CASES[name][3] else ["dprob"]
    for output in outputs:
        first = passes[f"{name}.{output}.0"].view(np.uint32)
        for run_index in range(1, RUNS):
            np.testing.assert_array_equal(passes[f"{name}.{output}.{run_index}"].view(np.uint32), first)


if __name__ == "__main__":
    _run_pass(sys.argv[1])
