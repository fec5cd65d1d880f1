"""The sm90 grouped-GEMM family: compile-only checks (CPU, CI) and correctness on a Hopper GPU.

Kernels: the ragged-M GEMM (`kernels/sm90/ragged_matmul_kernel.py`: rhs stored (E, k, n) or
(E, n, k), plain or squared-ReLU epilogue, with or without bias) and the ragged
contraction (`kernels/sm90/ragged_contract_kernel.py`: per-expert lhs^T rhs, float32 or 16-bit
out), reached through the backend protocol exactly as the primitives reach them.

Compile tier (marked `compile`, no GPU): every variant compiles for sm_90a into wgmma code
with no local-memory spills and no atomics; refusals name the value.

GPU tier (marked `gpu`): against an independent float64 NumPy computation, with ragged,
empty, negative and past-m group sizes, m from 0 to 64k, every output buffer NaN-filled
before the kernel runs; the contraction bitwise identical over 20 runs. Tolerances come
from the arithmetic (see `matmul_bound`) and are shown to reject wrong answers.
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
import ptxas  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

from jax_dsrelu.kernels import registry as backend_choice  # noqa: E402
from jax_dsrelu.kernels.sm90 import ragged_call as sm90_gemm  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest  # noqa: E402

BF16 = np.dtype(jnp.bfloat16)
FP16 = np.dtype(jnp.float16)
F32 = np.dtype(np.float32)

# An atomic or reduction instruction in PTX, predicated or not.
ATOMIC = re.compile(r"^\s*(@!?%p\d+\s+)?(atom|red)\.", re.M)

# Variants of the ragged-M GEMM the MoE layer uses: (rhs_layout, epilogue, with_bias).
MATMUL_VARIANTS = {
    "down_kn": ("kn", "none", False),  # y = act @ W2[e]
    "dx_nk": ("nk", "none", False),  # dx = dh @ W1[e]^T, W1 read in place
    "up_srelu": ("kn", "srelu", False),  # h, act = up-projection and its activation
    "up_srelu_bias": ("kn", "srelu", True),
}

# Shapes (E, k, n) share one compiled kernel per variant; the group sizes vary freely.
SMALL = (8, 520, 320)
GROUPINGS = {
    # name: (shape, m, group sizes)
    "ragged_with_empty": (SMALL, 4096, [0, 700, 1, 0, 1500, 129, 1766, 0]),
    "short_of_m": (SMALL, 3000, [500, 0, 1200, 3, 0, 0, 0, 0]),
    "past_m": (SMALL, 2000, [900, 800, 700, 0, 0, 0, 0, 5]),
    "negative": (SMALL, 2500, [-5, 1000, -1, 1300, 7, 0, 0, 0]),
    "all_empty": (SMALL, 700, [0] * 8),
    "one_row": (SMALL, 1, [1, 0, 0, 0, 0, 0, 0, 0]),
    "exact_tile": (SMALL, 700, [128, 0, 256, 1, 127, 128, 0, 60]),
    "no_rows": (SMALL, 0, [0] * 8),
    "tile_n_256": ((8, 1024, 2048), 16384, [3000, 0, 2500, 128, 4000, 1, 3755, 3000]),
    "rows_64k": ((32, 256, 512), 65536, None),  # Dirichlet-sized experts
    # Fine-grained: many short experts, widths that are no tile multiple (a = 200 over
    # 128-row tiles, b = 328 over 192-column tiles): each persistent CTA walks many tiles.
    "many_experts": ((160, 200, 328), 24000, None),
    # The most experts the kernels take: the contraction ranks 512 with 384 threads.
    "experts_512": ((512, 200, 328), 24000, None),
    # Nemotron-3 Nano's expert width as n and b (9 x 192 + 128 columns) over k = a = 768.
    "width_1856": ((16, 768, 1856), 6000, None),
    # A multiple of 768, where 192- and 256-wide tiles pad alike: at 512 experts the
    # up-projection takes 8 tiles of 192 (256-wide ones would get 3 operand stages), the
    # plain GEMMs and the contraction 6 of 256 (1536 rather than the benchmarks' 768, whose
    # 3 tiles of 256 would not pair up in the cluster test).
    "width_1536": ((512, 256, 1536), 6000, None),
    # 256 experts at n = 512: the up-projection's 128x256 tiles with 4 operand stages take
    # exactly the 227 KiB of shared memory sm_90 grants a CTA.
    "experts_256": ((256, 256, 512), 20000, None),
}
FP16_GROUPINGS = ("ragged_with_empty", "negative")

# The contraction's tile configurations, each on 3 CTAs, or 3 clusters of 2 (6 CTAs) for
# the `_pairs` configs, so that every CTA walks many work items (the operand ring's state carried from item to item, store buffers reused across
# items): the ones `choose_contract_config` picks at the benchmark shapes (a buffer per
# subtile for 16-bit outputs, 128x192 where b is 1856 or 2688 and 128x256 where it is 768
# or 2048; a ring of 3 buffers for float32 outputs with many experts), and 128x128.
_CONTRACT_TILES = dict(tile_k=32, epi_n=32, max_ctas=3)
CONTRACT_CONFIGS = {
    "128x192_whole_tile": sm90_config.ContractConfig(tile_n=192, ab_stages=8, store_stages=6, **_CONTRACT_TILES),
    "128x256_whole_tile": sm90_config.ContractConfig(tile_n=256, ab_stages=6, store_stages=8, **_CONTRACT_TILES),
    "128x256_store_ring": sm90_config.ContractConfig(tile_n=256, ab_stages=7, store_stages=3, **_CONTRACT_TILES),
    "128x128_whole_tile": sm90_config.ContractConfig(tile_n=128, ab_stages=8, store_stages=4, **_CONTRACT_TILES),
    # An expert's tiles walked a-block fastest, alone and in pairs.
    "128x256_whole_tile_a_fastest": sm90_config.ContractConfig(
        tile_n=256, ab_stages=6, store_stages=8, a_fastest=True, **_CONTRACT_TILES),
    "128x192_whole_tile_pairs_a_fastest": sm90_config.ContractConfig(
        tile_n=192, ab_stages=8, store_stages=6, cluster_n=2, a_fastest=True, **dict(_CONTRACT_TILES, max_ctas=6)),
    # Clusters of two CTAs along b (A multicast): not chosen, kept to hold the kernel in pairs
    # to the same tests.
    "128x192_whole_tile_pairs": sm90_config.ContractConfig(
        tile_n=192, ab_stages=8, store_stages=6, cluster_n=2, **dict(_CONTRACT_TILES, max_ctas=6)),
    "128x256_store_ring_pairs": sm90_config.ContractConfig(
        tile_n=256, ab_stages=7, store_stages=3, cluster_n=2, **dict(_CONTRACT_TILES, max_ctas=6)),
}
CONTRACT_CONFIG_GROUPINGS = ("many_experts", "negative", "exact_tile")


def grouping(name):
    shape, m, sizes = GROUPINGS[name]
    if sizes is None:
        rng = np.random.default_rng(5)
        sizes = np.floor(rng.dirichlet(np.ones(shape[0])) * m).astype(int)
        sizes[-1] += m - sizes.sum()
        sizes = sizes.tolist()
    return shape, m, sizes


def clamped_bounds(sizes, m):
    """(start, end) rows of each expert after clamping, as the contract says."""
    bounds, end = [], 0
    for size in sizes:
        start = end
        end = min(end + max(size, 0), m)
        bounds.append((start, end))
    return bounds


# The kernels accumulate in float32; tensor cores may round each addition toward zero, so
# the unit roundoff of the accumulation is taken as 2^-23 rather than 2^-24.
_ACC_UNIT = 2.0**-23


def out_unit(dtype) -> float:
    """Unit roundoff of one rounding to `dtype`."""
    return float(np.finfo(np.dtype(dtype)).eps) / 2 if np.dtype(dtype) != BF16 else 2.0**-8


def subnormal_step(dtype) -> float:
    """Spacing of dtype's subnormals: the absolute error a rounding can make near 0."""
    return 2.0**-133 if np.dtype(dtype) == BF16 else float(np.finfo(np.dtype(dtype)).smallest_subnormal)


def matmul_bound(abs_dot: np.ndarray, terms, ref: np.ndarray, dtype) -> np.ndarray:
    """Per-entry error bound of a float32-accumulated dot of `terms` products, rounded once
    to `dtype`: gamma(terms) * sum |a||b| (the accumulation; products of 16-bit values are
    exact in float32) plus u(dtype) |ref| (the final rounding) and the smallest subnormal
    step of dtype."""
    terms = np.asarray(terms, np.float64)
    gamma = terms * _ACC_UNIT / (1.0 - terms * _ACC_UNIT)
    return gamma * abs_dot * (1.0 + out_unit(dtype)) + out_unit(dtype) * np.abs(ref) + subnormal_step(dtype)


def reference_matmul(lhs, rhs_kn, bounds, m):
    """float64 (ref, |lhs| @ |rhs|) of a ragged matmul; rows owned by no expert are 0."""
    n = rhs_kn.shape[2]
    ref = np.zeros((m, n))
    abs_dot = np.zeros((m, n))
    for e, (start, end) in enumerate(bounds):
        if end > start:
            ref[start:end] = lhs[start:end] @ rhs_kn[e]
            abs_dot[start:end] = np.abs(lhs[start:end]) @ np.abs(rhs_kn[e])
    return ref, abs_dot


def check_matmul(out, lhs, rhs_kn, sizes, dtype):
    m, k = lhs.shape
    bounds = clamped_bounds(sizes, m)
    ref, abs_dot = reference_matmul(lhs, rhs_kn, bounds, m)
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all(), "an output element was not written (NaN poison left)"
    err = np.abs(got - ref)
    bound = matmul_bound(abs_dot, k, ref, dtype)
    assert (err <= bound).all(), f"max error {err.max()} at {np.unravel_index(np.argmax(err - bound), err.shape)}"
    return ref


# ------------------------------------------------------------------------ CPU: the bounds


def test_matmul_bound_rejects_wrong_answers():
    rng = np.random.default_rng(0)
    m, k, n, sizes = 512, 520, 320, [100, 0, 250, 162]
    lhs = rng.standard_normal((m, k)).astype(jnp.bfloat16).astype(np.float64)
    rhs = rng.standard_normal((4, k, n)).astype(jnp.bfloat16).astype(np.float64)
    ref, _ = reference_matmul(lhs, rhs, clamped_bounds(sizes, m), m)
    check_matmul(ref.astype(jnp.bfloat16), lhs, rhs, sizes, BF16)  # the exact answer passes
    wrong_expert = ref.copy()
    wrong_expert[100:350] = lhs[100:350] @ rhs[0]
    last_k_tile_dropped = ref.copy()
    last_k_tile_dropped[:350] -= lhs[:350, 512:] @ rhs[0, 512:]
    shifted = np.roll(ref, 1, axis=0)
    few_ulp = ref.astype(jnp.bfloat16).astype(np.float64)
    few_ulp[10, 7] *= 1 + 4 * 2.0**-8
    unowned_written = ref.copy()
    unowned_written[400] = 1.0
    for wrong in (wrong_expert, last_k_tile_dropped, shifted, few_ulp, unowned_written):
        with pytest.raises(AssertionError):
            check_matmul(wrong.astype(jnp.bfloat16), lhs, rhs, sizes, BF16)


# ------------------------------------------------------------------------- compile tier


def matmul_request(shape, variant, dtype=BF16):
    num_experts, k, n = shape
    rhs_layout, epilogue, with_bias = MATMUL_VARIANTS[variant]
    return RaggedMatmulRequest(
        num_experts=num_experts, k=k, n=n, rhs_layout=rhs_layout, operand_dtype=dtype,
        out_dtype=dtype, epilogue=epilogue, with_bias=with_bias,
    )


def contract_request(shape, out_dtype, dtype=BF16):
    num_experts, a, b = shape
    return RaggedContractRequest(num_experts=num_experts, a=a, b=b, operand_dtype=dtype, out_dtype=np.dtype(out_dtype))


def prebuild_requests():
    """Every (request, config or None for the chosen one, outputs_in_place) the GPU tier
    below runs, for the kernel cache."""
    built = []
    for name in GROUPINGS:
        shape = GROUPINGS[name][0]
        dtypes = (BF16, FP16) if name in FP16_GROUPINGS else (BF16,)
        for dtype in dtypes:
            built += [matmul_request(shape, variant, dtype) for variant in MATMUL_VARIANTS]
            built += [dataclasses.replace(matmul_request(shape, "up_srelu_bias", dtype), with_act=False)]
            built += [contract_request(shape, F32, dtype), contract_request(shape, dtype, dtype)]
    chosen = [(request, None, True) for request in sorted(set(built), key=repr)] + [
        (contract_request(GROUPINGS[name][0], F32), None, False) for name in ("tile_n_256", "many_experts", "experts_512")
    ]
    # Groupings of one shape share their kernels.
    shapes = dict.fromkeys(GROUPINGS[name][0] for name in CONTRACT_CONFIG_GROUPINGS)
    clusters = {(request, in_clusters(request, cluster_n, 6)) for request in
                (matmul_request(GROUPINGS[name][0], variant) for name in GROUPINGS for variant in MATMUL_VARIANTS)
                for cluster_n in (1, 2)}
    return chosen + [
        (contract_request(shape, BF16), config, True) for shape in shapes for config in CONTRACT_CONFIGS.values()
    ] + [(request, config, True) for request, config in sorted(clusters, key=repr)]


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 4096, 2048), (128, 2688, 1856), (512, 2048, 768)], ids=str)
@pytest.mark.parametrize("variant", sorted(MATMUL_VARIANTS))
def test_ragged_matmul_compiles_for_sm90a(variant, shape):
    # (E, k, n): 256-wide tiles, Nemotron-3 Nano's 192-wide ones, and the most experts.
    compiled = sm90_gemm.compile_kernel(matmul_request(shape, variant), keep=True)
    assert "wgmma.mma_async" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    assert not ATOMIC.search(compiled.ptx)
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.parametrize("shape", [(8, 4096, 2048), (128, 2688, 1856), (256, 2048, 768), (512, 2048, 768)], ids=str)
def test_the_up_projection_storing_h_alone_takes_the_tile_width_of_the_one_storing_act(shape):
    """The backward making h again runs the forward's wgmma shapes (at 512 experts of 768
    the freed store buffers would otherwise let a 256-wide tile in where act keeps 192)."""
    beside_act = matmul_request(shape, "up_srelu_bias")
    alone = sm90_gemm.choose_config(dataclasses.replace(beside_act, with_act=False))
    assert alone.tile_n == sm90_gemm.choose_config(beside_act).tile_n


@pytest.mark.compile
def test_the_up_projection_storing_h_alone_compiles_for_sm90a():
    """with_act=False, as the layer's backward makes h again: one output, so the kernel
    declares one stored tensor, and no spills."""
    request = dataclasses.replace(matmul_request((128, 2688, 1856), "up_srelu_bias"), with_act=False)
    assert [o.name for o in sm90_gemm.operands(request) if o.role == "output"] == ["h"]
    compiled = sm90_gemm.compile_kernel(request, keep=True)
    assert "wgmma.mma_async" in compiled.ptx and "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(8, 4096, 2048), (128, 2688, 1856), (256, 1024, 768), (512, 2048, 768)], ids=str)
@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
def test_ragged_contraction_compiles_for_sm90a(out_dtype, shape):
    request = contract_request(shape, out_dtype)
    compiled = sm90_gemm.compile_kernel(request, keep=True)
    assert "wgmma.mma_async" in compiled.ptx
    # Alone, as chosen (test_each_contraction_config_compiles_for_sm90a compiles pairs).
    assert "multicast::cluster" not in compiled.ptx and "barrier.cluster" not in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    # One writer per element and no split-K: no atomics of any kind.
    assert not ATOMIC.search(compiled.ptx)
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("kind, shape", [
    ("up_srelu_bias", (8, 4096, 2048)), ("up_srelu_bias", (128, 2048, 768)), ("up_srelu_bias", (512, 2048, 768)),
    # 128x256 tiles with 4 operand stages beside h's and act's buffers: at 256 experts the
    # struct is exactly the 227 KiB of sm_90.
    ("up_srelu_bias", (128, 2048, 512)), ("up_srelu_bias", (256, 2048, 512)),
    ("down_kn", (512, 1856, 2688)), ("dx_nk", (128, 2048, 768)),
    ("contraction", (128, 2688, 1856)), ("contraction", (512, 2048, 768)),
], ids=str)
def test_shared_memory_estimate_is_the_kernels_struct(kind, shape, monkeypatch):
    """The estimate that picks the operand stages is the shared-memory struct the kernel
    allocates: never less (a launch past the capacity fails with no word of why), and
    never more (a stage that fits would be left out)."""
    built = []
    make = sm90_gemm._kernel
    monkeypatch.setattr(sm90_gemm, "_kernel", lambda *key: built.append(make(*key)) or built[-1])
    request = contract_request(shape, BF16) if kind == "contraction" else matmul_request(shape, kind)
    config = sm90_gemm.choose_config(request)
    sm90_gemm.compile_kernel(request, config, keep=True)
    assert built[-1].shared_storage.size_in_bytes() == config.request_bytes(request) <= sm90_config.SMEM_CAPACITY
    if shape == (256, 2048, 512):
        assert (config.tile_n, config.ab_stages, config.request_bytes(request)) == (256, 4, sm90_config.SMEM_CAPACITY)


@pytest.mark.compile
@pytest.mark.parametrize("name", sorted(CONTRACT_CONFIGS))
def test_each_contraction_config_compiles_for_sm90a(name):
    config = dataclasses.replace(CONTRACT_CONFIGS[name], max_ctas=132)
    compiled = sm90_gemm.compile_kernel(contract_request((128, 2688, 1856), BF16), config, keep=True)
    assert "wgmma.mma_async" in compiled.ptx
    # In pairs: the a-block multicast, the releases in the partner CTA, the cluster barrier.
    pairs = config.cluster_n == 2
    for instruction in ("multicast::cluster", "mapa.shared::cluster", "barrier.cluster.wait"):
        assert (instruction in compiled.ptx) == pairs, instruction
    assert not ATOMIC.search(compiled.ptx)
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
@pytest.mark.parametrize("variant", sorted(MATMUL_VARIANTS))
def test_ragged_matmul_compiles_for_sm90a_in_cluster_pairs(variant):
    """Each CTA of a pair loads half of every A tile for both (TMA multicast); the
    consumers release each stage in both CTAs; one cluster barrier publishes the
    pipelines."""
    request = matmul_request((128, 2688, 1856), variant)
    compiled = sm90_gemm.compile_kernel(request, in_clusters(request, 2, 132), keep=True)
    assert "multicast::cluster" in compiled.ptx and "mapa.shared::cluster" in compiled.ptx
    assert "barrier.cluster.wait" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    assert not ATOMIC.search(compiled.ptx)
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
def test_cluster_pairs_are_chosen_for_the_plain_gemm_from_k_1536():
    def chosen(variant, k, n):
        return sm90_config.choose_gemm_config(matmul_request((128, k, n), variant)).cluster_n
    # Nemotron-3 Nano's down and dx (k = 1856, 14 N-tiles of 192), k = 2048, and the bound.
    assert chosen("down_kn", 1856, 2688) == chosen("dx_nk", 1856, 2688) == chosen("down_kn", 2048, 4096) == 2
    assert chosen("down_kn", 1536, 2048) == 2 and chosen("down_kn", 1528, 2048) == chosen("dx_nk", 1024, 2048) == 1
    # Short k, the squared-ReLU epilogue, and three N-tiles run alone.
    assert chosen("down_kn", 768, 2048) == chosen("up_srelu_bias", 2688, 1856) == chosen("down_kn", 2048, 768) == 1
    assert sm90_config.choose_contract_config(contract_request((128, 2688, 1856), BF16)).cluster_n == 1
    # Pairs keep whole clusters on the grid.
    assert sm90_config.choose_gemm_config(matmul_request((128, 1856, 2688), "down_kn"), sm_count=131).max_ctas == 130


def test_contraction_walks_the_smaller_operand_fastest():
    def a_fastest(num_experts, a, b):
        return sm90_config.choose_contract_config(contract_request((num_experts, a, b), BF16)).a_fastest
    # dW2 = act^T dy at (32768, 7168, 2048, 32) and at Nemotron-3 Nano's shape, then their dW1.
    assert a_fastest(32, 2048, 7168) and a_fastest(128, 1856, 2688)
    assert not a_fastest(32, 7168, 2048) and not a_fastest(128, 2688, 1856) and not a_fastest(8, 512, 512)


@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("a_fastest", [False, True])
def test_contraction_walks_visit_every_tile_once(a_fastest, cluster_n):
    """The schedule's arithmetic on host integers: every (expert, a-block, b-block) output
    tile is one work item's, the CTAs of a cluster share the a-block, and consecutive
    items of an expert differ in the block that walks fastest."""
    from jax_dsrelu.kernels.sm90 import schedule

    num_experts, a_tiles, b_tiles = 3, 5, 4
    row_start, expert_order = [0, 40, 40, 100], [2, 0, 1]
    total = num_experts * a_tiles * b_tiles // cluster_n
    walked = []
    for work in range(total):
        in_cluster = [schedule.ContractSchedule(row_start, expert_order, num_experts, a_tiles, b_tiles, work, 1,
                                                cluster_n, rank, a_fastest).tile() for rank in range(cluster_n)]
        assert len({a_tile for _, a_tile, *_ in in_cluster}) == 1
        walked += [(expert, a_tile, int(b_tile)) for expert, a_tile, b_tile, _, _ in in_cluster]
    assert sorted(walked) == [(e, a, b) for e in range(num_experts) for a in range(a_tiles) for b in range(b_tiles)]
    first, second = walked[0], walked[cluster_n]
    assert (first[1] != second[1]) == a_fastest and (first[2] != second[2]) != a_fastest
    assert [expert for expert, *_ in walked[::a_tiles * b_tiles]] == expert_order  # largest first


@pytest.mark.compile
def test_cluster_pairs_are_refused_where_they_cannot_run():
    # n = 768 and b = 768 have three 256-wide N-tiles.
    request = matmul_request((8, 512, 768), "down_kn")
    assert sm90_config.choose_gemm_config(request).cluster_n == 1
    with pytest.raises(ValueError, match=r"cluster_n=2 must divide the 3 N-tiles of n=768 with tile_n=256"):
        sm90_gemm.compile_kernel(request, in_clusters(request, 2, 132))
    contraction = contract_request((8, 512, 768), F32)
    with pytest.raises(ValueError, match=r"cluster_n=2 must divide the 3 N-tiles of b=768 with tile_n=256"):
        sm90_gemm.compile_kernel(contraction, dataclasses.replace(sm90_gemm.choose_config(contraction), cluster_n=2))


@pytest.mark.compile
def test_a_config_too_large_for_shared_memory_is_refused_by_name():
    # A whole 128x192 tile of float32 buffers and 8 operand stages: 264 KB, over sm_90's 227.
    config = dataclasses.replace(CONTRACT_CONFIGS["128x192_whole_tile"], max_ctas=132)
    with pytest.raises(ValueError, match=r"config=ContractConfig\(tile_n=192.*needs \d+ bytes of shared memory"):
        sm90_gemm.implementation(contract_request((8, 512, 384), F32), config)
    sm90_gemm.implementation(contract_request((8, 512, 384), BF16), config)


@pytest.mark.compile
def test_backend_serves_the_gemm_requests():
    backend = backend_choice.kernel_backend("sm90")
    assert backend.cannot_implement(matmul_request((8, 4096, 2048), "up_srelu_bias")) is None
    assert backend.cannot_implement(contract_request((8, 4096, 2048), F32)) is None
    refusals = {
        RaggedMatmulRequest(num_experts=4, k=60, n=64, rhs_layout="kn", operand_dtype=BF16, out_dtype=BF16): "k=60",
        RaggedMatmulRequest(num_experts=4, k=64, n=64, rhs_layout="kn", operand_dtype=F32, out_dtype=F32): "float32",
        RaggedContractRequest(num_experts=513, a=64, b=64, operand_dtype=BF16, out_dtype=F32): "E=513",
        RaggedContractRequest(num_experts=4, a=64, b=12, operand_dtype=BF16, out_dtype=F32): "b=12",
    }
    for request, message in refusals.items():
        reason = backend.cannot_implement(request)
        assert reason is not None and message in reason, (request, reason)
    assert "grouped_gemm_dsrelu only" in backend_choice.kernel_backend("sm100").cannot_implement(
        contract_request((8, 64, 64), F32)
    )


@pytest.mark.compile
def test_configs_validate_in_one_place():
    good = dict(tile_n=256, tile_k=64, ab_stages=4, epi_n=32, store_stages=2, max_ctas=132)
    sm90_config.GemmConfig(**good)
    for field, value in [("tile_n", 96), ("epi_n", 16), ("ab_stages", 1), ("tile_k", 128), ("cluster_n", 4)]:
        with pytest.raises(ValueError, match=field):
            sm90_config.GemmConfig(**dict(good, **{field: value}))
    for field, value in [("tile_n", 100), ("ab_stages", 1), ("tile_k", 16), ("epi_n", 48), ("store_stages", 0)]:
        with pytest.raises(ValueError, match=field):
            sm90_config.ContractConfig(**dict(dict(good, tile_n=192), **{field: value}))
    # The chosen configs fit in shared memory at the largest expert count.
    most = sm90_config.MAX_EXPERTS
    for variant in MATMUL_VARIANTS:
        request = matmul_request((most, 4096, 2048), variant)
        config = sm90_config.choose_gemm_config(request)
        outputs = 2 if request.epilogue == "srelu" else 1
        assert config.smem_bytes(most, outputs) <= sm90_config.SMEM_CAPACITY
    for out_dtype in (F32, BF16):
        for b in (64, 512, 1856, 2688, 7168):
            config = sm90_config.choose_contract_config(contract_request((most, 4096, b), out_dtype))
            assert config.smem_bytes(most, out_dtype.itemsize) <= sm90_config.SMEM_CAPACITY
            assert config.ab_stages >= 3 and config.store_stages >= 2
    # Widths that are not a tile multiple take the tile that pads them least.
    assert sm90_config.choose_tile_n(1856) == 192 and sm90_config.choose_tile_n(2688) == 192
    assert sm90_config.choose_tile_n(2048) == 256 and sm90_config.choose_tile_n(768) == 256
    # Where 192 and 256 pad alike, 256 unless it gets fewer than 4 operand stages: beside
    # two outputs, 256-wide tiles get 4 up to 375 experts and 3 beyond. 128 is never taken
    # for its stages.
    assert sm90_config.choose_tile_n(768, lambda tile: tile < 256) == 192
    assert sm90_config.choose_tile_n(1856, lambda tile: False) == 192
    assert sm90_config.choose_tile_n(512, lambda tile: False) == 256

    def chosen(variant, num_experts, n):
        config = sm90_config.choose_gemm_config(matmul_request((num_experts, 2048, n), variant))
        return config.tile_n, config.ab_stages

    assert chosen("up_srelu_bias", 375, 768) == chosen("down_kn", 512, 768) == (256, 4)
    assert chosen("up_srelu_bias", 376, 768) == chosen("up_srelu", 512, 1536) == (192, 4)
    assert chosen("up_srelu_bias", 512, 512) == (256, 3) and chosen("up_srelu_bias", 375, 512) == (256, 4)


# ----------------------------------------------------------------------------- GPU tier


def random_operands(rng, m, k, n, num_experts, dtype):
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs_kn = (rng.standard_normal((num_experts, k, n)) / np.sqrt(k)).astype(np.float32)
    return np.asarray(jnp.asarray(lhs, dtype)), np.asarray(jnp.asarray(rhs_kn, dtype))


def run_poisoned(request, lhs, rhs, group_sizes, prob=None, bias=None, *, config=None):
    """The kernel (of `config`, or the chosen one) with every output buffer NaN-filled
    first (aliased in and out); its results by name."""
    run = sm90_gemm.implementation(request, config, outputs_in_place=True)
    filled = {
        o.name: jnp.full(o.shape_for(lhs.shape[0]), jnp.nan, o.dtype)
        for o in sm90_gemm.operands(request, config) if o.role == "output"
    }
    operands = {name: value for name, value in dict(lhs=lhs, rhs=rhs, group_sizes=group_sizes, prob=prob,
                                                    bias=bias).items() if value is not None}
    return jax.jit(lambda o: run(**o, filled=filled))(operands)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["ragged_with_empty", "past_m", "negative"])
def test_the_up_projection_storing_h_alone_stores_the_same_h(hopper, name):
    """with_act=False: h alone, bit for bit the h stored beside act, into poisoned outputs."""
    (num_experts, k, n), m, sizes = GROUPINGS[name]
    rng = np.random.default_rng(zlib.crc32(f"h alone {name}".encode()))
    beside_act = matmul_request((num_experts, k, n), "up_srelu_bias")
    lhs = jnp.asarray(rng.standard_normal((m, k)), BF16)
    rhs = jnp.asarray(rng.standard_normal((num_experts, k, n)) / np.sqrt(k), BF16)
    operands = (lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32),
                jnp.asarray(rng.standard_normal((num_experts, n)), jnp.float32))
    alone = run_poisoned(dataclasses.replace(beside_act, with_act=False), *operands)
    both = run_poisoned(beside_act, *operands)
    assert set(alone) == {"h"}
    assert np.array_equal(np.asarray(alone["h"]).view(np.uint16), np.asarray(both["h"]).view(np.uint16))


def gpu_cases():
    cases = []
    for name in sorted(GROUPINGS):
        dtypes = (BF16, FP16) if name in FP16_GROUPINGS else (BF16,)
        cases += [pytest.param(name, dtype, id=f"{name}-{dtype.name}") for dtype in dtypes]
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(MATMUL_VARIANTS))
@pytest.mark.parametrize("name, dtype", gpu_cases())
def test_ragged_matmul_matches_float64(hopper, name, dtype, variant):
    check_ragged_matmul(name, dtype, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("variant", sorted(MATMUL_VARIANTS))
@pytest.mark.parametrize("name", sorted(GROUPINGS))
def test_ragged_matmul_in_clusters_of_each_size_matches_float64(hopper, name, variant, cluster_n):
    # Every grouping's width has an even number of N-tiles with the chosen tile: here each
    # cluster size on 6 CTAs, so that every CTA walks many tiles.
    check_ragged_matmul(name, BF16, variant, lambda request: in_clusters(request, cluster_n, 6))


def in_clusters(request, cluster_n, max_ctas):
    """The chosen config in clusters of `cluster_n` CTAs along N (A multicast when 2) on
    `max_ctas` CTAs."""
    return dataclasses.replace(sm90_config.choose_gemm_config(request), cluster_n=cluster_n, max_ctas=max_ctas)


def check_ragged_matmul(name, dtype, variant, config=None):
    """The kernel (of `config(request)`, or the chosen one) on grouping `name` against
    float64, every output NaN-filled first."""
    (num_experts, k, n), m, sizes = grouping(name)
    rng = np.random.default_rng(zlib.crc32(f"{name}{dtype.name}{variant}".encode()))
    lhs, rhs_kn = random_operands(rng, m, k, n, num_experts, dtype)
    request = matmul_request((num_experts, k, n), variant, dtype)
    config = config(request) if config else None
    rhs = rhs_kn if request.rhs_layout == "kn" else np.ascontiguousarray(np.swapaxes(rhs_kn, 1, 2))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs64, rhs64 = lhs.astype(np.float64), rhs_kn.astype(np.float64)
    if request.epilogue == "none":
        out = run_poisoned(request, jnp.asarray(lhs), jnp.asarray(rhs), group_sizes, config=config)["out"]
        check_matmul(out, lhs64, rhs64, sizes, dtype)
        return
    prob = rng.uniform(0.05, 1.0, m).astype(np.float32)
    bias = rng.standard_normal((num_experts, n)).astype(np.float32) if request.with_bias else None
    results = run_poisoned(
        request, jnp.asarray(lhs), jnp.asarray(rhs), group_sizes, jnp.asarray(prob),
        None if bias is None else jnp.asarray(bias), config=config,
    )
    h, act = results["h"], results["act"]
    # h against float64: the bias enters the exact sum, one more float32 addition.
    bounds = clamped_bounds(sizes, m)
    ref, abs_dot = reference_matmul(lhs64, rhs64, bounds, m)
    owned = np.zeros(m, bool)
    for e, (start, end) in enumerate(bounds):
        owned[start:end] = True
        if bias is not None:
            ref[start:end] += bias[e]
            abs_dot[start:end] += np.abs(bias[e])
    h64 = np.asarray(h, np.float64)
    act64 = np.asarray(act, np.float64)
    assert np.isfinite(h64).all() and np.isfinite(act64).all(), "an output element was not written"
    assert (np.abs(h64 - ref) <= matmul_bound(abs_dot, k + 1, ref, dtype)).all()
    # act from the kernel's own rounded h, as the contract says: relu, square, times prob,
    # three float32 roundings and one to dtype.
    r = np.maximum(h64, 0.0)
    expected = np.where(owned[:, None], r * r * prob[:, None].astype(np.float64), 0.0)
    bound = (3 * 2.0**-24 + out_unit(dtype)) * np.abs(expected) + subnormal_step(dtype)
    assert (np.abs(act64 - expected) <= bound).all()
    assert (h64[~owned] == 0).all() and (act64[~owned] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [F32, "same"], ids=["f32", "operand_dtype"])
@pytest.mark.parametrize("name, dtype", gpu_cases())
def test_ragged_contraction_matches_float64(hopper, name, dtype, out_dtype):
    (num_experts, a, b), m, sizes = grouping(name)
    out_dtype = dtype if out_dtype == "same" else out_dtype
    rng = np.random.default_rng(zlib.crc32(f"contract{name}{dtype.name}{np.dtype(out_dtype).name}".encode()))
    lhs = np.asarray(jnp.asarray(rng.standard_normal((m, a)), dtype))
    rhs = np.asarray(jnp.asarray(rng.standard_normal((m, b)), dtype))
    request = contract_request((num_experts, a, b), out_dtype, dtype)
    out = run_poisoned(request, jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes, jnp.int32))["out"]
    got = np.asarray(out, np.float64)
    assert got.shape == (num_experts, a, b)
    assert np.isfinite(got).all(), "an output element was not written (NaN poison left)"
    lhs64, rhs64 = lhs.astype(np.float64), rhs.astype(np.float64)
    for e, (start, end) in enumerate(clamped_bounds(sizes, m)):
        if end == start:
            assert (got[e] == 0).all(), f"empty expert {e} must be exactly 0"
            continue
        ref = lhs64[start:end].T @ rhs64[start:end]
        abs_dot = np.abs(lhs64[start:end]).T @ np.abs(rhs64[start:end])
        err = np.abs(got[e] - ref)
        assert (err <= matmul_bound(abs_dot, end - start, ref, out_dtype)).all(), f"expert {e}: max error {err.max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("config_name", sorted(CONTRACT_CONFIGS))
@pytest.mark.parametrize("name", CONTRACT_CONFIG_GROUPINGS)
def test_each_contraction_config_matches_float64(hopper, name, config_name):
    (num_experts, a, b), m, sizes = grouping(name)
    rng = np.random.default_rng(zlib.crc32(f"config{name}{config_name}".encode()))
    lhs = np.asarray(jnp.asarray(rng.standard_normal((m, a)), BF16))
    rhs = np.asarray(jnp.asarray(rng.standard_normal((m, b)), BF16))
    request = contract_request((num_experts, a, b), BF16)
    config = CONTRACT_CONFIGS[config_name]
    assert config.smem_bytes(num_experts, BF16.itemsize) <= sm90_config.SMEM_CAPACITY
    out = run_poisoned(request, jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes, jnp.int32), config=config)["out"]
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all(), "an output element was not written (NaN poison left)"
    lhs64, rhs64 = lhs.astype(np.float64), rhs.astype(np.float64)
    for e, (start, end) in enumerate(clamped_bounds(sizes, m)):
        ref = lhs64[start:end].T @ rhs64[start:end]
        abs_dot = np.abs(lhs64[start:end]).T @ np.abs(rhs64[start:end])
        err = np.abs(got[e] - ref)
        assert (err <= matmul_bound(abs_dot, max(end - start, 1), ref, BF16)).all(), f"expert {e}: max error {err.max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tile_n_256", "many_experts", "experts_512"])
def test_ragged_contraction_is_bitwise_reproducible(hopper, name):
    (num_experts, a, b), m, sizes = grouping(name)
    rng = np.random.default_rng(9)
    lhs = jnp.asarray(rng.standard_normal((m, a)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((m, b)), jnp.bfloat16)
    run = jax.jit(sm90_gemm.implementation(contract_request((num_experts, a, b), F32)))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    first = np.asarray(run(lhs=lhs, rhs=rhs, group_sizes=group_sizes)["out"])
    for _ in range(19):
        assert np.array_equal(np.asarray(run(lhs=lhs, rhs=rhs, group_sizes=group_sizes)["out"]), first)
