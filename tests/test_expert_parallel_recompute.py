"""moe_layer_expert_parallel with recompute_exchanged=True: the backward exchanges the rows
again and remakes their pre-activations instead of keeping them, and every value and
gradient is the same bits as when it keeps them (what it keeps is counted in
tests/test_expert_parallel_residuals.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_dsrelu
from jax_dsrelu.ops import expert_mlp
from test_moe_layer_expert_parallel import BLOCK_OPTIONS, block_inputs


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert len(jax.devices()) >= 8, "conftest.py asks XLA for 8 host devices"


def step(recompute, capacity_factor, precision, dtype, inputs):
    """(value, aux, gradients of x and every weight) of a Nemotron-style block on a 2 x 4 mesh."""
    x, params, bias, cotangent = inputs
    params = {name: a.astype(dtype) if name in ("w1", "w2") else a for name, a in params.items()}
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)

    def loss(x, params):
        out, aux = jax_dsrelu.moe_layer_expert_parallel(
            x, **params, expert_bias=bias, mesh=mesh, data_axis="data", return_aux=True, backend="xla",
            capacity_factor=capacity_factor, precision=precision, recompute_exchanged=recompute, **BLOCK_OPTIONS)
        return jnp.sum(out.astype(jnp.float32) * cotangent) + aux.load_balancing_loss, aux

    return jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params))


def same_bits(a, b) -> bool:
    return all(
        np.array_equal(np.ravel(u).view(np.uint8), np.ravel(v).view(np.uint8))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


CONFIGS = [
    (None, None, jnp.float32),
    (1.0, None, jnp.float32),
    (None, jax_dsrelu.quantization.FP8_BLOCKWISE, jnp.float32),
    (None, None, jnp.bfloat16),
]


@pytest.mark.parametrize("capacity_factor, precision, dtype", CONFIGS, ids=["dropless", "capacity", "fp8", "bfloat16"])
def test_remade_rows_give_the_kept_rows_bits(capacity_factor, precision, dtype):
    inputs = block_inputs(12)
    kept = step(False, capacity_factor, precision, dtype, inputs)
    remade = step(True, capacity_factor, precision, dtype, inputs)
    assert same_bits(kept, remade)
    # Every weight and x get a gradient (no zeros standing in for one).
    for grad in jax.tree.leaves(kept[1]):
        assert np.any(np.asarray(grad) != 0)


def test_a_remade_preactivation_off_by_its_bias_is_caught(monkeypatch):
    # The comparison above sees a recomputation that differs from the forward's.
    inputs = block_inputs(12)
    kept = step(False, None, None, jnp.float32, inputs)
    preactivation = expert_mlp.preactivation
    monkeypatch.setattr(
        expert_mlp, "preactivation",
        lambda backends, experts, *a: preactivation(backends, experts._replace(b1=None), *a))
    assert not same_bits(kept, step(True, None, None, jnp.float32, inputs))
