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


def step(recompute, capacity_factor, precision, dtype, inputs, quantize_once=False):
    """(value, aux, gradients of x and every weight) of a Nemotron-style block on a 2 x 4
    mesh, x and the experts' weights in dtype; with quantize_once, the experts' weights
    quantized by the precision outside the step (`quantized_weights=`)."""
    x, params, bias, cotangent = inputs
    x = x.astype(dtype)
    params = {name: a.astype(dtype) if name in ("w1", "w2") else a for name, a in params.items()}
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)

    def loss(x, params):
        quantized = (jax_dsrelu.quantize_expert_weights(params["w1"], params["w2"], precision)
                     if quantize_once else None)
        out, aux = jax_dsrelu.moe_layer_expert_parallel(
            x, **params, expert_bias=bias, mesh=mesh, data_axis="data", return_aux=True, backend="xla",
            capacity_factor=capacity_factor, precision=precision, recompute_exchanged=recompute,
            quantized_weights=quantized, **BLOCK_OPTIONS)
        return jnp.sum(out.astype(jnp.float32) * cotangent) + aux.load_balancing_loss, aux

    return jax.device_get(jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params))


def same_bits(a, b) -> bool:
    return all(
        np.array_equal(np.ravel(u).view(np.uint8), np.ravel(v).view(np.uint8))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


FP8 = jax_dsrelu.quantization.FP8_BLOCKWISE
CONFIGS = {
    "dropless": (None, None, jnp.float32, False),
    "capacity": (1.0, None, jnp.float32, False),
    "bfloat16": (None, None, jnp.bfloat16, False),
    "fp8": (None, FP8, jnp.float32, False),
    "fp8_capacity": (1.0, FP8, jnp.float32, False),
    "fp8_bfloat16_quantized_once": (None, FP8, jnp.bfloat16, True),
}


@pytest.mark.parametrize("capacity_factor, precision, dtype, quantize_once", CONFIGS.values(), ids=list(CONFIGS))
def test_remade_rows_give_the_kept_rows_bits(capacity_factor, precision, dtype, quantize_once):
    inputs = block_inputs(12)
    kept = step(False, capacity_factor, precision, dtype, inputs, quantize_once)
    remade = step(True, capacity_factor, precision, dtype, inputs, quantize_once)
    assert same_bits(kept, remade)
    # Every weight and x get a gradient (no zeros standing in for one).
    for grad in jax.tree.leaves(kept[1]):
        assert np.any(np.asarray(grad) != 0)


@pytest.mark.parametrize("precision", [None, FP8], ids=["plain", "fp8"])
def test_a_remade_preactivation_off_by_its_bias_is_caught(monkeypatch, precision):
    # The comparison above sees a recomputation that differs from the forward's.
    inputs = block_inputs(12)
    kept = step(False, None, precision, jnp.float32, inputs)
    preactivation = expert_mlp.preactivation
    monkeypatch.setattr(
        expert_mlp, "preactivation",
        lambda backends, experts, *a: preactivation(backends, experts._replace(b1=None), *a))
    assert not same_bits(kept, step(True, None, precision, jnp.float32, inputs))
