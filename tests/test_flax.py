"""jax_dsrelu.flax.MoE: the functional layer's values and gradients, and it trains."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="needs Flax (pip install 'jax-dsrelu[flax]')")
optax = pytest.importorskip("optax", reason="needs optax")

import jax_dsrelu  # noqa: E402
from jax_dsrelu.flax import MoE  # noqa: E402


def make_module(use_bias=True, **kwargs):
    module = MoE(16, 24, 6, use_bias=use_bias, rngs=nnx.Rngs(3), **kwargs)
    if use_bias:  # a bias that is not zero, so its gradient path is exercised
        module.b1[...] = 0.1 * jax.random.normal(jax.random.key(4), module.b1[...].shape)
    return module


def test_parameters_and_initial_scale():
    module = make_module(top_k=3)
    assert module.router[...].shape == (16, 6) and module.router[...].dtype == jnp.float32
    assert module.w1[...].shape == (6, 16, 24) and module.w2[...].shape == (6, 24, 16)
    assert module.b1[...].shape == (6, 24)
    # Fan-in scaling per expert: variance 1 / fan_in (truncated normal, rescaled).
    np.testing.assert_allclose(np.std(module.w1[...]), 1 / np.sqrt(16), rtol=0.1)
    np.testing.assert_allclose(np.std(module.w2[...]), 1 / np.sqrt(24), rtol=0.1)
    assert make_module(use_bias=False).b1 is None
    params = nnx.state(module, nnx.Param)
    assert len(jax.tree.leaves(params)) == 4


@pytest.mark.parametrize("use_bias", [True, False])
def test_values_and_gradients_equal_the_functional_layer(use_bias):
    module = make_module(use_bias=use_bias, top_k=2, normalize=True, deterministic=True)
    x = jax.random.normal(jax.random.key(5), (3, 10, 16))
    cotangent = jax.random.normal(jax.random.key(6), (3, 10, 16))

    def module_loss(module, x):
        return jnp.sum(module(x) * cotangent)

    value, grads = nnx.jit(nnx.value_and_grad(module_loss))(module, x)

    b1 = module.b1[...] if use_bias else None

    def functional_loss(router, w1, w2, b1):
        out = jax_dsrelu.moe_layer(
            x.reshape(30, 16), router, w1, w2, b1=b1, top_k=2, normalize=True, deterministic=True
        )
        return jnp.sum(out.reshape(x.shape) * cotangent)

    argnums = (0, 1, 2, 3) if use_bias else (0, 1, 2)
    want_value, want_grads = jax.jit(jax.value_and_grad(functional_loss, argnums=argnums))(
        module.router[...], module.w1[...], module.w2[...], b1
    )
    np.testing.assert_array_equal(value, want_value)
    got = [grads.router[...], grads.w1[...], grads.w2[...]] + ([grads.b1[...]] if use_bias else [])
    for name, a, b in zip(("router", "w1", "w2", "b1"), got, want_grads):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_bfloat16_compute_with_float32_parameters():
    module = make_module(dtype=jnp.bfloat16)
    assert module.w1[...].dtype == jnp.float32
    x = jax.random.normal(jax.random.key(7), (20, 16))
    out = module(x)
    assert out.dtype == jnp.float32
    want = jax_dsrelu.moe_layer(
        x, module.router[...], module.w1[...].astype(jnp.bfloat16), module.w2[...].astype(jnp.bfloat16),
        b1=module.b1[...],
    )
    np.testing.assert_array_equal(out, want)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(module)
    assert grads.w1[...].dtype == jnp.float32


def test_trains_with_optax_and_aux_losses():
    module = make_module(top_k=2)
    optimizer = nnx.Optimizer(module, optax.adam(1e-2), wrt=nnx.Param)
    key_x, key_target = jax.random.split(jax.random.key(8))
    x = jax.random.normal(key_x, (64, 16))
    target = jnp.tanh(x @ jax.random.normal(key_target, (16, 16)))

    @nnx.jit
    def step(module, optimizer):
        def loss(module):
            out, aux = module(x, return_aux=True)
            return jnp.mean((out - target) ** 2) + 1e-2 * aux.load_balancing_loss + 1e-3 * aux.router_z_loss

        value, grads = nnx.value_and_grad(loss)(module)
        optimizer.update(module, grads)
        return value

    losses = [float(step(module, optimizer)) for _ in range(60)]
    assert losses[-1] < 0.5 * losses[0], losses
    _, aux = module(x, return_aux=True)
    assert int(jnp.sum(aux.group_sizes)) == 2 * 64
