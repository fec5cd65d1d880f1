"""What the transformations table (docs/api.md) marks unsupported fails with JAX's own error.

The primitive is itself a backward pass and has no differentiation rule, so neither it nor
`moe_mlp`'s backward (which runs it) can be differentiated again; `moe_mlp` is a custom VJP,
which has no forward mode. Each must refuse loudly rather than return a wrong derivative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_layer import make_layer_inputs
from test_reference import make_inputs

import jax_dsrelu

SIZES = [9, 0, 15, 8]


def primitive_loss():
    grad, weight, preact, prob, group_sizes = make_inputs(np.random.default_rng(41), 32, 16, 8, SIZES, jnp.float32)
    return (lambda g: jax_dsrelu.grouped_gemm_dsrelu(g, weight, preact, prob, group_sizes).dh.sum()), grad


def layer_loss():
    x, w1, w2, prob, b1 = make_layer_inputs(np.random.default_rng(42), 32, 8, 16, SIZES, jnp.float32)
    return (lambda x: jax_dsrelu.moe_mlp(x, w1, w2, prob, jnp.asarray(SIZES), b1=b1).sum()), x


def test_primitive_has_no_gradient():
    loss, grad = primitive_loss()
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'grouped_gemm_dsrelu' not implemented"):
        jax.grad(loss)(grad)


def test_primitive_has_no_jvp():
    loss, grad = primitive_loss()
    with pytest.raises(NotImplementedError, match="Differentiation rule for 'grouped_gemm_dsrelu' not implemented"):
        jax.jvp(loss, (grad,), (jnp.ones_like(grad),))


def test_moe_mlp_has_no_forward_mode():
    loss, x = layer_loss()
    with pytest.raises(TypeError, match="can't apply forward-mode autodiff \\(jvp\\) to a custom_vjp function"):
        jax.jvp(loss, (x,), (jnp.ones_like(x),))


def test_moe_mlp_has_no_second_derivative():
    loss, x = layer_loss()
    # The backward's first primitive to be differentiated refuses (one of the library's).
    with pytest.raises(NotImplementedError, match="Differentiation rule for '(grouped_gemm_dsrelu|ragged_\\w+)' not implemented"):
        jax.grad(lambda x: jax.grad(loss)(x).sum())(x)
