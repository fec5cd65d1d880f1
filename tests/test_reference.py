"""The XLA backend against the float64 NumPy contract."""

from __future__ import annotations

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import assert_matches_contract

import jax_dsrelu


def make_inputs(rng, num_rows, k, n, group_sizes, dtype, prob_dtype=jnp.float32):
    """Fresh random inputs: normal operands, preact straddling 0, prob in (0, 1]."""
    num_experts = len(group_sizes)
    grad = jnp.asarray(rng.standard_normal((num_rows, k)), dtype)
    weight = jnp.asarray(rng.standard_normal((num_experts, n, k)) / np.sqrt(k), dtype)
    preact = jnp.asarray(rng.standard_normal((num_rows, n)), dtype)
    prob = jnp.asarray(rng.uniform(0.05, 1.0, num_rows), prob_dtype)
    return grad, weight, preact, prob, jnp.asarray(group_sizes, jnp.int32)


GROUPINGS = {
    "ragged_with_empty": [13, 0, 70, 1, 0, 44],
    "all_empty": [0, 0, 0],
    "short_of_m": [5, 17, 9],  # rows past the total belong to no expert
    "past_m": [60, 90, 40],  # the running total is capped at m
    "negative": [30, -7, 50, -1],  # negative sizes count as 0
    "one_expert": [128],
}


@pytest.mark.parametrize("grouping", sorted(GROUPINGS))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16])
def test_matches_float64_contract(grouping, dtype):
    rng = np.random.default_rng(zlib.crc32(f"{grouping}{np.dtype(dtype).name}".encode()))
    inputs = make_inputs(rng, 128, 48, 40, GROUPINGS[grouping], dtype)
    out = jax_dsrelu.grouped_gemm_dsrelu(
        *inputs, with_dbias=True, with_act=True, out_dtype=dtype, backend="xla"
    )
    assert_matches_contract(out, inputs, out_dtype=dtype)


@pytest.mark.parametrize("with_dbias", [False, True])
@pytest.mark.parametrize("with_act", [False, True])
def test_optional_outputs_and_alpha(with_dbias, with_act):
    rng = np.random.default_rng(7 + 2 * with_dbias + with_act)
    inputs = make_inputs(rng, 96, 32, 24, [20, 0, 50, 26], jnp.bfloat16, prob_dtype=jnp.bfloat16)
    alpha = jnp.asarray(rng.uniform(-2.0, 2.0, 4), jnp.float32)
    out = jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
            *a[:5], alpha=a[5], with_dbias=with_dbias, with_act=with_act, deterministic=True
        )
    )(*inputs, alpha)
    assert_matches_contract(out, inputs, alpha=alpha, with_dbias=with_dbias, with_act=with_act)


def test_zero_rows():
    rng = np.random.default_rng(3)
    inputs = make_inputs(rng, 0, 16, 8, [0, 0], jnp.bfloat16)
    out = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, with_act=True)
    # Empty dh, dprob and act of the right shapes and dtypes; dbias and amax exactly 0.
    assert_matches_contract(out, inputs)


def test_float32_outputs_from_float16_operands():
    rng = np.random.default_rng(4)
    inputs = make_inputs(rng, 32, 16, 8, [10, 22], jnp.float16)
    out = jax_dsrelu.grouped_gemm_dsrelu(
        *inputs, with_dbias=True, with_act=True, out_dtype=jnp.float32
    )
    # The contract's check holds every output to its dtype as well as to its values.
    assert_matches_contract(out, inputs, out_dtype=jnp.float32)


def test_nan_and_inf_propagate_within_their_expert():
    rng = np.random.default_rng(5)
    grad, weight, preact, prob, group_sizes = make_inputs(rng, 40, 16, 8, [10, 20, 10], jnp.float32)
    preact = preact.at[3, 2].set(jnp.nan)  # expert 0
    grad = grad.at[15].set(jnp.inf)  # expert 1
    out = jax_dsrelu.grouped_gemm_dsrelu(
        grad, weight, preact, prob, group_sizes, with_dbias=True, with_act=True
    )
    assert np.isnan(np.asarray(out.dh, np.float32)[3, 2]) and np.isnan(out.dprob[3])
    assert np.isnan(out.dbias[0, 2]) and np.isnan(out.amax[0]) and np.isnan(np.asarray(out.act, np.float32)[3, 2])
    dh_row = np.asarray(out.dh, np.float32)[15]
    assert not np.all(np.isfinite(dh_row))
    assert not np.isfinite(out.amax[1])
    # Nothing leaks into the expert that saw neither.
    assert np.all(np.isfinite(out.dbias[2])) and np.isfinite(out.amax[2])
    assert np.all(np.isfinite(np.asarray(out.dh, np.float32)[30:]))


def lowered_text(fn, inputs, platform) -> str:
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_xla_backend_has_no_scatter_in_either_mode(platform):
    """Why the XLA backend is deterministic on every platform: no operation in it adds
    values into one place in an order the device chooses (XLA's GPU scatter-add uses
    atomics), so `deterministic` has nothing to change and changes nothing."""
    inputs = make_inputs(np.random.default_rng(6), 512, 64, 96, [100, 0, 250, 150], jnp.bfloat16)
    texts = [
        lowered_text(
            lambda *a, d=deterministic: jax_dsrelu.grouped_gemm_dsrelu(
                *a, with_dbias=True, with_act=True, deterministic=d, backend="xla"
            ),
            inputs,
            platform,
        )
        for deterministic in (False, True)
    ]
    assert "dot_general" in texts[0]
    assert "scatter" not in texts[0]
    assert texts[0] == texts[1]
