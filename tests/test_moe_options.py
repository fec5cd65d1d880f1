"""The MoE layer's options and weights as objects (`jax_dsrelu.MoEOptions`, `jax_dsrelu.MoEWeights`):
every entry point takes them whole or as keywords with the same result, answers a bad option
with the same words, declares no default of its own and documents each option from the one
declaration; the options are frozen and hashable."""

from __future__ import annotations

import dataclasses
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu
from jax_dsrelu import MoEOptions, MoEWeights
from jax_dsrelu.moe.entry_points import UNSET, entry_point

nnx = pytest.importorskip("flax.nnx", reason="needs Flax (pip install 'jax-dsrelu[flax]')")
from jax_dsrelu.flax import MoE  # noqa: E402

T, D, F, E = 8, 4, 6, 4


def entry_points():
    """Each entry point, called with the options given: (name, function of the options)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((D, E)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((E, D, F)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, F, D)), jnp.float32)
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    return {
        "route": lambda top_k=2, **o: jax_dsrelu.route(x @ router, top_k, **o),
        "moe_layer": lambda **o: jax_dsrelu.moe_layer(x, router, w1, w2, **o),
        "moe_layer_expert_parallel": lambda **o: jax_dsrelu.moe_layer_expert_parallel(x, router, w1, w2, mesh=mesh, **o),
        "flax.MoE": lambda **o: MoE(D, F, E, rngs=nnx.Rngs(0), **o),
    }


BAD_OPTIONS = [
    (dict(top_k=5), ValueError, "top_k must be between 1 and the number of experts E=4, got top_k=5"),
    (dict(top_k=2.0), TypeError, "top_k must be a Python int, got 2.0 (float)"),
    (dict(score="Sigmoid"), ValueError, "score must be 'softmax' or 'sigmoid', got 'Sigmoid'"),
    (dict(num_groups=3), ValueError, "num_groups must be at least 1 and divide the number of experts E=4, got num_groups=3"),
    (dict(num_groups=2, top_groups=3), ValueError, "top_groups must be None or between 1 and num_groups=2, got top_groups=3"),
    (dict(top_k=3, num_groups=2, top_groups=1), ValueError, "top_k must be at most the 2 experts that top_groups=1 groups"),
    (dict(normalize=1), TypeError, "normalize must be a Python bool, got 1 (int)"),
    (dict(scale=float("inf")), ValueError, "scale must be finite, got scale=inf"),
    (dict(scale="2.5"), TypeError, "scale must be a Python float, got '2.5' (str)"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be None or a finite number > 0, got capacity_factor=0.0"),
    (dict(capacity_factor=float("nan")), ValueError, "capacity_factor must be None or a finite number > 0, got capacity_factor=nan"),
    (dict(capacity_factor="1.25"), TypeError, "capacity_factor must be None or a Python float, got '1.25' (str)"),
    (dict(recompute_exchanged=1), TypeError, "recompute_exchanged must be a Python bool, got 1 (int)"),
    (dict(deterministic="yes"), TypeError, "deterministic must be a Python bool, got 'yes' (str)"),
    (dict(backend="cuda"), ValueError, "backend must be one of 'auto', 'xla', 'sm90', 'sm100', got 'cuda'"),
    (dict(precision="fp8"), TypeError,
     "precision must be None or jax_dsrelu.quantization.FP8_BLOCKWISE (a Recipe), got 'fp8' (str)"),
    (dict(precision=jax_dsrelu.quantization.MXFP8), ValueError,
     "precision must be None or jax_dsrelu.quantization.FP8_BLOCKWISE, the recipes the experts run so far, "
     "got the recipe 'MXFP8'"),
    (dict(precision=jax_dsrelu.quantization.FP8_BLOCKWISE, backend="sm90"), NotImplementedError,
     "backend='sm90' does not take precision=FP8_BLOCKWISE: backend='auto' runs each GEMM of the step"),
]


# route takes the routing options only.
CASES = [
    (entry_point, *bad)
    for entry_point in ("route", "moe_layer", "moe_layer_expert_parallel", "flax.MoE")
    for bad in BAD_OPTIONS
    if not (entry_point == "route" and set(bad[0]) & {"capacity_factor", "recompute_exchanged", "deterministic", "backend", "precision"})
]


@pytest.mark.parametrize("entry_point, options, error, words", CASES)
def test_every_entry_point_answers_a_bad_option_alike(entry_point, options, error, words):
    with pytest.raises(error, match=re.escape(words)):
        entry_points()[entry_point](**options)


def test_options_are_frozen_hashable_and_checked_when_built():
    options = MoEOptions(top_k=2, score="sigmoid", num_groups=4, top_groups=2, normalize=True, scale=2.5,
                         deterministic=True, backend="xla")
    assert options == MoEOptions(top_k=2, score="sigmoid", num_groups=4, top_groups=2, normalize=True, scale=2.5,
                                 deterministic=True, backend="xla")
    assert hash(options) == hash(dataclasses.replace(options))
    assert hash(options) != hash(dataclasses.replace(options, top_k=3))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.top_k = 3
    with pytest.raises(ValueError, match=re.escape("top_k must be at least 1, got top_k=0")):
        dataclasses.replace(options, top_k=0)
    # What needs the number of experts is checked when the options meet the weights.
    with pytest.raises(ValueError, match=re.escape("top_k must be between 1 and the number of experts E=8, got top_k=9")):
        dataclasses.replace(options, top_k=9).check_experts(8)


@pytest.mark.parametrize("entry_point", ["moe_layer", "flax.MoE"])
def test_a_capacity_factor_is_refused_on_one_device(entry_point):
    # It bounds the rows one device sends another; on one device every routed row runs,
    # so a value there would be silently ignored.
    with pytest.raises(ValueError, match=re.escape(
        "capacity_factor must be None on one device (it bounds the rows each device sends to another under "
        "moe_layer_expert_parallel; here every routed row runs), got capacity_factor=1.25"
    )):
        entry_points()[entry_point](capacity_factor=1.25)


@pytest.mark.parametrize("entry_point", ["moe_layer", "flax.MoE"])
def test_recomputing_the_exchanged_rows_is_refused_on_one_device(entry_point):
    # One device receives no row from another: there is nothing to keep or remake.
    with pytest.raises(ValueError, match=re.escape(
        "recompute_exchanged must be False on one device (it says what moe_layer_expert_parallel's backward keeps "
        "of the rows other devices send; here none are sent), got recompute_exchanged=True"
    )):
        entry_points()[entry_point](recompute_exchanged=True)


def test_options_pass_through_jit_as_a_pytree_without_leaves():
    options = MoEOptions(top_k=3, normalize=True)
    assert jax.tree.leaves(options) == []
    traced = jax.jit(lambda x, options: x * options.top_k)(jnp.float32(2), options)
    assert traced == 6


def test_the_module_keeps_the_options_it_checked():
    module = MoE(D, F, E, top_k=3, score="sigmoid", normalize=True, scale=2.5, deterministic=True, rngs=nnx.Rngs(0))
    assert module.options == MoEOptions(top_k=3, score="sigmoid", normalize=True, scale=2.5, deterministic=True)


# --- Whole or as keywords: the same block either way. ---

SIGMOID = MoEOptions(top_k=2, score="sigmoid", num_groups=2, top_groups=1, normalize=True, scale=2.5,
                     deterministic=True, backend="xla")


def layer_arrays(seed=1):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
    return dict(router=normal(D, E), w1=normal(E, D, F), w2=normal(E, F, D), b1=normal(E, F),
                expert_bias=normal(E) / 10, shared_w1=normal(D, 5), shared_w2=normal(5, D))


def as_keywords(options: MoEOptions) -> dict:
    return dataclasses.asdict(options)


def test_moe_layer_takes_the_options_and_weights_whole():
    x = jnp.asarray(np.random.default_rng(2).standard_normal((T, D)), jnp.float32)
    arrays = layer_arrays()
    want, want_aux = jax_dsrelu.moe_layer(x, **arrays, **as_keywords(SIGMOID), return_aux=True)
    got, got_aux = jax_dsrelu.moe_layer(x, weights=MoEWeights(**arrays), options=SIGMOID, return_aux=True)
    np.testing.assert_array_equal(got, want)
    for a, b in zip(got_aux, want_aux):
        np.testing.assert_array_equal(a, b)
    # Under jit, with the options passed as an argument: a pytree without leaves, so static.
    jitted = jax.jit(lambda x, weights, options: jax_dsrelu.moe_layer(x, weights=weights, options=options))
    np.testing.assert_array_equal(jitted(x, MoEWeights(**arrays), SIGMOID), want)


def test_the_gradient_of_the_weights_is_an_moe_weights():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((T, D)), jnp.float32)
    arrays = layer_arrays()
    loss = lambda weights: jnp.sum(jax_dsrelu.moe_layer(x, weights=weights, options=SIGMOID) ** 2)  # noqa: E731
    grads = jax.grad(loss)(MoEWeights(**arrays))
    assert isinstance(grads, MoEWeights) and grads.latent_in is None
    by_keyword = jax.grad(
        lambda router: jnp.sum(jax_dsrelu.moe_layer(x, **{**arrays, "router": router}, **as_keywords(SIGMOID)) ** 2)
    )(arrays["router"])
    np.testing.assert_array_equal(grads.router, by_keyword)


def test_expert_parallel_takes_the_options_and_weights_whole():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((T, D)), jnp.float32)
    arrays = layer_arrays()
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    run = jax.jit(lambda x, weights: jax_dsrelu.moe_layer_expert_parallel(x, weights=weights, mesh=mesh, options=SIGMOID))
    want = jax.jit(lambda x, arrays: jax_dsrelu.moe_layer_expert_parallel(x, **arrays, mesh=mesh, **as_keywords(SIGMOID)))
    np.testing.assert_array_equal(run(x, MoEWeights(**arrays)), want(x, arrays))


def test_the_module_takes_the_options_whole():
    x = jnp.asarray(np.random.default_rng(5).standard_normal((T, D)), jnp.float32)
    whole = MoE(D, F, E, options=SIGMOID, rngs=nnx.Rngs(0))
    keywords = MoE(D, F, E, **as_keywords(SIGMOID), rngs=nnx.Rngs(0))
    assert whole.options == keywords.options == SIGMOID
    np.testing.assert_array_equal(whole(x), keywords(x))


def hf_tensors():
    rng = np.random.default_rng(6)
    return {
        "gate.weight": rng.standard_normal((E, D)).astype(np.float32),
        "gate.e_score_correction_bias": (rng.standard_normal(E) / 10).astype(np.float32),
        "experts.up_proj": rng.standard_normal((E, F, D)).astype(np.float32),
        "experts.down_proj": rng.standard_normal((E, D, F)).astype(np.float32),
    }


def test_the_hugging_face_loader_takes_the_options_whole():
    x = jnp.asarray(np.random.default_rng(7).standard_normal((T, D)), jnp.float32)
    keywords = {name: value for name, value in as_keywords(SIGMOID).items() if name != "score"}
    whole = MoE.from_hf_nemotron_h(hf_tensors(), options=SIGMOID)
    by_keyword = MoE.from_hf_nemotron_h(hf_tensors(), **keywords)
    assert whole.options == by_keyword.options == SIGMOID
    want = jax_dsrelu.moe_layer(x, weights=MoEWeights(**jax_dsrelu.params_from_hf_nemotron_h(hf_tensors())),
                                options=SIGMOID)
    np.testing.assert_array_equal(whole(x), want)
    np.testing.assert_array_equal(by_keyword(x), want)


def test_the_hugging_face_loader_refuses_softmax_options_and_needs_top_k():
    # A NemotronHMoE block scores by sigmoid; an options object with softmax is a mistake.
    with pytest.raises(ValueError, match=re.escape("options.score must be 'sigmoid' for MoE.from_hf_nemotron_h, got score='softmax'")):
        MoE.from_hf_nemotron_h(hf_tensors(), options=MoEOptions(top_k=2))
    with pytest.raises(TypeError, match=re.escape("MoE.from_hf_nemotron_h needs top_k, or options=MoEOptions(...)")):
        MoE.from_hf_nemotron_h(hf_tensors(), normalize=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'score'"):
        MoE.from_hf_nemotron_h(hf_tensors(), top_k=2, score="sigmoid")


def whole_and_keyword_calls():
    """Each entry point called with an options object and one option keyword besides."""
    x = jnp.asarray(np.random.default_rng(8).standard_normal((T, D)), jnp.float32)
    arrays = layer_arrays()
    mesh = jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])
    return {
        "moe_layer": lambda **o: jax_dsrelu.moe_layer(x, **arrays, **o),
        "moe_layer_expert_parallel": lambda **o: jax_dsrelu.moe_layer_expert_parallel(x, **arrays, mesh=mesh, **o),
        "MoE": lambda **o: MoE(D, F, E, rngs=nnx.Rngs(0), **o),
        "MoE.from_hf_nemotron_h": lambda **o: MoE.from_hf_nemotron_h(hf_tensors(), **o),
    }


@pytest.mark.parametrize("entry_point_name", ["moe_layer", "moe_layer_expert_parallel", "MoE", "MoE.from_hf_nemotron_h"])
def test_options_and_an_option_keyword_together_are_refused(entry_point_name):
    call = whole_and_keyword_calls()[entry_point_name]
    # Even a keyword that agrees with the object: either precedence would hide the other value.
    for keyword in (dict(top_k=2), dict(top_k=3)):
        with pytest.raises(TypeError, match=re.escape(
            f"{entry_point_name} takes the options either whole (options=MoEOptions(...)) or as keywords, not both: "
            f"got options and top_k={keyword['top_k']}; pass dataclasses.replace(options, top_k={keyword['top_k']}) instead"
        )):
            call(options=SIGMOID, **keyword)
    with pytest.raises(TypeError, match=re.escape("options must be a jax_dsrelu.MoEOptions or None, got {'top_k': 2} (dict)")):
        call(options={"top_k": 2})


@pytest.mark.parametrize("layer", ["moe_layer", "moe_layer_expert_parallel"])
def test_weights_and_a_weight_array_together_are_refused(layer):
    x = jnp.asarray(np.random.default_rng(9).standard_normal((T, D)), jnp.float32)
    arrays = layer_arrays()
    function = getattr(jax_dsrelu, layer)
    extra = dict(mesh=jax.make_mesh((1,), ("expert",), devices=jax.devices()[:1])) if "parallel" in layer else {}
    with pytest.raises(TypeError, match=re.escape(
        f"{layer} takes the weights either whole (weights=MoEWeights(...)) or as arrays, not both: got weights and b1"
    )):
        function(x, weights=MoEWeights(**arrays), b1=arrays["b1"], **extra)
    with pytest.raises(TypeError, match=re.escape("weights must be a jax_dsrelu.MoEWeights or None, got dict")):
        function(x, weights=arrays, **extra)
    # Without weights, a missing array is named as any bad one is.
    with pytest.raises(TypeError, match=re.escape("w2 must be a JAX or NumPy array, got NoneType")):
        function(x, arrays["router"], arrays["w1"], **extra)


# --- Each default declared once, and documented from that declaration. ---

ENTRY_POINTS = {
    "moe_layer": (jax_dsrelu.moe_layer, {}),
    "moe_layer_expert_parallel": (jax_dsrelu.moe_layer_expert_parallel, {}),
    "MoE": (MoE.__init__, {}),
    "MoE.from_hf_nemotron_h": (MoE.from_hf_nemotron_h, {"score": "sigmoid"}),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_every_option_without_a_default_of_its_own(name):
    function, fixed = ENTRY_POINTS[name]
    parameters = inspect.signature(function).parameters
    assert parameters["options"].default is None
    for field in dataclasses.fields(MoEOptions):
        if field.name in fixed:
            assert field.name not in parameters
        else:
            assert parameters[field.name].kind is inspect.Parameter.KEYWORD_ONLY
            assert parameters[field.name].default is UNSET, f"{name}'s {field.name} has a default of its own"


def test_route_takes_its_defaults_from_the_declaration():
    # route has no options object (it runs no experts), so its keywords hold the values.
    parameters = inspect.signature(jax_dsrelu.route).parameters
    for field in dataclasses.fields(MoEOptions):
        if field.name in parameters and field.name != "top_k":
            assert parameters[field.name].default == field.default, field.name
    assert parameters["top_k"].default is inspect.Parameter.empty


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_documents_every_option_with_its_declared_default(name):
    function, fixed = ENTRY_POINTS[name]
    doc = inspect.getdoc(function)
    assert "{MoEOptions}" not in doc
    for field in dataclasses.fields(MoEOptions):
        default = fixed.get(field.name, field.default)
        spelled = field.name if (name, field.name) == ("MoE.from_hf_nemotron_h", "top_k") else f"{field.name}={default!r}"
        assert re.search(rf"^    {re.escape(spelled)}\s", doc, re.MULTILINE), (name, spelled)


def test_keyword_defaults_are_the_declared_ones():
    # The keywords left out give MoEOptions' defaults.
    assert MoE(D, F, E, rngs=nnx.Rngs(0)).options == MoEOptions()
    assert MoE.from_hf_nemotron_h(hf_tensors(), top_k=3).options == MoEOptions(top_k=3, score="sigmoid")


def planted(default_of_top_k):
    """A copy of moe_layer's way of taking options, with top_k's default changed."""

    def layer(x, *, options=None, top_k=default_of_top_k, score=UNSET, num_groups=UNSET, top_groups=UNSET,
              normalize=UNSET, scale=UNSET, round_to=UNSET, capacity_factor=UNSET, recompute_exchanged=UNSET,
              deterministic=UNSET, backend=UNSET, precision=UNSET):
        """A layer.

        {MoEOptions}
        """
        return options

    return layer


def test_a_default_changed_in_one_entry_point_is_refused_when_it_is_defined():
    assert entry_point(planted(UNSET))(None) == MoEOptions()
    with pytest.raises(TypeError, match=re.escape(
        "layer's keyword top_k must be keyword-only with the default UNSET (its default is MoEOptions.top_k=2, "
        "declared there once), got top_k=3"
    )):
        entry_point(planted(3))


def test_an_option_left_out_of_an_entry_point_is_refused_when_it_is_defined():
    def layer(x, *, options=None, top_k=UNSET, score=UNSET, num_groups=UNSET, top_groups=UNSET,
              normalize=UNSET, scale=UNSET, deterministic=UNSET, backend=UNSET):
        """{MoEOptions}"""

    with pytest.raises(TypeError, match=re.escape("layer must take the fields of MoEOptions")):
        entry_point(layer)
