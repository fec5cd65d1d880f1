"""The static facts of one call, and what a kernel backend provides: a leaf module.

Kernels, their FFI layer and `jax_dsrelu.kernels.registry` all import from here, and this module
imports none of them, so no import cycle runs through backend choice.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Protocol

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Request:
    """The static facts of one call: everything a backend may decide on, nothing dynamic.

    The row count m and the group sizes are deliberately absent: they may change from
    step to step without changing which backend serves the call or what it compiles.
    """

    num_experts: int
    n: int
    k: int
    operand_dtype: np.dtype
    preact_dtype: np.dtype
    prob_dtype: np.dtype
    out_dtype: np.dtype
    with_dbias: bool
    with_act: bool
    deterministic: bool
    block_scaled: bool = False  # MXFP8 operands (sm100): e8m0 scales per 32 of k
    # FP8_BLOCKWISE operands (sm90): e4m3 grad and weight with float32 scales,
    # grad_block_scale (m, ceil(k / 128)) and weight_block_scale (E, ceil(n / 128), ceil(k / 128))
    blockwise_scaled: bool = False


@dataclasses.dataclass(frozen=True)
class RaggedMatmulRequest:
    """Static facts of a ragged-M grouped GEMM: row i of expert e is lhs[i] @ rhs[e].

    lhs (m, k); rhs stored (E, k, n) (rhs_layout "kn", as W1 and W2 are for the forward)
    or (E, n, k) ("nk", a weight read transposed in place, as for dx = dh @ W1[e]^T).
    Accumulation in float32. Rows owned by no expert come out 0.

    epilogue "none":  out (m, n) = acc in out_dtype.
                      implementation: (lhs=, rhs=, group_sizes=) -> {out}
    epilogue "srelu": h = acc (+ bias[e]) rounded to out_dtype, and
                      act = relu(h)**2 * prob computed from the rounded h, in out_dtype.
                      implementation: (lhs=, rhs=, group_sizes=, prob= (m,),
                      [bias= (E, n)]) -> {h, act}
                      with_act=False: h alone, {h} (for a caller that forms act
                      itself, or needs only h), prob read by no kernel.
    block_scaled:     lhs and rhs e4m3 under the FP8_BLOCKWISE recipe
                      (`jax_dsrelu.quantization`), their float32 scales two more
                      operands: lhs_scale= (m, ceil(k / 128)), one per row and K block,
                      and rhs_scale= (E, ceil(n / 128), ceil(k / 128)), one per 128 x 128
                      block of rhs stored (E, n, k) ("nk"); each K block's partial sum
                      is multiplied by its two scales in float32 and added to the total.
    """

    num_experts: int
    k: int
    n: int
    rhs_layout: str  # "kn" | "nk"
    operand_dtype: np.dtype
    out_dtype: np.dtype
    epilogue: str = "none"  # "none" | "srelu"
    with_bias: bool = False
    block_scaled: bool = False
    with_act: bool = True  # "srelu": whether act is stored beside h


@dataclasses.dataclass(frozen=True)
class RaggedContractRequest:
    """Static facts of a ragged-contraction GEMM (weight gradients):
    out[e] (a, b) = sum over expert e's rows i of lhs[i]^T rhs[i]; lhs (m, a), rhs (m, b).

    Accumulation in float32; an expert with no rows gets zeros; rows owned by no expert
    are never read into a sum. implementation: (lhs=, rhs=, group_sizes=) -> {out}

    block_scaled: lhs and rhs e4m3 under the FP8_BLOCKWISE recipe, quantized in groups of
                  128 rows that restart at each expert (`quantization.ragged`), their
                  float32 scales two more operands: lhs_scale= (G, a) and rhs_scale=
                  (G, b), G = ceil(m / 128) + E, group g's scale of each column; each
                  group's partial sum is multiplied by its two scales in float32 and
                  added to the total.
    quantized_from: (lhs dtype, rhs dtype), 16- or 32-bit floats, where the call gives
                  lhs and rhs unquantized and no scales: the implementation quantizes
                  them by that recipe first (`quantization.ragged.quantize_ragged_rows`),
                  then contracts as block_scaled (which is then True, operand_dtype e4m3).
    """

    num_experts: int
    a: int
    b: int
    operand_dtype: np.dtype
    out_dtype: np.dtype
    block_scaled: bool = False
    quantized_from: tuple[np.dtype, np.dtype] | None = None


@dataclasses.dataclass(frozen=True)
class GatherSumRequest:
    """Static facts of an ordered gather-and-sum (the `gather_sum` primitive):
    out[t] (n,) = rows[index[t, 0]] + ... + rows[index[t, slots - 1]], added in slot order
    in float32; rows (m, n) in rows_dtype, index (T, slots) int32, indices clamped into
    [0, m). The counts m and T are absent, as the rows are from a GEMM's.
    implementation: (rows=, index=) -> {out}
    """

    n: int
    slots: int
    rows_dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class WeightQuantizeRequest:
    """Static facts of expert weights quantized for the FP8 GEMMs (`quantize_expert_weights`):
    w (num_experts, n, k) in weight_dtype, in 128 x 128 blocks of amax-scaled e4m3.
    implementation: (w=) -> {values (E, n, k), transposed (E, k, n), scales (E, ceil(n / 128),
    ceil(k / 128))}, as `quantization.blockwise.quantize_blockwise` makes values and scales.
    """

    num_experts: int
    n: int
    k: int
    weight_dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class RowQuantizeRequest:
    """Static facts of activation rows quantized for the FP8 GEMMs' A operands: x (m, k) in
    rows_dtype, in 1 x 128 blocks of amax-scaled e4m3 along each row (m varies from call
    to call). implementation: (x=) -> {values (m, k), scales (m, ceil(k / 128))}, as
    `quantization.blockwise.quantize_blockwise` makes them. With prob_dtype, x is a
    pre-activation h and the rows quantized are the squared-ReLU activation
    relu(h)**2 * prob[:, None], formed in float32 (`quantized_expert_mlp.squared_relu`):
    implementation (x=, prob=) with prob (m,) in prob_dtype.
    """

    k: int
    rows_dtype: np.dtype
    prob_dtype: np.dtype | None = None


# Every kind of request a kernel backend may be asked to serve.
AnyRequest = (Request | RaggedMatmulRequest | RaggedContractRequest | GatherSumRequest | WeightQuantizeRequest
              | RowQuantizeRequest)


class KernelBackend(Protocol):
    """What `jax_dsrelu.kernels.<name>.backend` provides to the registry."""

    NAME: str
    DEVICE_DESCRIPTION: str  # which GPUs it runs on, in words
    REQUEST_KINDS: tuple[type, ...]  # the kinds of request it has kernels for

    def software_missing(self) -> str | None:
        """Why the backend's packages cannot be imported here, or None."""

    def supports_compute_capability(self, capability: tuple[int, int]) -> bool:
        """Whether the kernel runs on a device of this compute capability."""

    def cannot_implement(self, request: AnyRequest) -> str | None:
        """Why this request is outside the kernel's constraints, or None. A backend that
        has no kernel for a kind of request says so here."""

    def gathers_rows(self, request: AnyRequest) -> frozenset[str]:
        """The operands of `request`'s primitive whose rows the kernels read through a row
        index themselves; the primitives gather the others first
        (`jax_dsrelu.primitives.base`)."""

    def implementation(self, request: AnyRequest) -> Callable[..., Mapping[str, jax.Array]]:
        """A function of the primitive's operands by keyword, named as the primitive's
        schema names them (`jax_dsrelu.primitive_schema`), returning its results by those
        names, for lowering; it takes the row index of each operand named by
        `gathers_rows` (`lhs_index=...`), where a call gives one. Other names among its
        results (workspaces) are ignored."""


@functools.cache
def cuda_compute_capability() -> tuple[int, int] | None:
    """Compute capability of the first visible CUDA device, None when there is none."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError:
        return None
    if not devices:
        return None
    major, minor = str(devices[0].compute_capability).split(".")
    return int(major), int(minor)


def gather_sum_request(rows: Any, index: Any) -> GatherSumRequest:
    """The request of a gather-and-sum of `rows` (m, n) by `index` (T, slots), from their
    shapes and dtypes (arrays or avals)."""
    return GatherSumRequest(n=rows.shape[1], slots=index.shape[1], rows_dtype=np.dtype(rows.dtype))


def weight_quantize_request(w: Any) -> WeightQuantizeRequest:
    """The request of quantizing expert weights w (E, n, k) (an array or aval)."""
    return WeightQuantizeRequest(*w.shape, weight_dtype=np.dtype(w.dtype))


def row_quantize_request(x: Any, prob: Any = None) -> RowQuantizeRequest:
    """The request of quantizing activation rows x (m, k) (an array or aval), or, given
    prob (m,), the squared-ReLU activation of pre-activation rows x."""
    return RowQuantizeRequest(k=x.shape[-1], rows_dtype=np.dtype(x.dtype),
                              prob_dtype=None if prob is None else np.dtype(prob.dtype))


def request_from_avals(avals: Any, *, block_scaled: bool = False, **params: Any) -> Request:
    grad, weight, preact, prob = avals[:4]
    return Request(
        num_experts=weight.shape[0],
        n=weight.shape[1],
        k=weight.shape[2],
        operand_dtype=np.dtype(grad.dtype),
        preact_dtype=np.dtype(preact.dtype),
        prob_dtype=np.dtype(prob.dtype),
        block_scaled=block_scaled,
        **params,
    )
