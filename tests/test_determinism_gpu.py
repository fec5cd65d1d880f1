"""Bitwise reproducibility of the library's differentiable entry points on the GPU.

- `ragged_dot` has no flag: its forward (ragged-M GEMM) and both gradients (the ragged-M
  GEMM on the transposed weight, the ragged contraction) have one writer per element and
  a fixed order, so 20 runs are bitwise identical; the values match `jax.lax.ragged_dot`.
- `moe_layer` with deterministic=True: every gradient, the router's included, bitwise
  identical over 20 runs. First shown: at this configuration the default mode's gradients
  do vary (the fused kernel's dprob and dbias atomics), so the test can fail. The same at
  precision=FP8_BLOCKWISE on sm90's FP8 kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu

RUNS = 20


def distinct(fn, *args, runs=RUNS):
    """How many bitwise-different results `fn(*args)` gives over `runs` calls."""
    seen = set()
    for _ in range(runs):
        leaves = jax.tree.leaves(fn(*args))
        seen.add(b"".join(np.asarray(leaf).tobytes() for leaf in leaves))
    return len(seen)


# (m, k, n, sizes) of ragged_dot: ragged, one empty expert, rows owned by no expert.
RAGGED = (4096, 520, 320, [0, 700, 1, 0, 1500, 129, 1666, 0])


def ragged_dot_inputs(seed):
    m, k, n, sizes = RAGGED
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
    return lhs, rhs, jnp.asarray(sizes, jnp.int32), cotangent


def ragged_dot_value_and_grads(backend):
    def loss(lhs, rhs, group_sizes, cotangent):
        out = jax_dsrelu.ragged_dot(lhs, rhs, group_sizes, backend=backend)
        return jnp.sum(out.astype(jnp.float32) * cotangent), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


@pytest.mark.gpu
def test_ragged_dot_is_bitwise_reproducible_and_matches_lax(hopper):
    lhs, rhs, group_sizes, cotangent = ragged_dot_inputs(1)
    ours = ragged_dot_value_and_grads("sm90")
    assert distinct(ours, lhs, rhs, group_sizes, cotangent) == 1
    (_, out), (d_lhs, d_rhs) = ours(lhs, rhs, group_sizes, cotangent)

    def lax_loss(lhs, rhs):
        out = jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
        return jnp.sum(out.astype(jnp.bfloat16).astype(jnp.float32) * cotangent), out

    (_, expected), (e_lhs, e_rhs) = jax.jit(jax.value_and_grad(lax_loss, argnums=(0, 1), has_aux=True))(lhs, rhs)
    # Both accumulate in float32 in different orders and round once to bf16: within one
    # bf16 unit of the float32 result, relative to its magnitude, plus the order term.
    unit = 2.0**-8
    assert np.allclose(np.asarray(out, np.float64), np.asarray(expected, np.float64), rtol=unit, atol=unit)
    for ours_grad, lax_grad in ((d_lhs, e_lhs), (d_rhs, e_rhs)):
        a, b = np.asarray(ours_grad, np.float64), np.asarray(lax_grad, np.float64)
        assert np.linalg.norm(a - b) <= 2 * unit * np.linalg.norm(b)


# moe_layer at a size where the fused kernel's atomics are seen to vary.
TOKENS, D, F, EXPERTS, TOP_K = 8192, 512, 2048, 8, 2


def layer_inputs(seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((TOKENS, D)), jnp.bfloat16)
    router = jnp.asarray(rng.standard_normal((D, EXPERTS)) / np.sqrt(D), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((EXPERTS, D, F)) / np.sqrt(D), jnp.bfloat16)
    b1 = jnp.asarray(0.1 * rng.standard_normal((EXPERTS, F)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((EXPERTS, F, D)) / np.sqrt(F), jnp.bfloat16)
    target = jnp.asarray(rng.standard_normal((TOKENS, D)), jnp.float32)
    return x, router, w1, b1, w2, target


def layer_grads(deterministic, precision=None):
    def loss(x, router, w1, b1, w2, target):
        out = jax_dsrelu.moe_layer(
            x, router, w1, w2, b1=b1, top_k=TOP_K, deterministic=deterministic, backend="auto", precision=precision
        )
        return jnp.mean((out.astype(jnp.float32) - target) ** 2)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


# bf16, and FP8_BLOCKWISE on sm90's FP8 kernels (what "auto" runs on Hopper), whose fused
# kernel sums dprob and db1 by atomics as the bf16 one does.
PRECISIONS = [None, jax_dsrelu.quantization.FP8_BLOCKWISE]


def distinct_layer_grads(deterministic, precision):
    return distinct(layer_grads(deterministic, precision), *layer_inputs(2))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS, ids=["bf16", "fp8"])
def test_moe_layer_default_mode_varies_here(hopper, precision):
    assert distinct_layer_grads(False, precision) > 1


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS, ids=["bf16", "fp8"])
def test_moe_layer_deterministic_gradients_are_bitwise_stable(hopper, precision):
    assert distinct_layer_grads(True, precision) == 1
