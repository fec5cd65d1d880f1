"""The XLA backend on a GPU: correct, and deterministic where XLA's own scatter is not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import assert_matches_contract
from test_layer import make_layer_inputs
from test_reference import make_inputs

import jax_dsrelu

pytestmark = pytest.mark.gpu

RUNS = 20
# The configuration at which run-to-run variation of atomic reductions was observed
# (8 experts of about 1024 rows, n = 2048), made ragged with an empty expert.
DETERMINISM_SIZES = [1500, 700, 0, 1024, 1200, 900, 1024, 1844]
DETERMINISM_SHAPE = dict(k=512, n=2048)


def bits(tree):
    return [np.asarray(leaf).view(np.uint8).copy() for leaf in jax.tree.leaves(jax.device_get(tree))]


def distinct_results(fn, *args, runs=RUNS) -> int:
    seen = []
    for _ in range(runs):
        result = bits(fn(*args))
        if not any(all(np.array_equal(a, b) for a, b in zip(result, s)) for s in seen):
            seen.append(result)
    return len(seen)


@pytest.fixture(scope="module")
def determinism_inputs():
    rng = np.random.default_rng(101)
    num_rows = sum(DETERMINISM_SIZES)
    return make_inputs(rng, num_rows, DETERMINISM_SHAPE["k"], DETERMINISM_SHAPE["n"], DETERMINISM_SIZES, jnp.bfloat16)


def test_scatter_add_dbias_varies_at_this_configuration(determinism_inputs):
    """The hazard the XLA backend avoids: a segment_sum dbias changes from run to run here.

    Without this, a bitwise-stable result below would prove nothing.
    """
    grad, weight, preact, prob, group_sizes = determinism_inputs
    expert, _ = jax_dsrelu.groups.row_experts(group_sizes, grad.shape[0])

    @jax.jit
    def scatter_dbias(grad, weight, preact, prob, group_sizes):
        dh = jax_dsrelu.grouped_gemm_dsrelu(
            grad, weight, preact, prob, group_sizes, out_dtype=jnp.float32, backend="xla"
        ).dh
        return jax.ops.segment_sum(dh, expert, num_segments=len(DETERMINISM_SIZES))

    assert distinct_results(scatter_dbias, *determinism_inputs) > 1


def test_xla_backend_is_bitwise_stable(determinism_inputs):
    run = jax.jit(
        lambda *a: jax_dsrelu.grouped_gemm_dsrelu(
            *a, with_dbias=True, with_act=True, deterministic=True, backend="xla"
        )
    )
    assert distinct_results(run, *determinism_inputs) == 1


def test_xla_backend_matches_float64_on_gpu():
    rng = np.random.default_rng(102)
    inputs = make_inputs(rng, 4096, 256, 384, [1000, 0, 2000, 7, 1089], jnp.bfloat16)
    out = jax_dsrelu.grouped_gemm_dsrelu(*inputs, with_dbias=True, with_act=True, backend="xla")
    assert_matches_contract(out, inputs)


def test_moe_mlp_xla_gradients_are_bitwise_stable():
    rng = np.random.default_rng(103)
    sizes = [1500, 700, 0, 1024, 1200, 900, 1024, 1844]
    x, w1, w2, prob, b1 = make_layer_inputs(rng, sum(sizes), 512, 1024, sizes, jnp.bfloat16)
    group_sizes = jnp.asarray(sizes, jnp.int32)
    grad_fn = jax.jit(
        jax.grad(
            lambda *a: jnp.sum(
                jax_dsrelu.moe_mlp(*a[:4], group_sizes, b1=a[4], deterministic=True, backend="xla").astype(
                    jnp.float32
                )
                ** 2
            ),
            argnums=(0, 1, 2, 3, 4),
        )
    )
    assert distinct_results(grad_fn, x, w1, w2, prob, b1, runs=10) == 1


def test_fp8_quantizing_keeps_its_rounding_inside_one_program():
    """XLA:GPU folds x -> e4m3 -> float32 conversion chains (`quantization/stored.py`):
    quantizing and dequantizing in one program must give the bits of the two apart, the
    values stored between them, as on the CPU."""
    from jax_dsrelu.quantization import FP8_BLOCKWISE, blockwise, ragged

    x = jax.random.normal(jax.random.key(7), (1024, 640), jnp.float32) * 3
    sizes = jnp.asarray([300, 0, 500, 224], jnp.int32)
    scaling = FP8_BLOCKWISE.activations
    quantize_blocks = lambda x: blockwise.quantize_blockwise(x, scaling)  # noqa: E731
    dequantize_blocks = lambda q: blockwise.dequantize_blockwise(*q, scaling)  # noqa: E731
    quantize_rows = lambda x: ragged.quantize_ragged_rows(x, sizes, scaling)  # noqa: E731
    for quantize, dequantize in ((quantize_blocks, dequantize_blocks), (quantize_rows, ragged.dequantize_ragged_rows)):
        together = jax.jit(lambda x: dequantize(quantize(x)))(x)
        apart = jax.jit(dequantize)(jax.jit(quantize)(x))
        on_cpu = jax.jit(lambda x: dequantize(quantize(x)))(jax.device_put(x, jax.devices("cpu")[0]))
        np.testing.assert_array_equal(np.asarray(together).view(np.uint32), np.asarray(apart).view(np.uint32))
        np.testing.assert_array_equal(np.asarray(together).view(np.uint32), np.asarray(on_cpu).view(np.uint32))
        assert not np.array_equal(np.asarray(together), np.asarray(x))  # the rounding is there to keep
