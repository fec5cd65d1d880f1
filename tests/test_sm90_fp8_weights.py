"""Expert weights quantized for the FP8 GEMMs by one pass on Hopper
(`kernels/sm90/block_quantize_kernel.py`, through `weight_quantize.quantize_by_kernel`):
`quantization.blockwise.quantize_blockwise` in 128 x 128 blocks and the values' transpose;
and `quantize_expert_weights`, which runs it under "auto" on a Hopper GPU.

CPU: `quantize_expert_weights` by either backend name is XLA's quantizer there, and refuses
other names; the kernel refuses what it cannot take. Compile tier: compiles for sm_90a
with IEEE division, the saturating e4m3 conversion, 16-byte loads and stores, warp
shuffles and no local memory; lowers to one custom call binding its buffers in their
declared order; `quantize_expert_weights` on it under vmap (a loop) and grad (constants),
as lowered for Hopper. GPU tier: the kernel against the
recipe's NumPy oracle, byte for byte but for a NaN's sign, both layouts and the scales,
into outputs poisoned two ways, on partial blocks at both edges, Nano's widths, narrow
weights, 256 experts, NaN, infinity and zero blocks and values among e4m3's subnormals,
from bfloat16, float16 and float32; and `quantize_expert_weights` on the kernel, its four
layouts the oracle's, alone and for a stack of weights under vmap.
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

import jax_dsrelu  # noqa: E402
from jax_dsrelu.kernels.request import WeightQuantizeRequest  # noqa: E402
from jax_dsrelu.quantization.schema import FP8_BLOCKWISE  # noqa: E402
from test_quantization_blockwise import oracle_quantize  # noqa: E402
from test_sm90_fp8_quantize import assert_a_quantizing_pass, same_bytes_but_nan_sign  # noqa: E402

BLOCK = FP8_BLOCKWISE.weights.block
DTYPES = {"bf16": np.dtype(jnp.bfloat16), "f16": np.dtype(np.float16), "f32": np.dtype(np.float32)}
# (E, N, K) of each case: partial blocks along both axes, Nano's widths (N whole blocks, K
# 14.5), a single block, narrow weights (less than a block either way), many experts.
SHAPES = {"partial_both": (2, 144, 272), "nano_widths": (3, 2688, 1856), "one_block": (1, 128, 128),
          "narrow": (2, 16, 48), "experts_256": (256, 32, 64)}
CASES = [("partial_both", "bf16"), ("partial_both", "f32"), ("partial_both", "f16"), ("nano_widths", "bf16"),
         ("one_block", "bf16"), ("narrow", "f32"), ("experts_256", "bf16")]
IDS = [f"{name}-{dtype}" for name, dtype in CASES]


def weight(name: str, dtype_name: str) -> np.ndarray:
    """w (E, N, K) in the dtype: values over 2^-20 to 2^20 (most of a block's land among
    e4m3's subnormals), a NaN in one block, an infinity in another and a block of zeros
    where there are three blocks or more."""
    e, n, k = SHAPES[name]
    rng = np.random.default_rng(e + n + k)
    w = rng.standard_normal((e, n, k)) * np.exp2(rng.uniform(-20, 20, (e, n, k)))
    if dtype_name == "f16":  # float16's range: 2^-14 to 2^15 and its subnormals
        w = np.clip(w, -6e4, 6e4)
    if n * k > 2 * BLOCK[0] * BLOCK[1]:
        w[0, 3, 5], w[-1, n - 1, k - 1] = np.nan, -np.inf
        w[0, BLOCK[0]:, :BLOCK[1]] = 0.0
    return np.asarray(jnp.asarray(w, DTYPES[dtype_name]))


def oracle(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(values (E, N, K) e4m3 bytes, transposed (E, K, N) e4m3 bytes, scales) by the
    recipe's rules in NumPy (IEEE float32 division, round to nearest even)."""
    values, scales = oracle_quantize(np.asarray(w, np.float32), BLOCK)
    stored = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return stored, np.ascontiguousarray(np.swapaxes(stored, 1, 2)), scales


def test_quantize_expert_weights_by_either_backend_is_xlas_quantizer_on_the_cpu():
    w1, w2 = (jnp.asarray(weight("partial_both", "bf16")), jnp.asarray(weight("partial_both", "bf16")).swapaxes(1, 2))
    by_auto, by_xla = (jax.jit(functools.partial(jax_dsrelu.quantize_expert_weights, recipe=FP8_BLOCKWISE,
                                                 backend=backend))(w1, w2) for backend in ("auto", "xla"))
    for got, want in zip(jax.tree.leaves(by_auto), jax.tree.leaves(by_xla)):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
    stored, transposed, scales = oracle(np.asarray(w1))
    # XLA:CPU divides as IEEE asks: the oracle's bytes.
    assert same_bytes_but_nan_sign(np.asarray(by_xla.w1_dx.values).view(np.uint8), stored)
    assert same_bytes_but_nan_sign(np.asarray(by_xla.w1_up.values).view(np.uint8), transposed)
    np.testing.assert_array_equal(np.asarray(by_xla.w1_dx.scales), scales)
    with pytest.raises(ValueError, match="backend must be 'auto' or 'xla'.*'sm90'"):
        jax_dsrelu.quantize_expert_weights(w1, w2, FP8_BLOCKWISE, backend="sm90")


def test_the_byte_oracle_tells_a_wrong_block_scale():
    w = weight("partial_both", "bf16")
    stored, _, _ = oracle(w)
    doubled, _, _ = oracle(np.asarray(w, np.float32) * np.float32(2 ** -0.5))
    assert not same_bytes_but_nan_sign(doubled, stored)  # a scale off by sqrt(2) moves values


def test_the_weight_quantizer_refuses_what_it_cannot_take():
    from jax_dsrelu.kernels.sm90 import weight_quantize

    assert weight_quantize.cannot_quantize(WeightQuantizeRequest(128, 2688, 1856, np.dtype(jnp.bfloat16))) is None
    for shape, dtype, match in (((4, 40, 64), jnp.bfloat16, "multiples of 16.*40"), ((4, 64, 0), jnp.float32, "0"),
                                ((4, 64, 64), jnp.int8, "int8")):
        assert match.split(".*")[-1] in weight_quantize.cannot_quantize(WeightQuantizeRequest(*shape, np.dtype(dtype)))
        with pytest.raises(ValueError, match=match):
            weight_quantize.quantize_by_kernel(jax.ShapeDtypeStruct(shape, dtype))


def prebuild_copy_jobs():
    """The passes the GPU tier runs, for the kernel cache: in place into poisoned buffers,
    and as `quantize_expert_weights` calls them (both weights of its case)."""
    from jax_dsrelu.kernels.sm90 import weight_quantize

    shape = SHAPES["partial_both"]
    built = {(*SHAPES[name], DTYPES[dtype], True) for name, dtype in CASES}
    built |= {(shape[0], shape[1], shape[2], DTYPES["bf16"], False), (shape[0], shape[2], shape[1], DTYPES["bf16"], False)}
    return [functools.partial(weight_quantize.compile_block_quantize_kernel, e, n, k, dtype, outputs_in_place=in_place)
            for e, n, k, dtype, in_place in sorted(built, key=repr)]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_the_weight_quantizer_compiles_for_sm90a(dtype):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import weight_quantize

    ptx = weight_quantize.compile_block_quantize_kernel(128, 2688, 1856, DTYPES[dtype], keep=True).ptx
    assert_a_quantizing_pass(ptx, "shfl.sync.bfly")  # the block's maximum by warp shuffles


@pytest.mark.compile
def test_the_weight_quantizer_lowers_to_one_call_binding_its_buffers_in_order():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from test_operand_binding import unbound_buffers

    from jax_dsrelu.kernels.sm90 import weight_quantize

    shape = SHAPES["partial_both"]
    text = jax.jit(weight_quantize.quantize_by_kernel).trace(
        jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    plan = weight_quantize.block_quantize_kernel(*shape, np.dtype(jnp.bfloat16)).operands()
    assert unbound_buffers(plan, {}, text) == []


def lowered_on_hopper(fn, *shapes) -> str:
    """fn lowered for cuda as on a Hopper GPU ("auto" resolves as there; no GPU needed): its
    StableHLO text."""
    from unittest import mock

    from jax_dsrelu.kernels import registry

    with mock.patch.object(registry, "cuda_compute_capability", lambda: (9, 0)):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.compile
def test_quantize_expert_weights_on_the_kernel_lowers_under_vmap_and_grad():
    """On Hopper "auto" binds the pass once per weight; under vmap (a stack of layers'
    weights) each call sits in a loop, since the call has no batched form; under grad the
    copies are constants, since the call has no derivative (the layer's custom VJP gives
    the weights' gradients)."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    e, n, k = SHAPES["partial_both"]
    w1, w2 = jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16), jax.ShapeDtypeStruct((e, k, n), jnp.bfloat16)
    quantize = functools.partial(jax_dsrelu.quantize_expert_weights, recipe=FP8_BLOCKWISE)
    assert lowered_on_hopper(quantize, w1, w2).count("custom_call @CuteDSLRT_NvJaxCutlassCall") == 2
    stacked = [jax.ShapeDtypeStruct((3, *w.shape), w.dtype) for w in (w1, w2)]
    text = lowered_on_hopper(jax.vmap(quantize), *stacked)
    assert text.count("custom_call @CuteDSLRT_NvJaxCutlassCall") == 2 and "stablehlo.while" in text

    def loss(w1, w2):
        quantized = quantize(w1, w2)
        return sum(jnp.sum(weight.scales) for weight in quantized) + jnp.sum(w1.astype(jnp.float32))

    assert "custom_call @CuteDSLRT_NvJaxCutlassCall" in lowered_on_hopper(jax.value_and_grad(loss, argnums=(0, 1)), w1, w2)
    assert "CuteDSLRT" not in lowered_on_hopper(functools.partial(quantize, backend="xla"), w1, w2)


def test_quantize_expert_weights_refuses_weights_not_of_the_layers_shapes():
    w1 = jnp.zeros((2, 32, 48), jnp.bfloat16)
    for bad_w1, bad_w2, seen in ((w1[0], w1[0].T, r"w1.shape=\(32, 48\)"), (w1, w1, r"w2.shape=\(2, 32, 48\)")):
        with pytest.raises(ValueError, match=r"w1 must be \(E, d, f\) and w2 \(E, f, d\).*" + seen):
            jax_dsrelu.quantize_expert_weights(bad_w1, bad_w2, FP8_BLOCKWISE)


# ---------------------------------------------------------------------------- GPU tier


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", CASES, ids=IDS)
def test_the_weight_quantizer_computes_the_recipe(hopper, name, dtype):
    """Byte for byte the oracle (but for a NaN's sign), both layouts and the scales, into
    outputs poisoned two ways: a byte or scale the kernel does not write keeps the poison."""
    from jax_dsrelu.kernels.sm90 import weight_quantize

    w = weight(name, dtype)
    e, n, k = w.shape
    want_stored, want_transposed, want_scales = oracle(w)
    run = jax.jit(lambda w, filled: weight_quantize.quantize_by_kernel(w, filled=filled))
    for poison in (0xA5, 0x5A):
        def poisoned(shape):
            return jax.lax.bitcast_convert_type(jnp.full(shape, poison, jnp.uint8), jnp.float8_e4m3fn)

        filled = {"values": poisoned((e, n, k)), "transposed": poisoned((e, k, n)),
                  "scales": jnp.full(want_scales.shape, -float(poison), jnp.float32)}
        out = run(jnp.asarray(w), filled)
        assert same_bytes_but_nan_sign(np.asarray(out["values"]).view(np.uint8), want_stored)
        assert same_bytes_but_nan_sign(np.asarray(out["transposed"]).view(np.uint8), want_transposed)
        np.testing.assert_array_equal(np.asarray(out["scales"]), want_scales)


@pytest.mark.gpu
def test_quantize_expert_weights_runs_the_kernel_under_auto(hopper):
    """"auto" quantizes on the kernel: its program holds the kernel's call, and the four
    layouts are the oracle's bytes (XLA:GPU's division could move a value by a step of
    e4m3); "xla" holds no such call."""
    w1 = jnp.asarray(weight("partial_both", "bf16"))
    w2 = jnp.swapaxes(w1, 1, 2)
    call = jax.jit(functools.partial(jax_dsrelu.quantize_expert_weights, recipe=FP8_BLOCKWISE))
    assert "BlockQuantizeSm90" in call.lower(w1, w2).as_text()
    assert "BlockQuantizeSm90" not in jax.jit(functools.partial(
        jax_dsrelu.quantize_expert_weights, recipe=FP8_BLOCKWISE, backend="xla")).lower(w1, w2).as_text()
    quantized = call(w1, w2)
    stored, transposed, scales = oracle(np.asarray(w1))
    for values, want in ((quantized.w1_dx.values, stored), (quantized.w1_up.values, transposed),
                         (quantized.w2_dsrelu.values, transposed), (quantized.w2_down.values, stored)):
        assert same_bytes_but_nan_sign(np.asarray(values).view(np.uint8), want)
    np.testing.assert_array_equal(np.asarray(quantized.w1_dx.scales), scales)
    np.testing.assert_array_equal(np.asarray(quantized.w1_up.scales), np.swapaxes(scales, 1, 2))


@pytest.mark.gpu
def test_a_stack_of_weights_under_vmap_is_each_weight_quantized(hopper):
    """vmap over a stack of layers' weights: the kernel one weight after another, the same
    bytes as each weight alone."""
    w1 = jnp.asarray(weight("partial_both", "bf16"))
    stack = jnp.stack([w1, -2 * w1])
    quantize = jax.jit(jax.vmap(functools.partial(jax_dsrelu.quantize_expert_weights, recipe=FP8_BLOCKWISE)))
    stacked = quantize(stack, jnp.swapaxes(stack, 2, 3))
    for layer, w in enumerate((w1, -2 * w1)):
        stored, transposed, scales = oracle(np.asarray(w))
        assert same_bytes_but_nan_sign(np.asarray(stacked.w1_dx.values[layer]).view(np.uint8), stored)
        assert same_bytes_but_nan_sign(np.asarray(stacked.w1_up.values[layer]).view(np.uint8), transposed)
        np.testing.assert_array_equal(np.asarray(stacked.w1_dx.scales[layer]), scales)
