"""jax_dsrelu.flax.MoE with a mesh: moe_layer_expert_parallel's values and gradients, the
Hugging Face loader and the options it takes, checked when the module is built."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

nnx = pytest.importorskip("flax.nnx", reason="needs Flax (pip install 'jax-dsrelu[flax]')")
optax = pytest.importorskip("optax", reason="needs optax")

import jax_dsrelu  # noqa: E402
from jax_dsrelu.flax import MoE  # noqa: E402
from test_expert_parallel_recompute import same_bits  # noqa: E402

D, F, E = 16, 24, 8


@pytest.fixture(scope="module")
def mesh():
    # Axes named otherwise than the defaults, so that a module that ignores its
    # expert_axis fails.
    assert len(jax.devices()) >= 8, "conftest.py asks XLA for 8 host devices"
    return jax.make_mesh((2, 4), ("dp", "ep"), axis_types=(AxisType.Auto,) * 2)


AXES = dict(expert_axis="ep", data_axis="dp")


@pytest.mark.parametrize("options", [
    dict(top_k=2, deterministic=True),
    dict(top_k=3, score="sigmoid", normalize=True, capacity_factor=1.0, recompute_exchanged=True, deterministic=True),
], ids=["dropless", "sigmoid_capacity_recompute"])
def test_values_and_gradients_are_the_functional_expert_parallel_layers(mesh, options):
    module = MoE(D, F, E, mesh=mesh, **AXES, rngs=nnx.Rngs(3), **options)
    module.b1[...] = 0.1 * jax.random.normal(jax.random.key(4), module.b1[...].shape)
    x = jax.random.normal(jax.random.key(5), (4, 16, D))
    cotangent = jax.random.normal(jax.random.key(6), (4, 16, D))

    def module_loss(module, x):
        out, aux = module(x, return_aux=True)
        return jnp.sum(out * cotangent) + aux.load_balancing_loss

    value, grads = nnx.jit(nnx.value_and_grad(module_loss))(module, x)
    bias = None if module.expert_bias is None else module.expert_bias[...]

    # x, the bias and the cotangent as arguments, as the module's jit takes them.
    def functional_loss(router, w1, w2, b1, x, bias, cotangent):
        out, aux = jax_dsrelu.moe_layer_expert_parallel(
            x.reshape(64, D), router, w1, w2, b1=b1, expert_bias=bias, mesh=mesh, **AXES, return_aux=True, **options)
        return jnp.sum(out.reshape(x.shape) * cotangent) + aux.load_balancing_loss

    want_value, want_grads = jax.jit(jax.value_and_grad(functional_loss, argnums=(0, 1, 2, 3)))(
        module.router[...], module.w1[...], module.w2[...], module.b1[...], x, bias, cotangent)
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


def test_the_parameters_are_placed_on_the_mesh_and_a_training_step_runs(mesh):
    # data_axis as a list: kept as a tuple, since nnx.jit hashes the module's static state.
    module = MoE(D, F, E, mesh=mesh, expert_axis="ep", data_axis=["dp"], top_k=2, rngs=nnx.Rngs(3))
    assert module.data_axis == ("dp",)
    for name in ("w1", "w2", "b1"):
        assert getattr(module, name)[...].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("ep")), 3
                                                                       if name != "b1" else 2), name
    assert module.router[...].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec()), 2)
    optimizer = nnx.Optimizer(module, optax.sgd(0.1), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(7), (64, D))

    @nnx.jit
    def step(module, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(module)
        optimizer.update(module, grads)
        return loss

    losses = [float(step(module, optimizer, x)) for _ in range(3)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


def test_loads_a_hugging_face_nemotron_h_block_onto_a_mesh():
    from test_hf_nemotron import tensors as hf_tensors

    tensors = hf_tensors(dtype=np.float32)
    params = jax_dsrelu.params_from_hf_nemotron_h(tensors)
    num_experts = params["router"].shape[1]
    mesh = jax.make_mesh((8 // np.gcd(8, num_experts), np.gcd(8, num_experts)), ("dp", "ep"),
                         axis_types=(AxisType.Auto,) * 2)
    module = MoE.from_hf_nemotron_h(tensors, top_k=3, deterministic=True, mesh=mesh, **AXES)
    assert module.mesh is mesh and module.expert_axis == "ep" and module.data_axis == ("dp",)
    assert module.w1[...].sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("ep")), 3)
    x = jax.random.normal(jax.random.key(11), (2, 16, params["router"].shape[0]))
    out = nnx.jit(lambda m, x: m(x))(module, x)
    want = jax.jit(lambda x, params: jax_dsrelu.moe_layer_expert_parallel(
        x.reshape(32, -1), **params, score="sigmoid", top_k=3, deterministic=True, mesh=mesh, **AXES))(x, params)
    assert same_bits(out, want.reshape(x.shape))


def test_the_mesh_and_its_options_are_checked_when_the_module_is_built(mesh):
    rngs = nnx.Rngs(0)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        MoE(D, F, E, mesh="mesh", rngs=rngs)
    with pytest.raises(ValueError, match=r"expert_axis='expert' is not an axis of the mesh, whose axes are "
                                         r"\('dp', 'ep'\)"):
        MoE(D, F, E, mesh=mesh, rngs=rngs)
    with pytest.raises(ValueError, match=r"the number of experts E=6 \(w1.shape\[0\]\) must be a multiple of "
                                         r"mesh.shape\['ep'\]=4"):
        MoE(D, F, 6, mesh=mesh, **AXES, rngs=rngs)
    with pytest.raises(ValueError, match="round_to must be None or 1 under expert parallelism"):
        MoE(D, F, E, mesh=mesh, **AXES, round_to=4, rngs=rngs)
    # Without a mesh the options and axes of expert parallelism are refused, as moe_layer refuses them.
    with pytest.raises(ValueError, match="capacity_factor must be None on one device"):
        MoE(D, F, E, capacity_factor=1.0, rngs=rngs)
    with pytest.raises(ValueError, match=r"expert_axis and data_axis name axes of a mesh, and mesh is None: got "
                                         r"expert_axis='expert', data_axis='dp'"):
        MoE(D, F, E, data_axis="dp", rngs=rngs)
    module = MoE(D, F, E, mesh=mesh, **AXES, capacity_factor=1.25, recompute_exchanged=True, rngs=rngs)
    with pytest.raises(ValueError, match=r"the number of tokens T=x.shape\[0\]=12 must be a multiple of the 8 token "
                                         r"shards"):
        module(jnp.zeros((12, D)))
