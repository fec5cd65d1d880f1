"""Operands read through a row index (lhs_index, grad_index, rhs_index): the same bits as
the primitive on the gathered rows, under jit, vmap and sharded jit; what a kernel backend
receives, whether it reads gathered rows itself or not; what the MoE block asks of it."""

from __future__ import annotations

import re

import contract_numpy
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import ragged_numpy
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dsrelu
from jax_dsrelu.kernels import registry
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest, Request
from jax_dsrelu import primitive_schema as schema
from jax_dsrelu.primitives import dsrelu
from jax_dsrelu.primitives.ragged_contract import ragged_contract
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul, ragged_matmul_srelu

TOKENS, ROWS, K, N, E = 24, 56, 16, 12, 4
SIZES = [20, 0, 17, 11]  # an empty expert; the last 8 rows belong to none


def inputs(seed, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return dict(
        source=normal(TOKENS, K),
        index=jnp.asarray(rng.integers(0, TOKENS, ROWS), jnp.int32),
        rhs=normal(E, K, N),
        weight=normal(E, N, K),
        rows_n=normal(ROWS, N),
        source_n=normal(TOKENS, N),
        prob=jnp.asarray(rng.uniform(0.1, 1.0, ROWS), jnp.float32),
        bias=jnp.asarray(rng.standard_normal((E, N)), jnp.float32),
        sizes=jnp.asarray(SIZES, jnp.int32),
    )


def gathered_and_plain(a):
    """{name: (the call reading rows through the index, the call on the gathered rows)}."""
    rows = jnp.take(a["source"], a["index"], axis=0)
    rows_n = jnp.take(a["source_n"], a["index"], axis=0)
    matmul = dict(rhs_layout="kn", out_dtype=jnp.bfloat16, backend="xla")
    contract = dict(out_dtype=jnp.float32, backend="xla")
    fused = dict(
        weight=a["weight"], preact=a["rows_n"], prob=a["prob"], group_sizes=a["sizes"],
        alpha=jnp.ones((E,), jnp.float32), grad_scale=None, weight_scale=None, with_dbias=True,
        with_act=True, out_dtype=jnp.bfloat16, deterministic=True, backend="xla",
    )
    return {
        "ragged_matmul": (
            lambda: ragged_matmul(a["source"], a["rhs"], a["sizes"], lhs_index=a["index"], **matmul),
            lambda: ragged_matmul(rows, a["rhs"], a["sizes"], **matmul),
        ),
        "ragged_matmul_srelu": (
            lambda: ragged_matmul_srelu(
                a["source"], a["rhs"], a["sizes"], a["prob"], a["bias"], lhs_index=a["index"], **matmul
            ),
            lambda: ragged_matmul_srelu(rows, a["rhs"], a["sizes"], a["prob"], a["bias"], **matmul),
        ),
        "ragged_contract_lhs": (
            lambda: ragged_contract(a["source"], a["rows_n"], a["sizes"], lhs_index=a["index"], **contract),
            lambda: ragged_contract(rows, a["rows_n"], a["sizes"], **contract),
        ),
        "ragged_contract_both": (
            lambda: ragged_contract(
                a["source"], a["source_n"], a["sizes"], lhs_index=a["index"], rhs_index=a["index"], **contract
            ),
            lambda: ragged_contract(rows, rows_n, a["sizes"], **contract),
        ),
        "grouped_gemm_dsrelu": (
            lambda: dsrelu.bind(grad=a["source"], grad_index=a["index"], **fused),
            lambda: dsrelu.bind(grad=rows, **fused),
        ),
    }


def assert_bits_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("call", list(gathered_and_plain(inputs(0))))
def test_a_gathered_operand_gives_the_bits_of_its_rows(call):
    gathered, plain = gathered_and_plain(inputs(1))[call]
    assert_bits_equal(jax.jit(gathered)(), jax.jit(plain)())


def test_indices_outside_the_source_are_clamped():
    a = inputs(2)
    index = jnp.asarray(np.r_[[-5, TOKENS, TOKENS + 100], np.zeros(ROWS - 3)], jnp.int32)
    clamped = jnp.clip(index, 0, TOKENS - 1)
    run = lambda i: ragged_matmul(  # noqa: E731
        a["source"], a["rhs"], a["sizes"], rhs_layout="kn", out_dtype=jnp.float32, backend="xla", lhs_index=i
    )
    assert_bits_equal(run(index), run(clamped))


@pytest.mark.parametrize("batched", [("source",), ("index",), ("source", "index")], ids="+".join)
def test_batched_index_or_source_equals_each_element(batched):
    parts = [inputs(10 + b) for b in range(3)]
    names = ("source", "index")

    def run(source, index):
        return ragged_matmul(
            source, parts[0]["rhs"], parts[0]["sizes"], rhs_layout="kn", out_dtype=jnp.float32,
            backend="xla", lhs_index=index,
        )

    in_axes = tuple(0 if n in batched else None for n in names)
    args = [jnp.stack([p[n] for p in parts]) if n in batched else parts[0][n] for n in names]
    mapped = jax.jit(jax.vmap(run, in_axes=in_axes))(*args)
    for b in range(3):
        one = run(*(parts[b][n] if n in batched else parts[0][n] for n in names))
        assert_bits_equal(mapped[b], one)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_rows_split_over_devices_read_the_whole_source(axis_type):
    """The index is split with the rows; every device reads any token of the source. Each
    device's GEMM has 8 rows where the one-device program's has 64, and XLA:CPU may block
    its K otherwise for another shape (some hosts do), so both are held to the float32
    accumulation bound of the exact product, which a value 4 bounds off fails."""
    a = inputs(3)
    a["index"] = jnp.concatenate([a["index"], a["index"][:8]])  # 64 rows: 8 per device
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis_type,))
    split = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731

    def step(source, index, rhs, sizes):
        return ragged_matmul(source, rhs, sizes, rhs_layout="kn", out_dtype=jnp.float32, backend="xla",
                             lhs_index=index)

    want = jax.jit(step)(a["source"], a["index"], a["rhs"], a["sizes"])
    got = jax.jit(step)(split(a["source"], P("data")), split(a["index"], P("data")), split(a["rhs"], P()),
                        split(a["sizes"], P()))
    assert got.sharding.spec[0] == "data"
    exact, terms = ragged_numpy.ragged_matmul(np.asarray(jnp.take(a["source"], a["index"], axis=0)), a["rhs"], SIZES)
    bound = contract_numpy.tolerance(terms, K)
    for result in (got, want):
        assert not contract_numpy.outside_bound(result, exact, bound).any()
    planted = np.asarray(got, np.float64) + np.where(np.arange(got.size).reshape(got.shape) == 7, 4 * bound, 0.0)
    assert contract_numpy.outside_bound(planted, exact, bound).sum() == 1


def test_gathered_grad_is_refused_with_mxfp8_operands():
    a = inputs(4)
    with pytest.raises(NotImplementedError, match="grad_index"):
        dsrelu.bind(
            grad=a["source"], grad_index=a["index"], weight=a["weight"], preact=a["rows_n"], prob=a["prob"],
            group_sizes=a["sizes"], alpha=jnp.ones((E,), jnp.float32), grad_scale=a["source"],
            weight_scale=a["weight"], with_dbias=False, with_act=False, out_dtype=jnp.bfloat16,
            deterministic=False, backend="xla",
        )


def test_schema_letters_and_kernel_arguments_of_a_gathered_operand():
    s = schema.RAGGED_MATMUL
    params = dict(rhs_layout="kn", out_dtype=np.float32, with_lhs_index=True, block_scaled=False)
    assert [f.letters(params) for f in s.operand_fields(params)] == [("t", "k"), ("e", "k", "n"), ("e",), ("m",)]
    assert s.result_shapes([(9, 4), (3, 4, 5), (3,), (7,)], params) == [((7, 5), np.dtype(np.float32))]
    # The index is an argument by name beside the source.
    assert s.call_arguments(["source", "rhs", "sizes", "index"], params) == dict(
        lhs="source", rhs="rhs", group_sizes="sizes", lhs_index="index"
    )
    assert [f.name for f in s.index_fields(params)] == ["lhs_index"]
    assert "t" in s.kept_whole


# ------------------------------------------------------------------ kernel backends


class RecordingBackend:
    """A kernel backend for every request that records what it is given and computes
    nothing (its results are opaque custom calls of the calls' m rows): it reads through
    a row index the operands named in `reads`."""

    NAME = "sm90"
    DEVICE_DESCRIPTION = "any GPU (a stand-in for tests)"

    def __init__(self, reads: frozenset, rows: int):
        self.reads, self.rows = reads, rows
        self.calls: list = []

    def software_missing(self):
        return None

    def supports_compute_capability(self, capability):
        return True

    def cannot_implement(self, request):
        return None

    def gathers_rows(self, request):
        return self.reads

    def implementation(self, request):
        def run(**operands):
            self.calls.append((type(request).__name__, {k: tuple(v.shape) for k, v in operands.items()}))
            return {
                name: jax.ffi.ffi_call("jax_dsrelu_stand_in", jax.ShapeDtypeStruct(shape, dtype))(*operands.values())
                for name, (shape, dtype) in self.result_shapes(request).items()
            }

        return run

    def result_shapes(self, request):
        m = self.rows
        if isinstance(request, RaggedMatmulRequest):
            names = ("h", "act") if request.epilogue == "srelu" else ("out",)
            return {name: ((m, request.n), request.out_dtype) for name in names}
        if isinstance(request, RaggedContractRequest):
            return dict(out=((request.num_experts, request.a, request.b), request.out_dtype))
        assert isinstance(request, Request)
        shapes = dict(dh=((m, request.n), request.out_dtype), dprob=((m,), np.float32))
        if request.with_dbias:
            shapes["dbias"] = ((request.num_experts, request.n), np.float32)
        if request.with_act:
            shapes["act"] = ((m, request.n), request.out_dtype)
        return dict(shapes, amax=((request.num_experts,), np.float32))


def lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("reads", [frozenset(), frozenset({"lhs"})], ids=["gathers_none", "reads_lhs"])
def test_a_backend_gets_the_rows_or_the_source_and_index(monkeypatch, reads):
    backend = RecordingBackend(reads, ROWS)
    monkeypatch.setattr(registry, "kernel_backend", lambda name: backend)
    a = inputs(5)
    lowered_for_cuda(
        lambda s, i, r, g: ragged_matmul(s, r, g, rhs_layout="kn", out_dtype=jnp.bfloat16, backend="sm90",
                                         lhs_index=i),
        a["source"], a["index"], a["rhs"], a["sizes"],
    )
    if reads:
        assert backend.calls == [
            ("RaggedMatmulRequest", dict(lhs=(TOKENS, K), rhs=(E, K, N), group_sizes=(E,), lhs_index=(ROWS,)))
        ]
    else:
        assert backend.calls == [("RaggedMatmulRequest", dict(lhs=(ROWS, K), rhs=(E, K, N), group_sizes=(E,)))]


def test_the_block_reads_its_rows_through_the_routing(monkeypatch):
    # Every GEMM of the routed experts that reads tokens or their gradient reads them
    # through the routing's index: the up-projection (x), the fused dsReLU kernel (dy),
    # dW1 (x) and dW2 (dy); none gets a (T * top_k, d) copy of x or dy.
    tokens, d, f, experts, top_k = 24, 32, 16, 4, 2
    backend = RecordingBackend(frozenset({"lhs", "rhs", "grad"}), tokens * top_k)
    monkeypatch.setattr(registry, "kernel_backend", lambda name: backend)
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.standard_normal((tokens, d)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((d, experts)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((experts, d, f)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((experts, f, d)), jnp.bfloat16)

    def loss(x, router, w1, w2):
        out = jax_dsrelu.moe_layer(x, router, w1, w2, top_k=top_k, backend="sm90")
        return jnp.sum(out.astype(jnp.float32))

    lowered_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), x, router, w1, w2)
    m = tokens * top_k
    assert backend.calls == [
        ("RaggedMatmulRequest",
         dict(lhs=(tokens, d), rhs=(experts, d, f), group_sizes=(experts,), prob=(m,), lhs_index=(m,))),
        ("RaggedMatmulRequest", dict(lhs=(m, f), rhs=(experts, f, d), group_sizes=(experts,))),
        ("Request", dict(grad=(tokens, d), weight=(experts, f, d), preact=(m, f), prob=(m,), group_sizes=(experts,),
                         alpha=(experts,), grad_index=(m,))),
        ("RaggedMatmulRequest", dict(lhs=(m, f), rhs=(experts, d, f), group_sizes=(experts,))),
        ("RaggedContractRequest", dict(lhs=(tokens, d), rhs=(m, f), group_sizes=(experts,), lhs_index=(m,))),
        ("RaggedContractRequest", dict(lhs=(m, f), rhs=(tokens, d), group_sizes=(experts,), rhs_index=(m,))),
    ]


@pytest.mark.compile
def test_the_block_lowers_to_the_sm90_kernels():
    # The whole block's training step for cuda on the real sm90 backend: the routed and
    # the shared expert's six GEMMs each on a kernel, the gathered operands gathered for
    # kernels that load rows in place, and no scatter anywhere.
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    s, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    tokens, d, f, experts, fs = 512, 256, 512, 8, 512

    def loss(x, router, w1, w2, shared_w1, shared_w2, bias):
        out = jax_dsrelu.moe_layer(
            x, router, w1, w2, top_k=2, score="sigmoid", expert_bias=bias, normalize=True,
            shared_w1=shared_w1, shared_w2=shared_w2, deterministic=True, backend="sm90",
        )
        return jnp.sum(out.astype(jnp.float32))

    args = (
        s((tokens, d), bf16), s((d, experts), jnp.float32), s((experts, d, f), bf16), s((experts, f, d), bf16),
        s((d, fs), bf16), s((fs, d), bf16), s((experts,), jnp.float32),
    )
    text = lowered_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4, 5)), *args)
    kernels = [t for t in re.findall(r"stablehlo\.custom_call @(\w+)", text) if t == "CuteDSLRT_NvJaxCutlassCall_v2"]
    assert len(kernels) == 12
    assert not re.search(r"\bstablehlo\.scatter\b", text)
