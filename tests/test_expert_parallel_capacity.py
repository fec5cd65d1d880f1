"""moe_layer_expert_parallel with a per-peer capacity: each device sends each other at most
C = ceil(capacity_factor * T_local * top_k / D) rows, the heaviest, and the rows dropped
add nothing and get no gradient; checked against a dense reference that masks them."""

from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_dsrelu

T, D_MODEL, D_FF, E, TOP_K = 128, 16, 24, 8, 2
DATA, PEERS = 2, 4
T_LOCAL = T // (DATA * PEERS)


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert len(jax.devices()) >= 8, "conftest.py asks XLA for 8 host devices"


def make_inputs(seed):
    rng = np.random.default_rng(seed)
    router = rng.standard_normal((D_MODEL, E))
    router[:, :2] += 0.5  # device 0's experts are offered more than their share
    arrays = dict(
        x=rng.standard_normal((T, D_MODEL)), router=router,
        w1=rng.standard_normal((E, D_MODEL, D_FF)) / np.sqrt(D_MODEL),
        w2=rng.standard_normal((E, D_FF, D_MODEL)) / np.sqrt(D_FF),
        b1=0.1 * rng.standard_normal((E, D_FF)), cotangent=rng.standard_normal((T, D_MODEL)),
    )
    return {name: jnp.asarray(a, jnp.float32) for name, a in arrays.items()}


def kept_mask(x, router, capacity):
    """(T, top_k) bool: the assignments sent, by walking each token shard's rows: each
    device takes its `capacity` heaviest (ties to the lower token, then slot)."""
    probs = np.asarray(jax.nn.softmax(np.asarray(x, np.float64) @ np.asarray(router, np.float64), axis=-1))
    experts = np.argsort(-probs, axis=1, kind="stable")[:, :TOP_K]
    weight = np.take_along_axis(probs, experts, axis=1)
    kept = np.zeros((T, TOP_K), bool)
    for shard in range(DATA * PEERS):
        tokens = range(shard * T_LOCAL, (shard + 1) * T_LOCAL)
        for device in range(PEERS):
            offered = [(t, s) for t in tokens for s in range(TOP_K) if experts[t, s] // (E // PEERS) == device]
            for t, s in sorted(offered, key=lambda a: (-weight[a], a))[:capacity]:
                kept[t, s] = True
    return kept


def dense_reference(x, router, w1, w2, b1, kept):
    """sum over token t's kept slots of weight * relu(x @ w1[e] + b1[e])**2 @ w2[e], every
    expert on every token, masked: no routing, no exchange."""
    probs = jax.nn.softmax(x @ router, axis=-1)
    _, experts = jax.lax.top_k(jax.lax.stop_gradient(probs), TOP_K)
    weight = jnp.take_along_axis(probs, experts, axis=1) * kept
    every = jnp.einsum("tef,efd->ted", jax.nn.relu(jnp.einsum("td,edf->tef", x, w1) + b1) ** 2, w2)
    chosen = jnp.take_along_axis(every, experts[:, :, None], axis=1)
    return jnp.sum(weight[:, :, None] * chosen, axis=1)


def sharded(capacity_factor, deterministic=True):
    mesh = jax.make_mesh((DATA, PEERS), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    return lambda x, router, w1, w2, b1: jax_dsrelu.moe_layer_expert_parallel(
        x, router, w1, w2, b1=b1, mesh=mesh, data_axis="data", top_k=TOP_K, capacity_factor=capacity_factor,
        deterministic=deterministic, return_aux=True,
    )


def value_and_grads(layer, inputs):
    def loss(x, router, w1, w2, b1):
        out, aux = layer(x, router, w1, w2, b1)
        return jnp.sum(out * inputs["cotangent"]), (out, aux)

    arguments = [inputs[name] for name in ("x", "router", "w1", "w2", "b1")]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(*arguments)


@pytest.mark.parametrize("capacity_factor", [1.0, 0.75])
def test_drops_the_lightest_rows_and_they_get_no_gradient(capacity_factor):
    inputs = make_inputs(1)
    capacity = math.ceil(fractions.Fraction(repr(float(capacity_factor))) * T_LOCAL * TOP_K / PEERS)
    kept = kept_mask(inputs["x"], inputs["router"], capacity)
    (_, (out, aux)), grads = value_and_grads(sharded(capacity_factor), inputs)
    assert int(aux.dropped) == int((~kept).sum()) > 0
    # group_sizes counts what the router chose, before any drop, as the bias update wants.
    assert int(aux.group_sizes.sum()) == T * TOP_K
    reference = lambda x, router, w1, w2, b1: (dense_reference(x, router, w1, w2, b1, kept), None)  # noqa: E731
    (_, (want, _)), want_grads = value_and_grads(reference, inputs)
    for name, got, expected in zip(("out", "dx", "drouter", "dw1", "dw2", "db1"), (out, *grads), (want, *want_grads)):
        scale = float(jnp.max(jnp.abs(expected)))
        np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(expected) / scale, atol=2e-5, err_msg=name)


def test_a_capacity_that_drops_nothing_is_the_dropless_layer_bit_for_bit():
    # capacity_factor = D gives every peer room for all of a device's rows: C = T_local * top_k.
    inputs = make_inputs(2)
    (_, (dropless, aux)), dropless_grads = value_and_grads(sharded(None), inputs)
    (_, (roomy, roomy_aux)), roomy_grads = value_and_grads(sharded(float(PEERS)), inputs)
    assert int(aux.dropped) == int(roomy_aux.dropped) == 0
    for a, b in zip(jax.tree.leaves((dropless, dropless_grads)), jax.tree.leaves((roomy, roomy_grads))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_deterministic_repeats_bit_for_bit_with_drops():
    inputs = make_inputs(3)
    first = jax.device_get(value_and_grads(sharded(0.75), inputs))
    again = jax.device_get(value_and_grads(sharded(0.75), inputs))
    assert int(first[0][1][1].dropped) > 0
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.ravel(a).view(np.uint8), np.ravel(b).view(np.uint8))
