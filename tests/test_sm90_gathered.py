"""The sm90 kernels not verified on an H200: gathered operand loads and the ordered gather-and-sum.

Kernels: the ragged-M GEMM, the fused dsReLU kernel and the contraction reading their A
rows through a row index (`kernels/sm90/gather_a.py`, `gathered_kernels.py`), and the
gather-and-sum (`gather_sum_kernel.py`). No call uses them until JAX_DSRELU_SM90_UNVERIFIED
names their kind (`kernels/sm90/backend.py`).

CPU: the switch, the kernels' declarations, the gather-and-sum's refusals.

Compile tier (marked `compile`, no GPU): each kernel compiles for sm_90a, A by cp.async
and B by TMA, with no spills and no serialized wgmma (ptxas), its consumers fencing the
proxies between each stage's wait and its wgmma batch (a verified kernel does not);
through the primitives, lowered for cuda, the switch off runs the verified kernels on
rows XLA gathers first and the switch on runs the gathered kernels with no gather left;
new row or token counts do not recompile.

GPU tier (marked `gpu`): what the H200 run checks before a kind leaves UNVERIFIED_KINDS.
The gathered kernels bit for bit against the verified ones on the rows gathered in
memory (the same k loop on the same values), and against float64; the gather-and-sum bit
for bit against XLA's sequential sum and within float64's bound; the boundary cases:
empty experts, a token's rows at the end of the index, T no multiple of a tile, the last
row of the source gathered, indices outside it (clamped); the MoE layer the same bits
with the switch on and off. Run them under compute-sanitizer too (memcheck, racecheck).
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

from contract_numpy import assert_matches_contract  # noqa: E402
from test_sm90 import preact_releases_fenced  # noqa: E402
from test_sm90_gemms import check_matmul, clamped_bounds, matmul_bound  # noqa: E402

import jax_dsrelu  # noqa: E402
from jax_dsrelu.ffi import cutlass_bridge  # noqa: E402
from jax_dsrelu.kernels import registry  # noqa: E402
from jax_dsrelu.kernels.request import GatherSumRequest, RaggedContractRequest, RaggedMatmulRequest, Request  # noqa: E402
from jax_dsrelu.kernels import operands  # noqa: E402
from jax_dsrelu.kernels.sm90 import backend, dsrelu_call, gather_sum_call, gather_sum_config  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels.sm90 import ragged_call  # noqa: E402
from jax_dsrelu.primitives import dsrelu as dsrelu_primitive  # noqa: E402
from jax_dsrelu.primitives.gather_sum import gather_sum  # noqa: E402
from jax_dsrelu.primitives.ragged_contract import ragged_contract  # noqa: E402
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul_srelu  # noqa: E402

BF16 = np.dtype(jnp.bfloat16)
FP16 = np.dtype(jnp.float16)
F32 = np.dtype(np.float32)
SWITCH = backend.UNVERIFIED_VARIABLE
ATOMIC = re.compile(r"^\s*(@!?%p\d+\s+)?(atom|red)\.", re.M)
GATHER_OP = re.compile(r"\bstablehlo\.gather\b")
CUSTOM_CALL = re.compile(r"\bstablehlo\.custom_call\b")


def matmul_request(num_experts, k, n, rhs_layout="kn", epilogue="srelu", with_bias=True, dtype=BF16):
    return RaggedMatmulRequest(num_experts=num_experts, k=k, n=n, rhs_layout=rhs_layout, operand_dtype=dtype,
                               out_dtype=dtype, epilogue=epilogue, with_bias=with_bias)


def dsrelu_request(num_experts, k, n, deterministic=True, dtype=BF16):
    return Request(num_experts=num_experts, n=n, k=k, operand_dtype=dtype, preact_dtype=dtype, prob_dtype=F32,
                   out_dtype=dtype, with_dbias=True, with_act=True, deterministic=deterministic)


def contract_request(num_experts, a, b, out_dtype=BF16):
    return RaggedContractRequest(num_experts=num_experts, a=a, b=b, operand_dtype=BF16, out_dtype=np.dtype(out_dtype))


# ------------------------------------------------------------------------------ the switch


def test_unverified_kinds_serve_no_call_by_default(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    assert not backend.enabled("gathered") and not backend.enabled("gather_sum")
    for request in (matmul_request(8, 512, 384), dsrelu_request(8, 512, 384), contract_request(8, 512, 384)):
        assert backend.gathers_rows(request) == frozenset()
    reason = backend.cannot_implement(GatherSumRequest(n=64, slots=2, rows_dtype=BF16))
    assert SWITCH in reason and "gather_sum" in reason
    # The verified kernels are not behind the switch.
    assert backend.cannot_implement(matmul_request(8, 512, 384)) is None


def test_the_switch_names_the_kinds_it_enables(monkeypatch):
    monkeypatch.setenv(SWITCH, "gathered")
    assert backend.gathers_rows(matmul_request(8, 512, 384)) == {"lhs"}
    assert backend.gathers_rows(matmul_request(8, 512, 384, "nk", "none", False)) == {"lhs"}
    assert backend.gathers_rows(dsrelu_request(8, 512, 384)) == {"grad"}
    assert backend.gathers_rows(dataclasses.replace(dsrelu_request(8, 512, 384), block_scaled=True)) == frozenset()
    assert backend.gathers_rows(contract_request(8, 512, 384)) == {"lhs", "rhs"}
    assert backend.cannot_implement(GatherSumRequest(n=64, slots=2, rows_dtype=BF16)) is not None
    monkeypatch.setenv(SWITCH, " gather_sum , gathered ")
    assert backend.cannot_implement(GatherSumRequest(n=64, slots=2, rows_dtype=BF16)) is None
    monkeypatch.setenv(SWITCH, "gathered,gather-sum")
    with pytest.raises(ValueError, match=rf"{SWITCH} names \['gather-sum'\].*'gathered', 'gather_sum'"):
        backend.enabled("gathered")
    # Kinds verified since may still be named, as the switch was set while they were not.
    monkeypatch.setenv(SWITCH, "fp8,fp8_quantize,gathered")
    assert backend.enabled("gathered") and not backend.enabled("gather_sum") and backend.enabled("fp8")


def test_unverified_enabled_sets_the_switch_for_its_block_only(monkeypatch):
    monkeypatch.setenv(SWITCH, "gather_sum")
    with backend.unverified_enabled():
        assert backend.enabled("gathered") and backend.enabled("gather_sum")
    assert not backend.enabled("gathered") and backend.enabled("gather_sum")
    monkeypatch.delenv(SWITCH)
    with backend.unverified_enabled("gathered"):
        assert backend.enabled("gathered") and not backend.enabled("gather_sum")
    assert SWITCH not in os.environ
    with backend.unverified_enabled(on=False):  # the switch as it was: off
        assert not backend.enabled("gathered") and SWITCH not in os.environ
    monkeypatch.setenv(SWITCH, "gathered")
    with backend.unverified_enabled(on=False):
        assert backend.enabled("gathered")
    with pytest.raises(ValueError, match=r"kinds names \['gathers'\]"):
        with backend.unverified_enabled("gathers"):
            pass


def test_gather_sum_refusals_name_the_value():
    def reason(**facts):
        return gather_sum_config.cannot_implement(GatherSumRequest(**dict(dict(n=64, slots=2, rows_dtype=BF16), **facts)))

    assert reason() is None and reason(rows_dtype=F32, n=4) is None
    assert "got float64" in reason(rows_dtype=np.dtype(np.float64))
    assert "multiple of 8" in reason(n=60) and "n=60" in reason(n=60)
    assert "multiple of 4" in reason(rows_dtype=F32, n=6)
    assert "slots=0" in reason(slots=0) and f"slots={gather_sum_config.MAX_SLOTS + 1}" in reason(
        slots=gather_sum_config.MAX_SLOTS + 1)


@pytest.mark.parametrize("n, dtype, lanes", [(2688, BF16, 128), (64, BF16, 8), (8, BF16, 1), (12, F32, 4)])
def test_gather_sum_threads_cover_a_row(n, dtype, lanes):
    request = GatherSumRequest(n=n, slots=6, rows_dtype=dtype)
    assert gather_sum_config.token_lanes(request) == lanes
    assert gather_sum_config.THREADS % lanes == 0


# ---------------------------------------------------------------------- the declarations


def test_gathered_declarations_read_a_source_of_its_own_rows():
    # dW2's rhs, dy, has a source of its own (the schema's "u"), apart from x's tokens.
    counts = {operands.ROWS: 10, operands.SOURCE_ROWS: 4, operands.OTHER_SOURCE_ROWS: 6}

    def plan(declared):
        return [(o.name, o.shape_for(counts), o.mode, o.operand.varying) for o in declared]

    request = matmul_request(8, 512, 384)
    assert plan(ragged_call.operands(request, gathered="lhs"))[:3] == [
        ("lhs", (4, 512), None, (0,)), ("lhs_index", (10,), None, (0,)), ("rhs", (8, 512, 384), (2, 1, 0), ()),
    ]
    declared = dsrelu_call.operands(dsrelu_request(8, 512, 384), sm90_config.choose_config(dsrelu_request(8, 512, 384)),
                                    gathered="grad")
    assert plan(declared)[:3] == [
        ("grad", (4, 512), None, (0,)), ("grad_index", (10,), None, (0,)), ("weight", (8, 384, 512), (1, 2, 0), ()),
    ]
    assert plan(ragged_call.operands(contract_request(8, 512, 384), gathered="lhs"))[:3] == [
        ("lhs", (4, 512), (1, 0), (0,)), ("lhs_index", (10,), None, (0,)), ("rhs", (10, 384), (1, 0), (0,)),
    ]
    assert plan(ragged_call.operands(contract_request(8, 512, 384), gathered="rhs"))[:3] == [
        ("lhs", (10, 512), (1, 0), (0,)), ("rhs", (6, 384), (1, 0), (0,)), ("rhs_index", (10,), None, (0,)),
    ]
    # An extent of the source's rows needs their count.
    with pytest.raises(ValueError, match="count 't'"):
        ragged_call.operands(request, gathered="lhs")[0].shape_for(10)


def test_gathered_kernels_load_their_a_alone():
    # The plain GEMM is chosen in cluster pairs from k = 1536; its gathered variant is not.
    request = matmul_request(128, 1856, 2688, epilogue="none", with_bias=False)
    assert ragged_call.choose_config(request).cluster_n == 2
    assert ragged_call.choose_config(request, gathered="lhs").cluster_n == 1
    from jax_dsrelu.kernels.sm90.gathered_kernels import GatheredRaggedGemmSm90

    with pytest.raises(ValueError, match="cluster_n must be 1, got 2"):
        GatheredRaggedGemmSm90(ragged_call.choose_config(request), request)


# -------------------------------------------------------------------------- compile tier


def fences_before_each_wgmma_batch(ptx: str) -> list[int]:
    """Per wgmma batch (the wgmmas up to a commit), in PTX order: how many proxy fences
    lie between the last barrier wait before it and its first wgmma."""
    fences, batches, in_batch = 0, [], False
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("mbarrier.try_wait"):
            fences = 0
        elif line.startswith("fence.proxy.async"):
            fences += 1
        elif line.startswith("wgmma.mma_async") and not in_batch:
            batches.append(fences)
            in_batch = True
        elif line.startswith("wgmma.commit_group"):
            in_batch = False
    return batches


def assert_gathers_a(ptx: str) -> None:
    """A by cp.async (16-byte copies, their arrival on the ring's barrier), B by TMA, wgmma
    reading a stage only past one proxy fence after its wait (cp.async writes through the
    generic proxy, wgmma reads through the async proxy): the first k-tile's batch and the
    k loop's."""
    assert re.search(r"cp\.async\.cg\.shared\.global \[%r\d+(\+\d+)?\], \[%rd\d+(\+\d+)?\], 16", ptx)
    assert "cp.async.mbarrier.arrive.noinc.shared" in ptx
    assert re.search(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)
    assert fences_before_each_wgmma_batch(ptx) == [1, 1]
    assert "ld.local" not in ptx and "st.local" not in ptx
    ptxas.check_assembly(ptx)


@pytest.mark.compile
def test_a_verified_kernel_reads_its_tma_ring_with_no_proxy_fence():
    ptx = ragged_call.compile_kernel(matmul_request(8, 520, 320, "nk", "none", False), keep=True).ptx
    assert fences_before_each_wgmma_batch(ptx) == [0, 0]


ZERO_FILLED = re.compile(r"cp\.async\.cg\.shared\.global \[[^]]+\], \[[^]]+\], 16, %r\d+;")


@pytest.mark.compile
@pytest.mark.parametrize("request_", [
    # Nemotron-3 Nano's up-projection; a k that leaves a partial k-tile, read transposed.
    matmul_request(128, 2688, 1856),
    matmul_request(8, 520, 320, "nk", "none", False),
], ids=["up_srelu_bias_nano", "dx_nk_partial_k"])
def test_gathered_matmul_compiles_for_sm90a(request_):
    ptx = ragged_call.compile_kernel(request_, keep=True, gathered="lhs").ptx
    assert_gathers_a(ptx)
    assert not ATOMIC.search(ptx)
    # Chunks past k are zero-filled (a run-time source size) only where k leaves a partial k-tile.
    assert bool(ZERO_FILLED.search(ptx)) == (request_.k % 64 != 0)


@pytest.mark.compile
def test_gathered_kernels_take_the_shared_memory_of_their_config():
    # The ring is the same; no buffer of the gathered loads' own: the chosen configs fit.
    matmul = matmul_request(256, 2048, 512)  # exactly the 227 KiB sm_90 grants a CTA
    config = ragged_call.choose_config(matmul, gathered="lhs")
    ragged_call.compile_kernel(matmul, config, gathered="lhs")
    assert ragged_call._kernel(matmul, config, "lhs").shared_storage.size_in_bytes() == config.request_bytes(
        matmul) == sm90_config.SMEM_CAPACITY
    fused = dsrelu_request(128, 2688, 1856)
    config = sm90_config.choose_config(fused)
    dsrelu_call.compile_kernel(fused, config, gathered="grad")
    assert dsrelu_call._kernel(fused, config, "grad").shared_storage.size_in_bytes() == config.smem_bytes(
        128, True, True)


@pytest.mark.compile
@pytest.mark.parametrize("request_", [dsrelu_request(128, 2688, 1856), dsrelu_request(8, 520, 320, False)],
                         ids=["nano_deterministic", "partial_k_atomic"])
def test_gathered_dsrelu_compiles_for_sm90a(request_):
    config = sm90_config.choose_config(request_)
    ptx = dsrelu_call.compile_kernel(request_, config, keep=True, gathered="grad").ptx
    assert_gathers_a(ptx)
    assert bool(ZERO_FILLED.search(ptx)) == (request_.k % 64 != 0)
    assert preact_releases_fenced(ptx) == [True] * config.subtiles


@pytest.mark.compile
@pytest.mark.parametrize("request_, gathered", [
    # dW1 = x^T dh and dW2 = act^T dy at Nemotron-3 Nano's widths (x and dy gathered);
    # widths no multiple of the tiles, float32 out.
    (contract_request(128, 2688, 1856), "lhs"),
    (contract_request(128, 1856, 2688), "rhs"),
    (contract_request(8, 520, 328, F32), "lhs"),
    (contract_request(8, 328, 520, F32), "rhs"),
], ids=["nano_dw1", "nano_dw2", "partial_a_f32", "partial_b_f32"])
def test_gathered_contraction_compiles_for_sm90a(request_, gathered):
    ptx = ragged_call.compile_kernel(request_, keep=True, gathered=gathered).ptx
    assert_gathers_a(ptx)
    # Rows past the expert are zero-filled in every k-tile.
    assert ZERO_FILLED.search(ptx)
    assert not ATOMIC.search(ptx)


@pytest.mark.compile
@pytest.mark.parametrize("n, slots, dtype", [(2688, 6, BF16), (64, 2, FP16), (12, 8, F32)], ids=str)
def test_gather_sum_compiles_for_sm90a(n, slots, dtype):
    ptx = gather_sum_call.compile_kernel(GatherSumRequest(n=n, slots=slots, rows_dtype=dtype), keep=True).ptx
    # Each of a chunk's slots one 16-byte load (the index's loads may be vectors too), the
    # float32 sums 16-byte stores; no atomics.
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4\.b32", ptx)) >= slots
    assert not re.search(r"ld\.global(\.\w+)*\.[bfu]16\b", ptx)
    assert re.search(r"st\.global(\.\w+)*\.v4\.b32", ptx)
    assert not ATOMIC.search(ptx)
    # The slots are added, never multiplied and added: each addition rounds once.
    assert len(re.findall(r"\badd(\.rn)?\.f32\b", ptx)) == (slots - 1) * 16 // dtype.itemsize
    assert not re.search(r"\bfma\.", ptx)
    ptxas.check_assembly(ptx)


class KernelsCalled:
    """Records the kernel class of every sm90 custom call made while lowering."""

    def __init__(self, monkeypatch):
        self.names: list[str] = []
        call = operands.call

        def recording(host_function, *args, **kwargs):
            self.names.append(type(host_function).__name__)
            return call(host_function, *args, **kwargs)

        monkeypatch.setattr(operands, "call", recording)


def lowered(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


T, M, K, N, E = 24, 40, 64, 32, 5
SIZES = [7, 0, 20, 3, 2]


def small_operands():
    rng = np.random.default_rng(33)
    x = jnp.asarray(rng.standard_normal((T, K)), jnp.bfloat16)
    index = jnp.asarray(rng.integers(0, T, M), jnp.int32)
    return x, index, jnp.asarray(SIZES, jnp.int32), rng


def lowered_primitives(rows_dtype=jnp.bfloat16):
    """The three gathered primitives' calls on backend="sm90", lowered for cuda."""
    x, index, group_sizes, rng = small_operands()
    w1 = jnp.asarray(rng.standard_normal((E, K, N)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((E, N, K)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    prob, b1 = jnp.ones((M,), jnp.float32), jnp.zeros((E, N), jnp.float32)
    up = lowered(lambda x, w, g, p, b, i: ragged_matmul_srelu(
        x, w, g, p, b, rhs_layout="kn", out_dtype=jnp.bfloat16, backend="sm90", lhs_index=i), x, w1, group_sizes,
        prob, b1, index)
    fused = lowered(lambda dy, w, h, p, g, i: dsrelu_primitive.bind(
        grad=dy, grad_index=i, weight=w, preact=h, prob=p, group_sizes=g, alpha=jnp.ones((E,), jnp.float32),
        grad_scale=None, weight_scale=None, with_dbias=True, with_act=True, out_dtype=jnp.bfloat16,
        deterministic=True, backend="sm90")["dh"], x, w2, h, prob, group_sizes, index)
    weights = lowered(lambda x, dh, dy, g, i: (
        ragged_contract(x, dh, g, out_dtype=jnp.bfloat16, backend="sm90", lhs_index=i),
        ragged_contract(dh, dy, g, out_dtype=jnp.bfloat16, backend="sm90", rhs_index=i)), x, h, x, group_sizes, index)
    return up, fused, weights


@pytest.mark.compile
def test_switch_off_runs_the_verified_kernels_on_rows_gathered_first(monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    called = KernelsCalled(monkeypatch)
    up, fused, weights = lowered_primitives()
    assert called.names == ["RaggedGemmSm90", "GroupedGemmDsreluSm90", "RaggedContractSm90", "RaggedContractSm90"]
    for text in (up, fused, weights):
        assert GATHER_OP.search(text)


@pytest.mark.compile
def test_switch_on_runs_the_gathered_kernels_with_no_gather_left(monkeypatch):
    monkeypatch.setenv(SWITCH, "gathered")
    called = KernelsCalled(monkeypatch)
    up, fused, weights = lowered_primitives()
    assert called.names == ["GatheredRaggedGemmSm90", "GatheredDsreluSm90", "GatheredContractSm90",
                            "GatheredRhsContractSm90"]
    for text in (up, fused, weights):
        assert CUSTOM_CALL.search(text) and not GATHER_OP.search(text)


@pytest.mark.compile
def test_a_contraction_given_both_indices_gathers_one_side_in_memory(monkeypatch):
    x, index, group_sizes, rng = small_operands()
    dh = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
    monkeypatch.setenv(SWITCH, "gathered")
    called = KernelsCalled(monkeypatch)
    text = lowered(lambda x, dh, g, i, j: ragged_contract(x, dh, g, out_dtype=jnp.bfloat16, backend="sm90",
                                                          lhs_index=i, rhs_index=j),
                   x, dh, group_sizes, index, jnp.arange(M, dtype=jnp.int32))
    assert called.names == ["GatheredContractSm90"] and GATHER_OP.search(text)


@pytest.mark.compile
def test_gather_sum_lowers_to_one_custom_call(monkeypatch):
    x, _, _, rng = small_operands()
    index = jnp.asarray(rng.integers(-2, T + 2, (9, 3)), jnp.int32)
    monkeypatch.delenv(SWITCH, raising=False)
    with pytest.raises(NotImplementedError, match=SWITCH):
        gather_sum(x, index, backend="sm90")
    # "auto" runs it on XLA even on a Hopper GPU.
    monkeypatch.setattr(registry, "cuda_compute_capability", lambda: (9, 0))
    assert not CUSTOM_CALL.search(lowered(lambda r, i: gather_sum(r, i, backend="auto"), x, index))
    monkeypatch.setenv(SWITCH, "gather_sum")
    for name in ("sm90", "auto"):
        text = lowered(lambda r, i: gather_sum(r, i, backend=name), x, index)
        assert re.findall(r"\bstablehlo\.\w+", text) == ["stablehlo.custom_call"], name


@pytest.mark.compile
def test_new_row_and_token_counts_do_not_recompile():
    matmul = ragged_call.implementation(matmul_request(E, K, N, epilogue="none", with_bias=False))
    summed = gather_sum_call.implementation(GatherSumRequest(n=K, slots=2, rows_dtype=BF16))
    rng = np.random.default_rng(3)

    def lower_both(tokens, rows):
        x = jnp.asarray(rng.standard_normal((tokens, K)), jnp.bfloat16)
        w = jnp.asarray(rng.standard_normal((E, K, N)), jnp.bfloat16)
        index = jnp.asarray(rng.integers(0, tokens, rows), jnp.int32)
        lowered(lambda x, w, g, i: matmul(lhs=x, rhs=w, group_sizes=g, lhs_index=i), x, w,
                jnp.asarray(SIZES, jnp.int32), index)
        lowered(lambda r, i: summed(rows=r, index=i), x, index[: rows // 2 * 2].reshape(-1, 2))

    lower_both(24, 40)
    before = cutlass_bridge.compile_count()
    lower_both(1000, 3000)
    assert cutlass_bridge.compile_count() == before


# ------------------------------------------------------------------------------ GPU tier


def prebuild() -> int:
    """Compiles every kernel the GPU tier below runs, as it runs them (into the disk cache
    where JAX_DSRELU_KERNEL_CACHE is set), so that the GPU machine spends no time
    compiling; returns how many."""
    built = []
    for name in GATHER_CASES:
        tokens, k, n, sizes, _ = GATHER_CASES[name]
        for variant in MATMUL_CASE_VARIANTS.values():
            request = matmul_request(len(sizes), k, n, *variant)
            config = ragged_call.choose_config(request, gathered="lhs")
            built += [ragged_call.compile_kernel(request, config), ragged_call.compile_kernel(request, gathered="lhs")]
        for deterministic in (False, True):
            request = dsrelu_request(len(sizes), k, n, deterministic)
            config = sm90_config.choose_config(request)
            built += [dsrelu_call.compile_kernel(request, config),
                      dsrelu_call.compile_kernel(request, dataclasses.replace(config, cluster_n=1), gathered="grad")]
        for out_dtype in (F32, BF16):
            for request, gathered in ((contract_request(len(sizes), k, n, out_dtype), "lhs"),
                                      (contract_request(len(sizes), n, k, out_dtype), "rhs")):
                built += [ragged_call.compile_kernel(request), ragged_call.compile_kernel(request, gathered=gathered)]
    for tokens, n, slots in GATHER_SUM_CASES:
        for dtype in (BF16, F32):
            built.append(gather_sum_call.compile_kernel(GatherSumRequest(n=n, slots=slots, rows_dtype=dtype)))
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in layer_inputs()]
    layer_value_and_grads().trace(*shapes).lower(lowering_platforms=("cuda",))
    with backend.unverified_enabled():
        layer_value_and_grads().trace(*shapes).lower(lowering_platforms=("cuda",))
    return len(built)



# (tokens T, k, n, experts' row counts, slots per token): the index routes every token to
# `slots` rows, so m = T * slots; the rows' order is the experts'.
GATHER_CASES = {
    # Empty experts between full ones, T no multiple of the 128-row tile.
    "ragged_with_empty": (1000, 520, 320, [0, 700, 1, 0, 1500, 129, 670, 0], 3),
    # Nemotron-3 Nano's widths (k = 2688 in whole k-tiles, n = 1856 in 9 tiles of 192 + 128).
    "nano_widths": (777, 2688, 1856, [300, 0, 1000, 2, 1, 1029], 3),
    # One token: every row reads source row 0, the last row of the source too.
    "one_token": (1, 64, 64, [2, 0, 3, 1], 6),
    # Rows past the experts' total belong to no expert; a partial k-tile of 8 columns.
    "unowned_rows": (333, 136, 200, [100, 250, 0], 2),
}


def gather_index(rng, tokens: int, slots: int) -> np.ndarray:
    """Each token's `slots` rows in a random expert order, the last token's rows at the
    end of the table, and a few indices outside [0, T) (the kernels clamp them)."""
    index = np.repeat(np.arange(tokens), slots)
    order = rng.permutation(tokens * slots - slots)
    index = np.concatenate([index[:-slots][order], index[-slots:]]) if tokens > 1 else index
    outside = rng.choice(index.size, size=min(3, index.size), replace=False)
    index[outside[:1]] = -5
    index[outside[1:2]] = tokens + 7
    index[outside[2:]] = tokens - 1
    return index.astype(np.int32)


def gathered_case(name, dtype=BF16):
    tokens, k, n, sizes, slots = GATHER_CASES[name]
    rng = np.random.default_rng(zlib.crc32(f"gathered{name}{dtype.name}".encode()))
    index = gather_index(rng, tokens, slots)
    x = np.asarray(jnp.asarray(rng.standard_normal((tokens, k)), dtype))
    rows = x[np.clip(index, 0, tokens - 1)]
    return rng, x, index, rows, k, n, sizes


# (rhs_layout, epilogue, with_bias) of the ragged-M GEMMs the layer runs on gathered rows.
MATMUL_CASE_VARIANTS = {"up_srelu_bias": ("kn", "srelu", True), "down_kn": ("kn", "none", False),
                        "dx_nk": ("nk", "none", False)}
# (tokens, n, slots) of the gather-and-sum: Nano's width at top-6, one token of one slot,
# a width of 17 chunks, and a width of one chunk over many tokens.
GATHER_SUM_CASES = [(1000, 2688, 6), (1, 64, 1), (333, 136, 8), (4097, 8, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(MATMUL_CASE_VARIANTS.values()), ids=list(MATMUL_CASE_VARIANTS))
@pytest.mark.parametrize("name", sorted(GATHER_CASES))
def test_gathered_matmul_is_the_verified_kernel_on_gathered_rows(hopper, name, variant):
    rng, x, index, rows, k, n, sizes = gathered_case(name)
    request = matmul_request(len(sizes), k, n, *variant)
    m = index.size
    rhs_kn = np.asarray(jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), BF16))
    rhs = rhs_kn if variant[0] == "kn" else np.ascontiguousarray(np.swapaxes(rhs_kn, 1, 2))
    extra = ()
    if variant[1] == "srelu":
        extra = (jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32),
                 jnp.asarray(rng.standard_normal((len(sizes), n)), jnp.float32))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    config = ragged_call.choose_config(request, gathered="lhs")
    run = ragged_call.implementation(request, config)
    extra = dict(zip(("prob", "bias"), extra))
    gathered = jax.jit(lambda x, i, e: run(lhs=x, rhs=jnp.asarray(rhs), group_sizes=group_sizes, lhs_index=i, **e))(
        jnp.asarray(x), jnp.asarray(index), extra)
    in_memory = jax.jit(lambda r, e: run(lhs=r, rhs=jnp.asarray(rhs), group_sizes=group_sizes, **e))(
        jnp.asarray(rows), extra)
    assert sorted(gathered) == sorted(in_memory)
    for name in gathered:
        np.testing.assert_array_equal(np.asarray(gathered[name]), np.asarray(in_memory[name]))
    if variant[1] == "none":
        check_matmul(gathered["out"], rows.astype(np.float64), rhs_kn.astype(np.float64), sizes, BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("name", sorted(GATHER_CASES))
def test_gathered_dsrelu_is_the_verified_kernel_on_gathered_rows(hopper, name, deterministic):
    rng, dy, index, rows, k, n, sizes = gathered_case(name)
    m, num_experts = index.size, len(sizes)
    weight = jnp.asarray(rng.standard_normal((num_experts, n, k)) / np.sqrt(k), BF16)
    preact = jnp.asarray(rng.standard_normal((m, n)), BF16)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, m), jnp.float32)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    alpha = jnp.asarray(rng.uniform(-2.0, 2.0, num_experts), jnp.float32)
    run = dsrelu_call.implementation(dsrelu_request(num_experts, k, n, deterministic))
    others = dict(weight=weight, preact=preact, prob=prob, group_sizes=group_sizes, alpha=alpha)
    gathered = jax.jit(lambda dy, i: run(grad=dy, grad_index=i, **others))(jnp.asarray(dy), jnp.asarray(index))
    in_memory = jax.jit(lambda r: run(grad=r, **others))(jnp.asarray(rows))
    # With atomics dprob and dbias vary in their last bits.
    exact = ("dh", "dprob", "dbias", "act", "amax") if deterministic else ("dh", "act", "amax")
    for name in exact:
        np.testing.assert_array_equal(np.asarray(gathered[name]), np.asarray(in_memory[name]))
    out = jax_dsrelu.DsreluOutputs(**{name: gathered[name] for name in jax_dsrelu.DsreluOutputs._fields})
    assert_matches_contract(out, (jnp.asarray(rows), weight, preact, prob, group_sizes), alpha=alpha, out_dtype=BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("gathered", ["lhs", "rhs", "both"])
@pytest.mark.parametrize("out_dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(GATHER_CASES))
def test_gathered_contraction_is_the_verified_kernel_on_gathered_rows(hopper, name, out_dtype, gathered):
    # lhs: dW1 = x^T dh, x gathered (a = k); rhs: dW2 = act^T dy, dy gathered (b = k);
    # both: x and another source through the same index.
    rng, x, index, rows, k, other, sizes = gathered_case(name)
    m = index.size
    dense = np.asarray(jnp.asarray(rng.standard_normal((m, other)), BF16))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    lhs, rhs = (dense, rows) if gathered == "rhs" else (rows, dense)
    request = contract_request(len(sizes), lhs.shape[1], rhs.shape[1], out_dtype)
    run = ragged_call.implementation(request)
    indices = {"lhs": dict(lhs_index=index), "rhs": dict(rhs_index=index),
               "both": dict(lhs_index=index, rhs_index=np.arange(m, dtype=np.int32))}[gathered]
    sources = {"lhs": (x, dense), "rhs": (dense, x), "both": (x, dense)}[gathered]
    got = jax.jit(lambda l, r, **i: run(lhs=l, rhs=r, group_sizes=group_sizes, **i))(*map(jnp.asarray, sources), **{
        name: jnp.asarray(value) for name, value in indices.items()})["out"]
    in_memory = jax.jit(lambda l, r: run(lhs=l, rhs=r, group_sizes=group_sizes))(jnp.asarray(lhs), jnp.asarray(rhs))["out"]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(in_memory))
    got = np.asarray(got, np.float64)
    lhs64, rhs64 = lhs.astype(np.float64), rhs.astype(np.float64)
    for e, (start, end) in enumerate(clamped_bounds(sizes, m)):
        ref = lhs64[start:end].T @ rhs64[start:end]
        bound = matmul_bound(np.abs(lhs64[start:end]).T @ np.abs(rhs64[start:end]), max(end - start, 1), ref, out_dtype)
        assert (np.abs(got[e] - ref) <= bound).all(), f"expert {e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("tokens, n, slots", GATHER_SUM_CASES, ids=str)
def test_gather_sum_is_the_sequential_sum(hopper, tokens, n, slots, dtype):
    rng = np.random.default_rng(zlib.crc32(f"sum{tokens}{n}{slots}{dtype.name}".encode()))
    m = max(tokens * slots - 3, 1)
    rows = jnp.asarray(rng.standard_normal((m, n)) * np.exp(rng.uniform(-8, 8, (m, 1))), dtype)
    index = jnp.asarray(rng.integers(-3, m + 3, (tokens, slots)), jnp.int32)
    run = jax.jit(gather_sum_call.implementation(GatherSumRequest(n=n, slots=slots, rows_dtype=dtype)))
    out = run(rows=rows, index=index)["out"]
    # XLA's reference adds the slots one after another: the same additions in the same order.
    np.testing.assert_array_equal(np.asarray(out), np.asarray(gather_sum(rows, index, backend="xla")))
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(run(rows=rows, index=index)["out"]), np.asarray(out))
    terms = np.asarray(rows, np.float64)[np.clip(np.asarray(index), 0, m - 1)]
    bound = (slots - 1) * 2.0**-24 * np.abs(terms).sum(axis=1) / (1 - slots * 2.0**-24)
    assert (np.abs(np.asarray(out, np.float64) - terms.sum(axis=1)) <= bound).all()


# The MoE layer of the switch test: T, d, f, experts, top_k.
LAYER = (1000, 256, 192, 8, 3)


def layer_inputs():
    tokens, d, f, num_experts, _ = LAYER
    rng = np.random.default_rng(41)
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((d, num_experts)) / np.sqrt(d), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((num_experts, d, f)) / np.sqrt(d), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((num_experts, f, d)) / np.sqrt(f), jnp.bfloat16)
    b1 = jnp.asarray(rng.standard_normal((num_experts, f)) * 0.1, jnp.bfloat16)
    return x, router, w1, w2, b1


def layer_value_and_grads():
    """A fresh jitted value and gradients of the layer: traced anew, so that it sees the switch as it is."""
    def loss(x, router, w1, w2, b1):
        out = jax_dsrelu.moe_layer(x, router, w1, w2, b1=b1, top_k=LAYER[-1], deterministic=True, backend="sm90")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


@pytest.mark.gpu
def test_moe_layer_gives_the_same_bits_with_the_unverified_kernels(hopper, monkeypatch):
    monkeypatch.delenv(SWITCH, raising=False)
    verified = layer_value_and_grads()(*layer_inputs())
    with backend.unverified_enabled():
        unverified = layer_value_and_grads()(*layer_inputs())
    for got, want in zip(jax.tree.leaves(unverified), jax.tree.leaves(verified)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
