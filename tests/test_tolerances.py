"""The contract's error bounds can fail: each rejects wrong outputs at the GPU tier's shapes.

A bound that grows with the problem accepts anything at the sizes where kernels break, so
for the largest cases of the kernels' GPU tier (`kernel_cases.LARGEST`) every per-output
check of `contract_numpy` is fed the exact result rounded to the output dtypes, which it
must accept, and outputs with the mistakes kernels make, each of which it must reject:
an output never written, dbias missing each expert's last 128-row tile, dprob missing a
256-column N-tile, a value 10% too large, an expert computed with another expert's
weights, a dropped row, rows shifted by one, one element a few units in the last place off.
The float64 reference is computed once per case (dh and act held in float32: `Case`).
"""

from __future__ import annotations

import zlib

import contract_numpy
import jax.numpy as jnp
import kernel_cases
import numpy as np
import pytest
from test_reference import make_inputs

TILE_M, TILE_N = 128, 256  # the sm90 kernel's tile, whose loss a kernel bug would cause
OUT_DTYPE = np.dtype(jnp.bfloat16)
OUTPUTS = ("dh", "dprob", "dbias", "act", "amax")
ROW_OUTPUTS = ("dh", "dprob", "act")


class Case:
    """Inputs, the float64 contract with its bounds, and the exact outputs rounded."""

    def __init__(self, name: str):
        m, k, n, sizes = kernel_cases.grouping(name)
        rng = np.random.default_rng(zlib.crc32(f"tolerances {name}".encode()))
        self.inputs = make_inputs(rng, m, k, n, sizes, OUT_DTYPE)
        self.alpha = rng.uniform(-2.0, 2.0, len(sizes)).astype(np.float32)
        # dh and act held in float32 (at 65536 x 1024 the two are 1 GB in float64).
        self.expected = contract_numpy.grouped_gemm_dsrelu(
            *self.inputs, alpha=self.alpha, out_dtype=OUT_DTYPE, held_as=np.float32
        )
        self.ranges = contract_numpy.expert_rows(sizes, m)
        e = self.expected
        self.exact = dict(
            dh=e.dh.astype(OUT_DTYPE), dprob=e.dprob.astype(np.float32), dbias=e.dbias.astype(np.float32),
            act=e.act.astype(OUT_DTYPE), amax=e.amax.astype(np.float32),
        )

    def nonempty_by_size(self) -> list[int]:
        sizes = {e: end - start for e, (start, end) in enumerate(self.ranges) if end > start}
        return sorted(sizes, key=sizes.get)


# Each mutation: (case) -> {output name: wrong value}, for the outputs it must be caught in.


def never_written(case):
    return {name: np.zeros_like(value) for name, value in case.exact.items()}


def ten_percent_high(case):
    # float32 holds a 16-bit or float32 output times 1.1 to well under the 10% looked for,
    # at half the memory of float64.
    return {name: (value.astype(np.float32) * np.float32(1.10)).astype(value.dtype) for name, value in case.exact.items()}


def dbias_missing_last_row_tile(case):
    dbias = case.expected.dbias.copy()
    for e, (start, end) in enumerate(case.ranges):
        if end > start:
            last_tile = start + (end - start - 1) // TILE_M * TILE_M
            dbias[e] -= case.expected.dh[last_tile:end].sum(axis=0)
    return {"dbias": dbias.astype(np.float32)}


def dprob_missing_n_tile(case):
    # r^2 g = dh r / (2 p), column by column of the first N-tile.
    _, _, preact, prob, _ = case.inputs
    r = np.maximum(contract_numpy.f64(preact[:, :TILE_N]), 0.0)
    lost = np.sum(case.expected.dh[:, :TILE_N] * r, axis=1) / (2.0 * contract_numpy.f64(prob))
    return {"dprob": (case.expected.dprob - lost).astype(np.float32)}


def swapped_expert(case):
    """The smallest non-empty expert's rows computed with the next smallest's weights."""
    victim, other = case.nonempty_by_size()[:2]
    start, end = case.ranges[victim]
    grad, weight, preact, prob, _ = case.inputs
    wrong = contract_numpy.grouped_gemm_dsrelu(
        grad[start:end], weight[other:other + 1], preact[start:end], prob[start:end],
        [end - start], alpha=case.alpha[victim:victim + 1], out_dtype=OUT_DTYPE,
    )
    out = {name: case.exact[name].copy() for name in ("dh", "dprob", "dbias", "amax")}
    out["dh"][start:end] = wrong.dh.astype(OUT_DTYPE)
    out["dprob"][start:end] = wrong.dprob
    out["dbias"][victim] = wrong.dbias[0]
    out["amax"][victim] = wrong.amax[0]
    return out


def dropped_row(case):
    """The middle row of the smallest non-empty expert left out.

    In an expert of thousands of rows one row of dbias is within the bound of the sum's
    rounding, so the row is taken where the bound is tight enough to see it."""
    expert = case.nonempty_by_size()[0]
    start, end = case.ranges[expert]
    row = (start + end) // 2
    out = {name: case.exact[name].copy() for name in ROW_OUTPUTS}
    for name in ROW_OUTPUTS:
        out[name][row] = 0
    out["dbias"] = case.exact["dbias"].copy()
    out["dbias"][expert] = (case.expected.dbias[expert] - case.expected.dh[row]).astype(np.float32)
    return out


def shifted_by_one(case):
    """Row outputs one row down; per-expert outputs one expert on."""
    return {name: np.roll(value, 1, axis=0) for name, value in case.exact.items()}


def tightest(want: np.ndarray, bound: np.ndarray) -> int:
    """The flat index of the largest |want| / bound (0 where want is 0), the first of equals;
    block by block, since the outputs are large."""
    flat_want, flat_bound = want.reshape(-1), bound.reshape(-1)
    best, best_at = -1.0, 0
    for start in range(0, flat_want.size, contract_numpy.CHECK_BLOCK):
        w = flat_want[start:start + contract_numpy.CHECK_BLOCK]
        tightness = np.where(w != 0, np.abs(w) / flat_bound[start:start + contract_numpy.CHECK_BLOCK], 0.0)
        at = int(np.argmax(tightness))
        if tightness[at] > best:
            best, best_at = tightness[at], start + at
    return best_at


def few_ulps_off(case):
    """One element of each 16-bit output 3 units in the last place larger in magnitude,
    where the bound is tightest: there, more than 2.5 units off is out of bounds."""
    out = {}
    for name in ("dh", "act"):
        want = getattr(case.expected, name)
        bound = getattr(case.expected, f"{name}_bound")
        at = np.unravel_index(tightest(want, bound), want.shape)
        value = case.exact[name].copy()
        bits = value.view(np.uint16)
        bits[at] += 3  # sign-magnitude: 3 more units in the last place
        out[name] = value
    return out


MUTATIONS = {
    mutation.__name__: mutation
    for mutation in (
        never_written, ten_percent_high, dbias_missing_last_row_tile, dprob_missing_n_tile,
        swapped_expert, dropped_row, shifted_by_one, few_ulps_off,
    )
}


@pytest.fixture(scope="module", params=kernel_cases.LARGEST)
def case(request):
    return Case(request.param)


@pytest.mark.parametrize("name", OUTPUTS)
def test_exact_result_is_accepted(case, name):
    contract_numpy.CHECKS[name](case.exact[name], case.expected)


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_wrong_outputs_are_rejected(case, mutation):
    wrong = MUTATIONS[mutation](case)
    assert wrong
    for name, value in wrong.items():
        with pytest.raises(AssertionError, match=name):
            contract_numpy.CHECKS[name](value, case.expected)


def test_a_correct_float32_computation_is_accepted(case):
    """Not only the exact result: float32 arithmetic in another order is within the bounds.

    The GEMM is evaluated in float32 (NumPy's blocked order, not the kernel's), and the
    epilogue in the kernel's association, expert by expert."""
    grad, weight, preact, prob, _ = case.inputs
    e = case.expected
    # Rounded to the output dtypes expert by expert: whole float32 copies of dh and act
    # would double what the largest case holds.
    dh = np.zeros(e.dh.shape, OUT_DTYPE)
    dprob = np.zeros(e.dprob.shape, np.float32)
    act = np.zeros(e.act.shape, OUT_DTYPE)
    dbias = np.zeros(e.dbias.shape, np.float32)
    amax = np.zeros(e.amax.shape, np.float32)
    for x, (start, end) in enumerate(case.ranges):
        if end == start:
            continue
        rows = slice(start, end)
        acc = np.asarray(grad[rows], np.float32) @ np.asarray(weight[x], np.float32).T
        r = np.maximum(np.asarray(preact[rows], np.float32), np.float32(0))
        p = np.asarray(prob[rows], np.float32)[:, None]
        alpha = case.alpha[x]
        dh32 = ((alpha + alpha) * p * acc) * r
        dprob[rows] = alpha * np.sum(r * r * acc, axis=1)
        act[rows] = (r * r * p).astype(OUT_DTYPE)
        dbias[x] = np.sum(dh32, axis=0)
        amax[x] = np.max(np.abs(dh32))
        dh[rows] = dh32.astype(OUT_DTYPE)
    computed = dict(dh=dh, dprob=dprob, dbias=dbias, act=act, amax=amax)
    for name, value in computed.items():
        contract_numpy.CHECKS[name](value, e)
