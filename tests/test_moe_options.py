"""The MoE layer's options, checked once (`jax_dsrelu.moe.options`): every entry point that
takes them answers a bad one with the same words, and the checked options are frozen."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu
from jax_dsrelu.moe.options import LayerOptions, RoutingOptions

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
    (dict(deterministic="yes"), TypeError, "deterministic must be a Python bool, got 'yes' (str)"),
    (dict(backend="cuda"), ValueError, "backend must be one of 'auto', 'xla', 'sm90', 'sm100', got 'cuda'"),
]


# route takes the routing options only.
CASES = [
    (entry_point, *bad)
    for entry_point in ("route", "moe_layer", "moe_layer_expert_parallel", "flax.MoE")
    for bad in BAD_OPTIONS
    if not (entry_point == "route" and set(bad[0]) & {"deterministic", "backend"})
]


@pytest.mark.parametrize("entry_point, options, error, words", CASES)
def test_every_entry_point_answers_a_bad_option_alike(entry_point, options, error, words):
    with pytest.raises(error, match=re.escape(words)):
        entry_points()[entry_point](**options)


def test_options_are_frozen_hashable_and_checked_when_built():
    options = LayerOptions.of(8, top_k=2, score="sigmoid", num_groups=4, top_groups=2, normalize=True, scale=2.5,
                              deterministic=True, backend="xla")
    assert options.routing == RoutingOptions(num_experts=8, top_k=2, score="sigmoid", num_groups=4, top_groups=2,
                                             normalize=True, scale=2.5)
    assert hash(options) == hash(dataclasses.replace(options))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.routing.top_k = 3
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts E=8, got top_k=9"):
        dataclasses.replace(options.routing, top_k=9)


def test_the_module_keeps_the_options_it_checked():
    module = MoE(D, F, E, top_k=3, score="sigmoid", normalize=True, scale=2.5, deterministic=True, rngs=nnx.Rngs(0))
    assert module.options == LayerOptions.of(E, top_k=3, score="sigmoid", num_groups=1, top_groups=None,
                                             normalize=True, scale=2.5, deterministic=True, backend="auto")
