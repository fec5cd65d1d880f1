"""Public API: validation, backend choice, and JAX transformations of the primitive."""

from __future__ import annotations

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import assert_matches_contract
from jax.experimental import checkify
from test_reference import make_inputs

import jax_dsrelu


@pytest.fixture
def inputs():
    return make_inputs(np.random.default_rng(11), 64, 32, 24, [20, 0, 30, 14], jnp.bfloat16)


# The contract's signatures: positional operands, then keyword-only options and defaults.
CONTRACT_SIGNATURES = {
    "grouped_gemm_dsrelu": (
        ["grad", "weight", "preact", "prob", "group_sizes"],
        dict(alpha=None, grad_scale=None, weight_scale=None, with_dbias=False, with_act=False,
             out_dtype=jnp.bfloat16, deterministic=False, backend="auto"),
    ),
    "moe_mlp": (
        ["x", "w1", "w2", "prob", "group_sizes"],
        dict(b1=None, deterministic=False, backend="auto", precision=None, quantized_weights=None),
    ),
}


@pytest.mark.parametrize("name", sorted(CONTRACT_SIGNATURES))
def test_public_signatures_match_the_contract(name):
    assert name in jax_dsrelu.__all__
    positional, keywords = CONTRACT_SIGNATURES[name]
    parameters = inspect.signature(getattr(jax_dsrelu, name)).parameters.values()
    assert [p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD] == positional
    assert all(p.default is p.empty for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)
    assert {p.name: p.default for p in parameters if p.kind is p.KEYWORD_ONLY} == keywords


def test_outputs_are_named_as_in_the_contract(inputs):
    out = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, with_act=True)
    assert isinstance(out, jax_dsrelu.DsreluOutputs)
    assert jax_dsrelu.DsreluOutputs._fields == ("dh", "dprob", "dbias", "act", "amax")
    # Each field holds the contract's value of that name (swapped fields would fail).
    assert_matches_contract(out, inputs)


BAD_CALLS = [
    # (what to change, exception, words the message must contain)
    (lambda a: a | {"grad": a["grad"][None]}, ValueError, "grad.shape=(1, 64, 32)"),
    (lambda a: a | {"weight": a["weight"][:, :, :31]}, ValueError, "weight.shape[2] must equal grad.shape[1] (k)=32"),
    (lambda a: a | {"preact": a["preact"][:, :23]}, ValueError, "preact.shape[1] must equal weight.shape[1] (n)=24"),
    (lambda a: a | {"preact": a["preact"][:63]}, ValueError, "preact.shape[0] must equal grad.shape[0] (m)=64"),
    (lambda a: a | {"prob": a["prob"][:63]}, ValueError, "prob.shape[0] must equal grad.shape[0] (m)=64"),
    (lambda a: a | {"prob": a["prob"][:, None]}, ValueError, "prob.shape=(64, 1)"),
    (lambda a: a | {"group_sizes": a["group_sizes"][:3]}, ValueError, "group_sizes.shape[0] must equal weight.shape[0] (E)=4"),
    (lambda a: a | {"group_sizes": a["group_sizes"].astype(jnp.float32)}, TypeError, "group_sizes.dtype must be an integer type"),
    (lambda a: a | {"weight": a["weight"].astype(jnp.float16)}, TypeError, "weight.dtype must equal grad.dtype=bfloat16, got weight.dtype=float16"),
    (lambda a: a | {"grad": a["grad"].astype(jnp.int8), "weight": a["weight"].astype(jnp.int8)}, TypeError, "grad.dtype must be one of"),
    (lambda a: a | {"prob": a["prob"].astype(jnp.int32)}, TypeError, "prob.dtype must be one of"),
    (lambda a: a | {"alpha": jnp.ones((3,))}, ValueError, "alpha.shape[0] must equal weight.shape[0] (E)=4"),
    (lambda a: a | {"out_dtype": jnp.int8}, TypeError, "out_dtype must be one of bfloat16, float16, float32, got int8"),
    (lambda a: a | {"backend": "cuda"}, ValueError, "backend must be one of 'auto', 'xla', 'sm90', 'sm100', got 'cuda'"),
    (lambda a: a | {"deterministic": 1}, TypeError, "deterministic must be a Python bool, got 1"),
    (lambda a: a | {"with_dbias": "yes"}, TypeError, "with_dbias must be a Python bool"),
]


@pytest.mark.parametrize("change, error, words", BAD_CALLS)
def test_bad_arguments_raise_at_trace_time(inputs, change, error, words):
    grad, weight, preact, prob, group_sizes = inputs
    args = change(dict(grad=grad, weight=weight, preact=preact, prob=prob, group_sizes=group_sizes))
    positional = [args.pop(name) for name in ("grad", "weight", "preact", "prob", "group_sizes")]
    with pytest.raises(error, match=re.escape(words)):
        # Under jit, so the check is shown to happen while tracing.
        jax.jit(lambda *p: jax_dsrelu.grouped_gemm_dsrelu(*p, **args)).trace(*positional)


def test_kernel_backend_off_cuda_names_what_can_run(inputs):
    # Lowered for the CPU, a CUDA-only backend must refuse, not fall back silently.
    if jax_dsrelu.kernels.registry.kernel_backend("sm90").software_missing() is None:
        expected = "runs only on CUDA GPUs.*lowered for cpu"
    else:
        expected = r"backend='sm90' cannot serve.*pip install 'jax-dsrelu\[gpu\]'"
    with pytest.raises(NotImplementedError, match=expected):
        jax.jit(lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, backend="sm90")).lower(*inputs)


def test_sm100_refuses_bf16_operands_and_names_who_can(inputs):
    with pytest.raises(NotImplementedError, match=r"backend='sm100' cannot serve.*'xla'"):
        jax_dsrelu.grouped_gemm_dsrelu(*inputs, backend="sm100")


def test_backends_reports_every_backend_with_a_reason():
    statuses = {status.name: status for status in jax_dsrelu.backends()}
    assert set(statuses) == {"xla", "sm90", "sm100"}
    assert statuses["xla"].usable_here
    for status in statuses.values():
        assert status.detail
    if not any(d.platform == "gpu" for d in jax.devices()):
        assert not statuses["sm90"].usable_here and not statuses["sm100"].usable_here


def test_auto_on_cpu_is_the_reference(inputs):
    auto = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, deterministic=True)
    xla = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, deterministic=True, backend="xla")
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(xla)):
        np.testing.assert_array_equal(a, b)


def test_eager_and_jit_agree(inputs):
    eager = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, with_act=True)
    jitted = jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True)
    )(*inputs)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)


def test_vmap_matches_a_loop():
    rng = np.random.default_rng(12)
    batch = [make_inputs(rng, 48, 16, 24, sizes, jnp.bfloat16) for sizes in ([10, 0, 38], [48, 0, 0], [1, 2, 3])]
    stacked = [jnp.stack(parts) for parts in zip(*batch)]
    run = lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True)
    mapped = jax.jit(jax.vmap(run))(*stacked)
    for i, one in enumerate(batch):
        assert_matches_contract(jax.tree.map(lambda x: x[i], mapped), one)


def test_vmap_with_shared_weight():
    rng = np.random.default_rng(13)
    grad, weight, preact, prob, group_sizes = make_inputs(rng, 32, 16, 8, [12, 20], jnp.bfloat16)
    grads = jnp.stack([grad, -grad])
    mapped = jax.vmap(
        lambda g: jax_dsrelu.grouped_gemm_dsrelu(g, weight, preact, prob, group_sizes),
    )(grads)
    for i in range(2):
        assert_matches_contract(
            jax.tree.map(lambda x: x[i], mapped),
            (grads[i], weight, preact, prob, group_sizes),
            with_dbias=False,
            with_act=False,
        )


def test_export_round_trip(inputs):
    run = jax.jit(
        lambda *a: tuple(jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, deterministic=True, backend="xla"))
    )
    exported = jax.export.export(run)(*inputs)
    restored = jax.export.deserialize(exported.serialize())
    for a, b in zip(jax.tree.leaves(restored.call(*inputs)), jax.tree.leaves(run(*inputs))):
        np.testing.assert_array_equal(a, b)


def test_new_row_count_is_the_same_primitive():
    # The primitive's parameters hold only static facts: a new m changes no parameter.
    rng = np.random.default_rng(14)
    params = []
    for num_rows in (32, 48):
        jaxpr = jax.make_jaxpr(lambda *a: jax_dsrelu.grouped_gemm_dsrelu(*a))(
            *make_inputs(rng, num_rows, 16, 8, [num_rows // 2, num_rows // 2], jnp.bfloat16)
        )
        (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "grouped_gemm_dsrelu"]
        params.append(eqn.params)
    assert params[0] == params[1]


def test_checkify_flags_bad_group_sizes():
    def step(group_sizes):
        jax_dsrelu.check_group_sizes(group_sizes, 64)
        return group_sizes.sum()

    checked = jax.jit(checkify.checkify(step))
    err, _ = checked(jnp.array([10, 54], jnp.int32))
    err.throw()
    err, _ = checked(jnp.array([10, -1, 5], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="negative"):
        err.throw()
    err, _ = checked(jnp.array([2**30, 2**30, 2**30], jnp.int32))
    with pytest.raises(checkify.JaxRuntimeError, match="more than the 64 rows"):
        err.throw()


def test_bad_group_sizes_without_checkify_are_safe(inputs):
    # The same values run without the check: clamped, never out of bounds.
    grad, weight, preact, prob, _ = inputs
    for sizes in ([-5, 100, -1, 3], [2**31 - 1, 2**31 - 1, 5, 5], [-(2**31), 0, 0, 64]):
        group_sizes = jnp.asarray(sizes, jnp.int32)
        out = jax_dsrelu.grouped_gemm_dsrelu(grad, weight, preact, prob, group_sizes, with_dbias=True)
        assert_matches_contract(out, (grad, weight, preact, prob, group_sizes), with_act=False)


def test_each_gemm_of_moe_mlp_gets_its_backend_from_one_decision():
    from jax_dsrelu.kernels.registry import LayerBackends, layer_backends

    for name in ("auto", "xla"):
        assert layer_backends(name) == LayerBackends(dsrelu=name, matmul=name, contract=name, gather_sum=name)
    # The gather-and-sum is left to what "auto" picks on a kernel backend.
    assert layer_backends("sm90") == LayerBackends(dsrelu="sm90", matmul="sm90", contract="sm90", gather_sum="auto")
    # sm100 has a kernel for the fused backward only: its plain GEMMs go to what "auto" picks.
    assert layer_backends("sm100") == LayerBackends(
        dsrelu="sm100", matmul="auto", contract="auto", gather_sum="auto"
    )
