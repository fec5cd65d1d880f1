"""The sm90 ragged-M GEMM on FP8_BLOCKWISE operands: bounds, refusals, compile tier, GPU tier.

Kernel: `kernels/sm90/blockwise_matmul_kernel.py` (e4m3 lhs (m, k) and rhs (E, n, k), float32
scales per row and 128 of k and per 128 x 128 block of rhs, each K block's partial sum
promoted to float32). Reached through the backend protocol as the primitives reach it.

CPU: the error bound (`fp8_bound`) rejects wrong answers (a scale from the wrong block, a
dropped K block, another expert's weights); the XLA reference of the primitive is held to
float64; refusals name the value. Compile tier (`compile`): every variant compiles for
sm_90a into e4m3 wgmma with no spills and no serialized wgmma. GPU tier (`gpu`): against
float64 of the values the quantized operands represent and against the recipe's emulation
(`quantization.emulation`), ragged, empty and past-m groups, experts of fewer rows than a
scale group, partial K and N blocks, 1 to 256 experts, every output NaN-filled first; the
same bits on every run.
"""

from __future__ import annotations

import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import dataclasses  # noqa: E402
import re  # noqa: E402
import zlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from contract_numpy import expert_rows  # noqa: E402
from jax_dsrelu.kernels.request import RaggedMatmulRequest  # noqa: E402
from kernel_cases import dirichlet_sizes  # noqa: E402
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu  # noqa: E402
from jax_dsrelu.quantization import blockwise, emulation  # noqa: E402
from jax_dsrelu.quantization.schema import E4M3, FP8_BLOCKWISE  # noqa: E402

BF16 = np.dtype(jnp.bfloat16)
BLOCK = FP8_BLOCKWISE.promotion
# Hopper's FP8 wgmma keeps about 13 fraction bits of a partial sum as it adds (about 14 bits
# in all, DeepSeek-V3's report), each step truncating at most 2^-13 of the block's sum of
# |products|; how a wgmma of k = 32 steps through its products is not documented. Summing
# each wgmma's 32 products exactly (2 steps per wgmma, 8 per K block of 4 wgmma) is too
# few: the FP8 contraction's GPU tier exceeded that bound on an H100 (ragged_with_empty, in
# the expert of 129 rows; benchmarks/results/device_checks.log, fd9549f). The bound allows a
# step per 8 products, 16 per K block. The promotion then adds the blocks in float32 on the CUDA cores
# (2^-23, twice float32's unit roundoff, for margin). The GPU tier holds the kernels to it,
# and the CPU tests show it still rejects a wrong scale, a dropped block or another
# expert's rows.
_FP8_BLOCK_UNIT = 16 * 2.0**-13
_F32_UNIT = 2.0**-23
_BF16_UNIT = 2.0**-8
_BF16_SUBNORMAL = 2.0**-133

# variant: the request's epilogue fields; "up_h_alone" as the FP8 forward's up-projection runs (h alone).
VARIANTS = {"plain": dict(epilogue="none"), "srelu": dict(epilogue="srelu"),
            "srelu_bias": dict(epilogue="srelu", with_bias=True),
            "up_h_alone": dict(epilogue="srelu", with_bias=True, with_act=False)}
# name: ((E, k, n), m, group sizes or None for Dirichlet sizes)
GROUPINGS = {
    # k = 4 blocks and a partial one of 16; n = 2 N-blocks, the second of 64 columns.
    "ragged_with_empty": ((8, 528, 320), 4096, [0, 700, 1, 0, 1500, 129, 1766, 0]),
    "short_of_m": ((8, 528, 320), 3000, [500, 0, 1200, 3, 0, 0, 0, 0]),
    "past_m": ((8, 528, 320), 2000, [900, 800, 700, 0, 0, 0, 0, 5]),
    "no_rows": ((8, 528, 320), 0, [0] * 8),
    # Every expert fewer rows than a scale group of the weight gradients would hold.
    "fewer_rows_than_a_group": ((16, 256, 256), 700, [1, 0, 127, 5, 64, 100, 3, 0, 90, 2, 77, 33, 0, 120, 50, 28]),
    "one_expert": ((1, 2048, 1024), 1500, [1500]),
    "narrow_n": ((4, 384, 64), 1000, [400, 0, 300, 300]),
    "experts_256": ((256, 256, 384), 24000, None),
    # Nemotron-3 Nano's widths: d = 2688 (21 blocks) and f = 1856 (14.5 blocks).
    "nano_widths": ((16, 2688, 1856), 5000, None),
}
# (grouping, variant, schedule): True, the promotion beside the next wgmma batch
# (`promoted_mainloop.mma_k_tiles_promoted_overlapped`); False, between the batches;
# "wide", between them over N tiles of 192 columns spanning two N blocks of the weight
# (`promoted_mainloop.mma_k_tiles_promoted`, given `wide`: tiles starting on a block's edge and half
# way, the second block past n clamped); "wide_halves", over those tiles in column halves of 96,
# each promoted beside the other's batch (`mma_k_tiles_promoted_in_halves`, given `wide`);
# "whole", the rules' config storing each tile at once from a buffer per subtile
# (`whole_tile_store`: rows of no expert too, act beside h too).
GPU_CASES = [(name, "plain", False) for name in GROUPINGS] + [
    ("ragged_with_empty", "srelu", False), ("ragged_with_empty", "srelu_bias", False),
    ("nano_widths", "srelu_bias", False), ("past_m", "srelu", False), ("ragged_with_empty", "up_h_alone", False),
    ("nano_widths", "up_h_alone", False),
] + [(name, "plain", True) for name in ("ragged_with_empty", "past_m", "one_expert", "narrow_n", "nano_widths")] + [
    (name, "up_h_alone", True) for name in ("ragged_with_empty", "past_m", "nano_widths")] + [
    (name, "plain", "wide") for name in ("ragged_with_empty", "past_m", "one_expert", "narrow_n", "nano_widths")] + [
    (name, "up_h_alone", "wide") for name in ("ragged_with_empty", "one_expert", "nano_widths")] + [
    (name, variant, "wide_halves") for name in ("ragged_with_empty", "past_m", "one_expert", "nano_widths")
    for variant in ("plain", "up_h_alone")] + [("narrow_n", "plain", "wide_halves")] + [
    (name, "plain", "whole") for name in ("ragged_with_empty", "past_m", "one_expert", "narrow_n", "nano_widths")] + [
    ("short_of_m", "plain", "whole"), ("short_of_m", "srelu", "whole"), ("past_m", "srelu", "whole"),
    ("ragged_with_empty", "srelu_bias", "whole")]
SCHEDULE_IDS = {True: "-overlapped", False: "", "wide": "-wide", "wide_halves": "-wide_halves", "whole": "-whole"}


def grouping(name):
    shape, m, sizes = GROUPINGS[name]
    return shape, m, dirichlet_sizes(m, shape[0], seed=11) if sizes is None else sizes


def request_for(shape, variant) -> RaggedMatmulRequest:
    num_experts, k, n = shape
    return RaggedMatmulRequest(num_experts=num_experts, k=k, n=n, rhs_layout="nk", operand_dtype=E4M3,
                               out_dtype=BF16, block_scaled=True, **VARIANTS[variant])


def quantized_operands(rng, m, k, n, num_experts):
    """(lhs, lhs_scale, rhs, rhs_scale) of the recipe, from float32 rows whose magnitudes
    span 2^-6 .. 2^6 (so the scales differ from row to row and block to block), and their
    float64 dequantized values (m, k) and (E, n, k)."""
    rows = rng.standard_normal((m, k)) * np.exp2(rng.uniform(-6, 6, (m, 1)))
    weights = rng.standard_normal((num_experts, n, k)) * np.exp2(rng.uniform(-3, 3, (num_experts, 1, 1))) / np.sqrt(k)
    lhs, lhs_scale = blockwise.quantize_blockwise(jnp.asarray(rows, jnp.float32), FP8_BLOCKWISE.activations)
    rhs, rhs_scale = blockwise.quantize_blockwise(jnp.asarray(weights, jnp.float32), FP8_BLOCKWISE.weights)
    lhs64 = np.asarray(blockwise.dequantize_blockwise(lhs, lhs_scale, FP8_BLOCKWISE.activations), np.float64)
    rhs64 = np.asarray(blockwise.dequantize_blockwise(rhs, rhs_scale, FP8_BLOCKWISE.weights), np.float64)
    return (lhs, lhs_scale, rhs, rhs_scale), (lhs64, rhs64)


def reference(lhs64, rhs64, sizes, bias=None):
    """float64 (acc (+ bias), |lhs| @ |rhs|^T (+ |bias|), owned rows) of the ragged product
    of the dequantized operands; rows owned by no expert are 0."""
    m, n = lhs64.shape[0], rhs64.shape[1]
    ref, abs_dot, owned = np.zeros((m, n)), np.zeros((m, n)), np.zeros(m, bool)
    for e, (start, end) in enumerate(expert_rows(sizes, m)):
        if end > start:
            ref[start:end] = lhs64[start:end] @ rhs64[e].T
            abs_dot[start:end] = np.abs(lhs64[start:end]) @ np.abs(rhs64[e]).T
            owned[start:end] = True
            if bias is not None:
                ref[start:end] += bias[e]
                abs_dot[start:end] += np.abs(bias[e])
    return ref, abs_dot, owned


def fp8_bound(abs_dot, ref, k):
    """Per-entry bound of the kernel's output against the float64 product of the values its
    operands represent: the FP8 accumulation within each K block and the float32 promotion
    across blocks (module constants), then one rounding to bf16 and its subnormal step."""
    blocks = -(-k // BLOCK)
    accumulation = (_FP8_BLOCK_UNIT + (blocks + 1) * _F32_UNIT) * abs_dot
    return accumulation * (1 + _BF16_UNIT) + _BF16_UNIT * np.abs(ref) + _BF16_SUBNORMAL


def check_against(out, ref, abs_dot, k, what="float64"):
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all(), "an output element was not written (NaN poison left)"
    excess = np.abs(got - ref) - fp8_bound(abs_dot, ref, k)
    assert (excess <= 0).all(), f"against {what}: worst excess {excess.max()} at {np.unravel_index(np.argmax(excess), excess.shape)}"


def emulated(operands, sizes, m):
    """The recipe's emulation expert by expert (rows owned by no expert 0), float64. Each
    expert's rows are padded to one row count (zero rows, unit scales), so that one
    compiled emulation serves every expert."""
    lhs, lhs_scale, rhs, rhs_scale = (np.asarray(x) for x in operands)
    bounds = expert_rows(sizes, m)
    rows = max([end - start for start, end in bounds] + [1])
    rows = -(-rows // 256) * 256
    run = jax.jit(lambda a, s, w, t: emulation.blockwise_matmul(a, s, w.T, t.T, FP8_BLOCKWISE))
    out = np.zeros((m, rhs.shape[1]))
    for e, (start, end) in enumerate(bounds):
        if end > start:
            a = np.zeros((rows, lhs.shape[1]), lhs.dtype)
            a[: end - start] = lhs[start:end]
            scale = np.ones((rows, lhs_scale.shape[1]), np.float32)
            scale[: end - start] = lhs_scale[start:end]
            out[start:end] = np.asarray(run(a, scale, rhs[e], rhs_scale[e]), np.float64)[: end - start]
    return out


# ---------------------------------------------------------------------------- CPU: bound


def test_fp8_bound_rejects_wrong_answers():
    (num_experts, k, n), m, sizes = GROUPINGS["ragged_with_empty"]
    rng = np.random.default_rng(0)
    operands, (lhs64, rhs64) = quantized_operands(rng, m, k, n, num_experts)
    ref, abs_dot, _ = reference(lhs64, rhs64, sizes)
    emulation_out = emulated(operands, sizes, m)
    check_against(emulation_out.astype(BF16), ref, abs_dot, k, "the emulation")  # the recipe's own answer passes
    lhs, lhs_scale, rhs, rhs_scale = operands
    wrong_scale = np.array(lhs_scale)
    wrong_scale[701:2201, 1] = wrong_scale[701:2201, 2]  # a scale from the neighbouring block
    doubled = np.array(rhs_scale)
    doubled[4, 1, 3] *= 2  # one weight block's scale off by a factor of two
    last_block_dropped = ref - lhs64[:, 512:] @ rhs64[4, :, 512:].T
    wrong_expert = ref.copy()
    wrong_expert[701:2201] = lhs64[701:2201] @ rhs64[1].T
    unowned_written = ref.copy()
    unowned_written[-1] = 1.0
    for wrong in (
        emulated((lhs, jnp.asarray(wrong_scale), rhs, rhs_scale), sizes, m),
        emulated((lhs, lhs_scale, rhs, jnp.asarray(doubled)), sizes, m),
        last_block_dropped, wrong_expert, unowned_written,
    ):
        with pytest.raises(AssertionError):
            check_against(wrong.astype(BF16), ref, abs_dot, k)


@pytest.mark.parametrize("variant", ["plain", "srelu_bias"])
def test_xla_reference_is_the_float64_product_of_the_represented_values(variant):
    (num_experts, k, n), m, sizes = GROUPINGS["fewer_rows_than_a_group"]
    rng = np.random.default_rng(1)
    (lhs, lhs_scale, rhs, rhs_scale), (lhs64, rhs64) = quantized_operands(rng, m, k, n, num_experts)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    if variant == "plain":
        out = ragged_matmul(lhs, rhs, group_sizes, rhs_layout="nk", out_dtype=BF16, backend="xla",
                            lhs_scale=lhs_scale, rhs_scale=rhs_scale)
        ref, abs_dot, _ = reference(lhs64, rhs64, sizes)
        check_against(out, ref, abs_dot, k)
        return
    prob = rng.uniform(0.05, 1.0, m).astype(np.float32)
    bias = rng.standard_normal((num_experts, n)).astype(np.float32)
    h, act = ragged_matmul_srelu(lhs, rhs, group_sizes, jnp.asarray(prob), jnp.asarray(bias), rhs_layout="nk",
                                 out_dtype=BF16, backend="xla", lhs_scale=lhs_scale, rhs_scale=rhs_scale)
    ref, abs_dot, owned = reference(lhs64, rhs64, sizes, bias)
    check_against(h, ref, abs_dot, k)
    check_activation(h, act, prob, owned)


def check_activation(h, act, prob, owned):
    """act from the stored h: relu, square, times prob in float32, rounded once to bf16."""
    r = np.maximum(np.asarray(h, np.float64), 0.0)
    expected = np.where(owned[:, None], r * r * np.asarray(prob, np.float64)[:, None], 0.0)
    bound = (3 * 2.0**-24 + _BF16_UNIT) * np.abs(expected) + _BF16_SUBNORMAL
    assert (np.abs(np.asarray(act, np.float64) - expected) <= bound).all()


def test_block_scaled_calls_are_refused_by_name():
    lhs = jnp.zeros((4, 128), E4M3)
    scale = jnp.ones((4, 1), jnp.float32)
    rhs_nk = jnp.zeros((2, 128, 128), E4M3)
    rhs_scale = jnp.ones((2, 1, 1), jnp.float32)
    sizes = jnp.asarray([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="rhs_scale"):
        ragged_matmul(lhs, rhs_nk, sizes, rhs_layout="nk", out_dtype=BF16, backend="xla", lhs_scale=scale)
    with pytest.raises(ValueError, match="rhs_layout 'nk', got 'kn'"):
        ragged_matmul(lhs, rhs_nk, sizes, rhs_layout="kn", out_dtype=BF16, backend="xla", lhs_scale=scale,
                      rhs_scale=rhs_scale)
    with pytest.raises(ValueError, match="lhs_index must be None"):
        ragged_matmul(lhs, rhs_nk, sizes, rhs_layout="nk", out_dtype=BF16, backend="xla", lhs_scale=scale,
                      rhs_scale=rhs_scale, lhs_index=jnp.arange(4, dtype=jnp.int32))


def test_sm90_refuses_what_the_fp8_kernel_cannot_take():
    from jax_dsrelu.kernels.sm90 import backend, config

    request = request_for((8, 528, 320), "plain")
    assert backend.cannot_implement(request) is None
    for changed, expected in (
        (dict(k=520), "multiple of 16 (16-byte TMA rows), got k=520"),
        (dict(rhs_layout="kn"), "rhs_layout 'nk', got 'kn'"),
        (dict(operand_dtype=BF16), "float8_e4m3fn, got bfloat16"),
        (dict(out_dtype=np.dtype(np.float32)), "got out_dtype=float32"),
        (dict(num_experts=513), "1 to 512 experts, got E=513"),
    ):
        assert expected in config.cannot_implement_gemm(dataclasses.replace(request, **changed))


# ------------------------------------------------------------------------- compile tier


def config_for(request, schedule):
    """The chosen config with the promotion schedule named (whichever the rules choose):
    True or False (`overlap_promotion`) over 128-column tiles, or "wide" or "wide_halves"
    (`GPU_CASES`) over 192; "whole", the chosen config storing whole tiles; its stages
    as many as fit."""
    from jax_dsrelu.kernels.sm90 import config, ragged_call
    from jax_dsrelu.kernels.sm90.config import WIDE_TILE_N

    chosen = ragged_call.choose_config(request)
    if schedule == "whole":
        whole = dataclasses.replace(chosen, whole_tile_store=True, store_stages=chosen.subtiles)
        return config.with_most_gemm_stages(whole, request)
    wide = schedule in ("wide", "wide_halves")
    # True or False: the 128-column tiles (64 below n = 128), whichever width the rules take; each
    # through the ring of store buffers, whichever store the rules take.
    tile_n = WIDE_TILE_N if wide else config.fp8_tile_n(request.n)
    named = dataclasses.replace(chosen, tile_n=tile_n, overlap_promotion=schedule == "wide_halves" if wide else schedule,
                                whole_tile_store=False, store_stages=2)
    return config.with_most_gemm_stages(named, request)


def prebuild_requests():
    """Every (request, config or None for the chosen one, outputs_in_place) the GPU tier
    below runs through `ragged_call`, and the FP8 contraction's tiers
    (tests/test_sm90_fp8_contract.py, tests/test_sm90_fp8_quantize.py), for the kernel cache."""
    import test_sm90_fp8_contract
    import test_sm90_fp8_quantize

    built = {(request_for(GROUPINGS[name][0], variant), overlap) for name, variant, overlap in GPU_CASES}
    ours = [(request, config_for(request, overlap), True) for request, overlap in sorted(built, key=repr)]
    return ours + test_sm90_fp8_contract.prebuild_requests() + test_sm90_fp8_quantize.prebuild_contract_requests()


def prebuild_fused_requests():
    """The fused kernel's (request, config) of every case of its GPU tier, for the cache."""
    built = {(dsrelu_request(DSRELU_GROUPINGS[name][0], deterministic), overlap)
             for name, deterministic, overlap in DSRELU_GPU_CASES}
    built |= {(dsrelu_request(DSRELU_GROUPINGS[name][0], deterministic, BF16), False)
              for name in DSRELU_BF16_GROUPINGS for deterministic in (False, True)}
    return [(request, fused_config(request, overlap)) for request, overlap in sorted(built, key=repr)]


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 4096, 2048), (128, 2688, 1856), (512, 1856, 2688), (4, 384, 64)], ids=str)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_fp8_matmul_compiles_for_sm90a(variant, shape):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import ragged_call

    compiled = ragged_call.compile_kernel(request_for(shape, variant), keep=True)
    assert "wgmma.mma_async.sync.aligned.m64n" in compiled.ptx and ".f32.e4m3.e4m3" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 4096, 2048), (128, 1856, 2688), (4, 384, 64)], ids=str)
@pytest.mark.parametrize("variant", ["plain", "up_h_alone"])
def test_fp8_matmul_with_the_promotion_overlapped_compiles_for_sm90a(variant, shape):
    """No spills: the up-projection's bias loaded subtile by subtile, not held from before
    the mainloop beside the two partial sums."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import ragged_call

    request = request_for(shape, variant)
    compiled = ragged_call.compile_kernel(request, config_for(request, True), keep=True)
    assert compiled.ptx.count("wgmma.commit_group") == -(-shape[1] // BLOCK)  # the k-tiles unrolled
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("variant", ["plain", "up_h_alone"])
def test_fp8_matmul_in_pairs_compiles_for_sm90a(variant):
    """The configuration decision `fp8_gemm_pairs` would take (timed on an H100 in
    bench_fp8_gemms): two CTAs along N, A multicast to both, no spills."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import ragged_call

    request = request_for((8, 4096, 2048), variant)
    compiled = ragged_call.compile_kernel(request, dataclasses.replace(config_for(request, True), cluster_n=2), keep=True)
    assert "multicast::cluster" in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("schedule", ["wide", "wide_halves"])
@pytest.mark.parametrize("variant", ["plain", "up_h_alone"])
def test_fp8_matmul_with_wide_tiles_compiles_for_sm90a(variant, schedule):
    """N tiles of 192 columns (`config.WIDE_TILE_N`): one wgmma of n = 192 a k-block
    (between the batches) or two of n = 96 (in column halves, the k-tiles unrolled), the
    bias loaded subtile by subtile, no spills beside the partial sums."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import ragged_call

    request = request_for((8, 4096, 2048), variant)
    compiled = ragged_call.compile_kernel(request, config_for(request, schedule), keep=True)
    n = 192 if schedule == "wide" else 96
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k32\.f32\.e4m3\.e4m3", compiled.ptx)
    if schedule == "wide_halves":
        assert compiled.ptx.count("wgmma.commit_group") == 2 * (4096 // BLOCK)
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("variant", ["plain", "srelu_bias"])
def test_fp8_matmul_storing_whole_tiles_compiles_for_sm90a(variant):
    """A buffer per subtile, each tile stored as one bulk group: two epilogue barriers a
    tile (each subtile of the ring takes two), no spills, no serialized wgmma. (The
    up-projection storing h alone over 192 columns in halves spilled 128 bytes so.)"""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import ragged_call
    from jax_dsrelu.kernels.sm90.barriers import NamedBarrier

    request = request_for((8, 4096, 2048), variant)
    config = config_for(request, "whole")
    assert config.whole_tile_store and config.store_stages == config.subtiles > 2
    compiled = ragged_call.compile_kernel(request, config, keep=True)
    barrier = re.compile(rf"bar\.sync\s+{int(NamedBarrier.EPILOGUE)},")
    ring = ragged_call.compile_kernel(request, config_for(request, config.overlap_promotion), keep=True)
    # The tile's two and the rows of no expert's two (stored as whole tiles too), against two a subtile.
    assert len(barrier.findall(compiled.ptx)) == 4 < len(barrier.findall(ring.ptx))
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


def test_a_whole_tile_store_takes_a_buffer_per_subtile():
    from jax_dsrelu.kernels.sm90 import ragged_call

    chosen = ragged_call.choose_config(request_for((8, 4096, 2048), "plain"))
    with pytest.raises(ValueError, match="store_stages must be the tile's 4 subtiles, got 2"):
        dataclasses.replace(chosen, tile_n=128, store_stages=2, whole_tile_store=True)


def test_a_wide_tiles_values_take_their_columns_scale_block_in_either_schedule():
    """In a tile of 192 columns, value v of the waited form's fragment (96 values a
    thread) and value v of column half h in halves of 96 (48 values, the total's value
    v + 48 h) lie at the same column, so `fragment.segment` gives both the 64-column
    segment, whose weight block (the first, the middle's choice, the second) is the
    column's own: a segment never straddles two blocks at either start of a tile."""
    from jax_dsrelu.kernels.sm90 import fragment

    for value in range(96):
        column = 8 * (value // 4)  # of lane 0; other lanes add 2 (lane % 4) + c < 8
        assert fragment.segment(value) == column // 64
        half, in_half = divmod(value, 48)
        assert fragment.segment(in_half, half * 96) == fragment.segment(value)
        for tile_start in (0, 192):  # on a block's edge, and half way through one
            block_of = [(tile_start + s * 64) // BLOCK for s in range(3)]
            for lane_offset in range(8):
                assert (tile_start + column + lane_offset) // BLOCK == block_of[fragment.segment(value)]
    assert fragment.segment(47, 0) == 1 and fragment.segment(0, 96) == 1 and fragment.segment(16, 96) == 2


def test_wide_tiles_are_refused_where_they_do_not_fit():
    """192 columns only for a kernel with the wide promotion, in column halves only without
    act beside h; no other width past 128."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import block_scaled

    request = request_for((8, 528, 320), "plain")
    wide = config_for(request, "wide")
    for accepted in (wide, config_for(request, "wide_halves")):
        block_scaled.check_block_scaled("k", accepted, request, "block_scaled", wide_tiles=True)
    for config, wide_tiles in ((wide, False), (dataclasses.replace(wide, tile_n=256), True)):
        with pytest.raises(ValueError, match="tile_n=(192|256)"):
            block_scaled.check_block_scaled("k", config, request, "block_scaled", wide_tiles=wide_tiles)
    # In column halves beside act, which spills.
    from jax_dsrelu.kernels.sm90.blockwise_matmul_kernel import BlockScaledRaggedGemmSm90

    with_act = request_for((8, 528, 320), "srelu")
    with pytest.raises(ValueError, match="with_act=True"):
        BlockScaledRaggedGemmSm90(config_for(with_act, "wide_halves"), with_act)


@pytest.mark.compile
def test_fp8_matmul_lowers_for_cuda():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

    (num_experts, k, n), m, _ = GROUPINGS["ragged_with_empty"]
    shapes = (jax.ShapeDtypeStruct((m, k), E4M3), jax.ShapeDtypeStruct((num_experts, n, k), E4M3),
              jax.ShapeDtypeStruct((num_experts,), jnp.int32), jax.ShapeDtypeStruct((m, 5), jnp.float32),
              jax.ShapeDtypeStruct((num_experts, 3, 5), jnp.float32))

    def call(lhs, rhs, sizes, lhs_scale, rhs_scale):
        return ragged_matmul(lhs, rhs, sizes, rhs_layout="nk", out_dtype=BF16, backend="sm90", lhs_scale=lhs_scale,
                             rhs_scale=rhs_scale)

    text = jax.jit(call).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "CuteDSLRT_NvJaxCutlassCall" in text or "cutlass" in text.lower()


@pytest.mark.compile
def test_moe_mlp_in_fp8_runs_every_gemm_on_the_fp8_kernels():
    """The layer's precision path under backend="auto", lowered for a Hopper GPU: its up
    (h alone), down, dx, fused dsReLU, dW1 and dW2 GEMMs are the FP8 kernels' custom calls, dW1's and
    dW2's operands quantized straight into their K-major copies by the quantizing pass, and
    the weights quantized by their pass (w1 and w2 in the forward and again in the
    backward, which XLA's CSE merges when it compiles), and the GEMMs' rows (x, act, dy,
    dh) by the rows' pass; the fused kernel's dh and act in bf16."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from unittest import mock

    import jax_dsrelu
    from jax_dsrelu.kernels import registry
    from jax_dsrelu.kernels.sm90 import backend

    m, d, f, num_experts = 512, 256, 384, 4
    s = jax.ShapeDtypeStruct
    shapes = (s((m, d), BF16), s((num_experts, d, f), BF16), s((num_experts, f, d), BF16), s((m,), jnp.float32),
              s((num_experts,), jnp.int32))

    def loss(x, w1, w2, prob, sizes):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, sizes, precision=FP8_BLOCKWISE)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def lowered():
        grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        # Every unverified kind, whatever the environment names.
        with (backend.unverified_enabled(),
              mock.patch.object(registry, "cuda_compute_capability", lambda: (9, 0))):
            return grad.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

    def kernel_calls(text):
        """(GEMMs, K-major quantizing passes, weight passes, row quantizing passes) by the
        kernel's name in the object code each call carries."""
        calls = [line for line in text.splitlines() if "custom_call @CuteDSLRT" in line]
        named = [[line for line in calls if any(n in line for n in names)] for names in
                 (("BlockScaledRaggedGemm", "BlockScaledDsrelu", "BlockScaledContract"), ("KMajorQuantize",),
                  ("BlockQuantizeSm90",), ("RowQuantizeSm90",))]
        assert sum(map(len, named)) == len(calls), calls
        return tuple(map(len, named))

    text = lowered()
    assert kernel_calls(text) == (6, 4, 4, 4)
    # The up-projection stores h alone: act is formed and quantized where the down GEMM reads it.
    results = [line.split("->")[-1] for line in text.splitlines()
               if "custom_call @CuteDSLRT" in line and "BlockScaledRaggedGemm" in line]
    assert sorted(r.count("tensor<") for r in results) == [1, 1, 1]
    assert sum(f"tensor<{m}x{f}xbf16>" in r for r in results) == 1
    # The fused kernel stores dh and act in the caller's dtype, not float32.
    fused = [line.split("->")[-1] for line in text.splitlines()
             if "custom_call @CuteDSLRT" in line and "BlockScaledDsrelu" in line]
    assert len(fused) == 1 and fused[0].count(f"tensor<{m}x{f}xbf16>") == 2 and f"x{f}xf32>" not in fused[0]


# ---------------------------------------------------------------------------- GPU tier


def run_poisoned(request, named, m, config=None):
    """The kernel (of `config`, or the chosen one) with every output buffer NaN-filled
    first; its results by name."""
    from jax_dsrelu.kernels.sm90 import ragged_call

    run = ragged_call.implementation(request, config, outputs_in_place=True)
    filled = {o.name: jnp.full(o.shape_for(m), jnp.nan, o.dtype)
              for o in ragged_call.operands(request, config) if o.role == "output"}
    return jax.jit(lambda o: run(**o, filled=filled))(named)


@pytest.mark.gpu
@pytest.mark.parametrize("name, variant, overlap", GPU_CASES,
                         ids=[f"{n}-{v}{SCHEDULE_IDS[o]}" for n, v, o in GPU_CASES])
def test_fp8_matmul_matches_float64_and_the_emulation(hopper, name, variant, overlap):
    (num_experts, k, n), m, sizes = grouping(name)
    rng = np.random.default_rng(zlib.crc32(f"{name}{variant}".encode()))
    operands, (lhs64, rhs64) = quantized_operands(rng, m, k, n, num_experts)
    lhs, lhs_scale, rhs, rhs_scale = operands
    request = request_for((num_experts, k, n), variant)
    named = dict(lhs=lhs, rhs=rhs, group_sizes=jnp.asarray(sizes, jnp.int32), lhs_scale=lhs_scale,
                 rhs_scale=rhs_scale)
    bias = None
    if request.epilogue == "srelu":
        prob = rng.uniform(0.05, 1.0, m).astype(np.float32)
        named["prob"] = jnp.asarray(prob)
        if request.with_bias:
            bias = rng.standard_normal((num_experts, n)).astype(np.float32)
            named["bias"] = jnp.asarray(bias)
    config = config_for(request, overlap)
    results = run_poisoned(request, named, m, config)
    ref, abs_dot, owned = reference(lhs64, rhs64, sizes, bias)
    out = results["out" if request.epilogue == "none" else "h"]
    check_against(out, ref, abs_dot, k)
    if request.epilogue == "none":
        check_against(out, emulated(operands, sizes, m), abs_dot, k, "the emulation")
    elif request.with_act:
        check_activation(out, results["act"], named["prob"], owned)
    else:  # h alone: bit for bit the h stored beside act (whose kernel promotes between the batches, 128 wide)
        assert set(results) == {"h"}
        beside_act = dataclasses.replace(request, with_act=True)
        h = run_poisoned(beside_act, named, m, config_for(beside_act, False))["h"]
        assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(h).view(np.uint16))
    assert (np.asarray(out, np.float64)[~owned] == 0).all()
    again = run_poisoned(request, named, m, config)
    for key in results:
        assert np.array_equal(np.asarray(results[key]).view(np.uint16), np.asarray(again[key]).view(np.uint16)), key


# ------------------------------------------------------------ the fused dsReLU kernel

# name: ((E, n, k), m, group sizes): n = f, k = d of the layer (dy w2^T).
DSRELU_GROUPINGS = {
    "ragged_with_empty": ((8, 320, 528), 4096, [0, 700, 1, 0, 1500, 129, 1766, 0]),
    "short_of_m": ((8, 320, 528), 3000, [500, 0, 1200, 3, 0, 0, 0, 0]),
    "past_m": ((8, 320, 528), 2000, [900, 800, 700, 0, 0, 0, 0, 5]),
    "nano_widths": ((16, 1856, 2688), 5000, None),
}
# The groupings the kernel storing bf16 dh and act (as the FP8 step runs it) is held to the
# float32 one's values rounded once.
DSRELU_BF16_GROUPINGS = ("ragged_with_empty", "nano_widths")
# (name, deterministic, overlap_promotion): the promotion by column halves too
# (`promoted_mainloop.mma_k_tiles_promoted_in_halves`) and waited.
DSRELU_GPU_CASES = [(name, deterministic, False) for name in DSRELU_GROUPINGS for deterministic in (False, True)] + [
    (name, deterministic, True) for name in ("ragged_with_empty", "nano_widths") for deterministic in (False, True)]


def fused_config(request, overlap_promotion: bool):
    """The chosen config with the promotion by column halves or waited, whatever the
    tuning table decides."""
    from jax_dsrelu.kernels.sm90 import config

    return dataclasses.replace(config.choose_config(request), overlap_promotion=overlap_promotion)


def dsrelu_request(shape, deterministic, out_dtype=np.dtype(np.float32)):
    from jax_dsrelu.kernels.request import Request

    num_experts, n, k = shape
    return Request(num_experts=num_experts, n=n, k=k, operand_dtype=E4M3, preact_dtype=BF16,
                   prob_dtype=np.dtype(np.float32), out_dtype=out_dtype, with_dbias=True, with_act=True,
                   deterministic=deterministic, blockwise_scaled=True)


def dsrelu_case(name):
    (num_experts, n, k), m, sizes = DSRELU_GROUPINGS[name]
    if sizes is None:
        sizes = dirichlet_sizes(m, num_experts, seed=12)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    operands, (grad64, weight64) = quantized_operands(rng, m, k, n, num_experts)
    preact = jnp.asarray(rng.standard_normal((m, n)), BF16)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32)
    return (num_experts, n, k), m, sizes, operands, (grad64, weight64), preact, prob


def fused(operands, preact, prob, sizes, *, deterministic, backend):
    from jax_dsrelu.primitives import dsrelu

    grad, grad_scale, weight, weight_scale = operands
    return dsrelu.bind(grad=grad, grad_block_scale=grad_scale, weight=weight, weight_block_scale=weight_scale,
                       preact=preact, prob=prob, group_sizes=jnp.asarray(sizes, jnp.int32),
                       alpha=jnp.ones((weight.shape[0],), jnp.float32), with_dbias=True, with_act=True,
                       out_dtype=jnp.float32, deterministic=deterministic, backend=backend)


def check_fused(results, grad64, weight64, preact, prob, sizes, k):
    """dh, act, dprob, dbias against float64 of the represented values: the FP8 GEMM's
    bound carried through the epilogue (dh = 2 acc r p, dprob = sum r^2 acc), float32
    epilogue arithmetic (a few roundings of 2^-24) and sums over n (gamma(n) of |terms|)."""
    acc, abs_dot, owned = reference(grad64, weight64, sizes)
    got_dh = np.asarray(results["dh"], np.float64)
    assert (got_dh[~owned] == 0).all() and (np.asarray(results["dprob"])[~owned] == 0).all(), "rows of no expert"
    r = np.maximum(np.asarray(preact, np.float64), 0.0)
    p = np.asarray(prob, np.float64)[:, None]
    acc_bound = fp8_bound(abs_dot, acc, k) - _BF16_UNIT * np.abs(acc) - _BF16_SUBNORMAL  # no bf16 rounding here
    dh = np.where(owned[:, None], 2 * acc * r * p, 0.0)
    dh_bound = 2 * r * p * acc_bound + 2.0**-21 * np.abs(dh) + 1e-30
    got = {name: np.asarray(value, np.float64) for name, value in results.items() if value is not None}
    assert np.isfinite(got["dh"]).all() and np.isfinite(got["act"]).all()
    assert (np.abs(got["dh"] - dh) <= dh_bound).all(), "dh"
    act = np.where(owned[:, None], r * r * p, 0.0)
    assert (np.abs(got["act"] - act) <= 2.0**-21 * act + 1e-30).all(), "act"
    n = acc.shape[1]
    terms = r * r * np.abs(acc)
    dprob = np.where(owned, np.sum(r * r * acc, axis=1), 0.0)
    dprob_bound = np.sum(r * r * acc_bound, axis=1) + (n + 4) * 2.0**-23 * np.sum(terms, axis=1) + 1e-30
    assert (np.abs(got["dprob"] - dprob) <= dprob_bound).all(), "dprob"
    bounds = expert_rows(sizes, len(owned))
    for e, (start, end) in enumerate(bounds):
        column = dh[start:end].sum(axis=0)
        column_bound = dh_bound[start:end].sum(axis=0) + (end - start + 4) * 2.0**-23 * np.abs(dh[start:end]).sum(axis=0)
        assert (np.abs(got["dbias"][e] - column) <= column_bound + 1e-30).all(), f"dbias of expert {e}"


def test_fused_xla_reference_is_the_float64_of_the_represented_values():
    (num_experts, n, k), m, sizes, operands, (grad64, weight64), preact, prob = dsrelu_case("ragged_with_empty")
    results = fused(operands, preact, prob, sizes, deterministic=True, backend="xla")
    check_fused(results, grad64, weight64, preact, prob, sizes, k)
    # Not vacuous: a weight block's scale off by two fails it.
    grad, grad_scale, weight, weight_scale = operands
    doubled = jnp.asarray(weight_scale).at[4, 1, 2].multiply(2.0)
    wrong = fused((grad, grad_scale, weight, doubled), preact, prob, sizes, deterministic=True, backend="xla")
    with pytest.raises(AssertionError):
        check_fused(wrong, grad64, weight64, preact, prob, sizes, k)


def test_fused_scaled_operands_are_refused_where_they_cannot_run():
    from jax_dsrelu.kernels.sm90 import backend, config

    request = dsrelu_request((8, 320, 528), False)
    assert backend.cannot_implement(request) is None
    import dataclasses as dc

    assert "multiple of 16" in config.cannot_implement(dc.replace(request, k=520))
    assert "float8_e4m3fn, got bfloat16" in config.cannot_implement(dc.replace(request, operand_dtype=BF16))
    (_, n, k), m, sizes, operands, _, preact, prob = dsrelu_case("ragged_with_empty")
    from jax_dsrelu.primitives import dsrelu

    grad, grad_scale, weight, weight_scale = operands
    with pytest.raises(NotImplementedError, match="grad_index cannot be combined with scaled operands"):
        dsrelu.bind(grad=grad, grad_block_scale=grad_scale, weight=weight, weight_block_scale=weight_scale,
                    preact=preact, prob=prob, group_sizes=jnp.asarray(sizes, jnp.int32),
                    alpha=jnp.ones((8,), jnp.float32), grad_index=jnp.arange(m, dtype=jnp.int32), with_dbias=True,
                    with_act=True, out_dtype=jnp.float32, deterministic=False, backend="xla")


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 2048, 4096), (128, 1856, 2688), (512, 768, 2048), (4, 64, 384)], ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_fp8_fused_kernel_compiles_for_sm90a(shape, deterministic):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import config, dsrelu_call

    request = dsrelu_request(shape, deterministic)
    compiled = dsrelu_call.compile_kernel(request, config.choose_config(request), keep=True)
    assert ".f32.e4m3.e4m3" in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 2048, 4096), (128, 1856, 2688)], ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_fp8_fused_kernel_storing_bf16_compiles_for_sm90a(shape, deterministic):
    """dh and act stored in bf16, as the FP8 step stores them: stmatrix, no spills."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import config, dsrelu_call

    request = dsrelu_request(shape, deterministic, BF16)
    compiled = dsrelu_call.compile_kernel(request, config.choose_config(request), keep=True)
    assert ".f32.e4m3.e4m3" in compiled.ptx and "stmatrix" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 2048, 4096), (128, 1856, 2688), (4, 64, 384)], ids=str)
@pytest.mark.parametrize("deterministic", [False, True])
def test_fp8_fused_kernel_with_the_promotion_overlapped_compiles_for_sm90a(shape, deterministic):
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    import ptxas

    from jax_dsrelu.kernels.sm90 import dsrelu_call

    request = dsrelu_request(shape, deterministic)
    compiled = dsrelu_call.compile_kernel(request, fused_config(request, True), keep=True)
    half_n = fused_config(request, True).tile_n // 2
    assert f".m64n{half_n}k32.f32.e4m3.e4m3" in compiled.ptx
    # The k-tiles unrolled, two batches each, and a promotion beside every batch but the last.
    assert compiled.ptx.count("wgmma.commit_group") == 2 * -(-shape[2] // BLOCK)
    assert "wgmma.wait_group.sync.aligned \t1;" in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


def test_the_fused_kernels_rules_keep_128_columns_whichever_promotion_the_table_picks(decide):
    from jax_dsrelu.kernels.sm90 import config

    request = dsrelu_request((128, 1856, 2688), False)
    for overlapped in (False, True):
        decide("fp8_fused_overlap_promotion", overlapped)
        chosen = config.choose_config(request)
        assert (chosen.tile_n, chosen.overlap_promotion) == (128, overlapped)


def test_the_fused_kernels_preact_ring_follows_the_table(decide):
    """2 preact stages make room for one more operand stage where the table says so
    (`fp8_fused_fewer_preact`): 5 beside bf16 dh and act, where 4 preact stages leave 4,
    and 4 beside float32 ones, where they leave 3."""
    from jax_dsrelu.kernels.sm90 import config

    for fewer, bf16_stages, float32_stages in ((True, (5, 2), (4, 2)), (False, (4, 4), (3, 4))):
        decide("fp8_fused_fewer_preact", fewer)
        for shape in ((128, 1856, 2688), (8, 2048, 4096)):  # the A/B's two shapes
            for out_dtype, stages in ((BF16, bf16_stages), (np.dtype(np.float32), float32_stages)):
                chosen = config.choose_config(dsrelu_request(shape, False, out_dtype))
                assert (chosen.ab_stages, chosen.preact_stages) == stages, (fewer, shape, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name, deterministic, overlap", DSRELU_GPU_CASES,
                         ids=[f"{n}-{d}" + ("-overlapped" if o else "") for n, d, o in DSRELU_GPU_CASES])
def test_fp8_fused_kernel_matches_float64(hopper, name, deterministic, overlap):
    from jax_dsrelu.kernels.sm90 import dsrelu_call

    (num_experts, n, k), m, sizes, operands, (grad64, weight64), preact, prob = dsrelu_case(name)
    request = dsrelu_request((num_experts, n, k), deterministic)
    grad, grad_scale, weight, weight_scale = operands
    named = dict(grad=grad, grad_block_scale=grad_scale, weight=weight, weight_block_scale=weight_scale,
                 preact=preact, prob=prob, group_sizes=jnp.asarray(sizes, jnp.int32),
                 alpha=jnp.ones((num_experts,), jnp.float32))
    # Every output the kernel writes whole NaN-filled first (the accumulated ones start at 0).
    config = fused_config(request, overlap)
    run = dsrelu_call.implementation(request, config, outputs_in_place=True)
    filled = {o.name: jnp.full(o.shape_for(m), jnp.nan, o.dtype)
              for o in dsrelu_call.operands(request, config) if o.role == "output"}
    call = jax.jit(lambda o: run(**o, filled=filled))
    results, again = call(named), call(named)
    check_fused(results, grad64, weight64, preact, prob, sizes, k)
    # amax is the largest |dh| of each expert's rows, as the kernel stored them (0 when empty).
    dh = np.abs(np.asarray(results["dh"], np.float64))
    for e, (start, end) in enumerate(expert_rows(sizes, m)):
        assert float(results["amax"][e]) == (dh[start:end].max() if end > start else 0.0), f"amax of expert {e}"
    if deterministic:
        for key in ("dh", "act", "dprob", "dbias", "amax"):
            assert np.array_equal(np.asarray(results[key]), np.asarray(again[key])), key


@pytest.mark.gpu
@pytest.mark.parametrize("name", DSRELU_BF16_GROUPINGS)
@pytest.mark.parametrize("deterministic", [False, True])
def test_fp8_fused_kernel_storing_bf16_rounds_the_float32_values_once(hopper, name, deterministic):
    """dh and act stored in bf16 are the float32 kernel's (held to float64 above) rounded
    once; amax, and in deterministic mode dprob and dbias, are the float32 kernel's, bit
    for bit: the epilogue computes in float32 either way; in atomic mode dprob and dbias
    are within float32's error of summing their terms in another order. Outputs
    NaN-filled first."""
    from jax_dsrelu.kernels.sm90 import config, dsrelu_call

    (num_experts, n, k), m, sizes, operands, (grad64, weight64), preact, prob = dsrelu_case(name)
    grad, grad_scale, weight, weight_scale = operands
    named = dict(grad=grad, grad_block_scale=grad_scale, weight=weight, weight_block_scale=weight_scale,
                 preact=preact, prob=prob, group_sizes=jnp.asarray(sizes, jnp.int32),
                 alpha=jnp.ones((num_experts,), jnp.float32))
    results = {}
    for out_dtype in (np.dtype(np.float32), BF16):
        request = dsrelu_request((num_experts, n, k), deterministic, out_dtype)
        chosen = config.choose_config(request)
        run = dsrelu_call.implementation(request, chosen, outputs_in_place=True)
        filled = {o.name: jnp.full(o.shape_for(m), jnp.nan, o.dtype)
                  for o in dsrelu_call.operands(request, chosen) if o.role == "output"}
        results[out_dtype] = jax.jit(lambda o: run(**o, filled=filled))(named)
    wide, narrow = results[np.dtype(np.float32)], results[BF16]
    for key in ("dh", "act"):
        assert narrow[key].dtype == BF16
        np.testing.assert_array_equal(np.asarray(narrow[key]), np.asarray(wide[key].astype(BF16)), key)
    for key in ("amax",) + (("dprob", "dbias") if deterministic else ()):
        np.testing.assert_array_equal(np.asarray(narrow[key]), np.asarray(wide[key]), key)
    if not deterministic:
        # The same float32 partials added by atomics in another order: within twice float32's
        # error of summing the terms (|r^2 acc| over a row for dprob, |dh| over an expert's rows
        # for dbias), which a bf16-rounded dh (2^-8) would exceed.
        acc, _, owned = reference(grad64, weight64, sizes)
        r = np.maximum(np.asarray(preact, np.float64), 0.0)
        p = np.asarray(prob, np.float64)[:, None]
        gap = lambda key: np.abs(np.asarray(narrow[key], np.float64) - np.asarray(wide[key], np.float64))  # noqa: E731
        assert (gap("dprob") <= 2 * (n + 4) * 2.0**-23 * np.sum(r * r * np.abs(acc), axis=1) + 1e-30).all(), "dprob"
        dh_terms = np.where(owned[:, None], 2 * np.abs(acc) * r * p, 0.0)
        for e, (start, end) in enumerate(expert_rows(sizes, m)):
            bound = 2 * (end - start + 4) * 2.0**-23 * dh_terms[start:end].sum(axis=0) + 1e-30
            assert (gap("dbias")[e] <= bound).all(), f"dbias of expert {e}"


@pytest.mark.compile
@pytest.mark.parametrize("kernel, shape", [
    ("plain", (8, 4096, 2048)), ("srelu_bias", (128, 2688, 1856)), ("srelu_bias", (512, 2688, 1856)),
    ("fused", (128, 1856, 2688)), ("fused", (512, 768, 2048)), ("fused_bf16", (128, 1856, 2688)),
], ids=str)
def test_fp8_shared_memory_estimate_is_the_kernels_struct(kernel, shape, monkeypatch):
    """The estimate that picks the FP8 kernels' operand stages (1-byte operands, the fused
    kernel's float32 or, as the FP8 step stores them, bf16 outputs) is the shared-memory
    struct each allocates."""
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import config, dsrelu_call, ragged_call

    fused = kernel.startswith("fused")
    module = dsrelu_call if fused else ragged_call
    built, make = [], module._kernel
    monkeypatch.setattr(module, "_kernel", lambda *key: built.append(make(*key)) or built[-1])
    if fused:
        out_dtype = BF16 if kernel == "fused_bf16" else np.dtype(np.float32)
        request = dsrelu_request(shape, deterministic=True, out_dtype=out_dtype)
        chosen = config.choose_config(request)
        dsrelu_call.compile_kernel(request, chosen, keep=True)
        estimate = chosen.smem_bytes(request.num_experts, True, True, out_dtype.itemsize)
    else:
        request = request_for(shape, kernel)
        chosen = ragged_call.choose_config(request)
        ragged_call.compile_kernel(request, chosen, keep=True)
        estimate = chosen.request_bytes(request)
    assert built[-1].shared_storage.size_in_bytes() == estimate <= config.SMEM_CAPACITY


@pytest.mark.compile
def test_a_config_counting_other_operand_bytes_is_refused():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    from jax_dsrelu.kernels.sm90 import config
    from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90

    bf16_request = dataclasses.replace(request_for((8, 528, 320), "plain"), operand_dtype=BF16, block_scaled=False)
    fp8_counted = config.GemmConfig(tile_n=128, tile_k=64, ab_stages=6, epi_n=32, store_stages=2, max_ctas=132,
                                    operand_bytes=1)
    with pytest.raises(ValueError, match="config.operand_bytes must be 2 for bfloat16 operands, got 1"):
        RaggedGemmSm90(fp8_counted, bf16_request)
