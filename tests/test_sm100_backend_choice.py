"""What the sm100 backend refuses, and that it says who can serve instead. No CuTe DSL is
imported here: every refusal happens before the kernel would be built.

The backend reports missing software before anything else, so the refusals of shapes,
dtypes and GPUs are seen only where the sm100 extra is installed."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jax_dsrelu
from jax_dsrelu.kernels import registry as backend_choice
from jax_dsrelu.kernels import request as request_facts


def mx_args(m=256, k=64, n=128, e=3, element=jnp.float8_e4m3fn):
    s = jax.ShapeDtypeStruct
    return (
        s((m, k), element), s((e, n, k), element), s((m, n), jnp.bfloat16), s((m,), jnp.float32),
        s((e,), jnp.int32), s((m, k // 32), jnp.float8_e8m0fnu), s((e, n, k // 32), jnp.float8_e8m0fnu),
    )


def lower_sm100(args, **options):
    def f(grad, weight, preact, prob, sizes, grad_scale, weight_scale):
        return jax_dsrelu.grouped_gemm_dsrelu(
            grad, weight, preact, prob, sizes, grad_scale=grad_scale, weight_scale=weight_scale,
            backend="sm100", **options,
        )

    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


needs_sm100_software = pytest.mark.skipif(
    backend_choice.kernel_backend("sm100").software_missing() is not None,
    reason=f"{backend_choice.kernel_backend('sm100').software_missing()}: the refusal for missing software comes first",
)

REFUSED = [
    (dict(n=96), "n=96 must be a multiple of 64"),
    (dict(e=1025, m=64, n=64, k=32), "the kernel takes 1 to 1024 experts, got E=1025"),
]


@needs_sm100_software
@pytest.mark.parametrize("shape, words", REFUSED)
def test_shapes_outside_the_kernel_are_refused_at_trace_time(shape, words):
    with pytest.raises(NotImplementedError, match=re.escape(words) + r".*Backends that can: .*'xla'"):
        jax.jit(lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
            *a[:5], grad_scale=a[5], weight_scale=a[6], backend="sm100"
        )).trace(*mx_args(**shape))


@needs_sm100_software
def test_bf16_operands_are_refused_with_the_backends_that_can():
    s = jax.ShapeDtypeStruct
    args = (s((64, 64), jnp.bfloat16), s((2, 128, 64), jnp.bfloat16), s((64, 128), jnp.bfloat16),
            s((64,), jnp.float32), s((2,), jnp.int32))
    with pytest.raises(NotImplementedError, match=r"takes MXFP8 operands only.*got bfloat16.*'xla'"):
        jax.jit(lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, backend="sm100")).trace(*args)


@needs_sm100_software
def test_a_visible_gpu_older_than_sm100_is_refused(monkeypatch):
    monkeypatch.setattr(backend_choice, "cuda_compute_capability", lambda: (9, 0))
    with pytest.raises(NotImplementedError, match=r"compute capability 9\.0.*Backends that can: .*'xla'"):
        lower_sm100(mx_args())


def test_the_sm90_backend_does_not_claim_mxfp8():
    # So "auto" on Hopper falls back to the reference for MXFP8 instead of a wrong kernel.
    request = request_facts.request_from_avals(
        mx_args()[:4], block_scaled=True, with_dbias=True, with_act=True,
        out_dtype=jnp.dtype(jnp.bfloat16), deterministic=True,
    )
    assert backend_choice.kernel_backend("sm90").cannot_implement(request) is not None
    assert backend_choice.kernel_backend("sm100").cannot_implement(request) is None


def mx_request():
    return request_facts.request_from_avals(
        mx_args()[:4], block_scaled=True, with_dbias=True, with_act=True,
        out_dtype=jnp.dtype(jnp.bfloat16), deterministic=True,
    )


@pytest.mark.parametrize("capability", [(10, 3), (11, 0), (12, 0), (12, 1)])
def test_auto_never_picks_sm100_where_its_sm_100a_code_cannot_load(monkeypatch, capability):
    # Installed software and a request the kernel serves, so only the device can refuse.
    sm100 = backend_choice.kernel_backend("sm100")
    monkeypatch.setattr(sm100, "software_missing", lambda: None)
    monkeypatch.setattr(sm100, "implementation", lambda request: "the sm100 kernel")
    monkeypatch.setattr(backend_choice, "cuda_compute_capability", lambda: capability)
    assert backend_choice.cuda_implementation("auto", mx_request()) == ("xla", None)
    with pytest.raises(NotImplementedError, match=rf"compute capability {capability[0]}\.{capability[1]}"):
        backend_choice.cuda_implementation("sm100", mx_request())


def test_auto_picks_sm100_on_compute_capability_10_0(monkeypatch):
    # The same stand-ins as above: the test fails if the capability check refuses 10.0 too.
    sm100 = backend_choice.kernel_backend("sm100")
    monkeypatch.setattr(sm100, "software_missing", lambda: None)
    monkeypatch.setattr(sm100, "implementation", lambda request: "the sm100 kernel")
    monkeypatch.setattr(backend_choice, "cuda_compute_capability", lambda: (10, 0))
    assert backend_choice.cuda_implementation("auto", mx_request()) == ("sm100", "the sm100 kernel")
