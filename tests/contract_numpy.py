"""The contract in float64 NumPy, written independently of the library, for tests.

A loop over experts with explicit row ranges: nothing is shared with the library's code
(no ragged_dot, no clamping helpers), so the two cannot make the same mistake.
Besides the values it returns the magnitude of the terms behind each one, from which
tests derive tolerances that follow the arithmetic (see `tolerance`).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass
class Expected:
    dh: np.ndarray  # (m, n) float64
    dprob: np.ndarray  # (m,)
    dbias: np.ndarray  # (E, n)
    act: np.ndarray  # (m, n)
    amax: np.ndarray  # (E,)
    # Sums of absolute values of the terms behind each output, for tolerances.
    dh_terms: np.ndarray  # (m, n): 2 r p * sum_k |grad * weight| * |alpha|
    dprob_terms: np.ndarray  # (m,): sum_j r^2 |g|
    dbias_terms: np.ndarray  # (E, n): sum over rows of |dh|
    row_expert: np.ndarray  # (m,) expert index, -1 for rows owned by none


def expert_rows(group_sizes, num_rows: int) -> list[tuple[int, int]]:
    """[start, end) of every expert: negative sizes count as 0, rows stop at num_rows."""
    ranges, start = [], 0
    for size in np.asarray(group_sizes).tolist():
        end = min(start + max(int(size), 0), num_rows)
        ranges.append((start, end))
        start = end
    return ranges


def f64(x) -> np.ndarray:
    return np.asarray(np.asarray(x).astype(np.float32), dtype=np.float64)


def grouped_gemm_dsrelu(grad, weight, preact, prob, group_sizes, alpha=None) -> Expected:
    grad, weight, preact, prob = f64(grad), f64(weight), f64(preact), f64(prob)
    num_rows, num_cols = preact.shape
    num_experts = weight.shape[0]
    alpha = np.ones(num_experts) if alpha is None else f64(alpha)
    dh = np.zeros((num_rows, num_cols))
    dh_terms = np.zeros((num_rows, num_cols))
    dprob = np.zeros(num_rows)
    dprob_terms = np.zeros(num_rows)
    act = np.zeros((num_rows, num_cols))
    dbias = np.zeros((num_experts, num_cols))
    dbias_terms = np.zeros((num_experts, num_cols))
    amax = np.zeros(num_experts)
    row_expert = np.full(num_rows, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, (start, end) in enumerate(expert_rows(group_sizes, num_rows)):
            if end == start:
                continue
            rows = slice(start, end)
            row_expert[rows] = e
            g = alpha[e] * (grad[rows] @ weight[e].T)
            g_terms = abs(alpha[e]) * (np.abs(grad[rows]) @ np.abs(weight[e]).T)
            r = np.maximum(preact[rows], 0.0)
            # np.maximum keeps NaN, like the contract's relu.
            p = prob[rows, None]
            dh[rows] = 2.0 * g * r * p
            dh_terms[rows] = 2.0 * g_terms * r * np.abs(p)
            dprob[rows] = np.sum(r * r * g, axis=1)
            dprob_terms[rows] = np.sum(r * r * np.abs(g), axis=1)
            act[rows] = r * r * p
            dbias[e] = np.sum(dh[rows], axis=0)
            dbias_terms[e] = np.sum(np.abs(dh[rows]), axis=0)
            amax[e] = np.max(np.abs(dh[rows]))
    return Expected(dh, dprob, dbias, act, amax, dh_terms, dprob_terms, dbias_terms, row_expert)


def unit_roundoff(dtype) -> float:
    """2^-p for the dtype's p significand bits: the relative error of one rounding."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 2


def tolerance(terms: np.ndarray, num_summed: int, out_dtype=np.float32) -> np.ndarray:
    """Absolute error bound for a float32 sum of `num_summed` terms then one rounding.

    Recursive float32 summation errs by at most about num_summed * u32 times the sum of
    the absolute terms; the final rounding to out_dtype adds u_out times the value,
    bounded here by the same sum, or, among subnormals, half their spacing. A factor 2 of
    slack covers the epilogue's few multiplications.
    """
    u32 = unit_roundoff(np.float32)
    subnormal_step = float(ml_dtypes.finfo(np.dtype(out_dtype)).smallest_subnormal)
    return 2.0 * (num_summed * u32 + unit_roundoff(out_dtype)) * terms + subnormal_step
