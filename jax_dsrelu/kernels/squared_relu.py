"""The squared-ReLU epilogue's arithmetic on one float32 value, apart from where a
kernel's accumulator fragment keeps it.

Each function takes the values of one output element (its accumulator, its
pre-activation, its row's factors) and gives what the element contributes; the caller
walks its fragment and knows each value's row and column (on Hopper,
`sm90.fragment`). So the bf16 and FP8 variants and another architecture's kernels
compute the same expressions in the same order, and round alike.
"""

from __future__ import annotations

import cutlass
from cutlass import Float32


def relu(pre: Float32) -> Float32:
    """max(pre, 0), keeping NaN: a select (NaN < 0 is false), where fmax would drop it."""
    return Float32(cutlass.select_(pre < Float32(0.0), Float32(0.0), pre))


def activation(pre: Float32, prob: Float32) -> Float32:
    """The routed activation prob * relu(pre)^2, as (r r) prob."""
    r = relu(pre)
    return (r * r) * prob


def backward(acc: Float32, pre: Float32, row_scale: Float32, prob: Float32) -> tuple[Float32, Float32, Float32]:
    """(dh, act, dprob term) of one element, with acc = (dy W2^T) there and row_scale =
    2 alpha prob of its row:

        dh    = (row_scale acc) r            = 2 alpha prob acc relu(pre)
        act   = r^2 prob                     (the forward's activation, made again)
        term  = r^2 acc                      (summed over the row, times alpha: dprob)
    """
    r = relu(pre)
    r2 = r * r
    return (row_scale * acc) * r, r2 * prob, r2 * acc
