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
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
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
    with pytest.raises(ValueError, match=r"E=6 \(w1.shape\[0\]\) must be a multiple of mesh.shape\['expert'\]=4"):
        layer(x, router[:, :6], w1[:6], w2[:6], mesh=mesh)
    with pytest.raises(ValueError, match=r"T=x.shape\[0\]=100 must be a multiple of the 8 token shards"):
        layer(x[:100], router, w1, w2, mesh=mesh, data_axis="data")


def block_inputs(seed):
    """A Nemotron-style block's weights: sigmoid routing with a bias, a shared expert and
    latent projections (l = 8 < d = 16), expert 5 held off by its bias."""
    rng = np.random.default_rng(seed)
    latent, shared = 8, 20
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[-2]), jnp.float32)  # noqa: E731
    x = jnp.asarray(rng.standard_normal((NUM_TOKENS, D_MODEL)), jnp.float32)
    params = dict(
        router=normal(D_MODEL, NUM_EXPERTS), w1=normal(NUM_EXPERTS, latent, D_FF), w2=normal(NUM_EXPERTS, D_FF, latent),
        b1=jnp.asarray(0.1 * rng.standard_normal((NUM_EXPERTS, D_FF)), jnp.float32),
        shared_w1=normal(D_MODEL, shared), shared_w2=normal(shared, D_MODEL),
        latent_in=normal(D_MODEL, latent), latent_out=normal(latent, D_MODEL),
    )
    bias = jnp.asarray(0.05 * rng.standard_normal(NUM_EXPERTS), jnp.float32).at[5].set(-10.0)
    cotangent = jnp.asarray(rng.standard_normal((NUM_TOKENS, D_MODEL)), jnp.float32)
    return x, params, bias, cotangent


BLOCK_OPTIONS = dict(top_k=3, score="sigmoid", num_groups=4, top_groups=2, normalize=True, scale=2.5, deterministic=True)


def block_grads(layer, x, params, bias, cotangent):
    def loss(x, params):
        out, aux = layer(x, **params, expert_bias=bias, return_aux=True, **BLOCK_OPTIONS)
        return jnp.sum(out * cotangent) + aux.load_balancing_loss, aux

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)


def test_block_with_every_option_equals_one_device_and_repeats_bit_for_bit():
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    inputs = block_inputs(10)
    sharded_layer = lambda *a, **k: jax_dsrelu.moe_layer_expert_parallel(*a, mesh=mesh, data_axis="data", **k)  # noqa: E731
    (value, aux), grads = block_grads(sharded_layer, *inputs)
    (want_value, want_aux), want_grads = block_grads(jax_dsrelu.moe_layer, *inputs)
    assert int(want_aux.group_sizes[5]) == 0
    np.testing.assert_array_equal(aux.group_sizes, want_aux.group_sizes)
    np.testing.assert_allclose(value, want_value, rtol=1e-5)
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = np.max(np.abs(want))
        np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(want) / scale, atol=1e-5, err_msg=str(path))
    again = block_grads(sharded_layer, *inputs)
    for a, b in zip(jax.tree.leaves(jax.device_get(((value, aux), grads))), jax.tree.leaves(jax.device_get(again))):
        np.testing.assert_array_equal(np.ravel(a).view(np.uint8), np.ravel(b).view(np.uint8))
    x, params, bias, cotangent = inputs
    hlo = jax.jit(jax.grad(
        lambda x, p: jnp.sum(sharded_layer(x, **p, expert_bias=bias, **BLOCK_OPTIONS) * cotangent), argnums=(0, 1)
    )).lower(x, params).as_text()
    assert "all_to_all" in hlo and "scatter" not in hlo


def test_mesh_must_be_a_mesh():
    x, router, w1, w2, _, _ = make_inputs(11)
    with pytest.raises(TypeError, match=r"mesh must be a jax.sharding.Mesh \(e.g. from jax.make_mesh\) with an axis named expert_axis='expert', got None"):
        jax_dsrelu.moe_layer_expert_parallel(x, router, w1, w2, mesh=None)


def test_the_combine_adds_each_tokens_rows_in_slot_order():
    # With bfloat16 experts the sharded output is the one-device output bit for bit: the
    # same rows through the same experts, rounded to bfloat16, added in float32. Scaling the
    # experts' outputs by powers of 2 of both signs makes a token's three rows cancel, so
    # that any other order of its sum gives other bits (checked below): a combine that
    # reads a token's rows in another order, or another token's, fails here.
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    x, router, w1, w2, _, _ = make_inputs(12, jnp.bfloat16)
    signs = jnp.asarray([2.0**10, -(2.0**10), 2.0**-10, 1.0, 2.0**10, -(2.0**10), 2.0**-10, -1.0], jnp.bfloat16)
    w2 = w2 * signs[:, None, None]
    top_k = 3
    single = jax.jit(lambda *a: jax_dsrelu.moe_layer(*a, top_k=top_k))(x, router, w1, w2)
    sharded = jax.jit(
        lambda *a: jax_dsrelu.moe_layer_expert_parallel(*a, mesh=mesh, data_axis="data", top_k=top_k)
    )(x, router, w1, w2)
    np.testing.assert_array_equal(np.asarray(sharded), np.asarray(single))

    plan = jax_dsrelu.route(x @ router, top_k)
    y = jax_dsrelu.moe_mlp(jax_dsrelu.dispatch(x.astype(w1.dtype), plan), w1, w2, plan.row_prob, plan.group_sizes)
    slots = np.asarray(y, np.float32)[np.asarray(plan.inverse).reshape(-1, top_k)]  # (T, top_k, d)
    in_order = (slots[:, 0] + slots[:, 1]) + slots[:, 2]
    np.testing.assert_array_equal(in_order, np.asarray(single))
    reversed_order = (slots[:, 2] + slots[:, 1]) + slots[:, 0]
    assert not np.array_equal(reversed_order, in_order), "the inputs must make the order of the sum show"


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_no_tokens_give_an_empty_output_and_zero_weight_gradients(capacity_factor):
    # A device without tokens still sends its (empty) blocks and takes part in every exchange.
    _, router, w1, w2, b1, _ = make_inputs(0)
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)

    def loss(x, router, w1, w2, b1):
        out = jax_dsrelu.moe_layer_expert_parallel(
            x, router, w1, w2, b1=b1, mesh=mesh, expert_axis="expert", data_axis="data",
            capacity_factor=capacity_factor, deterministic=True)
        return jnp.sum(out), out

    x = jnp.zeros((0, D_MODEL), jnp.float32)
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, router, w1, w2, b1)
    assert out.shape == (0, D_MODEL) and grads[0].shape == (0, D_MODEL)
    for grad, weight in zip(grads[1:], (router, w1, w2, b1)):
        assert grad.shape == weight.shape and not np.asarray(grad).any()
