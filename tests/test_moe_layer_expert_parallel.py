"""moe_layer_expert_parallel on 8 host devices equals moe_layer on one, and repeats bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_dsrelu

NUM_TOKENS, D_MODEL, D_FF, NUM_EXPERTS = 128, 16, 24, 8


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert len(jax.devices()) >= 8, "conftest.py asks XLA for 8 host devices"


def make_inputs(seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NUM_TOKENS, D_MODEL))
    x[:, 0] = 1.0
    router = rng.standard_normal((D_MODEL, NUM_EXPERTS))
    router[0, 5] = -40.0  # expert 5 gets no token: one device has an empty expert
    router[0, 2] = 1.5  # and expert 2 more than its share
    w1 = rng.standard_normal((NUM_EXPERTS, D_MODEL, D_FF)) / np.sqrt(D_MODEL)
    w2 = rng.standard_normal((NUM_EXPERTS, D_FF, D_MODEL)) / np.sqrt(D_FF)
    b1 = 0.1 * rng.standard_normal((NUM_EXPERTS, D_FF))
    cotangent = rng.standard_normal((NUM_TOKENS, D_MODEL))
    return tuple(jnp.asarray(a, t) for a, t in ((x, jnp.float32), (router, jnp.float32), (w1, dtype), (w2, dtype), (b1, jnp.float32), (cotangent, jnp.float32)))


def loss_and_grads(layer, x, router, w1, w2, b1, cotangent):
    def loss(x, router, w1, w2, b1):
        out, aux = layer(x, router, w1, w2, b1)
        return jnp.sum(out * cotangent) + aux.load_balancing_loss + 0.1 * aux.router_z_loss, (out, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, router, w1, w2, b1)


def one_device(top_k, normalize):
    return lambda x, router, w1, w2, b1: jax_dsrelu.moe_layer(
        x, router, w1, w2, b1=b1, top_k=top_k, normalize=normalize, deterministic=True, return_aux=True
    )


def expert_parallel(mesh, data_axis, top_k, normalize):
    return lambda x, router, w1, w2, b1: jax_dsrelu.moe_layer_expert_parallel(
        x, router, w1, w2, b1=b1, mesh=mesh, expert_axis="expert", data_axis=data_axis,
        top_k=top_k, normalize=normalize, deterministic=True, return_aux=True,
    )


MESHES = [
    ((2, 4), ("data", "expert"), "data"),
    ((8,), ("expert",), None),
    ((2, 2, 2), ("data", "fsdp", "expert"), ("data", "fsdp")),
]


@pytest.mark.parametrize("top_k, normalize", [(2, False), (3, True), (1, False)])
@pytest.mark.parametrize("shape, names, data_axis", MESHES, ids=["data2_expert4", "expert8", "data2x2_expert2"])
def test_equals_one_device(shape, names, data_axis, top_k, normalize):
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    inputs = make_inputs(sum(shape) + top_k)
    (_, (sharded_out, sharded_aux)), sharded_grads = loss_and_grads(
        expert_parallel(mesh, data_axis, top_k, normalize), *inputs
    )
    (_, (out, aux)), grads = loss_and_grads(one_device(top_k, normalize), *inputs)
    assert int(aux.group_sizes[5]) == 0
    np.testing.assert_array_equal(sharded_aux.group_sizes, aux.group_sizes)
    np.testing.assert_allclose(sharded_aux.load_balancing_loss, aux.load_balancing_loss, rtol=1e-6)
    np.testing.assert_allclose(sharded_aux.router_z_loss, aux.router_z_loss, rtol=1e-6)
    for name, got, want in zip(("out", "dx", "drouter", "dw1", "dw2", "db1"), (sharded_out, *sharded_grads), (out, *grads)):
        got, want = np.asarray(got), np.asarray(want)
        # float32; the weight gradients add the rows in another order across devices.
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(got / scale, want / scale, atol=1e-5, err_msg=name)


def test_without_bias_and_aux_in_bfloat16():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    x, router, w1, w2, _, cotangent = make_inputs(5, jnp.bfloat16)
    sharded = jax.jit(
        lambda *a: jax_dsrelu.moe_layer_expert_parallel(*a, mesh=mesh, data_axis="data")
    )(x, router, w1, w2)
    single = jax.jit(lambda *a: jax_dsrelu.moe_layer(*a))(x, router, w1, w2)
    assert sharded.dtype == single.dtype == jnp.float32
    # The same bfloat16 rows through the same experts, in other row blocks.
    scale = float(jnp.max(jnp.abs(single)))
    np.testing.assert_allclose(np.asarray(sharded) / scale, np.asarray(single) / scale, atol=1e-5)


def test_deterministic_repeats_bit_for_bit():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    inputs = make_inputs(6, jnp.bfloat16)
    layer = expert_parallel(mesh, "data", 2, False)
    first = jax.device_get(loss_and_grads(layer, *inputs))
    again = jax.device_get(loss_and_grads(layer, *inputs))
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.ravel(a).view(np.uint8), np.ravel(b).view(np.uint8))


def test_gradient_lowers_to_no_scatter():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    x, router, w1, w2, b1, cotangent = make_inputs(7)
    layer = expert_parallel(mesh, "data", 2, True)
    hlo = jax.jit(
        jax.grad(lambda *a: jnp.sum(layer(*a)[0] * cotangent), argnums=(0, 1, 2, 3, 4))
    ).lower(x, router, w1, w2, b1).as_text()
    assert "all_to_all" in hlo
    assert "scatter" not in hlo


def test_explicit_mesh_axes():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    x, router, w1, w2, b1, _ = make_inputs(8)
    sharded = jax.jit(
        lambda *a: jax_dsrelu.moe_layer_expert_parallel(*a, b1=b1, mesh=mesh, data_axis="data")
    )(x, router, w1, w2)
    single = jax.jit(lambda *a: jax_dsrelu.moe_layer(*a, b1=b1))(x, router, w1, w2)
    # float32; the router's dot and the expert GEMMs run on other row blocks.
    scale = float(jnp.max(jnp.abs(single)))
    np.testing.assert_allclose(np.asarray(sharded) / scale, np.asarray(single) / scale, atol=1e-6)


def test_validation_names_the_argument():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    x, router, w1, w2, _, _ = make_inputs(9)
    layer = jax_dsrelu.moe_layer_expert_parallel
    with pytest.raises(ValueError, match=r"expert_axis='model' is not an axis of the mesh, whose axes are \('data', 'expert'\)"):
        layer(x, router, w1, w2, mesh=mesh, expert_axis="model")
    with pytest.raises(ValueError, match="data_axis='batch' names 'batch', not an axis of the mesh"):
        layer(x, router, w1, w2, mesh=mesh, data_axis="batch")
    with pytest.raises(ValueError, match=r"E=w1.shape\[0\]=6 must be a multiple of mesh.shape\['expert'\]=4"):
        layer(x, router[:, :6], w1[:6], w2[:6], mesh=mesh)
    with pytest.raises(ValueError, match=r"T=x.shape\[0\]=100 must be a multiple of the 8 token shards"):
        layer(x[:100], router, w1, w2, mesh=mesh, data_axis="data")
