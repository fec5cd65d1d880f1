"""jax_dsrelu.flax.MoE with a mesh: moe_layer_expert_parallel's values and gradients, the
Hugging Face loader and the options it takes, checked when the module is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

nnx = pytest.importorskip("flax.nnx", reason="needs Flax (pip install 'jax-dsrelu[flax]')")

import jax_dsrelu  # noqa: E402
from jax_dsrelu.flax import MoE  # noqa: E402

D, F, E = 16, 24, 8


@pytest.fixture(scope="module")
def mesh():
    assert len(jax.devices()) >= 8, "conftest.py asks XLA for 8 host devices"
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)


def same_bits(a, b) -> bool:
    return all(
        np.array_equal(np.ravel(u).view(np.uint8), np.ravel(v).view(np.uint8))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("options", [
    dict(top_k=2, deterministic=True),
    dict(top_k=3, score="sigmoid", normalize=True, capacity_factor=1.0, recompute_exchanged=True, deterministic=True),
], ids=["dropless", "sigmoid_capacity_recompute"])
def test_values_and_gradients_are_the_functional_expert_parallel_layers(mesh, options):
    module = MoE(D, F, E, mesh=mesh, data_axis="data", rngs=nnx.Rngs(3), **options)
    module.b1[...] = 0.1 * jax.random.normal(jax.random.key(4), module.b1[...].shape)
    x = jax.random.normal(jax.random.key(5), (4, 16, D))
    cotangent = jax.random.normal(jax.random.key(6), (4, 16, D))

    def module_loss(module, x):
        out, aux = module(x, return_aux=True)
        return jnp.sum(out * cotangent) + aux.load_balancing_loss

    value, grads = nnx.jit(nnx.value_and_grad(module_loss))(module, x)
    bias = None if module.expert_bias is None else module.expert_bias[...]

    def functional_loss(router, w1, w2, b1):
        out, aux = jax_dsrelu.moe_layer_expert_parallel(
            x.reshape(64, D), router, w1, w2, b1=b1, expert_bias=bias, mesh=mesh, data_axis="data",
            return_aux=True, **options)
        return jnp.sum(out.reshape(x.shape) * cotangent) + aux.load_balancing_loss

    want_value, want_grads = jax.jit(jax.value_and_grad(functional_loss, argnums=(0, 1, 2, 3)))(
        module.router[...], module.w1[...], module.w2[...], module.b1[...])
    got = (value, (grads.router[...], grads.w1[...], grads.w2[...], grads.b1[...]))
    assert same_bits(jax.device_get(got), jax.device_get((want_value, want_grads)))
    # The rows move between devices: the module runs the expert-parallel layer, not moe_layer.
    graphdef, state = nnx.split(module)
    assert "all_to_all" in jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, x).as_text()
    # And the one-device module's, to float32 rounding (the rows are summed in another order).
    if "capacity_factor" not in options:
        one_device = MoE(D, F, E, rngs=nnx.Rngs(3), **options)
        one_device.b1[...] = module.b1[...]
        np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(one_device, x), nnx.jit(lambda m, x: m(x))(module, x),
                                   rtol=1e-5, atol=1e-5)


def test_loads_a_hugging_face_nemotron_h_block_onto_a_mesh(mesh):
    from test_hf_nemotron import tensors as hf_tensors

    tensors = hf_tensors(dtype=np.float32)
    params = jax_dsrelu.params_from_hf_nemotron_h(tensors)
    num_experts = params["router"].shape[1]
    mesh = jax.make_mesh((8 // np.gcd(8, num_experts), np.gcd(8, num_experts)), ("data", "expert"),
                         axis_types=(AxisType.Auto,) * 2)
    module = MoE.from_hf_nemotron_h(tensors, top_k=3, deterministic=True, mesh=mesh, data_axis="data")
    x = jax.random.normal(jax.random.key(11), (2, 16, params["router"].shape[0]))
    out = nnx.jit(lambda m, x: m(x))(module, x)
    want = jax.jit(lambda x: jax_dsrelu.moe_layer_expert_parallel(
        x.reshape(32, -1), **params, score="sigmoid", top_k=3, deterministic=True, mesh=mesh, data_axis="data"))(x)
    assert same_bits(out, want.reshape(x.shape))


def test_the_mesh_and_its_options_are_checked_when_the_module_is_built(mesh):
    rngs = nnx.Rngs(0)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        MoE(D, F, E, mesh="mesh", rngs=rngs)
    with pytest.raises(ValueError, match=r"expert_axis='experts' is not an axis of the mesh, whose axes are "
                                         r"\('data', 'expert'\)"):
        MoE(D, F, E, mesh=mesh, expert_axis="experts", rngs=rngs)
    with pytest.raises(ValueError, match=r"the number of experts E=w1.shape\[0\]=6 must be a multiple of "
                                         r"mesh.shape\['expert'\]=4"):
        MoE(D, F, 6, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match="round_to must be None or 1 under expert parallelism"):
        MoE(D, F, E, mesh=mesh, round_to=4, rngs=rngs)
    # Without a mesh the options of expert parallelism are refused, as moe_layer refuses them.
    with pytest.raises(ValueError, match="capacity_factor must be None on one device"):
        MoE(D, F, E, capacity_factor=1.0, rngs=rngs)
    module = MoE(D, F, E, mesh=mesh, data_axis="data", capacity_factor=1.25, recompute_exchanged=True, rngs=rngs)
    with pytest.raises(ValueError, match=r"the number of tokens T=x.shape\[0\]=12 must be a multiple of the 8 token "
                                         r"shards"):
        module(jnp.zeros((12, D)))
