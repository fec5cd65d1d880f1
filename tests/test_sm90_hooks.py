"""The sm90 kernel skeleton's hooks: each is what a variant of `GemmSm90` is made of.

CPU checks of the operand declarations and the call plans that follow from them, and
compile-tier checks (marked `compile`, no GPU) that a small variant overriding a hook
compiles for sm_90a and changes the kernel where, and only where, the hook says: a
variant is its hooks.
"""

from __future__ import annotations

import os

# Before anything imports CuTe DSL: on a machine without a GPU it cannot detect one.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import dataclasses  # noqa: E402
import importlib  # noqa: E402
import inspect  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

import jax_dsrelu.kernels.sm90 as sm90_package  # noqa: E402
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest, Request  # noqa: E402
from jax_dsrelu.kernels.sm90 import config as sm90_config  # noqa: E402
from jax_dsrelu.kernels import operands  # noqa: E402
from jax_dsrelu.kernels.sm90 import dsrelu_call, mainloop, ragged_call, schedule  # noqa: E402
from jax_dsrelu.kernels.sm90.arch import ARCH  # noqa: E402
from jax_dsrelu.kernels.sm90.dsrelu_kernel import GroupedGemmDsreluSm90  # noqa: E402
from jax_dsrelu.kernels.sm90.gemm_base import GemmSm90  # noqa: E402
from jax_dsrelu.kernels.sm90.ragged_contract_kernel import RaggedContractSm90  # noqa: E402
from jax_dsrelu.kernels.sm90.ragged_matmul_kernel import RaggedGemmSm90  # noqa: E402

BF16 = np.dtype("bfloat16")
F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


def dsrelu_request(deterministic, with_dbias=True, with_act=True):
    return Request(num_experts=5, n=512, k=256, operand_dtype=BF16, preact_dtype=BF16, prob_dtype=F32,
                   out_dtype=BF16, with_dbias=with_dbias, with_act=with_act, deterministic=deterministic)


def matmul_request(rhs_layout="kn", epilogue="none", with_bias=False, n=384):
    return RaggedMatmulRequest(num_experts=8, k=512, n=n, rhs_layout=rhs_layout, operand_dtype=BF16,
                               out_dtype=BF16, epilogue=epilogue, with_bias=with_bias)


CONTRACT = RaggedContractRequest(num_experts=8, a=512, b=384, operand_dtype=BF16, out_dtype=F32)


# ------------------------------------------------------------- the declarations (CPU)


def test_only_the_base_defines_the_host_function_and_the_kernel():
    variants = []
    for module in pkgutil.iter_modules(sm90_package.__path__):
        for _, cls in inspect.getmembers(importlib.import_module(f"{sm90_package.__name__}.{module.name}"),
                                         inspect.isclass):
            if issubclass(cls, GemmSm90) and cls is not GemmSm90:
                variants.append(cls)
                assert "__call__" not in vars(cls) and "kernel" not in vars(cls), cls
    assert {GroupedGemmDsreluSm90, RaggedGemmSm90, RaggedContractSm90} <= set(variants)


def undeclared_calls(cls) -> set[str]:
    """The methods `cls`'s own source calls on self that `cls` itself does not declare."""
    called = set(re.findall(r"self\.([A-Za-z_]\w*)\(", inspect.getsource(cls)))
    return {name for name in called if name not in vars(cls)}


def test_every_hook_the_base_calls_is_declared_on_it():
    assert undeclared_calls(GemmSm90) == set()

    class Partial(GemmSm90):
        def _work_item(self, ctx, tile, *states):
            return self.a_hook_declared_nowhere(ctx, tile)

    # The check sees a call to an undeclared method.
    assert undeclared_calls(Partial) == {"a_hook_declared_nowhere"}


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_dsrelu_call_plan_is_its_declaration(deterministic):
    request = dsrelu_request(deterministic)
    config = sm90_config.choose_config(request)
    plan = dsrelu_call.operands(request, config)
    inputs, outputs, aliases = operands.call_layout(plan, outputs_in_place=False)
    names = lambda ops: [o.name for o in ops]  # noqa: E731
    assert names(plan) == names(inputs) + [o.name for o in outputs if o.role == "output"]
    if deterministic:
        # dprob and dbias written whole by the reduction, the GEMM's partials in slots.
        assert names(inputs) == ["grad", "weight", "preact", "prob", "group_sizes", "alpha", "amax"]
        assert names(outputs) == ["amax", "dh", "act", "dprob", "dbias", "dprob_slots", "dbias_slots"]
        assert aliases == {6: 0}
        slots = {o.name: o for o in plan}
        n_tiles = -(-512 // config.tile_n)  # the N-tiles of n = 512: a dprob slot row each
        assert slots["dprob_slots"].shape_for(1000) == (n_tiles, 1000)
        assert slots["dbias_slots"].shape_for(1000) == (sm90_config.max_m_tiles(1000, 5, config.tile_m), 512)
        assert slots["dprob_slots"].operand.varying == (1,) and slots["dbias_slots"].operand.varying == (0,)
    else:
        # amax, dprob and dbias zero-filled by XLA and updated by the kernel's atomics.
        assert names(inputs) == ["grad", "weight", "preact", "prob", "group_sizes", "alpha", "amax", "dprob", "dbias"]
        assert names(outputs) == ["amax", "dprob", "dbias", "dh", "act"]
        assert aliases == {6: 0, 7: 1, 8: 2}
    # With every output in place, the host function still takes the plan's order.
    inputs, outputs, aliases = operands.call_layout(plan, outputs_in_place=True)
    assert names(inputs) == names(plan) and len(aliases) == len(outputs)
    # The compile description: m varies, the rest is fixed; weight seen as (n, k, E).
    weight = plan[1]
    assert plan[0].operand == operands.Operand(BF16, 2, varying=(0,)) and plan[0].shape_for(1) == (1, 256)
    assert weight.operand.mode == (1, 2, 0) and weight.shape_for(7) == (5, 512, 256)


def test_the_gemm_call_plans_are_their_declarations():
    def plan(request):
        return [(o.name, o.role, o.shape_for(10), o.mode) for o in ragged_call.operands(request)]

    assert plan(matmul_request("kn")) == [
        ("lhs", "input", (10, 512), None), ("rhs", "input", (8, 512, 384), (2, 1, 0)),
        ("group_sizes", "input", (8,), None), ("out", "output", (10, 384), None),
    ]
    assert plan(matmul_request("nk", "srelu", True)) == [
        ("lhs", "input", (10, 512), None), ("rhs", "input", (8, 384, 512), (1, 2, 0)),
        ("group_sizes", "input", (8,), None), ("prob", "input", (10,), None), ("bias", "input", (8, 384), None),
        ("h", "output", (10, 384), None), ("act", "output", (10, 384), None),
    ]
    assert plan(CONTRACT) == [
        ("lhs", "input", (10, 512), (1, 0)), ("rhs", "input", (10, 384), (1, 0)),
        ("group_sizes", "input", (8,), None), ("out", "output", (8, 512, 384), (1, 2, 0)),
    ]


def test_majorness_follows_from_the_declared_mode_order():
    def kernel(request):
        return ragged_call._kernel(request, ragged_call.choose_config(request))

    # A (m, k) rows are K-major; rhs stored (E, k, n) is N-major, (E, n, k) K-major; the
    # contraction's (m, a) and (m, b), contracted over m, are both MN-major.
    assert kernel(matmul_request("kn")).major("lhs") == LayoutEnum.ROW_MAJOR
    assert kernel(matmul_request("kn")).major("rhs") == LayoutEnum.COL_MAJOR
    assert kernel(matmul_request("nk")).major("rhs") == LayoutEnum.ROW_MAJOR
    assert kernel(CONTRACT).major("lhs") == kernel(CONTRACT).major("rhs") == LayoutEnum.COL_MAJOR


def test_the_host_function_refuses_tensors_that_are_not_its_declaration():
    kernel = ragged_call._kernel(CONTRACT, ragged_call.choose_config(CONTRACT))
    with pytest.raises(ValueError, match=r"RaggedContractSm90 takes \['lhs', 'rhs', 'group_sizes', 'out'\], got 3"):
        operands.by_name(kernel.operands(), [1, 2, 3], type(kernel).__name__)
    with pytest.raises(ValueError, match="role must be one of"):
        operands.KernelOperand("x", "scratch", F32, (4,))
    with pytest.raises(ValueError, match=r"mode must order the axes of shape \(4, 2\), got \(0, 2\)"):
        operands.KernelOperand("x", "input", F32, (4, 2), mode=(0, 2))


def test_a_call_without_a_declared_input_names_it():
    with pytest.raises(ValueError, match=r"needs \['group_sizes'\]"):
        operands.call(None, None, ragged_call.operands(CONTRACT), dict(lhs=None, rhs=None), 10, arch=ARCH)


# -------------------------------------------------------------- variants (compile tier)


def compiled_ptx(kernel) -> str:
    key = ("tests.test_sm90_hooks", type(kernel).__name__, kernel.request, kernel.config)
    return operands.compile_kernel(kernel, key, kernel.operands(), arch=ARCH, keep=True).ptx


def without_kernel_names(ptx: str) -> str:
    """The PTX with its kernels' names, which spell their class and module, replaced."""
    for name in re.findall(r"\.entry (\w+)\(", ptx):
        ptx = ptx.replace(name, "KERNEL")
    return ptx


def gemm(cls, request, config=None):
    return cls(config or sm90_config.choose_gemm_config(request), request)


@pytest.fixture(scope="module")
def plain():
    """The stock ragged-M GEMM the variants below change, compiled (its shared-memory
    struct is known once compiled)."""
    kernel = gemm(RaggedGemmSm90, matmul_request())
    return SimpleNamespace(kernel=kernel, ptx=compiled_ptx(kernel))


class TripledGemm(RaggedGemmSm90):
    """out = 3 acc: another epilogue visit."""

    def epilogue_visit(self, ctx, item, tile, subtile):
        for v in range(ctx.sub_values):
            ctx.registers[0][v] = ctx.acc[subtile * ctx.sub_values + v] * Float32(3.0)


@pytest.mark.compile
def test_epilogue_visit_is_what_the_variant_stores(plain):
    ptx = compiled_ptx(gemm(TripledGemm, matmul_request()))
    three = re.compile(r"mul(\.rn)?\.f32\s+%\w+, %\w+, 0f40400000;")
    assert three.search(ptx) and not three.search(plain.ptx)


class PlusC(RaggedGemmSm90):
    """out = acc + c, with c (m, n) an epilogue input: loaded by producer warp 1, subtile
    by subtile, through its own ring."""

    epilogue_input = "c"
    epilogue_input_stages = 2

    def operands(self):
        plan = super().operands()
        c = operands.KernelOperand("c", "input", BF16, (operands.M, self.n))
        return plan[:3] + [c] + plan[3:]

    def epilogue_visit(self, ctx, item, tile, subtile):
        c = ctx.input_registers  # the subtile of c, in float32
        for v in range(ctx.sub_values):
            ctx.registers[0][v] = ctx.acc[subtile * ctx.sub_values + v] + c[v]


@pytest.mark.compile
def test_an_epilogue_input_is_loaded_by_a_producer_warp_of_its_own(plain):
    kernel = gemm(PlusC, matmul_request())
    ptx = compiled_ptx(kernel)
    # One more TMA load site (warp 1's), ldmatrix of c in the epilogue, and c's ring (two
    # stages of 128 x 32 bf16 buffers) in shared memory.
    tma_loads = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global")
    assert len(tma_loads.findall(ptx)) > len(tma_loads.findall(plain.ptx))
    assert "ldmatrix" in ptx and "ldmatrix" not in plain.ptx
    assert kernel.shared_storage.size_in_bytes() - plain.kernel.shared_storage.size_in_bytes() == 2 * 128 * 32 * 2


class CountedTiles(RaggedGemmSm90):
    """Counts each expert's work items into `tiles` (E,), an accumulate operand: its
    declaration makes it a zero-filled input aliased to an output, its kernel parameter
    reaches the epilogue's end, which adds one per tile."""

    def operands(self):
        plan = super().operands()
        return plan[:3] + [operands.KernelOperand("tiles", "accumulate", I32, (self.num_experts,))] + plan[3:]

    def kernel_params(self, t):
        return dict(super().kernel_params(t), tiles=t.tiles)

    @cute.jit
    def epilogue_end(self, ctx, item, tile):
        if ctx.ctid == 0:
            cute.arch.atomic_add(ctx.params.tiles.iterator + tile.expert, Int32(1))


@pytest.mark.compile
def test_kernel_params_and_epilogue_end_reach_the_kernel(plain):
    kernel = gemm(CountedTiles, matmul_request())
    inputs, outputs, aliases = operands.call_layout(kernel.operands(), outputs_in_place=False)
    assert [o.name for o in inputs][-1] == "tiles" and [o.name for o in outputs] == ["tiles", "out"]
    assert aliases == {3: 0}
    ptx = compiled_ptx(kernel)
    atomic_add = re.compile(r"\b(atom|red)(\.\w+)*\.add(\.\w+)*\.[us]32\b")
    assert atomic_add.search(ptx) and not atomic_add.search(plain.ptx)


class ScaledPerExpert(RaggedGemmSm90):
    """out = scale[e] acc: a per-expert scalar loaded before the mainloop
    (epilogue_prefetch), read in the visit; and a shared scratch buffer of the epilogue's
    (epilogue_scratch), which the consumers see as ctx.scratch."""

    epilogue_scratch = (Float32, (8, 128))

    def operands(self):
        plan = super().operands()
        return plan[:3] + [operands.KernelOperand("scale", "input", F32, (self.num_experts,))] + plan[3:]

    def kernel_params(self, t):
        return dict(super().kernel_params(t), scale=t.scale)

    def epilogue_prefetch(self, ctx, tile):
        return SimpleNamespace(scale=ctx.params.scale[tile.expert])

    def epilogue_visit(self, ctx, item, tile, subtile):
        for v in range(ctx.sub_values):
            ctx.registers[0][v] = ctx.acc[subtile * ctx.sub_values + v] * item.scale


@pytest.mark.compile
def test_epilogue_prefetch_and_scratch_reach_the_kernel(plain):
    kernel = gemm(ScaledPerExpert, matmul_request())
    ptx = compiled_ptx(kernel)
    # The scale is a global load of 32 bits the plain kernel does not have beside its
    # group sizes; the scratch buffer is 4 KiB more shared memory.
    load = re.compile(r"ld\.global(\.\w+)*\.[bf]32\b")
    assert len(load.findall(ptx)) > len(load.findall(plain.ptx))
    assert kernel.shared_storage.size_in_bytes() - plain.kernel.shared_storage.size_in_bytes() == 4096


class ContractAFastest(RaggedContractSm90):
    """The contraction whose schedule hook walks a-blocks fastest, whatever its config."""

    def make_schedule(self, tables, num_rows):
        row_start, expert_order = tables
        first, stride, rank = self._cluster_walk()
        return schedule.ContractSchedule(row_start, expert_order, self.num_experts, self.a_blocks, self.b_blocks,
                                         first, stride, self.config.cluster_n, rank, True)


@pytest.mark.compile
def test_the_work_schedule_is_the_variants_hook():
    config = sm90_config.choose_contract_config(CONTRACT)
    assert not config.a_fastest
    hooked = compiled_ptx(ContractAFastest(config, CONTRACT))
    by_config = compiled_ptx(RaggedContractSm90(dataclasses.replace(config, a_fastest=True), CONTRACT))
    stock = compiled_ptx(RaggedContractSm90(config, CONTRACT))
    assert without_kernel_names(hooked) == without_kernel_names(by_config) != without_kernel_names(stock)


class PairsWithoutMulticast(RaggedGemmSm90):
    """Cluster pairs whose CTAs each load their own A tile, not half of it for both: the
    A-load hooks a gathered-A variant overrides (its source, partition, k-tile loop and
    operand ring)."""

    def a_source(self, t, a_layout):
        return self._tma_load(t.lhs, a_layout, (self.tile_m, self.tile_k))

    def partition_a(self, copy_a, sA, gA, rank):
        return mainloop.tma_partition(copy_a, sA, gA)

    def load_k_tiles(self, copy_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles, staged):
        return mainloop.load_k_tiles(copy_a, tAgA, tAsA, tma_b, tBgB, tBsB, ab_pipeline, state, k_tiles, staged=staged)

    def operand_pipeline(self, storage, a_layout, b_layout):
        # Each CTA's stages are its own: released by its own consumers only.
        return self._tma_pipeline(
            storage.ab_barriers, self.config.ab_stages,
            cute.size_in_bytes(self.ab_dtype, cute.slice_(a_layout, (None, None, 0)))
            + cute.size_in_bytes(self.ab_dtype, cute.slice_(b_layout, (None, None, 0))),
        )


@pytest.mark.compile
def test_how_a_is_loaded_is_the_variants_hook():
    request = matmul_request(n=512)  # two N-tiles of 256: one pair
    config = dataclasses.replace(sm90_config.choose_gemm_config(request), cluster_n=2)
    stock = compiled_ptx(RaggedGemmSm90(config, request))
    hooked = compiled_ptx(PairsWithoutMulticast(config, request))
    assert "multicast::cluster" in stock and "mapa.shared::cluster" in stock
    assert "multicast::cluster" not in hooked and "mapa.shared::cluster" not in hooked
    assert "barrier.cluster.wait" in hooked and "wgmma.mma_async" in hooked
