"""Every public function answers a list, a Python scalar, None or a complex array where it
needs a real array with a TypeError or ValueError that names the argument, says what it
got and what it expected; none of them accepts such an input or fails inside JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu

nnx = pytest.importorskip("flax.nnx", reason="needs Flax (pip install 'jax-dsrelu[flax]')")
from jax_dsrelu.flax import MoE  # noqa: E402

T, D, F, E = 8, 4, 6, 2


def arrays():
    """Good inputs of every public function, under their argument names."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return dict(
        x=normal(T, D), w1=normal(E, D, F), w2=normal(E, F, D), prob=jnp.ones((T,), jnp.float32),
        group_sizes=jnp.asarray([3, 5], jnp.int32), b1=normal(E, F), lhs=normal(T, D), rhs=normal(E, D, F),
        grad=normal(T, D), weight=normal(E, F, D), preact=normal(T, F), alpha=jnp.ones((E,), jnp.float32),
        logits=normal(T, E), expert_bias=jnp.zeros((E,), jnp.float32), y=normal(T * 2, D), router=normal(D, E),
        shared_w1=normal(D, 3), shared_w2=normal(3, D), latent_in=normal(D, D), latent_out=normal(D, D),
    )


def hf_tensors():
    rng = np.random.default_rng(1)
    return {
        "gate.weight": rng.standard_normal((E, D)).astype(np.float32),
        "gate.e_score_correction_bias": np.zeros(E, np.float32),
        "experts.up_proj": rng.standard_normal((E, F, D)).astype(np.float32),
        "experts.down_proj": rng.standard_normal((E, D, F)).astype(np.float32),
        "shared_experts.up_proj.weight": rng.standard_normal((3, D)).astype(np.float32),
        "shared_experts.down_proj.weight": rng.standard_normal((D, 3)).astype(np.float32),
    }


def call(function, argument, bad):
    """`function` called on good inputs but for `argument`, which is `bad`."""
    a = arrays()
    a[argument] = bad(a[argument])
    plan = jax_dsrelu.route(arrays()["logits"], 2)
    layer_weights = {
        k: a[k] for k in ("w1", "w2", "b1", "expert_bias", "shared_w1", "shared_w2", "latent_in", "latent_out")
    }
    if function == "moe_mlp":
        return jax_dsrelu.moe_mlp(a["x"], a["w1"], a["w2"], a["prob"], a["group_sizes"], b1=a["b1"])
    if function == "ragged_dot":
        return jax_dsrelu.ragged_dot(a["lhs"], a["rhs"], a["group_sizes"])
    if function == "grouped_gemm_dsrelu":
        return jax_dsrelu.grouped_gemm_dsrelu(
            a["grad"], a["weight"], a["preact"], a["prob"], a["group_sizes"], alpha=a["alpha"]
        )
    if function == "route":
        return jax_dsrelu.route(a["logits"], 2, expert_bias=a["expert_bias"])
    if function == "dispatch":
        return jax_dsrelu.dispatch(a["x"], plan)
    if function == "combine":
        return jax_dsrelu.combine(a["y"], plan)
    if function == "moe_layer":
        return jax_dsrelu.moe_layer(a["x"], a["router"], **layer_weights)
    if function == "moe_layer_expert_parallel":
        mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
        return jax_dsrelu.moe_layer_expert_parallel(a["x"], a["router"], **layer_weights, mesh=mesh)
    if function == "update_expert_bias":
        return jax_dsrelu.update_expert_bias(a["expert_bias"], a["group_sizes"], 1e-3)
    if function == "flax.MoE":
        return MoE(D, F, E, rngs=nnx.Rngs(0))(a["x"])
    raise AssertionError(function)


LIST = ("list", lambda good: np.asarray(good).tolist())
NONE = ("NoneType", lambda good: None)
SCALAR = ("float", lambda good: 0.5)
COMPLEX = ("complex64", lambda good: jnp.asarray(good, jnp.complex64))

# (function, argument, the kind of bad value): each argument a function takes as an array.
BAD = [
    *[("moe_mlp", "x", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
    *[("moe_mlp", "w1", kind) for kind in (LIST, NONE, COMPLEX)],
    ("moe_mlp", "w2", NONE), ("moe_mlp", "prob", SCALAR), ("moe_mlp", "prob", LIST), ("moe_mlp", "b1", COMPLEX),
    ("moe_mlp", "b1", LIST), ("moe_mlp", "group_sizes", NONE),
    *[("ragged_dot", "lhs", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
    *[("ragged_dot", "rhs", kind) for kind in (LIST, NONE, COMPLEX)],
    *[("grouped_gemm_dsrelu", "grad", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
    ("grouped_gemm_dsrelu", "weight", NONE), ("grouped_gemm_dsrelu", "preact", LIST),
    ("grouped_gemm_dsrelu", "prob", SCALAR), ("grouped_gemm_dsrelu", "alpha", COMPLEX), ("grouped_gemm_dsrelu", "alpha", LIST),
    *[("route", "logits", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
    ("route", "expert_bias", LIST), ("route", "expert_bias", COMPLEX),
    *[("dispatch", "x", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
    *[("combine", "y", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
    *[(layer, "x", kind) for layer in ("moe_layer", "moe_layer_expert_parallel") for kind in (LIST, NONE, SCALAR, COMPLEX)],
    *[(layer, "router", kind) for layer in ("moe_layer", "moe_layer_expert_parallel") for kind in (LIST, NONE, COMPLEX)],
    *[("moe_layer", name, kind) for name in ("w1", "shared_w1", "latent_out", "expert_bias") for kind in (LIST, COMPLEX)],
    ("moe_layer", "b1", SCALAR),
    *[("update_expert_bias", "expert_bias", kind) for kind in (LIST, NONE, COMPLEX)],
    ("update_expert_bias", "group_sizes", LIST), ("update_expert_bias", "group_sizes", NONE),
    *[("flax.MoE", "x", kind) for kind in (LIST, NONE, SCALAR, COMPLEX)],
]


@pytest.mark.parametrize("function, argument, kind", BAD, ids=lambda v: v[0] if isinstance(v, tuple) else v)
def test_a_bad_array_is_refused_naming_the_argument_what_came_and_what_was_expected(function, argument, kind):
    seen, bad = kind
    with pytest.raises((TypeError, ValueError)) as caught:
        call(function, argument, bad)
    message = str(caught.value)
    assert f"{argument} must" in message or f"{argument}.dtype must" in message, message
    assert seen in message, message


def test_combine_refuses_complex_rows():
    # A complex y used to be summed in float32, its imaginary part dropped without a word.
    plan = jax_dsrelu.route(arrays()["logits"], 2)
    y = jnp.ones((T * 2, D), jnp.complex64)
    with pytest.raises(TypeError, match=r"y.dtype must be a real type .*got y.dtype=complex64: y is \(rows, d\)"):
        jax_dsrelu.combine(y, plan)


def test_the_message_says_what_was_expected():
    a = arrays()
    with pytest.raises(TypeError, match=r"^x must be a JAX or NumPy array, got list \(wrap it in jnp.asarray\): x is \(m, d\)$"):
        jax_dsrelu.moe_mlp(a["x"].tolist(), a["w1"], a["w2"], a["prob"], a["group_sizes"])
    with pytest.raises(TypeError, match=r"^rhs must be a JAX or NumPy array, got NoneType: rhs is \(E, k, n\)$"):
        jax_dsrelu.ragged_dot(a["x"], None, a["group_sizes"])
    with pytest.raises(TypeError, match=r"^prob must be a JAX or NumPy array, got float 0.5: prob is \(m,\)$"):
        jax_dsrelu.grouped_gemm_dsrelu(a["grad"], a["weight"], a["preact"], 0.5, a["group_sizes"])


def test_a_complex_rate_is_refused():
    a = arrays()
    with pytest.raises(TypeError, match=r"rate must be a float or a float scalar array, got 1j \(complex\)"):
        jax_dsrelu.update_expert_bias(a["expert_bias"], a["group_sizes"], 1j)


def test_flax_moe_needs_an_rngs():
    with pytest.raises(TypeError, match=r"rngs must be an nnx.Rngs \(e.g. nnx.Rngs\(0\)\), got 0 \(int\)"):
        MoE(D, F, E, rngs=0)
    with pytest.raises(TypeError, match=r"rngs must be an nnx.Rngs .*got None \(NoneType\)"):
        MoE(D, F, E, rngs=None)


@pytest.mark.parametrize("name", sorted(hf_tensors()))
@pytest.mark.parametrize("kind", [LIST, NONE, SCALAR, COMPLEX], ids=lambda kind: kind[0])
def test_the_converter_names_a_bad_tensor_by_its_hugging_face_name(name, kind):
    seen, bad = kind
    tensors = hf_tensors()
    tensors[name] = bad(tensors[name])
    with pytest.raises((TypeError, ValueError)) as caught:
        jax_dsrelu.params_from_hf_nemotron_h(tensors)
    message = str(caught.value)
    assert message.startswith(f"tensors[{name!r}]"), message
    assert seen in message, message
    with pytest.raises(type(caught.value), match=r"^tensors\["):
        MoE.from_hf_nemotron_h(tensors, top_k=1)


def test_the_converter_names_a_bad_per_expert_tensor():
    tensors = {name: array for name, array in hf_tensors().items() if not name.startswith("experts.")}
    for e in range(E):
        tensors[f"experts.{e}.up_proj.weight"] = hf_tensors()["experts.up_proj"][e]
        tensors[f"experts.{e}.down_proj.weight"] = hf_tensors()["experts.down_proj"][e]
    jax_dsrelu.params_from_hf_nemotron_h(tensors)
    with pytest.raises(TypeError, match=r"^tensors\['experts.1.down_proj.weight'\] must be a JAX or NumPy array, got list"):
        jax_dsrelu.params_from_hf_nemotron_h({**tensors, "experts.1.down_proj.weight": tensors["experts.1.down_proj.weight"].tolist()})
    with pytest.raises(ValueError, match=(
        r"^tensors\['experts.1.up_proj.weight'\] must have the shape of experts.0.up_proj.weight, \(6, 4\), got shape \(5, 4\)$"
    )):
        jax_dsrelu.params_from_hf_nemotron_h({**tensors, "experts.1.up_proj.weight": tensors["experts.1.up_proj.weight"][:5]})
