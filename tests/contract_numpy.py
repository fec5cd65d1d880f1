"""The contract in float64 NumPy, written independently of the library, and error bounds.

`grouped_gemm_dsrelu` is a loop over experts with explicit row ranges: nothing is shared
with the library's code (no ragged_dot, no clamping helpers), so the two cannot make the
same mistake. Besides the exact values it returns, for every output entry, a bound on how
far a correct float32 implementation can land from them; `assert_matches_contract` holds
a backend's outputs to those bounds.

Derivation of the bounds. u = 2^-24 is float32's unit roundoff, u_o that of out_dtype, and
gamma(n, v) = n v / (1 - n v) bounds the relative error of n operations that each err by
at most v (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1; the
denominator absorbs the higher-order terms). Every bound is a per-entry absolute bound,
a multiple of a sum of absolute values of that entry's own terms, so it stays as tight at
m = 65536 as at m = 16.

* The GEMM. acc[i, j] = sum_k grad[i, k] weight[e, j, k] over K = k products. Products of
  bfloat16 or float16 operands are exact in float32 (8 + 8 and 11 + 11 significand bits
  fit in 24); float32 operands round each product (u). A float32 sum of K terms in any
  order errs by at most gamma(K - 1, u) times the sum of the absolute terms. A tensor core
  adds a block of b products to its accumulator by aligning all b + 1 inputs to the
  largest exponent and truncating, so each input loses less than one unit in the last
  place of the largest, 2u relative to the block's sum of absolute values: at most
  2u (b + 1) / b <= 4u per product. Hence, for every backend,
      |acc~ - acc| <= gamma(K, 4u) T,   T[i, j] = sum_k |grad[i, k] weight[e, j, k]|.
  With g = alpha acc, the GEMM part of every output below is scaled by |alpha| T.
* dh = 2 alpha acc r p: three float32 multiplications (by alpha, r and p, in some order;
  the factor 2 is exact), then one rounding to out_dtype. The float32 value before that
  rounding, which dbias and amax use, errs by
      E32 = gamma(3, u) |dh| + (1 + gamma(3, u)) gamma(K, 4u) 2 r |p| |alpha| T + 3 tiny,
  and dh itself by E32 + u_o (|dh| + E32) + sub_o. tiny is float32's smallest normal
  (underflow in a product, flushed or not); sub_o is out_dtype's smallest subnormal, one
  spacing of its subnormals, which covers the rounding of values below its normal range.
* act = r r p: two float32 multiplications, one rounding:
      gamma(2, u) |act| + 2 tiny + u_o (|act| + that) + sub_o.
* dprob[i] = sum_j r^2 g over n columns: each term carries three roundings (r r, times
  acc, times alpha, once per term or once for the total) and the n terms are added by
  n - 1 float32 additions in any order (thread sums, shuffles, slots, atomics):
      gamma(n + 2, u) P + (1 + gamma(n + 2, u)) gamma(K, 4u) sum_j r^2 |alpha| T + 3 n tiny,
  P[i] = sum_j r^2 |g|.
* dbias[e, j] = sum over expert e's m_e rows of the float32 dh: m_e - 1 additions of terms
  that each err by E32 (adding the 0 of a masked row is exact, so rows of other experts
  cost nothing):  S + gamma(m_e - 1, u) (B + S),  S = sum_i E32,  B = sum_i |dh|.
* amax[e] = max |dh| over expert e's entries, on the float32 dh: max is exact and
  |max a - max b| <= max |a - b|, so the bound is the largest E32 of the expert.
* Rows owned by no expert and empty experts: exactly 0 (bound 0).
NaN and Inf: where the exact value is not finite, the output must be the same NaN or the
same infinity; where it is finite, the output must be finite and within the bound.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

UNIT_ROUNDOFF_F32 = 2.0**-24
# Per product of the k-dot: round-to-nearest sums need u (2u with float32 products), a
# truncating tensor-core accumulator at most 4u (see the module docstring).
DOT_UNIT = 4 * UNIT_ROUNDOFF_F32
TINY_F32 = float(np.finfo(np.float32).tiny)


@dataclasses.dataclass
class Expected:
    """The contract's outputs computed in float64 (dh and act unrounded; held in float64
    or, where asked, float32) and per-entry error bounds."""

    dh: np.ndarray  # (m, n)
    dprob: np.ndarray  # (m,)
    dbias: np.ndarray  # (E, n)
    act: np.ndarray  # (m, n)
    amax: np.ndarray  # (E,)
    dh_bound: np.ndarray  # (m, n), for dh rounded to out_dtype
    dprob_bound: np.ndarray  # (m,)
    dbias_bound: np.ndarray  # (E, n)
    act_bound: np.ndarray  # (m, n), for act rounded to out_dtype
    amax_bound: np.ndarray  # (E,)
    row_expert: np.ndarray  # (m,) expert index, -1 for rows owned by none
    out_dtype: np.dtype


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


def rounded_up_f32(x: np.ndarray) -> np.ndarray:
    """x in float32, each value rounded up to the next float32 where the cast rounded it down."""
    x32 = x.astype(np.float32)
    return np.where(x32 < x, np.nextafter(x32, np.float32(np.inf)), x32)


def unit_roundoff(dtype) -> float:
    """2^-p for the dtype's p significand bits: the relative error of one rounding."""
    return float(ml_dtypes.finfo(np.dtype(dtype)).eps) / 2


def gamma(count, unit: float):
    """Relative error bound of `count` operations erring by at most `unit` each."""
    product = np.asarray(count, np.float64) * unit
    return product / (1.0 - product)


def tolerance(terms: np.ndarray, num_summed, out_dtype=np.float32) -> np.ndarray:
    """Absolute error bound of a float32-accumulated dot or sum of `num_summed` products,
    `terms` being the sum of their absolute values, rounded once to out_dtype: the
    accumulation's gamma (DOT_UNIT per operation, as for the k-dot above), the final
    rounding, and near zero half the output dtype's subnormal step."""
    subnormal_step = float(ml_dtypes.finfo(np.dtype(out_dtype)).smallest_subnormal)
    return (gamma(num_summed, DOT_UNIT) + unit_roundoff(out_dtype)) * terms + subnormal_step


def grouped_gemm_dsrelu(
    grad, weight, preact, prob, group_sizes, alpha=None, out_dtype=np.dtype(ml_dtypes.bfloat16),
    held_as=np.float64,
) -> Expected:
    """The contract and its bounds, computed in float64 an expert at a time. `held_as`:
    the dtype dh and act are kept in once computed (the bounds always come from the float64
    values); float32 is 2^-24 relative, 2^15 times finer than a 16-bit output's bounds,
    and halves what the largest cases hold."""
    # preact, the largest input, is widened an expert's rows at a time.
    grad, weight, prob = f64(grad), f64(weight), f64(prob)
    preact = np.asarray(preact)
    out_dtype = np.dtype(out_dtype)
    u_out = unit_roundoff(out_dtype)
    sub_out = float(ml_dtypes.finfo(out_dtype).smallest_subnormal)
    num_rows, num_cols = preact.shape
    num_experts, _, k = weight.shape
    alpha = np.ones(num_experts) if alpha is None else f64(alpha)
    gemm = gamma(k, DOT_UNIT)
    g3, g2, gn = gamma(3, UNIT_ROUNDOFF_F32), gamma(2, UNIT_ROUNDOFF_F32), gamma(num_cols + 2, UNIT_ROUNDOFF_F32)

    # The (m, n) bounds are kept in float32, rounded up: a bound only ever grows by it, and
    # the largest cases need half the memory.
    dh, dh_bound = np.zeros((num_rows, num_cols), held_as), np.zeros((num_rows, num_cols), np.float32)
    act, act_bound = np.zeros((num_rows, num_cols), held_as), np.zeros((num_rows, num_cols), np.float32)
    dprob, dprob_bound = np.zeros(num_rows), np.zeros(num_rows)
    dbias, dbias_bound = np.zeros((num_experts, num_cols)), np.zeros((num_experts, num_cols))
    amax, amax_bound = np.zeros(num_experts), np.zeros(num_experts)
    row_expert = np.full(num_rows, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        for e, (start, end) in enumerate(expert_rows(group_sizes, num_rows)):
            if end == start:
                continue
            rows = slice(start, end)
            row_expert[rows] = e
            g = alpha[e] * (grad[rows] @ weight[e].T)
            gemm_error = gemm * abs(alpha[e]) * (np.abs(grad[rows]) @ np.abs(weight[e]).T)
            # np.maximum keeps NaN, like the contract's relu.
            r = np.maximum(f64(preact[rows]), 0.0)
            p = prob[rows, None]

            expert_dh = 2.0 * g * r * p
            dh[rows] = expert_dh
            dh_f32_error = g3 * np.abs(expert_dh) + (1 + g3) * 2.0 * r * np.abs(p) * gemm_error + 3 * TINY_F32
            dh_bound[rows] = rounded_up_f32(dh_f32_error + u_out * (np.abs(expert_dh) + dh_f32_error) + sub_out)

            expert_act = r * r * p
            act[rows] = expert_act
            act_f32_error = g2 * np.abs(expert_act) + 2 * TINY_F32
            act_bound[rows] = rounded_up_f32(act_f32_error + u_out * (np.abs(expert_act) + act_f32_error) + sub_out)
            del expert_act

            dprob[rows] = np.sum(r * r * g, axis=1)
            dprob_bound[rows] = (
                gn * np.sum(r * r * np.abs(g), axis=1)
                + (1 + gn) * np.sum(r * r * gemm_error, axis=1)
                + 3 * num_cols * TINY_F32
            )

            dbias[e] = np.sum(expert_dh, axis=0)
            summed_error = np.sum(dh_f32_error, axis=0)
            dbias_bound[e] = summed_error + gamma(end - start - 1, UNIT_ROUNDOFF_F32) * (
                np.sum(np.abs(expert_dh), axis=0) + summed_error
            )
            amax[e] = np.max(np.abs(expert_dh))
            amax_bound[e] = np.max(dh_f32_error)
    return Expected(
        dh, dprob, dbias, act, amax, dh_bound, dprob_bound, dbias_bound, act_bound, amax_bound,
        row_expert, out_dtype,
    )


CHECK_BLOCK = 1 << 20  # entries per block of assert_within


def outside_bound(got, want: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """Where got is not within the bound of want: |got - want| > bound where want is
    finite, not the same NaN or the same infinity where it is not."""
    g = np.asarray(got).astype(np.float64)
    with np.errstate(invalid="ignore"):
        ok = np.abs(g - want) <= bound  # False wherever either side is NaN or infinite
        same_special = ~np.isfinite(want) & ((np.isnan(g) & np.isnan(want)) | (g == want))
    return ~(ok | same_special)


def assert_within(name: str, got, want: np.ndarray, bound: np.ndarray, dtype) -> None:
    """got has `dtype` and want's shape; |got - want| <= bound where want is finite, and
    the same NaN or the same infinity where it is not."""
    got = np.asarray(got)
    if got.shape != want.shape or got.dtype != np.dtype(dtype):
        raise AssertionError(
            f"{name}: got {got.dtype.name} {got.shape}, expected {np.dtype(dtype).name} {want.shape}"
        )
    # Block by block, so that checking a large output costs a block's float64 temporaries
    # rather than several copies of the whole output.
    flat_got, flat_want, flat_bound = got.reshape(-1), want.reshape(-1), bound.reshape(-1)
    wrong_count, first_wrong = 0, None
    for start in range(0, flat_want.size, CHECK_BLOCK):
        block = slice(start, start + CHECK_BLOCK)
        wrong = np.flatnonzero(outside_bound(flat_got[block], flat_want[block], flat_bound[block]))
        if wrong.size and first_wrong is None:
            first_wrong = start + wrong[0]
        wrong_count += wrong.size
    if wrong_count:
        at = np.unravel_index(first_wrong, want.shape)
        raise AssertionError(
            f"{name}: {wrong_count} of {want.size} entries outside the bound, the first at {at}: "
            f"got {np.float64(got[at])!r}, expected {want[at]!r} within {bound[at]!r}"
        )


def assert_dh(got, expected: Expected) -> None:
    assert_within("dh", got, expected.dh, expected.dh_bound, expected.out_dtype)


def assert_dprob(got, expected: Expected) -> None:
    assert_within("dprob", got, expected.dprob, expected.dprob_bound, np.float32)


def assert_dbias(got, expected: Expected) -> None:
    assert_within("dbias", got, expected.dbias, expected.dbias_bound, np.float32)


def assert_act(got, expected: Expected) -> None:
    assert_within("act", got, expected.act, expected.act_bound, expected.out_dtype)


def assert_amax(got, expected: Expected) -> None:
    assert_within("amax", got, expected.amax, expected.amax_bound, np.float32)


# One check per output, by DsreluOutputs field name.
CHECKS = {"dh": assert_dh, "dprob": assert_dprob, "dbias": assert_dbias, "act": assert_act, "amax": assert_amax}


def assert_matches_contract(
    out, inputs, alpha=None, out_dtype=np.dtype(ml_dtypes.bfloat16), with_dbias=True, with_act=True
) -> None:
    """Every output of a `grouped_gemm_dsrelu` call against the float64 contract.

    `inputs` is (grad, weight, preact, prob, group_sizes); absent optional outputs must be None.
    """
    expected = grouped_gemm_dsrelu(*inputs, alpha=alpha, out_dtype=out_dtype)
    for name, check in CHECKS.items():
        value = getattr(out, name)
        if (name == "dbias" and not with_dbias) or (name == "act" and not with_act):
            assert value is None, f"{name} was not asked for, got {type(value).__name__}"
        else:
            check(value, expected)


def assert_agree_within_the_contract(a, b, inputs, names, out_dtype=np.dtype(ml_dtypes.bfloat16)) -> None:
    """Outputs `names` of two `grouped_gemm_dsrelu` results of the same inputs (sharded and
    on one device, say), each within the contract's bound of the exact value, so within
    twice it of each other. Where the two programs' GEMMs have other shapes that is what
    XLA:CPU promises: its dot may block K otherwise for another output width, and does on
    some hosts."""
    expected = grouped_gemm_dsrelu(*inputs, out_dtype=out_dtype)
    for name in names:
        apart = np.abs(np.asarray(getattr(a, name), np.float64) - np.asarray(getattr(b, name), np.float64))
        outside = apart > 2 * np.asarray(getattr(expected, f"{name}_bound"), np.float64)
        assert not outside.any(), f"{name}: {int(outside.sum())} values apart by more than twice the bound"
