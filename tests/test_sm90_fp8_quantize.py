"""The FP8 weight gradients' operands quantized straight into their K-major copies
(`kernels/sm90/k_major_quantize_kernel.py`, through `contract_layout.quantize_by_kernel`):
`quantization.ragged.quantize_ragged_rows` and the K-major copy in one pass; and
`ragged_contract(..., precision=FP8_BLOCKWISE)`, the contraction that quantizes its own
operands, which calls it on Hopper.

CPU: the kernel's formula (its module doc) in NumPy against XLA's quantizer and copy, on
values that reach e4m3's subnormals, with NaNs and infinities planted; refusals; the
contraction quantizing its operands on the XLA backend, and its refusals. Compile
tier: compiles for sm_90a with IEEE division, the saturating e4m3 conversion, 16-byte
loads and stores and no local memory; lowers to one custom call binding its buffers in
their declared order. GPU tier: the kernel against its formula, byte for byte but for a
NaN's sign, into outputs poisoned two ways, on the K-major copy's cases (empty, negative
and unowned groups, sums past m, fewer rows than a group, 512 experts), and against XLA's
quantizer on the GPU within one e4m3 step (XLA:GPU's float32 division is not IEEE's);
the contraction on the quantizing copies within the FP8 bound of float64.
"""

from __future__ import annotations

import functools
import os
import re

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jax_dsrelu.primitives.ragged_contract import ragged_contract  # noqa: E402
from jax_dsrelu.quantization import ragged  # noqa: E402
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE  # noqa: E402
from test_quantization_blockwise import oracle_quantize  # noqa: E402
from test_sm90_fp8_contract import (COPY_CASES, check_against, copy_case, grouping, reference,  # noqa: E402
                                    xla_copy)

GROUP = FP8_BLOCKWISE.activations.block[1]
DTYPES = {"bf16": np.dtype(jnp.bfloat16), "f32": np.dtype(np.float32)}
CASES = [(name, dtype) for name in sorted(COPY_CASES) for dtype in DTYPES]
IDS = [f"{name}-{dtype}" for name, dtype in CASES]


def operand(name, dtype_name, specials=True):
    """(x (m, n) in the dtype, group sizes): values over 2^-20 to 2^20 in every group, so
    that most land among e4m3's subnormals, a third of them zeros of either sign (as relu
    leaves in dh and act; -0 quantizes to e4m3's -0, 0x80), and a NaN and an infinity in
    two groups."""
    m, n, sizes = copy_case(name)
    rng = np.random.default_rng(m + n)
    x = rng.standard_normal((m, n)) * np.exp2(rng.uniform(-20, 20, (m, n)))
    x = np.where(rng.uniform(size=(m, n)) < 1 / 3, np.copysign(0.0, x), x)
    if specials and m > 40:
        x[3, 5], x[min(m - 1, 200), n - 1] = np.nan, -np.inf
    return np.asarray(jnp.asarray(x, DTYPES[dtype_name])), sizes


def xla_quantized(x, sizes):
    """(k_major (n, G * 128) e4m3 bytes, scales (G, n)) by XLA: the ragged quantizer, then
    the K-major copy of its values."""
    values, scales, _ = ragged.quantize_ragged_rows(jnp.asarray(x), jnp.asarray(sizes, jnp.int32),
                                                    FP8_BLOCKWISE.activations)
    return xla_copy(jax.lax.bitcast_convert_type(values, jnp.uint8), jnp.asarray(sizes, jnp.int32)), scales


def same_bytes_but_nan_sign(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two arrays of e4m3 bytes hold the same values, a NaN (0x7F or 0xFF) matching
    either NaN."""
    got_nan, want_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    return bool(np.array_equal(got_nan, want_nan) and np.array_equal(got[~got_nan], want[~want_nan]))


def formula(x: np.ndarray, sizes) -> tuple[np.ndarray, np.ndarray]:
    """(k_major (n, G * 128) e4m3 bytes, scales (G, n)) by the kernel's module doc, in
    NumPy: each group's columns by the recipe's oracle (`oracle_quantize`: IEEE float32
    division, round to nearest even), stored at the group's 128 places, zeros after."""
    m, n = x.shape
    count = ragged.max_groups(m, len(sizes), GROUP)
    first_rows = np.asarray(ragged.group_first_rows(jnp.asarray(sizes, jnp.int32), m, GROUP))
    k_major = np.zeros((n, count, GROUP), np.uint8)
    scales = np.ones((count, n), np.float32)  # a group of no rows: scale 1
    for group in range(count):
        start, stop = first_rows[group], min(first_rows[group + 1], m)
        if stop > start:
            values, group_scales = oracle_quantize(np.asarray(x[start:stop]).T, (1, GROUP))  # (n, rows), (n, 1)
            scales[group] = group_scales[:, 0]
            k_major[:, group, : stop - start] = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return k_major.reshape(n, -1), scales


def dequantized_rows(k_major: np.ndarray, scales: np.ndarray, sizes, num_rows: int) -> np.ndarray:
    """(m, n) float64: the values the K-major bytes and scales represent, back in row order."""
    count = scales.shape[0]
    first_rows = np.asarray(ragged.group_first_rows(jnp.asarray(sizes, jnp.int32), num_rows, GROUP))
    values = k_major.view(ml_dtypes.float8_e4m3fn).astype(np.float64).reshape(k_major.shape[0], count, GROUP)
    rows = np.empty((num_rows, k_major.shape[0]))
    for group in range(count):
        start, stop = first_rows[group], min(first_rows[group + 1], num_rows)
        rows[start:stop] = (values[:, group, : stop - start] * scales[group][:, None]).T
    return rows


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_the_kernels_formula_is_xlas_quantizer_and_copy_on_the_cpu(name, dtype):
    """The module doc's formula in NumPy against XLA's quantizer and copy on the CPU, which
    divides as IEEE asks (XLA:GPU does not: the GPU tier holds the kernel to the formula)."""
    x, sizes = operand(name, dtype)
    k_major, scales = formula(x, sizes)
    want_k_major, want_scales = (np.asarray(a) for a in xla_quantized(x, sizes))
    assert same_bytes_but_nan_sign(k_major, want_k_major)
    np.testing.assert_array_equal(scales, want_scales)
    # The cases reach e4m3's subnormals (exponent bits 0, mantissa not) and, but for the
    # smallest, its NaN.
    assert ((want_k_major & 0x78) == 0).sum() > ((want_k_major & 0x7F) == 0).sum()
    assert x.shape[0] <= 40 or ((want_k_major & 0x7F) == 0x7F).any()


def within_one_step(got: np.ndarray, want: np.ndarray) -> bool:
    """Whether two arrays of e4m3 bytes agree but for values one step apart (the same
    sign, codes one apart), NaNs alike: what a quotient one float32 ulp off can change."""
    got_nan, want_nan = (got & 0x7F) == 0x7F, (want & 0x7F) == 0x7F
    same_sign = (got & 0x80) == (want & 0x80)
    close = (np.abs((got & 0x7F).astype(int) - (want & 0x7F).astype(int)) <= 1) & same_sign
    return bool(np.array_equal(got_nan, want_nan) and (close | got_nan).all())


def test_the_byte_comparisons_tell_a_nans_sign_and_a_step_from_a_wrong_value():
    want = np.array([0x00, 0x01, 0x38, 0x7F, 0xB8], np.uint8)  # 0, a subnormal, 1, NaN, -1
    assert same_bytes_but_nan_sign(want.copy(), want)
    assert same_bytes_but_nan_sign(np.array([0x00, 0x01, 0x38, 0xFF, 0xB8], np.uint8), want)  # -NaN for NaN
    for wrong in ([0x00, 0x02, 0x38, 0x7F, 0xB8], [0x00, 0x01, 0x7F, 0x7F, 0xB8], [0x00, 0x01, 0x38, 0x7E, 0xB8]):
        assert not same_bytes_but_nan_sign(np.array(wrong, np.uint8), want)
    assert within_one_step(np.array([0x00, 0x02, 0x37, 0xFF, 0xB9], np.uint8), want)
    for wrong in ([0x80, 0x01, 0x38, 0x7F, 0xB8], [0x00, 0x03, 0x38, 0x7F, 0xB8], [0x00, 0x01, 0x38, 0x7E, 0xB8]):
        assert not within_one_step(np.array(wrong, np.uint8), want)
    # The rows the bytes stand for, back in row order (to e4m3's precision).
    x = np.array([[1.0, -2.0], [3.0, 448.0]], np.float32)[:, [0, 1] * 8]
    np.testing.assert_allclose(dequantized_rows(*formula(x, [2]), [2], 2), x, rtol=2.0**-4)


def test_the_quantizing_copy_refuses_what_it_cannot_take():
    from jax_dsrelu.kernels.sm90 import contract_layout

    first_rows = jnp.zeros((3,), jnp.int32)
    for shape in ((0, 64), (10, 40)):
        with pytest.raises(ValueError, match=r"m > 0 rows of n a positive multiple of 16, got x.shape="):
            contract_layout.quantize_by_kernel(jnp.zeros(shape, jnp.bfloat16), first_rows, 1)
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90.k_major_quantize_kernel import KMajorQuantizeSm90

    with pytest.raises(TypeError, match="bfloat16, float16 or float32 rows, got int8"):
        KMajorQuantizeSm90(64, 1, np.int8)


def unquantized(name, seed=0):
    """(lhs (m, a) bfloat16, rhs (m, b) float32, group sizes, out dtype) of a contraction
    case (`test_sm90_fp8_contract.GROUPINGS`): dW1's x and dh (float32 where the caller's
    dtype is; the FP8 step's bf16 dh is the lhs's kind), rows whose magnitudes span 2^-6
    to 2^6 from row to row."""
    (_, a, b), m, sizes, out_dtype = grouping(name)
    rng = np.random.default_rng(seed)
    lhs, rhs = (rng.standard_normal((m, w)) * np.exp2(rng.uniform(-6, 6, (m, 1))) for w in (a, b))
    return jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.float32), sizes, out_dtype


def test_quantized_here_is_the_block_scaled_form_of_xlas_quantizer():
    lhs, rhs, sizes, out_dtype = unquantized("ragged_with_empty")
    group_sizes = jnp.asarray(sizes, jnp.int32)
    here = jax.jit(lambda l, r, g: ragged_contract(l, r, g, precision=FP8_BLOCKWISE, out_dtype=out_dtype,
                                                   backend="xla"))(lhs, rhs, group_sizes)
    (lq, ls, _), (rq, rs, _) = (ragged.quantize_ragged_rows(x, group_sizes, FP8_BLOCKWISE.activations) for x in (lhs, rhs))
    given = ragged_contract(lq, rq, group_sizes, lhs_scale=ls, rhs_scale=rs, out_dtype=out_dtype, backend="xla")
    np.testing.assert_array_equal(np.asarray(here), np.asarray(given))


def test_quantized_here_keeps_the_rows_whole_under_sharding():
    # The groups are numbered over all of the rows, as for block-scaled operands.
    from jax_dsrelu.primitive_schema import RAGGED_CONTRACT, ROWS

    assert ROWS in RAGGED_CONTRACT.whole(dict(quantize=True, block_scaled=False))
    assert ROWS not in RAGGED_CONTRACT.whole(dict(quantize=False, block_scaled=False))


def test_quantized_here_refuses_scales_indices_and_quantized_operands():
    lhs, rhs, sizes, out_dtype = unquantized("short_of_m")
    group_sizes = jnp.asarray(sizes, jnp.int32)
    call = functools.partial(ragged_contract, out_dtype=out_dtype, backend="xla", precision=FP8_BLOCKWISE)
    scales = jnp.ones((ragged.max_groups(lhs.shape[0], len(sizes), GROUP), lhs.shape[1]), jnp.float32)
    with pytest.raises(ValueError, match=r"precision=FP8_BLOCKWISE quantizes lhs and rhs, read in row order: "
                                         r"\['lhs_scale', 'rhs_scale'\] must be None"):
        call(lhs, rhs, group_sizes, lhs_scale=scales, rhs_scale=scales)
    with pytest.raises(ValueError, match=r"\['lhs_index'\] must be None"):
        call(lhs, rhs, group_sizes, lhs_index=jnp.zeros((lhs.shape[0],), jnp.int32))
    with pytest.raises(TypeError, match=r"lhs must be float32, bfloat16 or float16 \(it is quantized here\), "
                                        r"got lhs.dtype=float8_e4m3fn"):
        call(lhs.astype(jnp.float8_e4m3fn), rhs, group_sizes)
    with pytest.raises(TypeError, match="precision must be None or jax_dsrelu.quantization.FP8_BLOCKWISE"):
        ragged_contract(lhs, rhs, group_sizes, out_dtype=out_dtype, backend="xla", precision="fp8")


@pytest.mark.compile
def test_quantized_here_lowers_to_the_quantizing_copies():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from test_operand_binding import bound_types, unbound_buffers

    from jax_dsrelu.kernels.operands import ROWS
    from jax_dsrelu.kernels.sm90 import contract_layout, ragged_call
    from test_sm90_fp8_contract import request_for

    lhs, rhs, sizes, out_dtype = unquantized("ragged_with_empty")
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (lhs, rhs, jnp.asarray(sizes, jnp.int32))]
    plan = ragged_call.operands(request_for((len(sizes), lhs.shape[1], rhs.shape[1]), out_dtype))
    counts = {ROWS: contract_layout.padded_rows(lhs.shape[0], len(sizes))}
    call = jax.jit(lambda l, r, g: ragged_contract(l, r, g, precision=FP8_BLOCKWISE, out_dtype=out_dtype,
                                                   backend="sm90"))
    text = call.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    # Two quantizing copies, then the contraction, which reads their results.
    assert text.count("custom_call @CuteDSLRT") == 3 and unbound_buffers(plan, counts, text, call=-1) == []
    # The quantizing copies read lhs and rhs themselves, in their own dtypes.
    assert [bound_types(text, call)[0][0] for call in (0, 1)] == [f"tensor<{lhs.shape[0]}x{lhs.shape[1]}xbf16>",
                                                                   f"tensor<{rhs.shape[0]}x{rhs.shape[1]}xf32>"]


def prebuild_copy_jobs():
    """The passes the GPU tier runs, for the kernel cache: in place into poisoned buffers,
    and as the quantized-here contraction calls them in its tier (lhs bfloat16, rhs float32)."""
    from jax_dsrelu.kernels.sm90 import contract_layout

    in_place = {(copy_case(name)[1], len(copy_case(name)[2]), DTYPES[dtype], True) for name, dtype in CASES}
    called = {(width, grouping(name)[0][0], DTYPES[dtype], False)
              for name in QUANTIZED_HERE for width, dtype in zip(grouping(name)[0][1:], ("bf16", "f32"))}
    return [functools.partial(contract_layout.compile_quantize_kernel, n, experts, dtype, outputs_in_place=in_place)
            for n, experts, dtype, in_place in sorted(in_place | called, key=repr)]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", sorted(DTYPES) + ["f16"])
def test_the_quantizing_copy_compiles_for_sm90a(dtype):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import contract_layout

    ptx = contract_layout.compile_quantize_kernel(1856, 128, DTYPES.get(dtype, np.dtype(np.float16)), keep=True).ptx
    assert_a_quantizing_pass(ptx)


SIXTEEN_BYTE_ACCESSES = ("ld.global.v4", "st.shared.v4", "st.global.v4")
# `e4m3.quotient`'s division: its dividend is 1 where the value is 0.
GUARDED_DIVISION = re.compile(r"selp\.f32 dividend, one, %r\d+, zero;\s+div\.rn\.f32 divided, dividend, %r\d+;")


def test_a_zero_values_stand_in_quotient_is_its_quotient_bit_for_bit():
    """What `e4m3.quotient` puts in a zero's place: its sign's 1 divided by the scale, times
    0, is +-0 / scale bit for bit for every kind of scale the recipe makes (float32's
    smallest normal, 1, 1 / 448, large, NaN); dividing +1 would lose -0's sign, as the
    comparison shows."""
    scales = np.array([np.finfo(np.float32).tiny, 1.0, 1.0 / 448.0, 3.0e30, np.nan], np.float32)
    for zero in (np.float32(0.0), np.float32(-0.0)):
        one = (zero.view(np.uint32) | np.float32(1.0).view(np.uint32)).view(np.float32)
        stand_in, quotient = (one / scales) * np.float32(0.0), zero / scales
        assert np.array_equal(stand_in.view(np.uint32)[:-1], quotient.view(np.uint32)[:-1])
        assert np.isnan(stand_in[-1]) and np.isnan(quotient[-1])
    unsigned = (np.float32(1.0) / scales[:-1]) * np.float32(0.0)
    assert not np.array_equal(unsigned.view(np.uint32), (np.float32(-0.0) / scales[:-1]).view(np.uint32))


@pytest.mark.compile
def test_the_compile_checks_tell_a_division_of_a_value_that_may_be_zero():
    """The guard check above fails on a pass whose division reads the value itself."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import contract_layout

    ptx = contract_layout.compile_quantize_kernel(256, 2, DTYPES["bf16"], keep=True).ptx
    bare = re.sub(r"div\.rn\.f32 divided, dividend,", "div.rn.f32 divided, %r1,", ptx, count=1)
    with pytest.raises(AssertionError, match="may be zero"):
        assert_a_quantizing_pass(bare)


def assert_a_quantizing_pass(ptx: str, *also: str, accesses=SIXTEEN_BYTE_ACCESSES) -> None:
    """A quantizing pass's PTX: IEEE division (no approximation, no flush to zero) of
    dividends that are never zero (`e4m3.quotient`), the saturating RNE conversion, its
    vector `accesses` (16-byte loads and stores unless named) and the instructions `also`
    names, no local memory, and ptxas takes it."""
    import ptxas

    for instruction in ("div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", *accesses, *also):
        assert instruction in ptx, instruction
    assert "div.approx" not in ptx and "div.full" not in ptx and ".ftz" not in ptx
    assert ptx.count("div.rn.f32") == len(GUARDED_DIVISION.findall(ptx)), "a division whose dividend may be zero"
    assert "ld.local" not in ptx and "st.local" not in ptx
    ptxas.check_assembly(ptx)


@pytest.mark.compile
def test_the_quantizing_copy_lowers_to_one_call_binding_its_buffers_in_order():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from test_operand_binding import unbound_buffers

    from jax_dsrelu.kernels.operands import ROWS
    from jax_dsrelu.kernels.sm90 import contract_layout

    m, n, sizes = copy_case("ragged_with_empty")

    def quantize(x, group_sizes):
        first_rows = ragged.group_first_rows(group_sizes, m, GROUP)
        return contract_layout.quantize_by_kernel(x, first_rows, len(sizes))

    shapes = (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((len(sizes),), jnp.int32))
    text = jax.jit(quantize).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    plan = contract_layout.quantize_kernel(n, len(sizes), np.dtype(jnp.bfloat16)).operands()
    assert unbound_buffers(plan, {ROWS: m}, text) == []


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_the_quantizing_copy_computes_its_formula(hopper, name, dtype):
    """Byte for byte the formula (but for a NaN's sign), into outputs poisoned two ways;
    and XLA's quantizer and copy on the GPU, whose float32 division (div.full.f32,
    openxla/xla#37181) can put a quotient one ulp off: the same scales, values at most one
    e4m3 step apart."""
    from jax_dsrelu.kernels.sm90 import contract_layout

    x, sizes = operand(name, dtype)
    m, n = x.shape
    group_sizes = jnp.asarray(sizes, jnp.int32)
    count = ragged.max_groups(m, len(sizes), GROUP)
    want_k_major, want_scales = formula(x, sizes)
    first_rows = ragged.group_first_rows(group_sizes, m, GROUP)
    run = jax.jit(lambda v, f, filled: contract_layout.quantize_by_kernel(v, f, len(sizes), filled=filled))
    # Into buffers poisoned two ways: a byte or scale the kernel does not write keeps the poison.
    for poison in (0xA5, 0x5A):
        filled = {"k_major": jax.lax.bitcast_convert_type(jnp.full((n, count, GROUP), poison, jnp.uint8),
                                                          jnp.float8_e4m3fn),
                  "scales": jnp.full((count, n), -float(poison), jnp.float32)}
        k_major, scales = run(jnp.asarray(x), first_rows, filled)
        got = np.asarray(jax.lax.bitcast_convert_type(k_major, jnp.uint8))
        assert got.shape == want_k_major.shape and same_bytes_but_nan_sign(got, want_k_major)
        np.testing.assert_array_equal(np.asarray(scales), want_scales)
    xla_k_major, xla_scales = (np.asarray(a) for a in jax.jit(xla_quantized)(x, sizes))
    np.testing.assert_array_equal(xla_scales, want_scales)
    assert within_one_step(got, xla_k_major)


QUANTIZED_HERE = ["ragged_with_empty", "past_m", "fewer_rows_than_a_group", "narrow_b", "nano_widths"]


def prebuild_contract_requests():
    """The contraction kernels the quantized-here GPU tier runs, for the kernel cache (the
    quantizing copies are `prebuild_copy_jobs`')."""
    from jax_dsrelu.kernels.sm90 import ragged_call
    from test_sm90_fp8_contract import request_for

    requests = {request_for(grouping(name)[0], grouping(name)[3]) for name in QUANTIZED_HERE}
    return [(request, ragged_call.choose_config(request), False) for request in sorted(requests, key=repr)]


@pytest.mark.gpu
@pytest.mark.parametrize("name", QUANTIZED_HERE)
def test_quantized_here_is_float64_within_the_fp8_bound(hopper, name):
    """The contraction on operands quantized by the quantizing copies: within the FP8
    bound of the float64 product of the values its operands were quantized to (the
    formula's, `test_the_quantizing_copy_computes_its_formula`)."""
    lhs, rhs, sizes, out_dtype = unquantized(name)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    m = lhs.shape[0]
    lhs64, rhs64 = (dequantized_rows(*formula(np.asarray(x), sizes), sizes, m) for x in (lhs, rhs))
    call = jax.jit(lambda l, r, g: ragged_contract(l, r, g, precision=FP8_BLOCKWISE, out_dtype=out_dtype,
                                                   backend="sm90"))
    out = call(lhs, rhs, group_sizes)
    ref, abs_dot = reference(lhs64, rhs64, sizes, len(sizes))
    check_against(out, ref, abs_dot, sizes, m, "float64 of the operands as quantized")
