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


NEMOTRON_STYLE = dict(
    top_k=3, score="sigmoid", num_groups=3, top_groups=2, normalize=True, scale=2.5, shared_d_ff=20, latent_dim=8
)


def test_nemotron_style_parameters_state_and_values():
    module = make_module(**NEMOTRON_STYLE, deterministic=True)
    shapes = {name: tuple(value.shape) for name, value in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    assert shapes == {
        ("router",): (16, 6), ("w1",): (6, 8, 24), ("b1",): (6, 24), ("w2",): (6, 24, 8),
        ("shared_w1",): (16, 20), ("shared_w2",): (20, 16), ("latent_in",): (16, 8), ("latent_out",): (8, 16),
    }
    # The bias is state, not a parameter.
    assert isinstance(module.expert_bias, jax_dsrelu.flax.ExpertBias) and not isinstance(module.expert_bias, nnx.Param)
    np.testing.assert_array_equal(module.expert_bias[...], np.zeros(6, np.float32))
    assert make_module().expert_bias is None  # softmax routing has none

    module.expert_bias[...] = jnp.asarray([0.3, -0.2, 0.0, 0.1, -0.5, 0.2], jnp.float32)
    x = jax.random.normal(jax.random.key(9), (2, 12, 16))
    out = nnx.jit(lambda m, x: m(x))(module, x)
    params = {name: getattr(module, name)[...] for name in ("b1", "shared_w1", "shared_w2", "latent_in", "latent_out")}
    options = {k: v for k, v in NEMOTRON_STYLE.items() if k not in ("shared_d_ff", "latent_dim")}
    want = jax.jit(lambda x: jax_dsrelu.moe_layer(
        x.reshape(24, 16), module.router[...], module.w1[...], module.w2[...], **params,
        expert_bias=module.expert_bias[...], deterministic=True, **options,
    ))(x)
    np.testing.assert_array_equal(out, want.reshape(x.shape))


def test_nemotron_style_trains_with_optax_and_balances_with_the_bias():
    module = make_module(**NEMOTRON_STYLE)
    optimizer = nnx.Optimizer(module, optax.adam(1e-2), wrt=nnx.Param)
    key_x, key_target = jax.random.split(jax.random.key(10))
    x = jax.random.normal(key_x, (64, 16))
    target = jnp.tanh(x @ jax.random.normal(key_target, (16, 16)))

    @nnx.jit
    def step(module, optimizer):
        def loss(module):
            out, aux = module(x, return_aux=True)
            return jnp.mean((out - target) ** 2), aux

        (value, aux), grads = nnx.value_and_grad(loss, has_aux=True)(module)
        assert "expert_bias" not in dict(grads)  # no gradient for the bias
        optimizer.update(module, grads)
        module.update_expert_bias(aux.group_sizes, 1e-2)
        return value, aux.group_sizes

    first_bias = None
    losses = []
    for _ in range(60):
        value, sizes = step(module, optimizer)
        losses.append(float(value))
        if first_bias is None:  # the first update, from the first step's loads
            first_bias = np.asarray(module.expert_bias[...])
            sizes = np.asarray(sizes)
            np.testing.assert_allclose(first_bias, 1e-2 * np.sign(sizes.mean() - sizes), rtol=1e-6)
    assert losses[-1] < 0.5 * losses[0], losses
    # 60 steps of +-0.01 or 0 each.
    assert np.all(np.abs(np.asarray(module.expert_bias[...])) <= 60 * 1e-2 + 1e-6)
    with pytest.raises(ValueError, match="update_expert_bias needs score='sigmoid'"):
        make_module().update_expert_bias(jnp.ones(6, jnp.int32), 1e-3)


def test_settings_are_checked_when_the_module_is_built():
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="top_k must be between 1 and the number of experts E=4, got top_k=6"):
        MoE(16, 24, 4, top_k=6, rngs=rngs)
    with pytest.raises(ValueError, match="score must be 'softmax' or 'sigmoid', got 'tanh'"):
        MoE(16, 24, 4, score="tanh", rngs=rngs)
    with pytest.raises(ValueError, match="num_groups must be at least 1 and divide the number of experts E=4, got num_groups=3"):
        MoE(16, 24, 4, num_groups=3, rngs=rngs)
    with pytest.raises(ValueError, match="shared_d_ff must be at least 1, got shared_d_ff=0"):
        MoE(16, 24, 4, shared_d_ff=0, rngs=rngs)
    with pytest.raises(TypeError, match=r"latent_dim must be a Python int, got 8.0 \(float\)"):
        MoE(16, 24, 4, latent_dim=8.0, rngs=rngs)
    with pytest.raises(TypeError, match="dtype must be one of bfloat16, float16, float32, got int8"):
        MoE(16, 24, 4, dtype=jnp.int8, rngs=rngs)
    with pytest.raises(TypeError, match="dtype must be one of bfloat16, float16, float32, got 'fp32'"):
        MoE(16, 24, 4, dtype="fp32", rngs=rngs)
    with pytest.raises(ValueError, match="backend must be one of"):
        MoE(16, 24, 4, backend="cuda", rngs=rngs)
    module = MoE(16, 24, 4, rngs=rngs)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] must equal d_model=16, got x.shape=\(3, 12\)"):
        module(jnp.zeros((3, 12)))


@pytest.mark.parametrize("checkpoint_dtype, param_dtype, dtype", [
    ("float32", None, None), ("bfloat16", None, None), ("bfloat16", jnp.float32, jnp.bfloat16),
])
def test_loads_a_hugging_face_nemotron_h_block_in_one_call(checkpoint_dtype, param_dtype, dtype):
    import ml_dtypes
    from test_hf_nemotron import tensors as hf_tensors

    tensors = hf_tensors(dtype=np.float32 if checkpoint_dtype == "float32" else ml_dtypes.bfloat16)
    options = dict(top_k=3, num_groups=3, top_groups=2, normalize=True, scale=2.5, deterministic=True)
    module = MoE.from_hf_nemotron_h(tensors, **options, param_dtype=param_dtype, dtype=dtype)
    params = jax_dsrelu.params_from_hf_nemotron_h(tensors)
    assert module.b1 is None and module.options.score == "sigmoid"
    assert module.w1[...].dtype == (param_dtype or params["w1"].dtype) and module.router[...].dtype == jnp.float32
    for name, value in params.items():
        np.testing.assert_array_equal(np.asarray(getattr(module, name)[...], np.float32), np.asarray(value, np.float32), err_msg=name)

    x = jax.random.normal(jax.random.key(11), (2, 12, params["router"].shape[0]))
    out = nnx.jit(lambda m, x: m(x))(module, x)
    want = jax.jit(lambda x: jax_dsrelu.moe_layer(x.reshape(24, -1), **params, score="sigmoid", **options))(x)
    np.testing.assert_array_equal(out, want.reshape(x.shape))
