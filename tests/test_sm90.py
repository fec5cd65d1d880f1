"""The sm90 backend: compile-only checks (CPU, CI) and correctness on a Hopper GPU.

Compile tier (marked `compile`, no GPU): the kernel compiles for sm_90a at the configs
`choose_config` picks for the benchmark shapes, in both modes; `grouped_gemm_dsrelu(...,
backend="sm90")` lowers for the cuda platform into exactly one custom call and no scatter;
the deterministic kernels contain no floating-point atomics; a new row count or new group
sizes do not recompile; unsupported requests are refused with a reason.

GPU tier (marked `gpu`): against the float64 NumPy contract for bf16 and fp16, m from 0 to
64k, ragged sizes with empty experts, negative sizes and sizes past m, every output, with
every output buffer NaN-filled before the kernel runs; determinism shown against a
configuration where the atomic path is seen to vary; moe_mlp gradients against the XLA
backend.
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

import contract_numpy  # noqa: E402
from contract_numpy import assert_matches_contract, expert_rows  # noqa: E402
from kernel_cases import GROUPINGS, grouping  # noqa: E402
from test_gpu_xla import distinct_results  # noqa: E402
from test_layer import make_layer_inputs  # noqa: E402
from test_reference import make_inputs  # noqa: E402

import jax_dsrelu  # noqa: E402
from jax_dsrelu.kernels import registry as backend_choice  # noqa: E402
from jax_dsrelu.kernels import request as request_facts  # noqa: E402
from jax_dsrelu.ffi import cutlass_bridge  # noqa: E402
from jax_dsrelu.kernels.sm90 import dsrelu_call as lowering  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels.sm90.arch import sm_count  # noqa: E402

# (m, k, n, E) of the fused kernel's benchmark.
BENCHMARK_SHAPES = [(16384, 4096, 2048, 8), (32768, 7168, 2048, 8), (65536, 2048, 1024, 32)]
CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @(\w+)")
# make_inputs' arrays by the primitive's operand names, as the kernel's call takes them.
DSRELU_OPERANDS = ("grad", "weight", "preact", "prob", "group_sizes")
# Floating-point add atomics and reductions in PTX (amax's integer max is allowed).
FLOAT_ATOMIC = re.compile(r"\b(atom|red)(\.\w+)*\.add(\.\w+)*\.f32\b")


def request_for(k, n, num_experts, *, dtype=np.dtype(jnp.bfloat16), deterministic=False,
                with_dbias=True, with_act=True, out_dtype=None) -> request_facts.Request:
    return request_facts.Request(
        num_experts=num_experts,
        n=n,
        k=k,
        operand_dtype=np.dtype(dtype),
        preact_dtype=np.dtype(dtype),
        prob_dtype=np.dtype(np.float32),
        out_dtype=np.dtype(out_dtype or dtype),
        with_dbias=with_dbias,
        with_act=with_act,
        deterministic=deterministic,
    )


def lower_for_cuda(m, k, n, num_experts, deterministic, **options):
    shaped = jax.ShapeDtypeStruct

    def f(grad, weight, preact, prob, group_sizes):
        return jax_dsrelu.grouped_gemm_dsrelu(
            grad, weight, preact, prob, group_sizes, with_dbias=True, with_act=True,
            deterministic=deterministic, backend="sm90", **options,
        )

    bf16 = jnp.bfloat16
    return jax.jit(f).trace(
        shaped((m, k), bf16), shaped((num_experts, n, k), bf16), shaped((m, n), bf16),
        shaped((m,), jnp.float32), shaped((num_experts,), jnp.int32),
    ).lower(lowering_platforms=("cuda",))


# ----------------------------------------------------------------------- compile tier


@pytest.mark.compile
@pytest.mark.parametrize("deterministic", [False, True])
def test_compiles_for_sm90a_with_the_most_experts(deterministic):
    num_experts = sm90_config.MAX_EXPERTS
    request = request_for(2048, 768, num_experts, deterministic=deterministic)
    config = sm90_config.choose_config(request)
    assert config.smem_bytes(num_experts, True, True) <= sm90_config.SMEM_CAPACITY
    assert "wgmma.mma_async" in lowering.compile_kernel(request, config, keep=True).ptx
    assert backend_choice.kernel_backend("sm90").cannot_implement(request) is None
    assert "1 to 512 experts" in backend_choice.kernel_backend("sm90").cannot_implement(
        request_for(2048, 768, num_experts + 1))


def preact_releases_fenced(ptx: str) -> list[bool]:
    """Per read of a preact buffer (its ldmatrix), in PTX order: whether a proxy fence lies
    between the read and the buffer's release (the next mbarrier.arrive), after which the
    TMA warp writes the buffer through the async proxy."""
    found, read, fenced = [], False, False
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("ldmatrix"):
            read, fenced = True, False
        elif read and line.startswith("fence.proxy.async"):
            fenced = True
        elif read and line.startswith("mbarrier.arrive"):
            found.append(fenced)
            read = False
    return found


# The benchmark shapes and the fused GEMM of the Nemotron-3 Nano layer (k = d = 2688,
# n = f = 1856: a partial last N-tile).
COMPILE_SHAPES = BENCHMARK_SHAPES + [(49152, 2688, 1856, 128)]


@pytest.mark.compile
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("shape", COMPILE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_compiles_for_sm90a_at_benchmark_shapes(shape, deterministic):
    _, k, n, num_experts = shape
    request = request_for(k, n, num_experts, deterministic=deterministic)
    config = sm90_config.choose_config(request)
    assert config.smem_bytes(num_experts, True, True) <= sm90_config.SMEM_CAPACITY
    ptx = lowering.compile_kernel(request, config, keep=True).ptx
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert "stmatrix" in ptx and "ldmatrix" in ptx
    # One release per subtile of the tile's walk, each after a proxy fence (the PTX memory
    # model's order between the consumers' ldmatrix and the TMA warp's next write).
    assert preact_releases_fenced(ptx) == [True] * config.subtiles
    float_atomics = FLOAT_ATOMIC.findall(ptx)
    if deterministic:
        # dprob and dbias go to single-writer slots, summed by the reduction pass.
        assert not float_atomics
        assert "SlotReduction" in ptx
    else:
        assert float_atomics
    ptxas.check_assembly(ptx)


@pytest.mark.compile
@pytest.mark.parametrize("deterministic", [False, True])
def test_lowers_to_one_custom_call_without_scatter(deterministic):
    m, k, n, num_experts = BENCHMARK_SHAPES[0]
    text = lower_for_cuda(m, k, n, num_experts, deterministic).as_text()
    assert CUSTOM_CALL.findall(text) == ["CuteDSLRT_NvJaxCutlassCall_v2"]
    assert "scatter" not in text


@pytest.mark.compile
def test_new_row_count_does_not_recompile(monkeypatch):
    # Whatever this process compiled before and whatever the disk cache holds: with an
    # empty cache and no disk cache the first lowering compiles, the next two do not.
    monkeypatch.delenv(cutlass_bridge.CACHE_DIR_VARIABLE, raising=False)
    monkeypatch.setattr(cutlass_bridge, "_cache", {})
    k, n, num_experts = 512, 384, 5
    before = cutlass_bridge.compile_count()
    texts = [lower_for_cuda(m, k, n, num_experts, True).as_text() for m in (3000, 4097, 70001)]
    assert cutlass_bridge.compile_count() - before == 1
    # The same object code (its fingerprint is the call's key) for every m.
    keys = [re.search(r'key = "([^"]*)"', text).group(1) for text in texts]
    assert len(set(keys)) == 1


class _DsreluVariant(lowering.GroupedGemmDsreluSm90):
    """A kernel subclassed outside the package, as a benchmark's variant is."""


@pytest.mark.compile
def test_a_variant_defined_elsewhere_is_cached_under_its_bases_sources(tmp_path, monkeypatch):
    # Its object code must not outlive an edit of the kernels it inherits from.
    monkeypatch.setenv(cutlass_bridge.CACHE_DIR_VARIABLE, str(tmp_path))
    request = request_for(512, 384, 5)
    modules = cutlass_bridge._defining_modules(_DsreluVariant(sm90_config.choose_config(request), request))
    assert {__name__, "jax_dsrelu.kernels.sm90.gemm_base"} <= set(modules)
    before = cutlass_bridge._disk_path(("variant",), modules)
    sm90_folder = os.path.dirname(os.path.abspath(lowering.__file__))
    source_digest = cutlass_bridge._source_digest
    monkeypatch.setattr(cutlass_bridge, "_source_digest",
                        lambda folder: b"edited" if folder == sm90_folder else source_digest(folder))
    assert cutlass_bridge._disk_path(("variant",), modules) != before


@pytest.mark.compile
def test_zero_rows_need_no_kernel():
    text = lower_for_cuda(0, 64, 32, 3, False).as_text()
    assert not CUSTOM_CALL.findall(text)
    request = request_for(64, 32, 3, deterministic=True)
    inputs = make_inputs(np.random.default_rng(0), 0, 64, 32, [0, 5, -1], jnp.bfloat16)
    results = lowering.implementation(request)(**dict(zip(DSRELU_OPERANDS, inputs)), alpha=jnp.ones(3, jnp.float32))
    out = jax_dsrelu.DsreluOutputs(**{name: results.get(name) for name in jax_dsrelu.DsreluOutputs._fields})
    # Empty dh, dprob and act of the contract's shapes and dtypes; dbias and amax 0.
    assert_matches_contract(out, inputs)


REFUSALS = {
    "float32 operands": (dict(dtype=np.float32), "grad/weight dtype bfloat16 or float16, got float32"),
    "float32 out_dtype": (dict(out_dtype=np.float32), "out_dtype bfloat16 or float16, got float32"),
    "n not a multiple of 8": (dict(n=100), "n=100"),
    "k not a multiple of 8": (dict(k=36), "k=36"),
    "too many experts": (dict(num_experts=513), "E=513"),
}


@pytest.mark.compile
@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_cannot_implement_names_the_value(case):
    changes, message = REFUSALS[case]
    shape = dict(k=64, n=64, num_experts=4)
    shape.update({key: changes.pop(key) for key in list(changes) if key in shape})
    request = request_for(shape["k"], shape["n"], shape["num_experts"], **changes)
    reason = sm90_config.cannot_implement(request)
    assert reason is not None and message in reason
    with pytest.raises(NotImplementedError, match="sm90"):
        backend_choice.check_explicit_backend("sm90", request)


@pytest.mark.compile
def test_supported_request_is_accepted():
    assert sm90_config.cannot_implement(request_for(4096, 2048, 8)) is None


@pytest.mark.compile
@pytest.mark.parametrize("shape", [(2688, 1856, 128), (4096, 2048, 8), (2048, 768, 512)], ids=str)
def test_shared_memory_estimate_is_the_kernels_struct(shape, monkeypatch):
    """The estimate that picks the operand stages is the shared-memory struct the kernel
    allocates: never less (a launch past the capacity fails with no word of why), and
    never more (a stage that fits would be left out)."""
    built = []
    make = lowering._kernel
    monkeypatch.setattr(lowering, "_kernel", lambda *key: built.append(make(*key)) or built[-1])
    request = request_for(*shape)
    config = sm90_config.choose_config(request)
    lowering.compile_kernel(request, config, keep=True)
    estimate = config.smem_bytes(request.num_experts, request.with_act, request.with_dbias)
    assert built[-1].shared_storage.size_in_bytes() == estimate <= sm90_config.SMEM_CAPACITY


@pytest.mark.compile
@pytest.mark.parametrize("n, tile_n", [(64, 64), (120, 64), (128, 128), (200, 128), (248, 128), (256, 256),
                                       (320, 128), (384, 128), (448, 256), (768, 192), (1024, 256), (1536, 192),
                                       (1856, 192), (2688, 192)])
def test_fused_kernel_tile_width(n, tile_n):
    # 256 from n = 256 unless it computes 10% more columns than 128 (320: 512 against 384),
    # 192 where it computes fewer than that choice (1856: 1920 against 2048; 2688: 2688
    # against 2816) or as many as 256 (768, 1536), and then with 2 preact stages and the
    # operand stage they make room for.
    assert sm90_config.dsrelu_tile_n(n) == tile_n
    config = sm90_config.choose_config(request_for(256, n, 4))
    assert config.tile_n == tile_n
    if tile_n == 192:
        assert (config.ab_stages, config.preact_stages) == (4, 2)


def in_clusters(request, cluster_n, max_ctas=6):
    """The chosen config in clusters of `cluster_n` CTAs along N (A multicast when 2) on
    `max_ctas` CTAs: by default 6, so that every CTA of the GPU tier below walks many tiles."""
    return dataclasses.replace(sm90_config.choose_config(request), cluster_n=cluster_n, max_ctas=max_ctas)


@pytest.mark.compile
@pytest.mark.parametrize("deterministic", [False, True])
def test_compiles_for_sm90a_in_cluster_pairs(deterministic):
    """Each CTA of a pair loads half of every grad tile for both (TMA multicast); the
    consumers release each stage in both CTAs; one cluster barrier publishes the
    pipelines."""
    request = request_for(2688, 1856, 128, deterministic=deterministic)
    assert sm90_config.choose_config(request).cluster_n == 1  # pairs are not chosen (docs/sm90.md)
    compiled = lowering.compile_kernel(request, in_clusters(request, 2, 132), keep=True)
    assert "multicast::cluster" in compiled.ptx and "mapa.shared::cluster" in compiled.ptx
    assert "barrier.cluster.wait" in compiled.ptx
    assert "ld.local" not in compiled.ptx and "st.local" not in compiled.ptx
    if deterministic:
        assert not FLOAT_ATOMIC.search(compiled.ptx)
    ptxas.check_assembly(compiled.ptx)


@pytest.mark.compile
def test_cluster_pairs_need_an_even_n_tile_count():
    # n = 448 has two 256-wide N-tiles, n = 320 three 128-wide ones.
    lowering.compile_kernel(request_for(256, 448, 4), in_clusters(request_for(256, 448, 4), 2))
    with pytest.raises(ValueError, match=r"cluster_n=2 must divide the 3 N-tiles of n=320 with tile_n=128"):
        lowering.compile_kernel(request_for(256, 320, 4), in_clusters(request_for(256, 320, 4), 2))


@pytest.mark.compile
def test_tile_config_validates_in_one_place():
    good = dict(tile_n=256, tile_k=64, ab_stages=3, epi_n=32, preact_stages=4, store_stages=2, max_ctas=132)
    sm90_config.TileConfig(**good)
    for field, value in [("tile_n", 96), ("epi_n", 16), ("ab_stages", 1), ("tile_k", 128), ("tile_m", 64),
                         ("cluster_n", 3)]:
        with pytest.raises(ValueError, match=field):
            sm90_config.TileConfig(**dict(good, **{field: value}))
    with pytest.raises(ValueError, match="max_ctas must be a multiple of cluster_n=2.*got 131"):
        sm90_config.TileConfig(**dict(good, cluster_n=2, max_ctas=131))
    too_big = sm90_config.TileConfig(**dict(good, ab_stages=5))
    with pytest.raises(ValueError, match="shared memory"):
        too_big.check_fits(8, True, True)


# --------------------------------------------------------------------------- GPU tier


def run_in_place(inputs, alpha, *, deterministic, with_dbias=True, with_act=True, out_dtype=None, config=None):
    """Runs the kernel (of `config(request)`, or the chosen one) with every output buffer
    NaN-filled first (aliased in and out)."""
    grad, weight, preact, prob, group_sizes = inputs
    request = request_facts.request_from_avals(
        (grad, weight, preact, prob),
        out_dtype=np.dtype(out_dtype or grad.dtype),
        with_dbias=with_dbias,
        with_act=with_act,
        deterministic=deterministic,
    )
    config = config(request) if config else sm90_config.choose_config(request, sm_count())
    run = lowering.implementation(request, config, outputs_in_place=True)
    filled = {
        o.name: jnp.full(o.shape_for(grad.shape[0]), jnp.nan, o.dtype)
        for o in lowering.operands(request, config) if o.role == "output"
    }
    results = jax.jit(lambda o: run(**o, alpha=alpha, filled=filled))(dict(zip(DSRELU_OPERANDS, inputs)))
    return jax_dsrelu.DsreluOutputs(**{name: results.get(name) for name in jax_dsrelu.DsreluOutputs._fields})


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", sorted(GROUPINGS))
def test_matches_float64_contract(hopper, name, dtype, deterministic):
    m, k, n, sizes = grouping(name)
    rng = np.random.default_rng(zlib.crc32(f"{name}{np.dtype(dtype).name}{deterministic}".encode()))
    inputs = make_inputs(rng, m, k, n, sizes, dtype)
    alpha = jnp.asarray(rng.uniform(-2.0, 2.0, len(sizes)), jnp.float32)
    out = run_in_place(inputs, alpha, deterministic=deterministic)
    # Per-entry bounds derived from the arithmetic (contract_numpy's docstring), shown to
    # reject wrong outputs at these shapes by test_tolerances.py; NaN left in any buffer
    # fails them.
    assert_matches_contract(out, inputs, alpha=alpha, out_dtype=dtype)


# (m, k, n, group sizes) with an even number of N-tiles, where the kernel can run in
# cluster pairs: the GPU tier's groupings that have one, and negative sizes, sizes past m
# and rows owned by no expert (zero tiles) at n = 512 (two 256-wide tiles).
CLUSTER_CASES = {
    **{name: grouping(name) for name in ("tile_n_256", "rows_64k", "width_1856", "width_768")},
    "negative_and_unowned": (3000, 256, 512, [-5, 1000, -1, 1300, 7, 0]),
    "past_m": (2000, 128, 512, [900, 800, 700]),
    "one_row": (1, 64, 512, [1, 0]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("cluster_n", [1, 2])
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", sorted(CLUSTER_CASES))
def test_clusters_of_each_size_match_float64_contract(hopper, name, deterministic, cluster_n):
    m, k, n, sizes = CLUSTER_CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"cluster{name}{deterministic}{cluster_n}".encode()))
    inputs = make_inputs(rng, m, k, n, sizes, jnp.bfloat16)
    alpha = jnp.asarray(rng.uniform(-2.0, 2.0, len(sizes)), jnp.float32)
    out = run_in_place(inputs, alpha, deterministic=deterministic,
                       config=lambda request: in_clusters(request, cluster_n))
    assert_matches_contract(out, inputs, alpha=alpha)


@pytest.mark.gpu
@pytest.mark.parametrize("with_dbias", [False, True])
@pytest.mark.parametrize("with_act", [False, True])
def test_optional_outputs_through_the_api(hopper, with_dbias, with_act):
    rng = np.random.default_rng(11 + 2 * with_dbias + with_act)
    inputs = make_inputs(rng, 3000, 256, 512, [1000, 0, 37, 1500, 400], jnp.bfloat16, jnp.bfloat16)
    for deterministic in (False, True):
        out = jax.jit(
            lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
                *a, with_dbias=with_dbias, with_act=with_act, deterministic=deterministic, backend="sm90"
            )
        )(*inputs)
        assert_matches_contract(out, inputs, with_dbias=with_dbias, with_act=with_act)


@pytest.mark.gpu
def test_zero_rows_on_gpu(hopper):
    inputs = make_inputs(np.random.default_rng(1), 0, 64, 32, [0, 3], jnp.bfloat16)
    out = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, with_act=True, backend="sm90")
    np.testing.assert_array_equal(out.dbias, np.zeros((2, 32)))
    np.testing.assert_array_equal(out.amax, np.zeros(2))


@pytest.mark.gpu
def test_nan_and_inf_propagate_within_their_expert(hopper):
    rng = np.random.default_rng(12)
    inputs = make_inputs(rng, 512, 128, 256, [200, 150, 162], jnp.bfloat16)
    grad, weight, preact, prob, group_sizes = inputs
    preact = preact.at[3, 5].set(jnp.nan).at[300, 7].set(jnp.inf)  # experts 0 and 1
    weight = weight.at[2, 17, 3].set(-jnp.inf)  # expert 2's weights, read by no other rows
    poisoned = (grad, weight, preact, prob, group_sizes)
    for backend in ("sm90", "xla"):
        out = jax_dsrelu.grouped_gemm_dsrelu(*poisoned, with_dbias=True, with_act=True, backend=backend)
        # The float64 contract's NaN and Inf, entry by entry, and its values elsewhere.
        assert_matches_contract(out, poisoned)
        assert np.isnan(out.amax[0]) and np.isnan(out.dprob[3]), backend


def rows_with_every_product_far_from_zero(inputs) -> list[int]:
    """In every non-empty expert, the row whose smallest |grad . weight[e, j]| is largest,
    so that no rounding can change the sign of an infinite dh there."""
    grad, weight, _, _, group_sizes = inputs
    chosen = []
    for e, (start, end) in enumerate(expert_rows(group_sizes, grad.shape[0])):
        if end > start:
            g = np.asarray(grad[start:end], np.float64) @ np.asarray(weight[e], np.float64).T
            chosen.append(start + int(np.argmax(np.min(np.abs(g), axis=1))))
    return chosen


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("n, tile_n", [(448, 256), (320, 128)])
def test_amax_ignores_the_padding_columns_of_a_partial_n_tile(hopper, n, tile_n, deterministic):
    """The last N-tile is partial (448 = 256 + 192 real columns of a 256-column tile; 320 =
    2 x 128 + 64 of a 128-column tile). A row with prob = Inf and relu(preact) > 0 has
    dh = +-Inf on every real column, so amax = Inf; a padding column (acc = 0, preact = 0)
    would give Inf * 0 = NaN if it were counted."""
    rng = np.random.default_rng(13 + n)
    sizes = [300, 0, 257, 1, 342]
    inputs = make_inputs(rng, 1000, 128, n, sizes, jnp.bfloat16)
    assert sm90_config.choose_config(request_for(128, n, len(sizes))).tile_n == tile_n and n % tile_n
    grad, weight, preact, prob, group_sizes = inputs
    rows = np.asarray(rows_with_every_product_far_from_zero(inputs))
    preact = preact.at[rows].set(jnp.abs(preact[rows]) + 0.25)
    prob = prob.at[rows].set(jnp.inf)
    poisoned = (grad, weight, preact, prob, group_sizes)
    np.testing.assert_array_equal(
        contract_numpy.grouped_gemm_dsrelu(*poisoned).amax, [np.inf, 0.0, np.inf, np.inf, np.inf]
    )
    out = run_in_place(poisoned, jnp.ones(len(sizes), jnp.float32), deterministic=deterministic)
    assert_matches_contract(out, poisoned)


# The configuration at which atomic reductions were seen to vary from run to run (8 experts
# of about 1024 rows, n = 2048), made ragged with an empty expert.
DETERMINISM_SIZES = [1500, 700, 0, 1024, 1200, 900, 1024, 1844]
RUNS = 20


@pytest.fixture(scope="module")
def determinism_inputs():
    return make_inputs(
        np.random.default_rng(101), sum(DETERMINISM_SIZES), 512, 2048, DETERMINISM_SIZES, jnp.bfloat16
    )


def sm90_outputs(deterministic):
    return jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
            *a, with_dbias=True, with_act=True, deterministic=deterministic, backend="sm90"
        )
    )


@pytest.mark.gpu
def test_atomic_mode_varies_at_this_configuration(hopper, determinism_inputs):
    """Without this, the bitwise-stable result below would prove nothing."""
    assert distinct_results(sm90_outputs(False), *determinism_inputs, runs=RUNS) > 1


@pytest.mark.gpu
def test_deterministic_mode_is_bitwise_stable(hopper, determinism_inputs):
    run = sm90_outputs(True)
    assert distinct_results(run, *determinism_inputs, runs=RUNS) == 1
    assert_matches_contract(run(*determinism_inputs), determinism_inputs)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_moe_mlp_uses_the_kernel_and_matches_xla_gradients(hopper, deterministic):
    rng = np.random.default_rng(104 + deterministic)
    sizes = [700, 0, 1300, 48, 2048]
    x, w1, w2, prob, b1 = make_layer_inputs(rng, sum(sizes) + 96, 256, 512, sizes, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    cotangent = jnp.asarray(rng.standard_normal((x.shape[0], 256)), jnp.float32)

    def grads(backend):
        def loss(x, w1, w2, prob, b1):
            y = jax_dsrelu.moe_mlp(
                x, w1, w2, prob, group_sizes, b1=b1, deterministic=deterministic, backend=backend
            )
            return jnp.sum(y.astype(jnp.float32) * cotangent)

        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))

    kernel_grads = grads("auto")
    text = kernel_grads.lower(x, w1, w2, prob, b1).as_text()
    # Every GEMM on the kernels: the up-projection (its h is the backward's residual), the
    # fused backward, dx, dW1 and dW2; the forward's down-projection is dead in a grad.
    assert CUSTOM_CALL.findall(text).count("CuteDSLRT_NvJaxCutlassCall_v2") == 5
    ours = kernel_grads(x, w1, w2, prob, b1)
    reference = grads("xla")(x, w1, w2, prob, b1)
    for name, a, b in zip(("x", "w1", "w2", "prob", "b1"), ours, reference):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        # Both backends round dh and act to bf16 before the bf16 grouped GEMMs that follow;
        # the roundings differ where float32 sums differ in their last bits, so the
        # gradients agree to a few bf16 ulps relative to their norm.
        assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b), name


def prebuild_requests():
    """The distinct (request, config, outputs_in_place) of every kernel the GPU tier above
    calls directly, for the kernel cache (benchmarks/prebuild_kernels.py)."""
    both = (False, True)
    calls = [(request_for(k, n, len(sizes), dtype=np.dtype(dtype), deterministic=det), True)
             for name in GROUPINGS for _, k, n, sizes in [grouping(name)]
             for dtype in (jnp.bfloat16, jnp.float16) for det in both]
    for det in both:
        calls += [(request_for(256, 512, 5, deterministic=det, with_dbias=dbias, with_act=act), False)
                  for dbias in both for act in both]
        calls.append((request_for(512, 2048, len(DETERMINISM_SIZES), deterministic=det), False))
    calls.append((request_for(128, 256, 2), False))  # NaN/Inf propagation
    chosen = [(request, sm90_config.choose_config(request, sm90_config.DEFAULT_SM_COUNT), in_place)
              for request, in_place in calls]
    clusters = [(request, in_clusters(request, cluster_n), True) for _, k, n, sizes in CLUSTER_CASES.values()
                for request in (request_for(k, n, len(sizes), deterministic=det) for det in both) for cluster_n in (1, 2)]
    distinct = {}
    for request, config, in_place in chosen + clusters:
        distinct.setdefault((lowering.kernel_request(request), config, in_place), (request, config, in_place))
    return list(distinct.values())
