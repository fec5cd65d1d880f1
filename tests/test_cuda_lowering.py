"""The CUDA lowering path of ragged_dot and moe_mlp, lowered for cuda on a machine
without a GPU.

Plumbing (CPU, CI): `backend_choice.kernel_backend` is replaced by a stand-in backend
that records every request and the arguments its implementation receives, computes the
XLA reference (or, opaque, nothing) and passes its results through a custom call of its
own, so the lowered module shows where a kernel would run.

Kernels (marked `compile`): the real `backend="sm90"` lowering, with no XLA ragged dot
and no scatter left; expected to fail until the sm90 grouped-GEMM kernels exist.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layer import make_layer_inputs

import jax_dsrelu
from jax_dsrelu.kernels import registry as backend_choice
from jax_dsrelu.primitives import dsrelu as primitive
from jax_dsrelu.primitives.ragged_contract import ragged_contract_primitive
from jax_dsrelu.primitives.ragged_matmul import ragged_matmul_primitive, ragged_matmul_srelu_primitive
from jax_dsrelu.kernels.request import RaggedContractRequest, RaggedMatmulRequest, Request

STAND_IN_TARGET = "jax_dsrelu_stand_in"
CUSTOM_CALL = re.compile(r"stablehlo\.custom_call @(\w+)")
RAGGED_OP = re.compile(r"\b(stablehlo|chlo|mhlo)\.ragged\w*")
SCATTER_OP = re.compile(r"\b(stablehlo|mhlo)\.scatter\b")


def reference_of(request):
    """The primitive serving this request: (its reference, the reference's params)."""
    if isinstance(request, Request):
        return primitive.grouped_gemm_dsrelu.reference, dict(
            with_dbias=request.with_dbias,
            with_act=request.with_act,
            out_dtype=request.out_dtype,
            deterministic=request.deterministic,
            block_scaled=request.block_scaled,
            blockwise_scaled=request.blockwise_scaled,
        )
    if isinstance(request, RaggedContractRequest):
        return ragged_contract_primitive.reference, dict(out_dtype=request.out_dtype, block_scaled=request.block_scaled,
                                                         quantize=False)
    params = dict(rhs_layout=request.rhs_layout, out_dtype=request.out_dtype, block_scaled=request.block_scaled)
    if request.epilogue == "srelu":
        return ragged_matmul_srelu_primitive.reference, dict(params, with_bias=request.with_bias, with_act=request.with_act)
    return ragged_matmul_primitive.reference, params


class StandInBackend:
    """A kernel backend for every request, on every GPU, with no kernel."""

    NAME = "sm90"
    DEVICE_DESCRIPTION = "any GPU (a stand-in for tests)"

    def __init__(self, opaque: bool):
        self.opaque = opaque
        self.requests: list = []
        self.arguments: list[list] = []

    def software_missing(self):
        return None

    def supports_compute_capability(self, capability):
        return True

    def cannot_implement(self, request):
        return None

    def gathers_rows(self, request):
        # Reads every operand in place: the primitives gather any row-indexed operand first.
        return frozenset()

    def implementation(self, request):
        self.requests.append(request)
        reference, params = reference_of(request)

        def run(**operands):
            self.arguments.append({name: (tuple(a.shape), np.dtype(a.dtype)) for name, a in operands.items()})
            if self.opaque:
                results = jax.eval_shape(lambda o: reference(**o, **params), operands)
            else:
                results = reference(**operands, **params)
            inputs = list(operands.values()) if self.opaque else list(results.values())
            return {
                name: jax.ffi.ffi_call(STAND_IN_TARGET, jax.ShapeDtypeStruct(r.shape, r.dtype))(*inputs)
                for name, r in results.items()
            }

        return run


@pytest.fixture(params=[False, True], ids=["reference", "opaque"])
def stand_in(request, monkeypatch):
    backend = StandInBackend(opaque=request.param)
    monkeypatch.setattr(backend_choice, "kernel_backend", lambda name: backend)
    return backend


def lowered_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


M, K, N, E = 40, 24, 16, 5  # all distinct, so every argument's place shows in its shape


def ragged_dot_args(dtype=jnp.bfloat16):
    rng = np.random.default_rng(60)
    return (
        jnp.asarray(rng.standard_normal((M, K)), dtype),
        jnp.asarray(rng.standard_normal((E, K, N)), dtype),
        jnp.asarray([7, 0, 20, 3, 2], jnp.int32),
        jnp.asarray(rng.standard_normal((M, N)), dtype),
    )


def ragged_dot_step(backend):
    def step(lhs, rhs, group_sizes, cotangent):
        out, vjp = jax.vjp(lambda l, r: jax_dsrelu.ragged_dot(l, r, group_sizes, backend=backend), lhs, rhs)
        return (out, *vjp(cotangent))

    return step


def test_ragged_dot_requests_and_argument_order(stand_in):
    text = lowered_for_cuda(ragged_dot_step("sm90"), *ragged_dot_args())
    bf16, i32 = np.dtype(jnp.bfloat16), np.dtype(np.int32)
    assert stand_in.requests == [
        RaggedMatmulRequest(num_experts=E, k=K, n=N, rhs_layout="kn", operand_dtype=bf16, out_dtype=bf16),
        # d lhs = d out @ rhs[e]^T: rhs (E, k, n) read as (E, n', k') = (E, K, N) in place.
        RaggedMatmulRequest(num_experts=E, k=N, n=K, rhs_layout="nk", operand_dtype=bf16, out_dtype=bf16),
        RaggedContractRequest(num_experts=E, a=K, b=N, operand_dtype=bf16, out_dtype=bf16),
    ]
    assert stand_in.arguments == [
        dict(lhs=((M, K), bf16), rhs=((E, K, N), bf16), group_sizes=((E,), i32)),
        dict(lhs=((M, N), bf16), rhs=((E, K, N), bf16), group_sizes=((E,), i32)),
        dict(lhs=((M, K), bf16), rhs=((M, N), bf16), group_sizes=((E,), i32)),
    ]
    assert CUSTOM_CALL.findall(text).count(STAND_IN_TARGET) == 3
    if stand_in.opaque:
        assert not RAGGED_OP.search(text) and not SCATTER_OP.search(text)
        assert "stablehlo.transpose" not in text


def moe_step(backend, with_bias=True):
    def loss(x, w1, w2, prob, b1, group_sizes):
        y = jax_dsrelu.moe_mlp(
            x, w1, w2, prob, group_sizes, b1=b1 if with_bias else None, deterministic=True, backend=backend
        )
        return jnp.sum(y.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))


D, F = 24, 16


def moe_args(dtype=jnp.bfloat16):
    x, w1, w2, prob, b1 = make_layer_inputs(np.random.default_rng(61), M, D, F, [7, 0, 20, 3, 2], dtype)
    return x, w1, w2, prob, b1, jnp.asarray([7, 0, 20, 3, 2], jnp.int32)


@pytest.mark.parametrize("with_bias", [True, False])
def test_moe_mlp_runs_every_gemm_on_the_backend(stand_in, with_bias):
    text = lowered_for_cuda(moe_step("sm90", with_bias), *moe_args())
    bf16, f32, i32 = np.dtype(jnp.bfloat16), np.dtype(np.float32), np.dtype(np.int32)
    kinds = [
        (type(r).__name__, getattr(r, "epilogue", None), getattr(r, "rhs_layout", None))
        for r in stand_in.requests
    ]
    assert kinds == [
        ("RaggedMatmulRequest", "srelu", "kn"),  # h and act
        ("RaggedMatmulRequest", "none", "kn"),  # y
        ("Request", None, None),  # the fused dsReLU backward
        ("RaggedMatmulRequest", "none", "nk"),  # dx = dh @ w1[e]^T
        ("RaggedContractRequest", None, None),  # dw1
        ("RaggedContractRequest", None, None),  # dw2
    ]
    srelu, y, fused, dx, dw1, dw2 = stand_in.requests
    assert srelu.with_bias == with_bias and (srelu.k, srelu.n) == (D, F)
    assert fused.with_act and fused.with_dbias == with_bias and fused.deterministic
    assert (dx.k, dx.n, dw1.a, dw1.b, dw2.a, dw2.b) == (F, D, D, F, F, D)
    bias = dict(bias=((E, F), f32)) if with_bias else {}
    assert stand_in.arguments[0] == dict(
        lhs=((M, D), bf16), rhs=((E, D, F), bf16), group_sizes=((E,), i32), prob=((M,), f32), **bias
    )
    # The fused backward gets grad = dy, weight = w2 as stored (E, f, d), preact = h.
    assert stand_in.arguments[2] == dict(
        grad=((M, D), bf16), weight=((E, F, D), bf16), preact=((M, F), bf16), prob=((M,), f32),
        group_sizes=((E,), i32), alpha=((E,), f32),
    )
    assert stand_in.arguments[3] == dict(lhs=((M, F), bf16), rhs=((E, D, F), bf16), group_sizes=((E,), i32))
    assert stand_in.arguments[4] == dict(lhs=((M, D), bf16), rhs=((M, F), bf16), group_sizes=((E,), i32))
    assert stand_in.arguments[5] == dict(lhs=((M, F), bf16), rhs=((M, D), bf16), group_sizes=((E,), i32))
    assert CUSTOM_CALL.findall(text).count(STAND_IN_TARGET) == sum(
        (2, 1, 3 + with_bias + 1, 1, 1, 1)
    )
    if stand_in.opaque:
        # Nothing of layer size is computed outside the backend: no ragged dot, no
        # dense expansion, no scatter, no weight transposed.
        for pattern in (RAGGED_OP, SCATTER_OP, re.compile(r"stablehlo\.(dot_general|transpose)\b")):
            assert not pattern.search(text), pattern.pattern


class RefusingBackend(StandInBackend):
    def supports_compute_capability(self, capability):
        return False


def test_auto_on_a_capable_gpu_picks_the_kernel(monkeypatch):
    kernel, other = StandInBackend(opaque=True), RefusingBackend(opaque=True)
    monkeypatch.setattr(backend_choice, "kernel_backend", lambda name: kernel if name == "sm90" else other)
    monkeypatch.setattr(backend_choice, "cuda_compute_capability", lambda: (9, 0))
    text = lowered_for_cuda(ragged_dot_step("auto"), *ragged_dot_args())
    assert len(kernel.requests) == 3 and other.requests == []
    assert CUSTOM_CALL.findall(text).count(STAND_IN_TARGET) == 3


# ------------------------------------------------------------------ the sm90 kernels

def assert_kernels_only(text: str) -> None:
    assert CUSTOM_CALL.findall(text), "no custom call"
    assert not RAGGED_OP.search(text), "an XLA ragged dot is left"
    assert not SCATTER_OP.search(text), "a scatter is left"
    assert not re.search(r"stablehlo\.dot_general\b", text), "a dense expansion is left"


def test_the_xla_backend_lowered_for_cuda_is_seen_by_these_checks():
    # The XLA backend computes each expert's rows with a dense dot (rows selected, so a NaN
    # stays in its expert): exactly what the kernel path must not contain.
    text = lowered_for_cuda(ragged_dot_step("xla"), *ragged_dot_args())
    assert re.search(r"stablehlo\.dot_general\b", text)
    with pytest.raises(AssertionError):
        assert_kernels_only(text)


@pytest.mark.compile
def test_sm90_ragged_dot_forward_lowers_to_kernels():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    lhs, rhs, group_sizes, _ = ragged_dot_args()
    assert_kernels_only(
        lowered_for_cuda(lambda l, r, g: jax_dsrelu.ragged_dot(l, r, g, backend="sm90"), lhs, rhs, group_sizes)
    )


@pytest.mark.compile
def test_sm90_ragged_dot_gradients_lower_to_kernels():
    pytest.importorskip("cutlass", reason="CuTe DSL (the 'gpu' extra) is not installed")
    assert_kernels_only(lowered_for_cuda(ragged_dot_step("sm90"), *ragged_dot_args()))
