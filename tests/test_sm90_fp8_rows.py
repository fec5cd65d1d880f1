"""Activation rows quantized for the FP8 GEMMs' A operands by one pass on Hopper
(`kernels/sm90/row_quantize_kernel.py`, through `row_quantize.quantize_rows_by_kernel`):
`quantization.blockwise.quantize_blockwise` in 1 x 128 blocks along each row; and the FP8
step, which quantizes its rows on it (the "fp8_rows" kind, verified on an H100).

CPU: the kernel refuses what it cannot take, naming it. Compile tier: compiles for sm_90a
with IEEE division, the saturating e4m3 conversion, 16-byte loads, half-warp shuffles and no
local memory; lowers to one call binding its buffers in their declared order; the FP8 step
as lowered for Hopper quantizes its rows on it (x, act, dy, dh: four calls, and a loop under
vmap), with no switch. GPU tier (both forms run on an H100): the kernel
against the recipe's NumPy oracle, byte for byte but for a NaN's sign, values and scales,
into outputs poisoned two ways, on a partial last block, a block count that leaves a CTA
part empty, one row, Nano's widths, NaN, infinity and zero blocks and values among e4m3's
subnormals, from bfloat16, float16 and float32; its squared-ReLU form (the activation
relu(h)**2 * prob formed from pre-activation rows as it reads them) likewise against the
oracle of the activation formed in float32. CPU, where CuTe DSL is installed: no rows
give empty outputs without a launch.
"""

from __future__ import annotations

import functools
import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_dsrelu.kernels.request import RowQuantizeRequest  # noqa: E402
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE  # noqa: E402
from test_quantization_blockwise import oracle_quantize  # noqa: E402
from test_sm90_fp8_quantize import assert_a_quantizing_pass, same_bytes_but_nan_sign  # noqa: E402

BLOCK = FP8_BLOCKWISE.activations.block
DTYPES = {"bf16": np.dtype(jnp.bfloat16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
# (m, k) of each case: a partial last block (Nano's f = 14.5 blocks), a block count that is
# no multiple of a CTA's 16 (3 x 21), one row of one partial block, Nano's d, last blocks of
# 16 and 112 columns.
SHAPES = {"partial_last": (300, 1856), "ragged_cta": (3, 2688), "one_row": (1, 48), "nano_d": (520, 2688),
          "tail_16": (5, 144), "tail_112": (5, 240)}
CASES = [("partial_last", "bf16"), ("partial_last", "f32"), ("partial_last", "f16"), ("ragged_cta", "bf16"),
         ("one_row", "f32"), ("nano_d", "bf16"), ("tail_16", "bf16"), ("tail_112", "bf16")]
IDS = [f"{name}-{dtype}" for name, dtype in CASES]
# The squared-ReLU form's cases: (shape, the pre-activation's dtype, prob's dtype).
ACT_CASES = [("partial_last", "bf16", "f32"), ("ragged_cta", "bf16", "bf16"), ("one_row", "f32", "f32"),
             ("tail_112", "f16", "f16")]
ACT_IDS = [f"{name}-{dtype}-prob_{prob}" for name, dtype, prob in ACT_CASES]


def rows(name: str, dtype_name: str) -> np.ndarray:
    """x (m, k) in the dtype: values over 2^-20 to 2^20 (most of a block's land among
    e4m3's subnormals), a third of them zeros of either sign (as relu leaves in dh; -0
    quantizes to e4m3's -0, 0x80), a NaN in one block, an infinity in another and a block
    of zeros where there are three blocks or more."""
    m, k = SHAPES[name]
    rng = np.random.default_rng(m + k)
    x = rng.standard_normal((m, k)) * np.exp2(rng.uniform(-20, 20, (m, k)))
    x = np.where(rng.uniform(size=(m, k)) < 1 / 3, np.copysign(0.0, x), x)
    if dtype_name == "f16":  # float16's range: 2^-14 to 2^15 and its subnormals
        x = np.clip(x, -6e4, 6e4)
    if m * k > 2 * BLOCK[1]:
        x[0, 5], x[m - 1, k - 1] = np.nan, -np.inf
        x[m // 2, :BLOCK[1]] = 0.0
    return np.asarray(jnp.asarray(x, DTYPES[dtype_name]))


def oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values (m, k) e4m3 bytes, scales (m, ceil(k / 128))) by the recipe's rules in NumPy
    (IEEE float32 division, round to nearest even)."""
    values, scales = oracle_quantize(np.asarray(x, np.float32), BLOCK)
    return values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scales


def activation_rows(name: str, dtype_name: str) -> np.ndarray:
    """`rows` as pre-activations: besides its -inf (which relu makes 0), a +inf in row 1
    (its block's scale NaN) and, but in float16, a finite h whose square overflows
    float32 in row 2 (2^70: an infinite act, its block's scale NaN)."""
    h = np.asarray(rows(name, dtype_name), np.float32)
    if h.shape[0] >= 3:
        h[1, 3] = np.inf
        if dtype_name != "f16":
            h[2, h.shape[1] - 1] = 2.0 ** 70
    return np.asarray(jnp.asarray(h, DTYPES[dtype_name]))


def probs(m: int, dtype_name: str) -> np.ndarray:
    """prob (m,) in the dtype: values in (0, 1], a NaN in row m // 2 + 1 where there are
    three rows or more (its row's blocks quantize to NaN)."""
    prob = np.random.default_rng(m).uniform(2 ** -8, 1.0, m)
    if m >= 3:
        prob[m // 2 + 1] = np.nan
    return np.asarray(jnp.asarray(prob, DTYPES[dtype_name]))


def activation(h: np.ndarray, prob: np.ndarray) -> np.ndarray:
    """relu(h)**2 * prob in float32 as the forward forms it ((r * r) * prob, NaN kept)."""
    r = np.asarray(h, np.float32)
    r = np.where(r < 0, np.float32(0), r)
    with np.errstate(over="ignore", invalid="ignore"):  # a square past float32's range is inf, as on the GPU
        return (r * r) * np.asarray(prob, np.float32)[:, None]


def test_the_byte_oracle_tells_a_wrong_scale():
    x = rows("partial_last", "bf16")
    stored, _ = oracle(x)
    moved, _ = oracle(np.asarray(x, np.float32) * np.float32(2 ** -0.5))
    assert not same_bytes_but_nan_sign(moved, stored)  # a scale off by sqrt(2) moves values


def test_the_row_quantizer_refuses_what_it_cannot_take():
    from jax_dsrelu.kernels.sm90 import row_quantize

    assert row_quantize.cannot_quantize_rows(RowQuantizeRequest(1856, np.dtype(jnp.bfloat16))) is None
    for shape, dtype, match in (((4, 40), jnp.bfloat16, "multiple of 16, got k=40"), ((4, 0), jnp.float32, "k=0"),
                                ((4, 64), jnp.int8, "int8")):
        assert match in row_quantize.cannot_quantize_rows(RowQuantizeRequest(shape[1], np.dtype(dtype)))
        with pytest.raises(ValueError, match=match):
            row_quantize.quantize_rows_by_kernel(jax.ShapeDtypeStruct(shape, dtype))
    with pytest.raises(ValueError, match=r"x \(m, k\), got x.shape=\(2, 4, 64\)"):
        row_quantize.quantize_rows_by_kernel(jax.ShapeDtypeStruct((2, 4, 64), jnp.bfloat16))
    request = RowQuantizeRequest(64, np.dtype(jnp.bfloat16), np.dtype(np.int32))
    assert "prob, got int32" in row_quantize.cannot_quantize_rows(request)
    with pytest.raises(ValueError, match=r"prob \(m,\) = \(4,\) for x \(4, 64\), got prob.shape=\(3,\)"):
        row_quantize.quantize_rows_by_kernel(jax.ShapeDtypeStruct((4, 64), jnp.bfloat16),
                                             prob=jax.ShapeDtypeStruct((3,), jnp.float32))


def test_the_row_quantizer_serves_the_fp8_step_whatever_the_switch_names():
    """Verified on a Hopper card (it left UNVERIFIED_KINDS): no switch needed, and a switch
    that still names it, as set while it was unverified, is accepted."""
    from unittest import mock

    from jax_dsrelu.kernels.sm90 import backend

    request = RowQuantizeRequest(2688, np.dtype(jnp.bfloat16))
    assert "fp8_rows" in backend.VERIFIED_KINDS and "fp8_rows" not in backend.UNVERIFIED_KINDS
    with backend.unverified_enabled("gathered", "gather_sum"):  # the switch names the other kinds, not this one
        assert backend.cannot_implement(request) is None
    with mock.patch.dict(os.environ, {backend.UNVERIFIED_VARIABLE: "fp8_rows"}):
        # Read and accepted (an unknown name raises), enabling no unverified kind.
        assert not backend.enabled("gathered") and backend.cannot_implement(request) is None


def prebuild_copy_jobs():
    """The passes the GPU tier runs (in place into poisoned buffers), for the kernel cache."""
    from jax_dsrelu.kernels.sm90 import row_quantize

    built = {(SHAPES[name][1], DTYPES[dtype], None) for name, dtype in CASES}
    built |= {(SHAPES[name][1], DTYPES[dtype], DTYPES[prob]) for name, dtype, prob in ACT_CASES}
    return [functools.partial(row_quantize.compile_row_quantize_kernel, k, dtype, prob, outputs_in_place=True)
            for k, dtype, prob in sorted(built, key=repr)]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_row_quantizer_compiles_for_sm90a(dtype):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import row_quantize

    ptx = row_quantize.compile_row_quantize_kernel(1856, DTYPES[dtype], keep=True).ptx
    # 16-byte loads, 8-byte value stores (four e4m3 pairs), no shared memory.
    assert_a_quantizing_pass(ptx, "shfl.sync.bfly", accesses=("ld.global.v4", "st.global.v4.b16"))


@pytest.mark.compile
def test_the_squared_relu_form_compiles_for_sm90a():
    """The activation's form: the same pass, reading prob (a 2-byte load for bf16 prob) and
    forming each of a thread's 8 values by two products, relu a select that keeps NaN
    (the plain pass has neither)."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import re

    from jax_dsrelu.kernels.sm90 import row_quantize

    ptx = row_quantize.compile_row_quantize_kernel(1856, DTYPES["bf16"], DTYPES["bf16"], keep=True).ptx
    assert_a_quantizing_pass(ptx, "shfl.sync.bfly", accesses=("ld.global.v4", "st.global.v4.b16", "ld.global.b16"))
    plain = row_quantize.compile_row_quantize_kernel(1856, DTYPES["bf16"], keep=True).ptx
    assert "ld.global.b16" not in plain
    relu = re.compile(r"setp\.lt\.f32\s+(%p\d+), %r\d+, 0f00000000;\s+selp\.f32\s+%r\d+, 0f00000000, %r\d+, \1;")
    assert len(relu.findall(ptx)) == 8 and not relu.findall(plain)
    assert ptx.count("mul.f32") - plain.count("mul.f32") == 16


@pytest.mark.compile
def test_the_compile_checks_tell_another_quantizing_pass():
    """The checks above are the row quantizer's: a pass of 16-byte stores (the weights')
    lacks its 8-byte value stores."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import weight_quantize

    ptx = weight_quantize.compile_block_quantize_kernel(1, 128, 128, DTYPES["bf16"], keep=True).ptx
    assert "st.global.v4.b16" not in ptx
    assert_a_quantizing_pass(ptx)


@pytest.mark.compile
def test_the_row_quantizer_lowers_to_one_call_binding_its_buffers_in_order():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from test_operand_binding import unbound_buffers

    from jax_dsrelu.kernels.sm90 import row_quantize

    m, k = SHAPES["partial_last"]
    text = jax.jit(row_quantize.quantize_rows_by_kernel).trace(
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @CuteDSLRT_NvJaxCutlassCall") == 1
    plan = row_quantize.row_quantize_kernel(k, np.dtype(jnp.bfloat16)).operands()
    assert unbound_buffers(plan, {"m": m}, text) == []


def _fp8_step_text(batched=False) -> str:
    """The FP8 moe_mlp step (value and grad in x, w1, w2) under "auto" as lowered for Hopper:
    its StableHLO text."""
    from unittest import mock

    import jax_dsrelu
    from jax_dsrelu.kernels import registry
    from jax_dsrelu.kernels.sm90 import backend

    m, d, f, e = 512, 256, 384, 4
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((m, d), (e, d, f), (e, f, d))]
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)

    def loss(x, w1, w2, group_sizes):
        y = jax_dsrelu.moe_mlp(x, w1, w2, jnp.ones((m,), jnp.float32), group_sizes, precision=FP8_BLOCKWISE)
        return jnp.sum(y.astype(jnp.float32))

    step = jax.value_and_grad(loss, argnums=(0, 1, 2))
    if batched:
        step = jax.vmap(step, in_axes=(0, None, None, None))
        shapes[0] = jax.ShapeDtypeStruct((2, m, d), jnp.bfloat16)
    # Every unverified kind enabled, whatever the environment names: the step reads no row through an index.
    with (backend.unverified_enabled(),
          mock.patch.object(registry, "cuda_compute_capability", lambda: (9, 0))):
        return jax.jit(step).trace(*shapes, sizes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.compile
def test_the_fp8_step_quantizes_its_rows_on_the_kernel():
    """The step's four row quantizations (x for up, act for down, dy for the fused kernel,
    dh for dx) are the kernel's calls, one each, act's the squared-ReLU form that reads h
    and prob (no float32 act between them), and under vmap each of a batched operand sits
    in a loop of its own."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

    def calls(text, name):
        return sum("custom_call @CuteDSLRT" in line and name in line for line in text.splitlines())

    from unittest import mock

    from jax_dsrelu.kernels.sm90 import row_quantize

    text, batched = _fp8_step_text(), _fp8_step_text(batched=True)
    assert calls(text, "RowQuantizeSm90") == 4 and calls(text, "SquaredReluRowQuantizeSm90") == 1
    assert calls(batched, "RowQuantizeSm90") == 4
    # Each call of a batched operand a loop of its own under vmap, beside the loops of the step
    # on XLA's quantizer: x's, act's and dh's (dy, the cotangent of a sum, is every member's).
    with mock.patch.object(row_quantize, "cannot_quantize_rows", lambda request: "refused here"):
        on_xla = _fp8_step_text(batched=True)
    assert calls(on_xla, "RowQuantizeSm90") == 0
    assert batched.count("stablehlo.while") - on_xla.count("stablehlo.while") == 3


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_the_row_quantizer_computes_the_recipe(hopper, name, dtype):
    """Byte for byte the oracle (but for a NaN's sign), values and scales, into outputs
    poisoned two ways: a byte or scale the kernel does not write keeps the poison."""
    from jax_dsrelu.kernels.sm90 import row_quantize

    x = rows(name, dtype)
    want_values, want_scales = oracle(x)
    run = jax.jit(lambda x, filled: row_quantize.quantize_rows_by_kernel(x, filled=filled))
    for poison in (0xA5, 0x5A):
        filled = {"values": jax.lax.bitcast_convert_type(jnp.full(x.shape, poison, jnp.uint8), jnp.float8_e4m3fn),
                  "scales": jnp.full(want_scales.shape, -float(poison), jnp.float32)}
        out = run(jnp.asarray(x), filled)
        assert same_bytes_but_nan_sign(np.asarray(out["values"]).view(np.uint8), want_values)
        np.testing.assert_array_equal(np.asarray(out["scales"]), want_scales)


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype, prob_dtype", ACT_CASES, ids=ACT_IDS)
def test_the_squared_relu_form_computes_the_recipe_of_the_activation(hopper, name, dtype, prob_dtype):
    """Byte for byte the oracle of relu(h)**2 * prob formed in float32 (but for a NaN's
    sign), into poisoned outputs: negative h, a NaN, -inf, +inf and a finite h whose
    square overflows (`activation_rows`), a NaN prob."""
    from jax_dsrelu.kernels.sm90 import row_quantize

    h = activation_rows(name, dtype)
    prob = probs(h.shape[0], prob_dtype)
    want_values, want_scales = oracle(activation(h, prob))
    run = jax.jit(lambda h, prob, filled: row_quantize.quantize_rows_by_kernel(h, filled=filled, prob=prob))
    for poison in (0xA5, 0x5A):
        filled = {"values": jax.lax.bitcast_convert_type(jnp.full(h.shape, poison, jnp.uint8), jnp.float8_e4m3fn),
                  "scales": jnp.full(want_scales.shape, -float(poison), jnp.float32)}
        out = run(jnp.asarray(h), jnp.asarray(prob), filled)
        assert same_bytes_but_nan_sign(np.asarray(out["values"]).view(np.uint8), want_values)
        np.testing.assert_array_equal(np.asarray(out["scales"]), want_scales)


@pytest.mark.parametrize("name", ["partial_last", "one_row"])
def test_the_inputs_hold_zeros_of_both_signs_which_the_oracle_keeps(name):
    """The GPU tier's rows (and the K-major pass's) carry -0, and the oracle quantizes it to
    0x80, +0 to 0x00: a kernel dropping the sign of zero fails them."""
    import test_sm90_fp8_quantize

    for x in (np.asarray(rows(name, "bf16"), np.float32), test_sm90_fp8_quantize.operand("one_expert", "bf16")[0]):
        zeros = x == 0
        assert (zeros & np.signbit(x)).any() and (zeros & ~np.signbit(x)).any()
    x = np.asarray(rows(name, "bf16"), np.float32)
    values, _ = oracle(x)
    zeros = (x == 0) & ~np.isnan(oracle(x)[1]).repeat(BLOCK[1], axis=1)[:, :x.shape[1]]
    assert (values[zeros & np.signbit(x)] == 0x80).all() and (values[zeros & ~np.signbit(x)] == 0x00).all()
    unsigned = np.where(values == 0x80, np.uint8(0), values)
    assert not same_bytes_but_nan_sign(unsigned, values)


def test_the_activation_oracle_tells_a_missing_square_and_a_dropped_prob():
    h, prob = rows("partial_last", "bf16"), probs(SHAPES["partial_last"][0], "f32")
    stored, _ = oracle(activation(h, prob))
    r = np.maximum(np.asarray(h, np.float32), 0)
    for wrong in (r * np.asarray(prob, np.float32)[:, None], r * r):
        assert not same_bytes_but_nan_sign(oracle(wrong)[0], stored)


def test_no_rows_give_empty_outputs_without_a_launch():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import row_quantize

    out = jax.jit(row_quantize.quantize_rows_by_kernel)(jnp.zeros((0, 1856), jnp.bfloat16))
    assert out["values"].shape == (0, 1856) and out["scales"].shape == (0, 15)


@pytest.mark.compile
def test_the_fp8_step_takes_no_loop():
    """No while loop in the step as lowered for Hopper: on the GPU each step of one is a
    kernel or more (the K-major passes' group tables once searched the m rows' groups, a
    loop of log2 m steps; `quantization.ragged.group_first_rows`)."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    assert "stablehlo.while" not in _fp8_step_text()
