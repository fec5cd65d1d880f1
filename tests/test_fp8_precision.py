"""The precision option, `precision=FP8_BLOCKWISE`: the XLA path's quantize-dequantize
arithmetic of the six GEMMs of a `moe_mlp` step, held to float64 two ways.

1. Against float64 of the same quantized arithmetic, GEMM by GEMM: each GEMM's operands
   are quantized by the NumPy oracle of the recipe (`test_quantization_blockwise`'s, and
   the per-expert loop of `test_quantization_ragged` along the tokens), from the values
   the path feeds that GEMM (its own h, dh and act, so that a rounding decision of the
   quantizer never depends on float32 against float64), and multiplied in float64. The
   tolerance is float32 accumulation's: (K + 3) * 2^-24 * |A| @ |B|. Quantization bugs
   planted in the path (a scale from the neighbouring block, a weight's block scales
   transposed, groups along the tokens that straddle two experts) fail it.
2. Against float64 of the unquantized layer, within a bound carried through the step from
   e4m3's unit roundoff 2^-4 per operand (plus half a subnormal step times the scale),
   float32 accumulation and the caller dtype's rounding, in float32 and in bfloat16. It is
   a worst-case bound, on |A| @ |B| at every GEMM, so it is loose where products cancel
   (tens of times the result's size at these shapes); it still catches a scale taken
   from the neighbouring block, and the tight check is the first.

Then: `moe_mlp`'s forward and gradients are these stages' bit for bit; deterministic runs
repeat bit for bit; the option is checked; `MoEOptions` carries it through `moe_layer`,
`moe_layer_expert_parallel` and `flax.MoE`.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu
from jax_dsrelu import MoEOptions
from jax_dsrelu.kernels.registry import LayerBackends, layer_backends
from jax_dsrelu.ops import quantized_expert_mlp as qmlp
from jax_dsrelu.ops.expert_operands import Experts
from jax_dsrelu.quantization import FP8_BLOCKWISE, MXFP8, ragged, stored
from test_quantization_blockwise import oracle_quantize
from test_quantization_ragged import per_expert_loop

RECIPE = FP8_BLOCKWISE
BACKENDS = layer_backends("xla", RECIPE)
U8 = 2.0**-4  # e4m3's unit roundoff
SUBNORMAL_HALF_STEP = 2.0**-10  # relative to the block's scale
F32, BF16 = 2.0**-24, 2.0**-8
UNITS = {"float32": F32, "bfloat16": BF16}

# An empty expert, experts of fewer than 128 rows, one of 128 + 72, and 15 rows past the
# total; d and f are not multiples of 128.
SIZES = [0, 70, 200, 5, 40]
M, D, F = 330, 160, 200
E = len(SIZES)
OWNED = sum(SIZES)


def inputs(dtype=jnp.float32, seed=0):
    """x, w1, w2, prob, b1, dy as NumPy arrays (x, w1, w2, dy representable in dtype), with
    magnitudes that change from one expert's rows to the next and from one K block of d to
    the next, so that a scale taken from a wrong block shows."""
    rng = np.random.default_rng(seed)
    expert = np.searchsorted(np.cumsum(SIZES), np.arange(M), side="right")
    by_expert = lambda: np.exp2(rng.integers(-4, 5, E + 1))[expert][:, None]  # noqa: E731
    by_block = lambda factors: np.repeat(np.asarray(factors), 128)[:D]  # noqa: E731
    rounded = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731
    x = rounded(rng.standard_normal((M, D)) * by_expert() * by_block([2.0, 0.125]))
    w1 = rounded(rng.standard_normal((E, D, F)) / np.sqrt(D))
    w2 = rounded(rng.standard_normal((E, F, D)) / np.sqrt(F))
    prob = rng.uniform(0.1, 1.0, M).astype(np.float32)
    b1 = (0.1 * rng.standard_normal((E, F))).astype(np.float32)
    dy = rounded(rng.standard_normal((M, D)) * by_expert() * by_block([0.25, 4.0]))
    return x, w1, w2, prob, b1, dy


# --- float64 helpers ---


def expert_of_rows():
    return np.searchsorted(np.cumsum(SIZES), np.arange(M), side="right")


def bias_rows(b1):
    """b1 of each row's expert, 0 on rows of no expert: (m, f) float64."""
    expert = expert_of_rows()
    return np.where((expert < E)[:, None], np.asarray(b1, np.float64)[np.minimum(expert, E - 1)], 0.0)


def rows_matmul(a, b):
    """Row i of expert e is a[i] @ b[e], in float64; rows of no expert 0: (m, K), (E, K, N)."""
    expert = expert_of_rows()
    out = np.zeros((a.shape[0], b.shape[2]))
    for e in range(E):
        rows = expert == e
        out[rows] = a[rows].astype(np.float64) @ b[e].astype(np.float64)
    return out


def per_expert_outer(a, b):
    """sum over expert e's rows of a^T b, in float64: (m, p), (m, q) -> (E, p, q)."""
    expert = expert_of_rows()
    return np.stack([a[expert == e].astype(np.float64).T @ b[expert == e].astype(np.float64) for e in range(E)])


def per_expert_sum(a):
    expert = expert_of_rows()
    return np.stack([a[expert == e].sum(axis=0) for e in range(E)])


def dequantize(values, scales, block, shape):
    """values * their block's scale, one float32 product as the library forms it, as float64."""
    rows, cols = block
    per_value = np.repeat(np.repeat(scales.astype(np.float64), rows, axis=-2), cols, axis=-1)
    return (values * per_value[..., : shape[-2], : shape[-1]]).astype(np.float32).astype(np.float64)


def oracle_along_k(a):
    values, scales = oracle_quantize(np.asarray(a, np.float32), RECIPE.activations.block)
    return dequantize(values, scales, RECIPE.activations.block, a.shape)


def oracle_weights(w):
    values, scales = oracle_quantize(np.asarray(w, np.float32), RECIPE.weights.block)
    return dequantize(values, scales, RECIPE.weights.block, w.shape)


def oracle_along_expert_rows(a):
    return per_expert_loop(np.asarray(a, np.float32), SIZES)[0].astype(np.float64)


def within(got, want, tolerance) -> bool:
    got = np.asarray(got, np.float64)
    return got.shape == want.shape and bool(np.all(np.abs(got - want) <= tolerance))


def accumulation(k, a, b, product=np.matmul):
    """float32 accumulation of K products of the float32 operands a and b, and the rounding
    of its result: (K + 3) * 2^-24 * |a| @ |b|."""
    return (k + 3) * F32 * product(np.abs(a), np.abs(b))


# --- 1. The quantized arithmetic, GEMM by GEMM ---


def run_stages(x, w1, w2, prob, b1, dy):
    """The path's stages, each under jit: the forward, the fused dsReLU step, the GEMMs
    that read its dh and act."""
    sizes = jnp.asarray(SIZES, jnp.int32)
    experts = Experts(x, w1, w2, prob, sizes, b1)
    y, h = jax.jit(lambda e: qmlp.forward(RECIPE, BACKENDS, e))(experts)
    epilogue = jax.jit(lambda *a: qmlp.epilogue(RECIPE, True, BACKENDS, *a), static_argnums=3)
    fused = epilogue(qmlp.QuantizedWeight(*qmlp._quantized_weight(w2, RECIPE)), prob, sizes, True,
                     h, dy)
    gemms = jax.jit(lambda *a: qmlp.gradient_gemms(RECIPE, BACKENDS, *a))
    drows, dw1, dw2 = gemms(experts, fused, dy)
    return dict(y=y, h=h, dh=fused.dh, act=fused.act, dprob=fused.dprob, db1=fused.dbias, dx=drows, dw1=dw1,
                dw2=dw2)


def stage_checks(x, w1, w2, prob, b1, dy, got, unit=0.0) -> dict[str, bool]:
    """Each output of the stages against float64 of the same quantized arithmetic, fed the
    values the path feeds it; True where it is within float32 accumulation's tolerance and
    the rounding (unit) to the caller's dtype of what the path stores in it."""
    f64 = lambda a: np.asarray(a, np.float64)  # noqa: E731
    rounded = lambda value, tolerance: tolerance + unit * (np.abs(value) + tolerance)  # noqa: E731
    qx, qw1, qw2, qdy = oracle_along_k(x), oracle_weights(w1), oracle_weights(w2), oracle_along_k(dy)
    qw1_t, qw2_t = np.swapaxes(qw1, 1, 2), np.swapaxes(qw2, 1, 2)
    checks = {}

    h = rows_matmul(qx, qw1) + bias_rows(b1)
    checks["h"] = within(got["h"], h, rounded(h, accumulation(D, qx, qw1, rows_matmul) + 4 * F32 * np.abs(h)))

    # The activation, from the path's own h, in float32 as the epilogue forms it: the
    # forward quantizes it as it is; the backward regenerates it and stores it in h's dtype.
    r = np.maximum(np.asarray(got["h"], np.float32), 0)
    act = r * r * prob[:, None]
    stored_act = np.asarray(jnp.asarray(act).astype(got["h"].dtype))
    checks["act"] = np.array_equal(np.asarray(got["act"]), stored_act)  # bit for bit
    qact = oracle_along_k(act)
    y = rows_matmul(qact, qw2)
    checks["y"] = within(got["y"], y, rounded(y, accumulation(F, qact, qw2, rows_matmul)))

    da = rows_matmul(qdy, qw2_t)
    da_tolerance = accumulation(D, qdy, qw2_t, rows_matmul)
    r, p = f64(r), f64(prob)[:, None]
    dh = 2 * da * r * p
    dh_tolerance = 2 * r * p * da_tolerance + 4 * F32 * np.abs(dh)
    checks["dh"] = within(got["dh"], dh, rounded(dh, dh_tolerance))
    dprob = np.sum(r * r * da, axis=1)
    checks["dprob"] = within(got["dprob"], dprob,
                             np.sum(r * r * da_tolerance, axis=1) + (F + 4) * F32 * np.sum(r * r * np.abs(da), axis=1))
    checks["db1"] = within(got["db1"], per_expert_sum(dh),
                           per_expert_sum(dh_tolerance) + (M + 3) * F32 * per_expert_sum(np.abs(dh)))

    # The gradient GEMMs, fed the path's own dh and act as it stores them.
    got_dh, got_act = (np.asarray(got[name], np.float32) for name in ("dh", "act"))
    qdh = oracle_along_k(got_dh)
    dx = rows_matmul(qdh, qw1_t)
    checks["dx"] = within(got["dx"], dx, rounded(dx, accumulation(F, qdh, qw1_t, rows_matmul)))
    qx_rows, qdh_rows = oracle_along_expert_rows(x), oracle_along_expert_rows(got_dh)
    dw1 = per_expert_outer(qx_rows, qdh_rows)
    checks["dw1"] = within(got["dw1"], dw1, rounded(dw1, accumulation(M, qx_rows, qdh_rows, per_expert_outer)))
    qact_rows, qdy_rows = oracle_along_expert_rows(got_act), oracle_along_expert_rows(dy)
    dw2 = per_expert_outer(qact_rows, qdy_rows)
    checks["dw2"] = within(got["dw2"], dw2, rounded(dw2, accumulation(M, qact_rows, qdy_rows, per_expert_outer)))
    # Rows of no expert: exact zeros.
    checks["unowned"] = all(not np.asarray(got[name])[OWNED:].any() for name in ("y", "h", "dh", "act", "dprob", "dx"))
    return checks


@pytest.fixture(scope="module")
def case():
    arrays = inputs()
    return arrays, run_stages(*arrays)


def test_every_gemm_is_float64_of_the_same_quantized_operands_in_bf16():
    """The same checks with x, the weights and dy in bf16: h, dh, act and the outputs are
    stored in bf16, and each GEMM is fed those."""
    arrays = inputs(jnp.bfloat16)
    x, w1, w2, prob, b1, dy = arrays
    bf16 = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    got = run_stages(bf16(x), bf16(w1), bf16(w2), prob, b1, bf16(dy))
    assert got["dh"].dtype == got["act"].dtype == got["dw1"].dtype == jnp.bfloat16
    checks = stage_checks(*arrays, got, unit=BF16)
    assert all(checks.values()), checks
    # Not vacuous: float32 accumulation's tolerance alone rejects the bf16 roundings.
    assert not all(stage_checks(*arrays, got).values())


def test_every_gemm_is_float64_of_the_same_quantized_operands(case):
    arrays, got = case
    checks = stage_checks(*arrays, got)
    assert all(checks.values()), checks
    # Not vacuous: the quantization shows against the unquantized product.
    exact_h = rows_matmul(arrays[0], arrays[1]) + bias_rows(arrays[4])
    assert np.abs(np.asarray(got["h"]) - exact_h).max() > 1e-3 * np.abs(exact_h).max()


def test_the_fused_step_stores_dh_and_act_once_rounded_to_hs_dtype():
    """In bf16 the gradient GEMMs read dh and act rounded once from the float32 epilogue;
    dprob and db1 stay its float32 sums."""
    x, w1, w2, prob, b1, dy = inputs(jnp.bfloat16)
    sizes = jnp.asarray(SIZES, jnp.int32)
    h = jnp.asarray(np.random.default_rng(3).standard_normal((M, F)), jnp.bfloat16)
    w2_q = qmlp.QuantizedWeight(*qmlp._quantized_weight(jnp.asarray(w2, jnp.bfloat16), RECIPE))
    fused = qmlp.epilogue(RECIPE, True, BACKENDS, w2_q, prob, sizes, True, h, jnp.asarray(dy, jnp.bfloat16))
    as_float32 = qmlp.epilogue(RECIPE, True, BACKENDS, w2_q, prob, sizes, True, h.astype(jnp.float32),
                               jnp.asarray(dy, jnp.bfloat16))
    assert fused.dh.dtype == fused.act.dtype == jnp.bfloat16
    assert fused.dprob.dtype == fused.dbias.dtype == jnp.float32
    for name in ("dh", "act"):
        want = getattr(as_float32, name)
        assert want.dtype == jnp.float32 and (np.asarray(want) != np.asarray(want.astype(jnp.bfloat16), np.float32)).any()
        np.testing.assert_array_equal(np.asarray(getattr(fused, name)), np.asarray(want.astype(jnp.bfloat16)), name)
    for name in ("dprob", "dbias"):
        np.testing.assert_array_equal(np.asarray(getattr(fused, name)), np.asarray(getattr(as_float32, name)), name)


def rolled_row_scales(a, recipe, backend, prob=None):
    """A quantizer bug: each block along K of the rows (or of the activation formed from
    them) with its neighbour's scale."""
    values, scales = QUANTIZE_ROWS(a, recipe, backend, prob=prob)
    return values, jnp.roll(scales, 1, axis=-1)


def rolled_quantized_weight_scales(w, recipe):
    """A quantizer bug: each 128 x 128 block of a weight with its neighbour's scale."""
    values, scales = QUANTIZED_WEIGHT(w, recipe)
    return values, jnp.roll(scales, 1, axis=-1)


def straddling_row_groups(group_sizes, num_rows, rows_per_group):
    """A grouping bug: groups of 128 tokens from row 0, across the experts' boundaries."""
    return jnp.arange(num_rows, dtype=jnp.int32) // rows_per_group


QUANTIZE_ROWS, QUANTIZED_WEIGHT = qmlp._quantize_source_rows, qmlp._quantized_weight
# bug: (the functions it replaces, as (module, name, wrong version), the checks it must fail).
PLANTED = {
    "a scale from the neighbouring block": (
        [(qmlp, "_quantize_source_rows", rolled_row_scales)],
        {"h", "y", "dh", "dprob", "db1", "dx"}),
    "a weight's block scale from the neighbouring block": (
        [(qmlp, "_quantized_weight", rolled_quantized_weight_scales)],
        {"h", "y", "dh", "dprob", "db1", "dx"}),
    "groups along the tokens that straddle experts": (
        [(ragged, "row_groups", straddling_row_groups)], {"dw1", "dw2"}),
}


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_the_checks_catch_a_planted_quantization_bug(case, monkeypatch, bug):
    replaced, caught = PLANTED[bug]
    arrays, _ = case
    for module, name, wrong in replaced:
        monkeypatch.setattr(module, name, wrong)
    checks = stage_checks(*arrays, run_stages(*arrays))
    failed = {check for check, ok in checks.items() if not ok}
    assert caught <= failed, checks


def test_moe_mlp_is_the_stages_bit_for_bit(case):
    (x, w1, w2, prob, b1, dy), got = case

    @jax.jit
    def step(x, w1, w2, prob, b1, dy):
        y, pullback = jax.vjp(
            lambda *a: jax_dsrelu.moe_mlp(*a[:4], jnp.asarray(SIZES, jnp.int32), b1=a[4], precision=RECIPE,
                                          deterministic=True),
            x, w1, w2, prob, b1,
        )
        return y, pullback(dy)

    y, (dx, dw1, dw2, dprob, db1) = step(x, w1, w2, prob, b1, dy)
    for name, value in dict(y=y, dx=dx, dw1=dw1, dw2=dw2, dprob=dprob, db1=db1).items():
        np.testing.assert_array_equal(np.asarray(value), np.asarray(got[name]), err_msg=name)


# --- 2. Against the unquantized layer ---


def quantization_error(v, error):
    """A bound on |qdq(v^) - v| for a value v^ fed with |v^ - v| <= error: e4m3's unit
    roundoff (plus float32's rounding of v / scale and of the dequantized product) on
    |v^|, and half a subnormal step times the block's scale, at most amax / 448."""
    fed = np.abs(v) + error
    return error + (U8 + 2 * F32) * fed + SUBNORMAL_HALF_STEP * fed.max() / 448 * 1.001


def gemm_error(a, a_error, b, b_error, k, product, unit):
    """|c^ - a @ b| for c^ the float32 GEMM of qdq(a^) and qdq(b^), rounded by `unit`."""
    qa, qb = quantization_error(a, a_error), quantization_error(b, b_error)
    a, b = np.abs(a), np.abs(b)
    error = product(qa, b + qb) + product(a, qb) + (k + 2) * F32 * product(a + qa, b + qb)
    return error + unit * (product(a, b) + error)


def unquantized_bounds(x, w1, w2, prob, b1, dy, unit):
    """(exact float64 results, bounds) of the step, each bound carried from the errors of
    the values it is computed from."""
    x, w1, w2, dy = (np.asarray(a, np.float64) for a in (x, w1, w2, dy))
    p = np.asarray(prob, np.float64)[:, None]
    w1_t, w2_t = np.swapaxes(w1, 1, 2), np.swapaxes(w2, 1, 2)
    zero = lambda a: np.zeros_like(a)  # noqa: E731

    h = rows_matmul(x, w1) + bias_rows(b1)
    # The GEMM, the bias added in float32, then h rounded to the caller's dtype.
    h_error = gemm_error(x, zero(x), w1, zero(w1), D, rows_matmul, 0.0) + 2 * F32 * np.abs(h)
    h_error += unit * (np.abs(h) + h_error)
    r = np.maximum(h, 0)
    act = r * r * p
    act_error = p * (2 * r * h_error + h_error**2) + 3 * F32 * p * (r + h_error) ** 2
    y = rows_matmul(act, w2)
    y_error = gemm_error(act, act_error, w2, zero(w2), F, rows_matmul, unit)

    da = rows_matmul(dy, w2_t)
    da_error = gemm_error(dy, zero(dy), w2_t, zero(w2_t), D, rows_matmul, 0.0)
    dh = 2 * r * da * p
    dh_error = 2 * p * (h_error * (np.abs(da) + da_error) + r * da_error)
    dh_error += 4 * F32 * 2 * p * (r + h_error) * (np.abs(da) + da_error)
    dprob = np.sum(r * r * da, axis=1)
    dprob_error = np.sum((2 * r * h_error + h_error**2) * (np.abs(da) + da_error) + r * r * da_error, axis=1)
    dprob_error += (F + 3) * F32 * np.sum((r + h_error) ** 2 * (np.abs(da) + da_error), axis=1)
    db1 = per_expert_sum(dh)
    db1_error = per_expert_sum(dh_error) + (M + 3) * F32 * per_expert_sum(np.abs(dh) + dh_error)
    # dh and the regenerated act as the fused step stores them, rounded to the caller's dtype.
    stored_dh_error = dh_error + unit * (np.abs(dh) + dh_error)
    stored_act_error = act_error + unit * (act + act_error)

    dx = rows_matmul(dh, w1_t)
    dx_error = gemm_error(dh, stored_dh_error, w1_t, zero(w1_t), F, rows_matmul, unit)
    dw1 = per_expert_outer(x, dh)
    dw1_error = gemm_error(x, zero(x), dh, stored_dh_error, M, per_expert_outer, unit)
    dw2 = per_expert_outer(act, dy)
    dw2_error = gemm_error(act, stored_act_error, dy, zero(dy), M, per_expert_outer, unit)
    exact = dict(y=y, dx=dx, dw1=dw1, dw2=dw2, dprob=dprob, db1=db1)
    bounds = dict(y=y_error, dx=dx_error, dw1=dw1_error, dw2=dw2_error, dprob=dprob_error, db1=db1_error)
    return exact, bounds


def moe_mlp_step(dtype, x, w1, w2, prob, b1, dy) -> dict[str, jax.Array]:
    """moe_mlp's output and gradients with precision=FP8_BLOCKWISE, x, w1, w2 and dy in dtype."""
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731

    @jax.jit
    def step(x, w1, w2, prob, b1, dy):
        y, pullback = jax.vjp(
            lambda *a: jax_dsrelu.moe_mlp(*a[:4], jnp.asarray(SIZES, jnp.int32), b1=a[4], precision=RECIPE), x, w1,
            w2, prob, b1,
        )
        return y, pullback(dy)

    y, (dx, dw1, dw2, dprob, db1) = step(cast(x), cast(w1), cast(w2), prob, b1, cast(dy))
    return dict(y=y, dx=dx, dw1=dw1, dw2=dw2, dprob=dprob, db1=db1)


def outside_the_bound(got, exact, bounds) -> dict[str, float]:
    """The largest |error| / bound of each result."""
    return {name: float((np.abs(np.asarray(got[name], np.float64) - exact[name]) / np.maximum(bounds[name], 1e-300))
                        .max()) for name in exact}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_step_is_float64_of_the_unquantized_layer_within_the_e4m3_bound(dtype):
    arrays = inputs(jnp.dtype(dtype), seed=1)
    got = moe_mlp_step(dtype, *arrays)
    # Master weights and outputs in the caller's dtypes.
    assert got["y"].dtype == got["dx"].dtype == got["dw1"].dtype == got["dw2"].dtype == jnp.dtype(dtype)
    assert got["dprob"].dtype == got["db1"].dtype == jnp.float32
    exact, bounds = unquantized_bounds(*arrays, UNITS[dtype])
    ratios = outside_the_bound(got, exact, bounds)
    assert max(ratios.values()) <= 1, ratios
    for name in exact:  # FP8 is visibly inexact
        assert np.abs(np.asarray(got[name], np.float64) - exact[name]).max() > 1e-3 * np.abs(exact[name]).max(), name


def test_the_e4m3_bound_catches_a_scale_from_the_neighbouring_block(monkeypatch):
    arrays = inputs(seed=1)
    monkeypatch.setattr(qmlp, "_quantize_source_rows", rolled_row_scales)
    ratios = outside_the_bound(moe_mlp_step("float32", *arrays), *unquantized_bounds(*arrays, F32))
    assert max(ratios.values()) > 1, ratios


# XLA:GPU folds a chain of float conversions x -> e4m3 -> float32 into x -> float32
# (`quantization/stored.py`): a conversion whose operand is an 8-bit float would let it drop
# the rounding the recipe is. Every dequantizing read goes through the values' bits instead:
# the one conversion from an 8-bit float left is the table of the 256 patterns' values,
# made from bits (`stablehlo.bitcast_convert` of 256 uint8).
_FP8_CONVERSION = re.compile(r"stablehlo\.convert (%\S+) : \(tensor<[^>]*xf8E\w+>\) -> ")
_TABLE_BITS = re.compile(r"(%\S+) = stablehlo\.bitcast_convert %\S+ : \(tensor<256xui8>\) -> tensor<256xf8E\w+>")


def fp8_conversions(fn, *args) -> list[str]:
    """The operands of conversions from an 8-bit float in fn's lowering, but the tables'."""
    found = []
    for function in jax.jit(fn).lower(*args).as_text().split("func.func")[1:]:  # value names are per function
        tables = set(_TABLE_BITS.findall(function))
        found += [operand for operand in _FP8_CONVERSION.findall(function) if operand not in tables]
    return found


def test_no_fp8_value_is_read_by_a_float_conversion_on_the_xla_path():
    x, w1, w2, prob, b1, dy = (jnp.asarray(a) for a in inputs(seed=4))
    sizes = jnp.asarray(SIZES, jnp.int32)

    def loss(x, w1, w2, prob, b1):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1, precision=RECIPE, backend="xla")
        return jnp.sum(y * dy)

    assert fp8_conversions(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), x, w1, w2, prob, b1) == []
    # The search finds the conversion where one is written, and passes over a table's.
    assert len(fp8_conversions(lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32), x)) == 1
    assert fp8_conversions(lambda x: stored.to_float32(x.astype(jnp.float8_e4m3fn)), x) == []


# --- Reproducibility, the option's checks, the layers that carry it ---


def test_deterministic_steps_repeat_bit_for_bit():
    x, w1, w2, prob, b1, dy = (jnp.asarray(a) for a in inputs(seed=2))
    sizes = jnp.asarray(SIZES, jnp.int32)

    def loss(x, w1, w2, prob, b1):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1, precision=RECIPE, deterministic=True)
        return jnp.sum(y * dy)

    grads = [jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w1, w2, prob, b1) for _ in range(2)]
    for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))


BAD_PRECISIONS = [
    ("fp8", TypeError, "precision must be None or jax_dsrelu.quantization.FP8_BLOCKWISE (a Recipe), got 'fp8' (str)"),
    (MXFP8, ValueError, "precision must be None or jax_dsrelu.quantization.FP8_BLOCKWISE, the recipes the experts "
                        "run so far, got the recipe 'MXFP8'"),
]


@pytest.mark.parametrize("precision, error, words", BAD_PRECISIONS, ids=["str", "MXFP8"])
def test_a_bad_precision_names_what_was_seen(precision, error, words):
    x, w1, w2, prob, _, _ = inputs()
    with pytest.raises(error, match=re.escape(words)):
        jax_dsrelu.moe_mlp(x, w1, w2, prob, SIZES, precision=precision)
    with pytest.raises(error, match=re.escape(words)):
        MoEOptions(precision=precision)


@pytest.mark.parametrize("backend", ["sm90", "sm100"])
def test_a_kernel_backend_without_the_recipe_refuses_it(backend):
    words = (f"backend={backend!r} does not take precision=FP8_BLOCKWISE: backend='auto' runs each GEMM of the "
             f"step on a kernel where one serves it")
    x, w1, w2, prob, _, _ = inputs()
    with pytest.raises(NotImplementedError, match=re.escape(words)):
        jax_dsrelu.moe_mlp(x, w1, w2, prob, SIZES, precision=RECIPE, backend=backend)
    with pytest.raises(NotImplementedError, match=re.escape(words)):
        MoEOptions(precision=RECIPE, backend=backend)


def test_auto_takes_the_xla_path_for_a_precision_but_where_a_kernel_may_serve():
    # Every block-scaled GEMM of the step stays "auto": resolved per call, a kernel where one serves.
    assert layer_backends("auto", RECIPE) == LayerBackends(dsrelu="auto", matmul="auto", contract="auto", gather_sum="auto")
    assert layer_backends("xla", RECIPE) == LayerBackends(dsrelu="xla", matmul="xla", contract="xla", gather_sum="xla")
    assert layer_backends("auto") == LayerBackends(dsrelu="auto", matmul="auto", contract="auto", gather_sum="auto")


T, DM, FF, NE, TOP_K = 96, 160, 200, 4, 2


def layer_inputs(seed=3):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((T, DM)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((DM, NE)) / np.sqrt(DM), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((NE, DM, FF)) / np.sqrt(DM), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((NE, FF, DM)) / np.sqrt(FF), jnp.float32)
    b1 = jnp.asarray(0.1 * rng.standard_normal((NE, FF)), jnp.float32)
    return x, router, w1, w2, b1


def test_moe_layer_carries_the_precision_to_its_experts():
    x, router, w1, w2, b1 = layer_inputs()
    options = MoEOptions(top_k=TOP_K, precision=RECIPE, deterministic=True)

    def layer(x, w1, w2, precision):
        return jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, options=dataclasses.replace(options, precision=precision))

    def composed(x, w1, w2):
        plan = jax_dsrelu.route(x @ router, TOP_K)
        rows = jax_dsrelu.dispatch(x, plan)
        y = jax_dsrelu.moe_mlp(rows, w1, w2, plan.row_prob, plan.group_sizes, b1=b1, precision=RECIPE,
                               deterministic=True)
        return jax_dsrelu.combine(y, plan).astype(x.dtype)

    quantized = jax.jit(layer, static_argnums=3)(x, w1, w2, RECIPE)
    np.testing.assert_array_equal(quantized, jax.jit(composed)(x, w1, w2))
    exact = jax.jit(layer, static_argnums=3)(x, w1, w2, None)
    assert not np.array_equal(quantized, exact)
    np.testing.assert_allclose(quantized, exact, rtol=0.2, atol=0.2 * np.abs(exact).max())
    # The experts' weight gradients too: dW1 and dW2 read the tokens in expert order alike.
    loss = lambda f: lambda *a: jnp.sum(f(*a) ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(loss(lambda *a: layer(*a, RECIPE)), argnums=(1, 2)))(x, w1, w2)
    composed_grads = jax.jit(jax.grad(loss(composed), argnums=(1, 2)))(x, w1, w2)
    for a, b in zip(grads, composed_grads):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_expert_parallel_and_the_flax_module_take_the_precision():
    from jax_dsrelu.flax import MoE
    from flax import nnx

    x, router, w1, w2, b1 = layer_inputs()
    expected = jax.jit(lambda x: jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=TOP_K, precision=RECIPE))(x)
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    parallel = jax.jit(lambda x: jax_dsrelu.moe_layer_expert_parallel(
        x, router, w1, w2, b1=b1, mesh=mesh, top_k=TOP_K, precision=RECIPE))(x)
    np.testing.assert_allclose(parallel, expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())

    module = MoE(DM, FF, NE, top_k=TOP_K, precision=RECIPE, rngs=nnx.Rngs(0))
    assert module.options.precision == RECIPE
    plain = MoE(DM, FF, NE, top_k=TOP_K, rngs=nnx.Rngs(0))
    call = nnx.jit(lambda module, x: module(x))
    weights = dict(router=module.router[...], w1=module.w1[...], w2=module.w2[...], b1=module.b1[...])
    layer = jax.jit(lambda x, weights: jax_dsrelu.moe_layer(x, **weights, top_k=TOP_K, precision=RECIPE))
    np.testing.assert_array_equal(call(module, x), layer(x, weights))
    assert not np.array_equal(call(module, x), call(plain, x))
    # The gradients reach the parameters, which stay float32, through the quantized path.
    grads = nnx.jit(nnx.grad(lambda module: jnp.sum(module(x) ** 2)))(module)
    assert grads.w1[...].dtype == jnp.float32 and np.isfinite(grads.w1[...]).all() and grads.w1[...].any()


def test_options_with_a_precision_stay_hashable_and_static():
    options = MoEOptions(top_k=TOP_K, precision=RECIPE)
    assert hash(options) == hash(MoEOptions(top_k=TOP_K, precision=RECIPE))
    assert options != MoEOptions(top_k=TOP_K) and hash(options) != hash(MoEOptions(top_k=TOP_K))
    assert jax.tree.leaves(options) == []
    assert jax.jit(lambda x, options: x * (options.precision is RECIPE))(jnp.float32(2), options) == 2


# --- Quantized weights made once and reused ---


def test_quantized_weights_made_once_give_the_same_bits_and_gradients():
    x, w1, w2, prob, b1, dy = inputs()
    sizes = jnp.asarray(SIZES, jnp.int32)

    def loss(x, w1, w2, prob, b1, quantized):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, b1=b1, precision=RECIPE, quantized_weights=quantized)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    quantized = jax.jit(jax_dsrelu.quantize_expert_weights, static_argnums=2)(w1, w2, RECIPE)
    without = step(x, w1, w2, prob, b1, None)
    reused = step(x, w1, w2, prob, b1, quantized)
    for a, b in zip(jax.tree.leaves(without), jax.tree.leaves(reused)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    # Not vacuous: weights quantized otherwise change the result.
    other = jax_dsrelu.quantize_expert_weights(w1 * 1.5, w2, RECIPE)
    assert not np.array_equal(np.asarray(step(x, w1, w2, prob, b1, other)[0]), np.asarray(without[0]))


def test_a_step_given_quantized_weights_quantizes_only_its_activations():
    x, w1, w2, prob, b1, dy = inputs()
    sizes = jnp.asarray(SIZES, jnp.int32)

    def step(quantized):
        def loss(x, w1, w2):
            y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, precision=RECIPE, quantized_weights=quantized)
            return jnp.sum(y.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))

    def e4m3_conversions(fn, *args):
        text = jax.jit(fn).lower(*args).as_text()
        return sum(1 for line in text.splitlines() if "stablehlo.convert" in line and line.rstrip().endswith("xf8E4M3FN>"))

    quantized = jax_dsrelu.quantize_expert_weights(w1, w2, RECIPE)
    made_each_step = e4m3_conversions(step(None), x, w1, w2)
    reused = e4m3_conversions(lambda x, w1, w2, q: step(q)(x, w1, w2), x, w1, w2, quantized)
    # The forward's and the backward's weight quantizations (two layouts of each weight
    # read in each) are gone; the activations' remain.
    assert made_each_step > reused > 0


def test_quantized_weights_are_checked_against_the_weights_and_the_precision():
    x, w1, w2, prob, _, _ = inputs()
    quantized = jax_dsrelu.quantize_expert_weights(w1, w2, RECIPE)
    with pytest.raises(ValueError, match="quantized_weights needs precision="):
        jax_dsrelu.moe_mlp(x, w1, w2, prob, SIZES, quantized_weights=quantized)
    with pytest.raises(TypeError, match="quantized_weights must be None or a QuantizedExpertWeights"):
        jax_dsrelu.moe_mlp(x, w1, w2, prob, SIZES, precision=RECIPE, quantized_weights=(w1, w2))
    wrong = jax_dsrelu.quantize_expert_weights(w1[:, :, :128], w2[:, :128], RECIPE)
    with pytest.raises(ValueError, match=r"quantized_weights.w1_up.values must be float8_e4m3fn of shape"):
        jax_dsrelu.moe_mlp(x, w1, w2, prob, SIZES, precision=RECIPE, quantized_weights=wrong)


def test_a_precision_step_with_the_expert_width_split_over_devices_is_the_one_device_step(case):
    # The quantized weights' 128-column blocks keep the width whole on each device
    # (`Schema.whole_when`): a split would hand a device columns without their scales. The
    # loss and dx come out of whole-width GEMMs, bit for bit the one-device step's. The weight
    # gradients are contracted over the rows, each device for the columns it holds: XLA:CPU's
    # blocking of a GEMM's K follows the host's caches and the output's width, so its float32
    # sums may round in another order than the one-device GEMM's. They are held to the
    # quantized arithmetic's float32 accumulation bound, twice (one per order), which a
    # column scaled by one e4m3 step (1 + 2^-4), as a scale off by that much makes it, leaves.
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    (x, w1, w2, prob, b1, dy), stages = case
    sizes = jnp.asarray(SIZES, jnp.int32)
    mesh = jax.make_mesh((2,), ("model",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])

    def step(x, w1, w2):
        def loss(x, w1, w2):
            y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, precision=RECIPE, backend="xla")
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    (loss, (dx, dw1, dw2)) = jax.jit(step)(x, w1, w2)
    split_loss, (split_dx, split_dw1, split_dw2) = jax.jit(step)(
        x, jax.device_put(w1, NamedSharding(mesh, P(None, None, "model"))),
        jax.device_put(w2, NamedSharding(mesh, P(None, "model", None))))
    np.testing.assert_array_equal(np.asarray(loss), np.asarray(split_loss))
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(split_dx))

    operands = {"dw1": (x, stages["dh"]), "dw2": (stages["act"], dy)}
    for name, one_device, split in (("dw1", dw1, split_dw1), ("dw2", dw2, split_dw2)):
        a, b = (oracle_along_expert_rows(v) for v in operands[name])
        tolerance = 2 * accumulation(M, a, b, per_expert_outer)
        assert within(split, np.asarray(one_device, np.float64), tolerance), name
        one_step_off = np.asarray(one_device).copy()
        one_step_off[..., 0] *= 1 + U8
        assert not within(one_step_off, np.asarray(one_device, np.float64), tolerance), name


def bfloat16_layer(tokens, num_experts, seed, d=160, f=200):
    """(x, router, w1, w2, dy) of a bfloat16 layer whose widths have partial 128-blocks."""
    keys = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(keys[0], (tokens, d), jnp.bfloat16)
    router = jax.random.normal(keys[1], (d, num_experts), jnp.float32)
    w1 = (jax.random.normal(keys[2], (num_experts, d, f)) / d**0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[3], (num_experts, f, d)) / f**0.5).astype(jnp.bfloat16)
    return x, router, w1, w2, jax.random.normal(keys[4], (tokens, d), jnp.float32)


def assert_same_bits(a, b):
    for left, right in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(left), np.asarray(right))


def test_moe_layer_takes_quantized_weights_made_once():
    x, router, w1, w2, dy = bfloat16_layer(96, 4, seed=7)

    def loss(x, router, w1, w2, quantized):
        out = jax_dsrelu.moe_layer(x, router, w1, w2, top_k=2, precision=RECIPE, quantized_weights=quantized)
        return jnp.sum(out.astype(jnp.float32) * dy)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    assert_same_bits(step(x, router, w1, w2, None),
                     step(x, router, w1, w2, jax_dsrelu.quantize_expert_weights(w1, w2, RECIPE)))
    with pytest.raises(ValueError, match="quantized_weights needs precision="):
        jax_dsrelu.moe_layer(x, router, w1, w2, quantized_weights=jax_dsrelu.quantize_expert_weights(w1, w2, RECIPE))


def test_the_expert_parallel_layer_takes_quantized_weights_made_once():
    # Split on E over 4 devices like w1 and w2: each device reads its experts' blocks and
    # scales, with the bits and gradients of quantizing in the step.
    from jax.sharding import AxisType

    x, router, w1, w2, dy = bfloat16_layer(64, 8, seed=9)
    mesh = jax.make_mesh((4,), ("expert",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])

    def loss(x, router, w1, w2, quantized):
        out = jax_dsrelu.moe_layer_expert_parallel(x, router, w1, w2, mesh=mesh, top_k=2, precision=RECIPE,
                                                   quantized_weights=quantized)
        return jnp.sum(out.astype(jnp.float32) * dy)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    without = step(x, router, w1, w2, None)
    assert_same_bits(without, step(x, router, w1, w2, jax_dsrelu.quantize_expert_weights(w1, w2, RECIPE)))
    # They are read, not quantized again: another w1's give another output.
    other = step(x, router, w1, w2, jax_dsrelu.quantize_expert_weights(2 * w1, w2, RECIPE))
    assert not np.array_equal(np.asarray(other[0]), np.asarray(without[0]))
    wrong = jax_dsrelu.quantize_expert_weights(w1[:, :, :128], w2[:, :128], RECIPE)
    with pytest.raises(ValueError, match=r"quantized_weights.w1_up.values must be float8_e4m3fn of shape"):
        step(x, router, w1, w2, wrong)


def test_the_flax_module_takes_its_weights_quantized_once():
    from flax import nnx

    from jax_dsrelu.flax import MoE

    x, *_ = layer_inputs()
    module = MoE(DM, FF, NE, top_k=TOP_K, precision=RECIPE, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    quantized = nnx.jit(lambda module: module.quantize_weights())(module)
    call = nnx.jit(lambda module, x, q: module(x, quantized_weights=q))
    np.testing.assert_array_equal(call(module, x, quantized), call(module, x, None))
    grad = nnx.jit(nnx.grad(lambda module, q: jnp.sum(module(x, quantized_weights=q).astype(jnp.float32) ** 2)))
    assert_same_bits(grad(module, quantized), grad(module, None))
    with pytest.raises(ValueError, match="quantize_weights needs a module built with precision="):
        MoE(DM, FF, NE, top_k=TOP_K, rngs=nnx.Rngs(0)).quantize_weights()
