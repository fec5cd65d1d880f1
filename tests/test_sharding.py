"""The primitive and moe_mlp on many devices: sharded jit, and experts under shard_map."""

from __future__ import annotations

import re

import contract_numpy
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from contract_numpy import assert_matches_contract
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_layer import make_layer_inputs
from test_reference import make_inputs

import jax_dsrelu

NUM_DEVICES = 8


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert len(jax.devices()) >= NUM_DEVICES, "conftest.py asks XLA for 8 host devices"


def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def put(x, mesh_, spec):
    return jax.device_put(x, NamedSharding(mesh_, spec))


def one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def all_gathers(hlo: str) -> list[str]:
    return [line.strip() for line in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", line)]


# Expert boundaries fall inside shards, an expert is empty, and the last 37 rows belong
# to no expert.
SIZES = [70, 0, 131, 9, 200, 65]
NUM_ROWS = 512


def run_primitive(*args, **kwargs):
    return jax.jit(
        lambda *a: tuple(
            jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True, **kwargs)
        )
    )(*args)


@pytest.mark.parametrize(
    "mesh_shape, names, specs",
    [
        ((8,), ("data",), dict(rows="data", cols=None)),
        ((2, 4), ("data", "model"), dict(rows="data", cols="model")),
        ((2, 4), ("data", "model"), dict(rows=("data", "model"), cols=None)),
        ((8,), ("model",), dict(rows=None, cols="model")),
    ],
    ids=["rows", "rows_and_cols", "rows_over_two_axes", "cols"],
)
def test_sharded_jit_partitions_and_matches_one_device(mesh_shape, names, specs):
    rng = np.random.default_rng(31)
    grad, weight, preact, prob, group_sizes = make_inputs(rng, NUM_ROWS, 64, 96, SIZES, jnp.bfloat16)
    m = mesh(mesh_shape, names)
    rows, cols = specs["rows"], specs["cols"]
    sharded_args = (
        put(grad, m, P(rows, None)),
        put(weight, m, P(None, cols, None)),
        put(preact, m, P(rows, cols)),
        put(prob, m, P(rows)),
        put(group_sizes, m, P()),
    )
    run = jax.jit(
        lambda *a: tuple(
            jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True, deterministic=True)
        )
    )
    compiled = run.lower(*sharded_args).compile().as_text()
    # The operands are never gathered: the only all-gathers move the small float32
    # partials of dbias (rows split) or dprob (columns split).
    for line in all_gathers(compiled):
        assert "bf16" not in line, line
    dh, dprob, dbias, act, amax = run(*sharded_args)
    assert dh.sharding.is_equivalent_to(NamedSharding(m, P(rows, cols)), 2)

    single = jax_dsrelu.DsreluOutputs(*run_primitive(*one_device((grad, weight, preact, prob, group_sizes)), deterministic=True))
    sharded = jax_dsrelu.DsreluOutputs(dh, dprob, dbias, act, amax)
    assert_matches_contract(sharded, (grad, weight, preact, prob, group_sizes))
    # act reads no GEMM: the same arithmetic on every device as on one. dh (and its amax)
    # come from a GEMM whose output width a column split changes, which XLA:CPU may sum in
    # another blocking of K; dprob and dbias are associated by shard. Each result is within
    # the contract's bound of the exact value, so within twice it of the other (for dprob,
    # a sum over n that can cancel, a bound on its absolute terms, not on its value).
    np.testing.assert_array_equal(np.asarray(sharded.act), np.asarray(single.act))
    contract_numpy.assert_agree_within_the_contract(sharded, single, (grad, weight, preact, prob, group_sizes),
                                                    ("dh", "dprob", "dbias", "amax"))

    again = run(*sharded_args)
    for a, b in zip(jax.tree.leaves((dh, dprob, dbias, act, amax)), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_agreement_check_catches_a_row_off_by_a_bfloat16_step():
    inputs = make_inputs(np.random.default_rng(31), NUM_ROWS, 64, 96, SIZES, jnp.bfloat16)
    out = jax_dsrelu.DsreluOutputs(*run_primitive(*inputs, deterministic=True))
    contract_numpy.assert_agree_within_the_contract(out, out, inputs, ("dh", "dprob", "dbias", "amax"))
    moved = out._replace(dh=out.dh.at[3].multiply(1 + 2.0**-7))  # one step of bfloat16
    with pytest.raises(AssertionError, match="dh: "):
        contract_numpy.assert_agree_within_the_contract(moved, out, inputs, ("dh",))


def expert_parallel_inputs(rng, local_sizes, local_rows):
    """Per-device blocks as all-to-all dispatch leaves them: each device holds its own
    experts' rows from its row 0, with unowned padding rows at the end."""
    num_devices, local_experts = len(local_sizes), len(local_sizes[0])
    blocks = [
        make_inputs(rng, local_rows, 32, 48, sizes, jnp.bfloat16) for sizes in local_sizes
    ]
    stacked = [jnp.concatenate(parts) for parts in zip(*blocks)]
    assert stacked[1].shape[0] == num_devices * local_experts
    return blocks, stacked


def test_primitive_under_shard_map_with_experts_sharded():
    rng = np.random.default_rng(32)
    local_sizes = [[20, 30], [0, 64], [64, 0], [1, 2], [33, 31], [0, 0], [50, 10], [7, 50]]
    blocks, stacked = expert_parallel_inputs(rng, local_sizes, 64)
    m = mesh((NUM_DEVICES,), ("expert",))
    spec = P("expert")
    run = jax.jit(
        jax.shard_map(
            lambda *a: tuple(
                jax_dsrelu.grouped_gemm_dsrelu(*a, with_dbias=True, with_act=True, deterministic=True)
            ),
            mesh=m,
            in_specs=(spec,) * 5,
            out_specs=(spec,) * 5,
        )
    )
    dh, dprob, dbias, act, amax = run(*(put(x, m, spec) for x in stacked))
    for d, block in enumerate(blocks):
        rows, experts = slice(64 * d, 64 * (d + 1)), slice(2 * d, 2 * (d + 1))
        local = jax_dsrelu.DsreluOutputs(dh[rows], dprob[rows], dbias[experts], act[rows], amax[experts])
        assert_matches_contract(local, block)
        alone = run_primitive(*one_device(block), deterministic=True)
        for got, want in zip(local, alone):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_moe_mlp_gradients_under_shard_map_match_each_device_alone():
    rng = np.random.default_rng(33)
    local_sizes = [[20, 30], [0, 64], [64, 0], [1, 2], [33, 31], [0, 0], [50, 10], [7, 50]]
    local_rows, d_model, d_ff = 64, 16, 32
    blocks = [make_layer_inputs(rng, local_rows, d_model, d_ff, s, jnp.float32) for s in local_sizes]
    x, w1, w2, prob, b1 = (jnp.concatenate(parts) for parts in zip(*blocks))
    group_sizes = jnp.asarray(np.concatenate(local_sizes), jnp.int32)

    def loss(x, w1, w2, prob, b1, group_sizes):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1, deterministic=True)
        return jnp.sum(y * y)

    m = mesh((NUM_DEVICES,), ("expert",))
    spec = P("expert")
    sharded_grads = jax.jit(
        jax.shard_map(
            jax.grad(loss, argnums=(0, 1, 2, 3, 4)),
            mesh=m,
            in_specs=(spec,) * 6,
            out_specs=(spec,) * 5,
        )
    )(x, w1, w2, prob, b1, group_sizes)
    for d, (block, sizes) in enumerate(zip(blocks, local_sizes)):
        alone = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*one_device((*block, jnp.asarray(sizes, jnp.int32))))
        rows, experts = slice(local_rows * d, local_rows * (d + 1)), slice(2 * d, 2 * (d + 1))
        for got, want, part in zip(sharded_grads, alone, (rows, experts, experts, rows, experts)):
            np.testing.assert_array_equal(np.asarray(got[part]), np.asarray(want))


def test_moe_mlp_under_row_sharded_jit_matches_one_device():
    rng = np.random.default_rng(34)
    x, w1, w2, prob, b1 = make_layer_inputs(rng, NUM_ROWS, 32, 64, SIZES, jnp.float32)
    group_sizes = jnp.asarray(SIZES, jnp.int32)
    m = mesh((NUM_DEVICES,), ("data",))
    grad_fn = jax.jit(
        jax.value_and_grad(
            lambda x, w1, w2, prob, b1: jnp.sum(
                jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1, deterministic=True) ** 2
            ),
            argnums=(0, 1, 2, 3, 4),
        )
    )
    sharded = grad_fn(put(x, m, P("data")), w1, w2, put(prob, m, P("data")), b1)
    single = grad_fn(*one_device((x, w1, w2, prob, b1)))
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
        scale = np.max(np.abs(np.asarray(want))) + 1e-12
        np.testing.assert_allclose(np.asarray(got) / scale, np.asarray(want) / scale, atol=1e-5)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
def test_a_pass_split_over_its_leading_axis_runs_on_each_devices_experts(axis_type):
    """`sharding.split_over_leading_axis` (the weights' quantizing pass on a GPU): each device
    runs it on its experts, with no collective, and its results are the pass's on the whole
    weight, split the same way; a weight split along another axis is gathered there first
    (its results whole)."""
    from jax_dsrelu.primitives import sharding
    from jax_dsrelu.quantization import blockwise
    from jax_dsrelu.quantization.schema import FP8_BLOCKWISE

    def quantize(w):
        values, scales = blockwise.quantize_blockwise(w, FP8_BLOCKWISE.weights)
        return values, jnp.swapaxes(values, 1, 2), scales

    split = jax.jit(sharding.split_over_leading_axis(quantize, "e n k -> e n k, e k n, e p q"))
    devices = jax.make_mesh((2,), ("x",), axis_types=(axis_type,))
    w = jnp.asarray(np.random.default_rng(0).standard_normal((4, 144, 272)), jnp.bfloat16)
    whole = jax.jit(quantize)(w)
    for spec, collective in ((P("x"), False), (P(None, "x"), True)):
        placed = jax.device_put(w, NamedSharding(devices, spec))
        compiled = split.lower(placed).compile().as_text()
        assert ("all-gather" in compiled or "all-to-all" in compiled) == collective, spec
        out = split(placed)
        for got, want in zip(out, whole):
            np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))
        assert all((tuple(o.sharding.spec) + (None,))[0] == spec[0] for o in out)
