"""The expert MLP under an FP8 recipe, as quantize-dequantize arithmetic on the XLA backend.

`jax_dsrelu.ops.expert_mlp` runs this in place of its own forward and backward when the
layer is given a precision. Each of a step's six GEMMs reads its two operands quantized
by the recipe along its own K (`jax_dsrelu.quantization.qdq`), dequantized to float32,
and multiplies them with float32 accumulation:

    GEMM     A, quantized along K             B                               K
    up       x: blocks along d                w1: 128 x 128                   d
    down     act: blocks along f              w2: 128 x 128                   f
    dsrelu   dy: blocks along d               w2 read transposed              d
    dx       dh: blocks along f               w1 read transposed              f
    dW1      x: blocks along expert rows      dh: blocks along expert rows    each expert's rows
    dW2      act: blocks along expert rows    dy: blocks along expert rows    each expert's rows

A weight's square blocks are the same blocks read either way, so one quantization of it
serves its forward and backward GEMMs. In the weight gradients the blocks along the rows
restart at each expert's first row (`jax_dsrelu.quantization.ragged`).

The epilogues compute in float32, as without a recipe: h = acc (+ b1) is rounded to the
caller's dtype, which the backward keeps; act = relu(h)**2 * prob is formed from that h
in float32 and, in the forward, quantized from float32 for the down GEMM (never rounded
to the caller's dtype first); dh, dprob and db1 come from the fused dsReLU step's float32
epilogue, which sums dprob and db1 in float32 and, as without a recipe, stores dh and the
regenerated act in the caller's dtype, the values dx and the weight gradients quantize
(in bf16 a rounding of 2^-8 beside e4m3's 2^-4, for half the bytes of float32 values
written once and read three times). y and dx come out in the caller's dtype, dW1 and dW2
in the weights'.

Every GEMM takes its operands quantized, values and scales: the ragged-M GEMMs (up,
down, dx) and the fused dsReLU step as the block-scaled `ragged_matmul` and
`grouped_gemm_dsrelu` (weights stored (E, N, K)), the weight gradients as the
block-scaled `ragged_contract` (rows quantized in groups that restart at each expert). On
the XLA backend their references dequantize them, the same arithmetic; under backend
"auto" on a Hopper GPU the FP8 kernels serve them (`kernels/sm90/backend.py`). On the XLA
path every step has a fixed summation order and amax maxima are exact in any order, so
every result is bitwise reproducible; the FP8 fused kernel sums dprob and db1 by atomics
unless `deterministic=True`, as the 16-bit one does. The quantizing passes here are what
the FP8 kernels' epilogues will write instead.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.custom_batching
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_dsrelu.kernels import registry
from jax_dsrelu.kernels.registry import LayerBackends
from jax_dsrelu.kernels.request import row_quantize_request, weight_quantize_request
from jax_dsrelu.ops.expert_operands import Experts, Gradients
from jax_dsrelu.primitives import dsrelu, sharding, validation
from jax_dsrelu.primitives.ragged_contract import ragged_contract
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu
from jax_dsrelu.quantization import blockwise, qdq
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE, Recipe


class Epilogue(NamedTuple):
    """The backward's fused step: da = dy w2^T on quantized operands, and its epilogue."""

    dh: jax.Array  # (m, f) in h's dtype, rows of no expert 0
    act: jax.Array  # (m, f) in h's dtype: relu(h)**2 * prob, regenerated
    dprob: jax.Array  # (m,) float32
    dbias: jax.Array | None  # (E, f) float32, when b1 is given


def squared_relu(h: jax.Array, prob: jax.Array) -> jax.Array:
    """relu(h)**2 * prob in float32, as the fused dsReLU step regenerates it: (m, f)."""
    r = jnp.maximum(h.astype(jnp.float32), 0.0)
    return r * r * prob.astype(jnp.float32)[:, None]


def _rows(source: jax.Array, index: jax.Array | None) -> jax.Array:
    return source if index is None else jnp.take(source, index, axis=0, mode="clip")


def forward(
    recipe: Recipe,
    backends: LayerBackends,
    experts: Experts,
    quantized: QuantizedExpertWeights | None = None,  # w1 and w2 quantized already
) -> tuple[jax.Array, jax.Array]:  # y (m, l), h (m, f), both in w1.dtype
    """(y, h), as `expert_mlp.forward` returns them, on quantized operands."""
    weights = quantized if quantized is not None else quantize_expert_weights(experts.w1, experts.w2, recipe,
                                                                                 backend=backends.matmul)
    h = _up(recipe, backends, experts, weights.w1_up)
    # act = squared_relu(h, prob), quantized as it is formed (0 on rows of no expert, whose h is 0).
    y = _block_scaled_matmul(h, weights.w2_down, experts.group_sizes, recipe, backends, out_dtype=experts.w1.dtype,
                             prob=experts.prob)
    return y, h


def preactivation(
    recipe: Recipe,
    backends: LayerBackends,
    experts: Experts,
    quantized: QuantizedExpertWeights,  # w1 and w2 quantized (`quantize_expert_weights`), as the backward reads them
) -> jax.Array:  # h (m, f) in w1.dtype
    """forward's h, bit for bit, without the down-projection (`expert_mlp.preactivation`)."""
    return _up(recipe, backends, experts, quantized.w1_up)


def _up(recipe: Recipe, backends: LayerBackends, experts: Experts, w1_up: QuantizedWeight) -> jax.Array:
    """h of the up-projection on the rows quantized here and w1 quantized as w1_up."""
    rows, w1, _, prob, group_sizes, b1, row_index = experts
    # Blocks along d are within a row, so quantizing the source rows and reading them
    # through the index is quantizing the rows read.
    lhs, lhs_scale = _quantized_rows(rows, recipe, backends.matmul, row_index)
    # act is quantized as it is formed from h, where the down GEMM reads it: the up-projection stores h alone.
    h, _ = ragged_matmul_srelu(lhs, w1_up.values, group_sizes, prob, b1, with_act=False, rhs_layout="nk",
                               out_dtype=w1.dtype, backend=backends.matmul, lhs_scale=lhs_scale,
                               rhs_scale=w1_up.scales)
    return h


def _quantized_rows(a: jax.Array, recipe: Recipe, backend: str,
                    index: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """(values, scales) of the rows a[index] (all of a without an index), in blocks of
    recipe.activations along K: a source quantized once (`_quantize_source_rows`), its rows'
    values and scales read through the index."""
    values, scales = _quantize_source_rows(a, recipe, backend)
    if index is None:
        return values, scales
    return jnp.take(values, index, axis=0, mode="clip"), jnp.take(scales, index, axis=0, mode="clip")


def _quantize_source_rows(a: jax.Array, recipe: Recipe, backend: str,
                          prob: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`blockwise.quantize_blockwise(a, recipe.activations)` of rows a (m, k), or given prob
    (m,) of the activation `squared_relu(a, prob)` of pre-activation rows a: on a kernel
    where `backend` finds one that serves (on Hopper, one pass over the rows that forms
    the activation as it reads them: `kernels/sm90/row_quantize_kernel.py`), else XLA's
    quantizer. On a GPU the two may differ by a step of e4m3 where XLA's float32 division
    is not IEEE's (`quantization.blockwise`)."""
    operands = (a,) if prob is None else (a, prob)

    def by_xla(a, prob=None):
        return blockwise.quantize_blockwise(a if prob is None else squared_relu(a, prob), recipe.activations)

    if backend == "xla" or recipe.activations != FP8_BLOCKWISE.activations or jnp.ndim(a) != 2:
        return by_xla(*operands)
    request = row_quantize_request(a, prob)
    name, implementation = registry.cuda_implementation(backend, request)
    # An explicit backend's implementation comes without its refusals (the kernel's limits).
    if implementation is None or registry.kernel_backend(name).cannot_implement(request) is not None:
        return by_xla(*operands)

    def by_kernel(a, prob=None):
        out = implementation(x=a) if prob is None else implementation(x=a, prob=prob)
        return out["values"], out["scales"]

    # A device quantizes its own rows, and under vmap one operand after another.
    rule = "m k -> m k, m q" if prob is None else "m k, m -> m k, m q"
    on_rows = jax.custom_batching.sequential_vmap(sharding.split_over_leading_axis(by_kernel, rule))
    # Where the computation is lowered for a GPU the kernel, elsewhere XLA.
    return lax.platform_dependent(*operands, cuda=on_rows, default=by_xla)


class QuantizedWeight(NamedTuple):
    """A weight quantized by a recipe, stored (E, N, K) as the block-scaled GEMM reads it."""

    values: jax.Array  # (E, N, K) in the recipe's element type
    scales: jax.Array  # (E, ceil(N / 128), ceil(K / 128)) float32


class QuantizedExpertWeights(NamedTuple):
    """An expert MLP's weights quantized by a recipe, in the layouts its GEMMs read:
    `quantize_expert_weights(w1, w2, recipe)`. A training loop that accumulates gradients
    over micro-steps makes it once per update of the weights and passes it to every
    micro-step's `moe_mlp` (`quantized_weights=`), which then reads no weight in its
    dtype for its GEMMs: the quantizing pass reads w1 and w2 and writes both layouts.

    w1 (E, d, f) read as up's (E, f, d) and dx's (E, d, f); w2 (E, f, d) as down's
    (E, d, f) and the fused dsReLU step's (E, f, d)."""

    w1_up: QuantizedWeight  # (E, f, d): up, K = d
    w1_dx: QuantizedWeight  # (E, d, f): dx, K = f
    w2_down: QuantizedWeight  # (E, d, f): down, K = f
    w2_dsrelu: QuantizedWeight  # (E, f, d): dy w2^T, K = d


def quantize_expert_weights(w1: jax.Array, w2: jax.Array, recipe: Recipe, *, backend: str = "auto") -> QuantizedExpertWeights:
    """w1 (E, d, f) and w2 (E, f, d) quantized by `recipe` (FP8_BLOCKWISE), each in both
    layouts its GEMMs read (`QuantizedExpertWeights`). Quantizing is deterministic: made
    here once or by every moe_mlp call of the same backend, the copies are the same bits.
    backend "auto" quantizes each weight on a kernel where one serves (on Hopper, one pass
    writing both layouts: `kernels/sm90/block_quantize_kernel.py`), else as "xla" does:
    XLA's quantizer, then the values transposed. On a GPU the two may differ by a step of
    e4m3 where XLA's float32 division is not IEEE's (`quantization.blockwise`). No
    gradient flows through the copies (the layer's custom VJP gives w1's and w2's); under
    jit each device quantizes its own experts where E is split."""
    recipe = validation.precision(recipe)
    if recipe is None:
        raise ValueError("recipe must be an FP8 recipe (jax_dsrelu.quantization.FP8_BLOCKWISE), got None")
    if backend not in ("auto", "xla"):
        raise ValueError(f"backend must be 'auto' or 'xla' (the layer's backend under a precision), got {backend!r}")
    if jnp.ndim(w1) != 3 or jnp.shape(w2) != tuple(jnp.shape(w1)[i] for i in (0, 2, 1)):
        raise ValueError(f"w1 must be (E, d, f) and w2 (E, f, d), got w1.shape={jnp.shape(w1)} and "
                         f"w2.shape={jnp.shape(w2)}")
    w1, w2 = lax.stop_gradient(w1), lax.stop_gradient(w2)
    w1_dx, w1_up = _both_layouts(w1, recipe, backend)
    w2_dsrelu, w2_down = _both_layouts(w2, recipe, backend)
    return QuantizedExpertWeights(w1_up=w1_up, w1_dx=w1_dx, w2_down=w2_down, w2_dsrelu=w2_dsrelu)


def _both_layouts(w: jax.Array, recipe: Recipe, backend: str) -> tuple[QuantizedWeight, QuantizedWeight]:
    """w (E, a, b) quantized in the recipe's square blocks: (as stored, transposed (E, b, a)),
    the same values and scales read the other way."""
    def by_xla(w):
        stored = QuantizedWeight(*_quantized_weight(w, recipe))
        return stored, _transposed(stored)

    if backend == "xla" or recipe.weights != FP8_BLOCKWISE.weights:
        return by_xla(w)
    _, implementation = registry.cuda_implementation(backend, weight_quantize_request(w))
    if implementation is None:
        return by_xla(w)

    def by_kernel(w):
        out = implementation(w=w)
        return out["values"], out["transposed"], out["scales"]

    # A device quantizes its own experts (the custom call alone has no partitioning rule),
    # and under vmap one weight after another (nor a batched form).
    on_experts = jax.custom_batching.sequential_vmap(
        sharding.split_over_leading_axis(by_kernel, "e n k -> e n k, e k n, e p q"))

    def on_gpu(w):
        values, transposed, scales = on_experts(w)
        return QuantizedWeight(values, scales), QuantizedWeight(transposed, jnp.swapaxes(scales, 1, 2))

    # Where the computation is lowered for a GPU the kernel, elsewhere XLA.
    return lax.platform_dependent(w, cuda=on_gpu, default=by_xla)


def _transposed(weight: QuantizedWeight) -> QuantizedWeight:
    """The square blocks read the other way: the same values and scales, transposed."""
    return QuantizedWeight(jnp.swapaxes(weight.values, 1, 2), jnp.swapaxes(weight.scales, 1, 2))


def check_quantized_weights(quantized, w1: jax.Array, w2: jax.Array, recipe: Recipe | None) -> None:
    """Raises unless `quantized` is None or a `QuantizedExpertWeights` of w1's and w2's
    shapes, given with a recipe."""
    if quantized is None:
        return
    if not isinstance(quantized, QuantizedExpertWeights):
        raise TypeError(f"quantized_weights must be None or a QuantizedExpertWeights (quantize_expert_weights), "
                        f"got {type(quantized).__name__}")
    if recipe is None:
        raise ValueError("quantized_weights needs precision= the recipe that made them, got precision=None")
    expected = {name: (w.shape[0], w.shape[dims[0]], w.shape[dims[1]])
                for name, w, dims in (("w1_up", w1, (2, 1)), ("w1_dx", w1, (1, 2)), ("w2_down", w2, (2, 1)),
                                      ("w2_dsrelu", w2, (1, 2)))}
    block = recipe.weights.block[0]
    for name, shape in expected.items():
        weight = getattr(quantized, name)
        scales = (shape[0], -(-shape[1] // block), -(-shape[2] // block))
        for part, array, want, dtype in (("values", weight.values, shape, recipe.weights.element),
                                         ("scales", weight.scales, scales, np.dtype(np.float32))):
            seen = (tuple(array.shape), np.dtype(array.dtype))
            if seen != (want, np.dtype(dtype)):
                raise ValueError(f"quantized_weights.{name}.{part} must be {np.dtype(dtype).name} of shape {want} "
                                 f"for w1 {w1.shape} and w2 {w2.shape}, got {seen[1].name} of shape {seen[0]}")


def _quantized_weight(w: jax.Array, recipe: Recipe) -> tuple[jax.Array, jax.Array]:
    """(values, scales) of w (E, a, b) in the recipe's square weight blocks, as stored."""
    return blockwise.quantize_blockwise(qdq.square_blocks(w, recipe), recipe.weights)


def _block_scaled_matmul(a, weight: QuantizedWeight, group_sizes, recipe, backends, *, out_dtype, prob=None):
    """a @ w[e] row by row on a quantized and the weight as quantized (E, N, K): the
    block-scaled ragged matmul; given prob, on the activation squared_relu(a, prob)
    quantized as it is formed (`_quantize_source_rows`)."""
    lhs, lhs_scale = _quantize_source_rows(a, recipe, backends.matmul, prob=prob)
    return ragged_matmul(lhs, weight.values, group_sizes, rhs_layout="nk", out_dtype=out_dtype,
                         backend=backends.matmul, lhs_scale=lhs_scale, rhs_scale=weight.scales)


def epilogue(
    recipe: Recipe,
    deterministic: bool,
    backends: LayerBackends,
    w2: QuantizedWeight,  # (E, f, l) quantized
    prob: jax.Array,  # (m,)
    group_sizes: jax.Array,  # (E,) int32
    with_dbias: bool,
    h: jax.Array,  # (m, f) the forward's pre-activation
    dy: jax.Array,  # (m, l), or its source (U, l) with dy_index
    dy_index: jax.Array | None = None,
) -> Epilogue:
    """The fused dsReLU GEMM on quantized dy and w2 (values and scales: the FP8 fused
    kernel where "auto" finds one, else XLA's dequantizing reference), with its
    float32 epilogue, dh and act stored in h's dtype."""
    grad, grad_scale = _quantized_rows(dy, recipe, backends.dsrelu, dy_index)
    fused = dsrelu.bind(
        grad=grad, grad_block_scale=grad_scale, weight=w2.values, weight_block_scale=w2.scales, preact=h, prob=prob,
        group_sizes=group_sizes, alpha=jnp.ones((w2.values.shape[0],), jnp.float32),
        with_dbias=with_dbias, with_act=True, out_dtype=h.dtype, deterministic=deterministic,
        backend=backends.dsrelu,
    )
    return Epilogue(fused["dh"], fused["act"], fused["dprob"], fused["dbias"] if with_dbias else None)


def backward(
    recipe: Recipe,
    deterministic: bool,
    backends: LayerBackends,
    experts: Experts,
    h: jax.Array,  # (m, f) the forward's pre-activation
    dy: jax.Array,  # (m, l) in w1.dtype, or its source (U, l) with dy_index
    dy_index: jax.Array | None = None,
    quantized: QuantizedExpertWeights | None = None,  # w1 and w2 quantized already
) -> Gradients:
    """`expert_mlp.backward`'s gradients on quantized operands: `epilogue`, then the GEMMs
    that read its dh and act (`gradient_gemms`)."""
    weights = quantized if quantized is not None else quantize_expert_weights(experts.w1, experts.w2, recipe,
                                                                                 backend=backends.matmul)
    fused = epilogue(recipe, deterministic, backends, weights.w2_dsrelu, experts.prob, experts.group_sizes,
                     experts.b1 is not None, h, dy, dy_index)
    drows, dw1, dw2 = gradient_gemms(recipe, backends, experts, fused, dy, dy_index, weights.w1_dx)
    db1 = None if experts.b1 is None else fused.dbias.astype(experts.b1.dtype)
    return Gradients(drows, dw1, dw2, fused.dprob.astype(experts.prob.dtype), db1)


def gradient_gemms(
    recipe: Recipe,
    backends: LayerBackends,
    experts: Experts,
    fused: Epilogue,
    dy: jax.Array,
    dy_index: jax.Array | None = None,
    w1_dx: QuantizedWeight | None = None,  # w1 quantized as dx reads it (made here without)
) -> tuple[jax.Array, jax.Array, jax.Array]:  # drows (m, l) w1.dtype, dw1 (E, l, f), dw2 (E, f, l)
    """dx = dh w1^T, dW1 = x^T dh and dW2 = act^T dy, each on its operands quantized along its K."""
    rows, w1, w2, _, group_sizes, _, row_index = experts
    if w1_dx is None:
        w1_dx = QuantizedWeight(*_quantized_weight(w1, recipe))
    drows = _block_scaled_matmul(fused.dh, w1_dx, group_sizes, recipe, backends, out_dtype=w1.dtype)
    dw1 = _block_scaled_contract(_rows(rows, row_index), fused.dh, group_sizes, recipe, backends, out_dtype=w1.dtype)
    dw2 = _block_scaled_contract(fused.act, _rows(dy, dy_index), group_sizes, recipe, backends, out_dtype=w2.dtype)
    return drows, dw1, dw2


def _block_scaled_contract(lhs, rhs, group_sizes, recipe: Recipe, backends: LayerBackends, *, out_dtype):
    """lhs^T rhs per expert, K = each expert's rows (in expert order): both sides quantized
    in groups of rows that restart at each expert, by the contraction itself (which reads
    the quantized values alone, so a kernel may write them in the layout it reads)."""
    return ragged_contract(lhs, rhs, group_sizes, precision=recipe, out_dtype=out_dtype, backend=backends.contract)
