"""The FP8 weight gradients' operands quantized straight into their K-major copies
(`kernels/sm90/k_major_quantize_kernel.py`, through `contract_layout.quantize_by_kernel`):
`quantization.ragged.quantize_ragged_rows` and the K-major copy in one pass.

CPU: the kernel's formula (its module doc) in NumPy against XLA's quantizer and copy, on
values that reach e4m3's subnormals, with NaNs and infinities planted; refusals. Compile
tier: compiles for sm_90a with IEEE division, the saturating e4m3 conversion, 16-byte
loads and stores and no local memory; lowers to one custom call binding its buffers in
their declared order. GPU tier: the kernel against XLA's quantizer and copy, byte for
byte but for a NaN's sign, into outputs poisoned two ways, on the K-major copy's cases
(empty, negative and unowned groups, sums past m, fewer rows than a group, 512 experts).
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

from jax_dsrelu.quantization import ragged  # noqa: E402
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE  # noqa: E402
from test_sm90_fp8_contract import COPY_CASES, copy_case, xla_copy  # noqa: E402

GROUP = FP8_BLOCKWISE.activations.block[1]
DTYPES = {"bf16": np.dtype(jnp.bfloat16), "f32": np.dtype(np.float32)}
CASES = [(name, dtype) for name in sorted(COPY_CASES) for dtype in DTYPES]
IDS = [f"{name}-{dtype}" for name, dtype in CASES]


def operand(name, dtype_name, specials=True):
    """(x (m, n) in the dtype, group sizes): values over 2^-20 to 2^20 in every group, so
    that most land among e4m3's subnormals, and a NaN and an infinity in two groups."""
    m, n, sizes = copy_case(name)
    rng = np.random.default_rng(m + n)
    x = rng.standard_normal((m, n)) * np.exp2(rng.uniform(-20, 20, (m, n)))
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


@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_the_kernels_formula_is_xlas_quantizer_and_copy(name, dtype):
    """The module doc's formula in NumPy (float32 operations, e4m3 by ml_dtypes) against
    XLA's quantizer and copy: the GPU tier then only has to show the kernel computes it."""
    x, sizes = operand(name, dtype)
    m, n = x.shape
    count = ragged.max_groups(m, len(sizes), GROUP)
    first_rows = np.asarray(ragged.group_first_rows(ragged.row_groups(jnp.asarray(sizes, jnp.int32), m, GROUP), count))
    rows32 = x.astype(np.float32)
    k_major = np.zeros((n, count, GROUP), np.uint8)
    scales = np.empty((count, n), np.float32)
    for group in range(count):
        start, stop = first_rows[group], min(first_rows[group + 1], m)
        block = rows32[start:stop]  # (rows, n), rows <= 128
        finite = np.isfinite(block)
        amax = np.where(finite, np.abs(block), np.float32(0)).max(axis=0, initial=np.float32(0))
        scale = np.where(amax > 0, np.maximum(amax * np.float32(1 / 448), np.finfo(np.float32).tiny), np.float32(1))
        scale = np.where(finite.all(axis=0), scale, np.float32(np.nan)).astype(np.float32)
        scales[group] = scale
        with np.errstate(invalid="ignore"):
            quotient = (block / scale).astype(np.float32)
        saturated = np.where(np.isnan(quotient), quotient, np.clip(quotient, -448, 448))
        k_major[:, group, : stop - start] = saturated.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).T
    want_k_major, want_scales = (np.asarray(a) for a in xla_quantized(x, sizes))
    assert same_bytes_but_nan_sign(k_major.reshape(n, -1), want_k_major)
    np.testing.assert_array_equal(scales, want_scales)
    # The cases reach e4m3's subnormals (exponent bits 0, mantissa not) and, but for the
    # smallest, its NaN.
    assert ((want_k_major & 0x78) == 0).sum() > ((want_k_major & 0x7F) == 0).sum()
    assert m <= 40 or ((want_k_major & 0x7F) == 0x7F).any()


def test_the_byte_comparison_tells_a_nans_sign_from_a_wrong_value():
    want = np.array([0x00, 0x01, 0x38, 0x7F, 0xB8], np.uint8)  # 0, a subnormal, 1, NaN, -1
    assert same_bytes_but_nan_sign(want.copy(), want)
    assert same_bytes_but_nan_sign(np.array([0x00, 0x01, 0x38, 0xFF, 0xB8], np.uint8), want)  # -NaN for NaN
    for wrong in ([0x00, 0x02, 0x38, 0x7F, 0xB8], [0x00, 0x01, 0x7F, 0x7F, 0xB8], [0x00, 0x01, 0x38, 0x7E, 0xB8]):
        assert not same_bytes_but_nan_sign(np.array(wrong, np.uint8), want)


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


def prebuild_copy_jobs():
    """The passes the GPU tier runs (in place, into poisoned buffers), for the kernel cache."""
    from jax_dsrelu.kernels.sm90 import contract_layout

    built = sorted({(copy_case(name)[1], len(copy_case(name)[2]), dtype) for name, dtype in CASES})
    return [functools.partial(contract_layout.compile_quantize_kernel, n, experts, DTYPES[dtype], outputs_in_place=True)
            for n, experts, dtype in built]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", sorted(DTYPES) + ["f16"])
def test_the_quantizing_copy_compiles_for_sm90a(dtype):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import contract_layout

    ptx = contract_layout.compile_quantize_kernel(1856, 128, DTYPES.get(dtype, np.dtype(np.float16)), keep=True).ptx
    # IEEE division (no approximation), the saturating RNE conversion, 16-byte accesses.
    for instruction in ("div.rn.f32", "cvt.rn.satfinite.e4m3x2.f32", "ld.global.v4", "st.shared.v4", "st.global.v4"):
        assert instruction in ptx, instruction
    assert "div.approx" not in ptx and "div.full" not in ptx and ".ftz" not in ptx
    assert "ld.local" not in ptx and "st.local" not in ptx
    ptxas.check_assembly(ptx)


@pytest.mark.compile
def test_the_quantizing_copy_lowers_to_one_call_binding_its_buffers_in_order():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from test_operand_binding import unbound_buffers

    from jax_dsrelu.kernels.operands import ROWS
    from jax_dsrelu.kernels.sm90 import contract_layout

    m, n, sizes = copy_case("ragged_with_empty")
    count = ragged.max_groups(m, len(sizes), GROUP)

    def quantize(x, group_sizes):
        first_rows = ragged.group_first_rows(ragged.row_groups(group_sizes, m, GROUP), count)
        return contract_layout.quantize_by_kernel(x, first_rows, len(sizes))

    shapes = (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), jax.ShapeDtypeStruct((len(sizes),), jnp.int32))
    text = jax.jit(quantize).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    plan = contract_layout.quantize_kernel(n, len(sizes), np.dtype(jnp.bfloat16)).operands()
    assert unbound_buffers(plan, {ROWS: m}, text) == []


# ---------------------------------------------------------------------------- GPU tier


@pytest.fixture(scope="module")
def hopper():
    from jax_dsrelu.kernels import registry

    capability = registry.cuda_compute_capability()
    if capability != (9, 0):
        pytest.skip(f"the sm90 kernels run on compute capability 9.0; this GPU has {capability}")


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_the_quantizing_copy_is_xlas_quantizer_and_copy(hopper, name, dtype):
    from jax_dsrelu.kernels.sm90 import contract_layout

    x, sizes = operand(name, dtype)
    m, n = x.shape
    group_sizes = jnp.asarray(sizes, jnp.int32)
    count = ragged.max_groups(m, len(sizes), GROUP)
    want_k_major, want_scales = (np.asarray(a) for a in jax.jit(xla_quantized)(x, sizes))
    first_rows = ragged.group_first_rows(ragged.row_groups(group_sizes, m, GROUP), count)
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
