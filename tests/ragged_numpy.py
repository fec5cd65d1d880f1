"""The ragged matmul, its squared-ReLU epilogue and the ragged contraction in float64
NumPy, written independently of the library: a loop over experts with explicit row
ranges (`contract_numpy.expert_rows`), no ragged_dot, no clamping helpers.

Each function also returns the sum of the absolute terms behind every value, from which
`contract_numpy.tolerance` derives an error bound that follows the arithmetic.
"""

from __future__ import annotations

import numpy as np
from contract_numpy import expert_rows, f64


def ragged_matmul(lhs, rhs, group_sizes, rhs_layout="kn"):
    """(m, k) x (E, k, n) ("kn") or (E, n, k) ("nk") -> (values, terms), (m, n) float64."""
    lhs, rhs = f64(lhs), f64(rhs)
    if rhs_layout == "nk":
        rhs = rhs.transpose(0, 2, 1)
    num_rows, n = lhs.shape[0], rhs.shape[2]
    out, terms = np.zeros((num_rows, n)), np.zeros((num_rows, n))
    for e, (start, end) in enumerate(expert_rows(group_sizes, num_rows)):
        out[start:end] = lhs[start:end] @ rhs[e]
        terms[start:end] = np.abs(lhs[start:end]) @ np.abs(rhs[e])
    return out, terms


def srelu_preact(lhs, rhs, group_sizes, bias=None, rhs_layout="kn"):
    """h = lhs @ rhs[e] + bias[e] over each expert's rows, 0 elsewhere: (values, terms)."""
    h, terms = ragged_matmul(lhs, rhs, group_sizes, rhs_layout)
    if bias is not None:
        bias = f64(bias)
        for e, (start, end) in enumerate(expert_rows(group_sizes, h.shape[0])):
            h[start:end] += bias[e]
            terms[start:end] += np.abs(bias[e])
    return h, terms


def ragged_contract(lhs, rhs, group_sizes, num_experts):
    """out[e] = sum over expert e's rows of lhs[i]^T rhs[i]: (values, terms), (E, a, b)."""
    lhs, rhs = f64(lhs), f64(rhs)
    out = np.zeros((num_experts, lhs.shape[1], rhs.shape[1]))
    terms = np.zeros_like(out)
    for e, (start, end) in enumerate(expert_rows(group_sizes, lhs.shape[0])):
        out[e] = lhs[start:end].T @ rhs[start:end]
        terms[e] = np.abs(lhs[start:end]).T @ np.abs(rhs[start:end])
    return out, terms


def owned_rows(group_sizes, num_rows) -> np.ndarray:
    """Whether each row belongs to an expert, bool (m,)."""
    owned = np.zeros(num_rows, bool)
    for start, end in expert_rows(group_sizes, num_rows):
        owned[start:end] = True
    return owned
