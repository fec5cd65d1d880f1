"""MXFP8 operands through the public API: validation, and the XLA reference against the
float64 NumPy contract evaluated on the dequantized operands."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import assert_matches_contract
from test_reference import make_inputs

import jax_dsrelu


def quantized_inputs(rng, num_rows, k, n, group_sizes, element_dtype, preact_dtype=jnp.bfloat16):
    grad, weight, preact, prob, sizes = make_inputs(rng, num_rows, k, n, group_sizes, jnp.float32)
    grad_q, grad_scale = jax_dsrelu.quantize_mx(grad, dtype=element_dtype)
    weight_q, weight_scale = jax_dsrelu.quantize_mx(weight, dtype=element_dtype)
    return grad_q, weight_q, preact.astype(preact_dtype), prob, sizes, grad_scale, weight_scale


def numpy_dequantize(values, scales) -> np.ndarray:
    """values * 2^(scale bits - 127) in float64, written without the library."""
    bits = np.asarray(jax.lax.bitcast_convert_type(scales, jnp.uint8)).astype(np.float64)
    factor = np.where(bits == 255, np.nan, np.exp2(bits - 127))
    return np.asarray(values, np.float64) * np.repeat(factor, 32, axis=-1)


@pytest.mark.parametrize("element_dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize(
    "group_sizes",
    [[70, 0, 33, 1, 20], [40, 90, 60], [30, -5, 10]],
    ids=["ragged_with_empty", "past_m", "negative_and_short"],
)
def test_reference_matches_the_contract_on_dequantized_operands(element_dtype, group_sizes):
    rng = np.random.default_rng(sum(map(abs, group_sizes)) + len(group_sizes))
    grad, weight, preact, prob, sizes, grad_scale, weight_scale = quantized_inputs(
        rng, 128, 96, 40, group_sizes, element_dtype
    )
    alpha = jnp.asarray(rng.uniform(0.5, 2.0, len(group_sizes)), jnp.float32)
    out = jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
            *a[:5], alpha=alpha, grad_scale=a[5], weight_scale=a[6],
            with_dbias=True, with_act=True, deterministic=True, backend="xla",
        )
    )(grad, weight, preact, prob, sizes, grad_scale, weight_scale)
    dequantized = (
        numpy_dequantize(grad, grad_scale),
        numpy_dequantize(weight, weight_scale),
        preact,
        prob,
        sizes,
    )
    assert_matches_contract(out, dequantized, alpha=alpha)


def test_auto_on_cpu_runs_the_reference_for_mxfp8():
    args = quantized_inputs(np.random.default_rng(2), 64, 64, 32, [20, 30, 14], jnp.float8_e4m3fn)
    grad, weight, preact, prob, sizes, grad_scale, weight_scale = args
    results = [
        jax_dsrelu.grouped_gemm_dsrelu(
            grad, weight, preact, prob, sizes, grad_scale=grad_scale, weight_scale=weight_scale,
            with_dbias=True, backend=backend,
        )
        for backend in ("auto", "xla")
    ]
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_array_equal(a, b)


def test_nan_scale_propagates_to_its_rows():
    args = list(quantized_inputs(np.random.default_rng(3), 64, 64, 32, [30, 34], jnp.float8_e4m3fn))
    bits = jax.lax.bitcast_convert_type(args[5], jnp.uint8).at[5, 1].set(255)
    args[5] = jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
    grad, weight, preact, prob, sizes, grad_scale, weight_scale = args
    out = jax_dsrelu.grouped_gemm_dsrelu(
        grad, weight, preact, prob, sizes, grad_scale=grad_scale, weight_scale=weight_scale,
        with_dbias=True, backend="xla",
    )
    dh = np.asarray(out.dh, np.float32)
    # relu(preact) is 0 in about half the columns, and 0 * NaN is NaN: the whole row is NaN.
    assert np.all(np.isnan(dh[5])) and np.isnan(out.dprob[5])
    assert np.all(np.isfinite(np.delete(dh, 5, axis=0)))
    assert np.all(np.isnan(out.dbias[0])) and np.all(np.isfinite(out.dbias[1]))


def _mx_args():
    rng = np.random.default_rng(4)
    grad, weight, preact, prob, sizes, grad_scale, weight_scale = quantized_inputs(
        rng, 64, 64, 32, [20, 30, 14], jnp.float8_e4m3fn
    )
    return dict(grad=grad, weight=weight, preact=preact, prob=prob, group_sizes=sizes,
                grad_scale=grad_scale, weight_scale=weight_scale)


BAD_CALLS = [
    (lambda a: a | {"grad_scale": None, "weight_scale": None}, TypeError,
     "grad.dtype=float8_e4m3fn is an MXFP8 element type: pass grad_scale (m, k/32) and weight_scale (E, n, k/32)"),
    (lambda a: a | {"weight_scale": None}, ValueError,
     "weight_scale and grad_scale go together: got grad_scale but weight_scale=None"),
    (lambda a: a | {"grad": a["grad"].astype(jnp.bfloat16), "weight": a["weight"].astype(jnp.bfloat16)}, TypeError,
     "grad.dtype must be one of float8_e4m3fn, float8_e5m2, got grad.dtype=bfloat16"),
    (lambda a: a | {"weight": a["weight"].astype(jnp.float8_e5m2)}, TypeError,
     "weight.dtype must equal grad.dtype=float8_e4m3fn, got weight.dtype=float8_e5m2"),
    (lambda a: a | {"grad_scale": a["grad_scale"][:, :1]}, ValueError,
     "grad_scale.shape[1] must equal k/32=2, got grad_scale.shape=(64, 1)"),
    (lambda a: a | {"grad_scale": a["grad_scale"][:63]}, ValueError,
     "grad_scale.shape[0] must equal grad.shape[0] (m)=64, got grad_scale.shape=(63, 2)"),
    (lambda a: a | {"weight_scale": a["weight_scale"][0]}, ValueError,
     "weight_scale must be (E, n, k/32), got weight_scale.shape=(32, 2)"),
    (lambda a: a | {"weight_scale": a["weight_scale"][:, :31]}, ValueError,
     "weight_scale.shape[1] must equal weight.shape[1] (n)=32, got weight_scale.shape=(3, 31, 2)"),
    (lambda a: a | {"grad_scale": jax.lax.bitcast_convert_type(a["grad_scale"], jnp.uint8)}, TypeError,
     "grad_scale.dtype must be one of float8_e8m0fnu, got grad_scale.dtype=uint8"),
    (lambda a: a | {"grad": a["grad"][:, :48], "weight": a["weight"][:, :, :48]}, ValueError,
     "grad.shape[1] (k) must be a multiple of the MX block size 32 for block-scaled operands, got grad.shape=(64, 48)"),
]


@pytest.mark.parametrize("change, error, words", BAD_CALLS)
def test_bad_mx_arguments_raise_at_trace_time(change, error, words):
    args = change(_mx_args())
    positional = [args.pop(name) for name in ("grad", "weight", "preact", "prob", "group_sizes")]
    with pytest.raises(error, match=re.escape(words)):
        jax.jit(lambda *p: jax_dsrelu.grouped_gemm_dsrelu(*p, **args)).trace(*positional)
