"""Sharded jit of ragged_dot, the ragged primitives, moe_mlp and grouped_gemm_dsrelu over
Auto and Explicit mesh axes: values against one device, shardings, no operand gathered."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_layer import make_layer_inputs
from contract_numpy import assert_agree_within_the_contract
from test_reference import assert_matches_contract, make_inputs

import jax_dsrelu
from jax_dsrelu.primitives.ragged_contract import ragged_contract

NUM_DEVICES = 8
# Expert boundaries fall inside shards, an expert is empty, and the last 37 rows belong
# to no expert.
SIZES = [70, 0, 131, 9, 200, 65]
NUM_ROWS = 512
AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert len(jax.devices()) >= NUM_DEVICES, "conftest.py asks XLA for 8 host devices"


def mesh(shape, names, axis_type):
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def put(x, mesh_, spec):
    return jax.device_put(x, NamedSharding(mesh_, spec))


def one_device(tree):
    return jax.device_put(tree, jax.devices()[0])


def gathered_operands(compiled_hlo: str) -> list[str]:
    """All-gathers that move an operand: anything in bfloat16 (every operand here is;
    the partials of cross-shard sums are float32) or with the global row count."""
    lines = [l.strip() for l in compiled_hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", l)]
    return [l for l in lines if "bf16" in l.split("all-gather")[0] or f"[{NUM_ROWS}," in l or f",{NUM_ROWS}]" in l]


def assert_same_values(got, want, exact=False):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            scale = np.max(np.abs(b), initial=0.0) + 1e-30
            # Sums across shards are associated by shard: float32 rounding apart, then
            # one rounding to bfloat16.
            np.testing.assert_allclose(a / scale, b / scale, atol=1e-2, rtol=0)


def ragged_dot_inputs(seed):
    rng = np.random.default_rng(seed)
    lhs = jnp.asarray(rng.standard_normal((NUM_ROWS, 32)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((len(SIZES), 32, 48)) / 6, jnp.bfloat16)
    cotangent = jnp.asarray(rng.standard_normal((NUM_ROWS, 48)), jnp.bfloat16)
    return lhs, rhs, jnp.asarray(SIZES, jnp.int32), cotangent


def ragged_dot_step(lhs, rhs, group_sizes, cotangent):
    out, vjp = jax.vjp(lambda l, r: jax_dsrelu.ragged_dot(l, r, group_sizes), lhs, rhs)
    return (out, *vjp(cotangent))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
@pytest.mark.parametrize(
    "mesh_shape, names, rows, cols",
    [((8,), ("data",), "data", None), ((2, 4), ("data", "model"), "data", "model")],
    ids=["rows", "rows_and_cols"],
)
def test_ragged_dot_and_gradients(axis_type, mesh_shape, names, rows, cols):
    lhs, rhs, group_sizes, cotangent = ragged_dot_inputs(41)
    m = mesh(mesh_shape, names, axis_type)
    args = (
        put(lhs, m, P(rows, None)),
        put(rhs, m, P(None, None, cols)),
        put(group_sizes, m, P()),
        put(cotangent, m, P(rows, cols)),
    )
    step = jax.jit(ragged_dot_step)
    assert gathered_operands(step.lower(*args).compile().as_text()) == []
    out, d_lhs, d_rhs = step(*args)
    assert out.sharding.is_equivalent_to(NamedSharding(m, P(rows, cols)), 2)
    assert d_lhs.sharding.is_equivalent_to(NamedSharding(m, P(rows, None)), 2)
    assert d_rhs.sharding.is_equivalent_to(NamedSharding(m, P(None, None, cols)), 3)
    single = jax.jit(ragged_dot_step)(*one_device((lhs, rhs, group_sizes, cotangent)))
    # Row-local outputs see the same arithmetic as on one device.
    assert_same_values((out, d_lhs), single[:2], exact=True)
    assert_same_values(d_rhs, single[2])
    assert_same_values((out, d_lhs, d_rhs), step(*args), exact=True)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_contraction_partials_are_summed_in_shard_order(axis_type):
    rng = np.random.default_rng(42)
    lhs = jnp.asarray(rng.standard_normal((NUM_ROWS, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((NUM_ROWS, 24)), jnp.float32)
    group_sizes = jnp.asarray(SIZES, jnp.int32)
    m = mesh((NUM_DEVICES,), ("data",), axis_type)
    run = jax.jit(lambda l, r, g: ragged_contract(l, r, g, out_dtype=jnp.float32, backend="auto"))
    out = run(put(lhs, m, P("data")), put(rhs, m, P("data")), group_sizes)
    # The same sum written out: each shard's per-expert partial over its 64 rows, then
    # the eight partials added in shard order.
    shard_rows = NUM_ROWS // NUM_DEVICES
    ends = np.cumsum(SIZES)
    starts = ends - np.asarray(SIZES)
    expected = np.zeros((len(SIZES), 16, 24), np.float32)
    for d in range(NUM_DEVICES):
        rows = np.arange(d * shard_rows, (d + 1) * shard_rows)
        for e in range(len(SIZES)):
            mine = rows[(rows >= starts[e]) & (rows < ends[e])]
            partial = np.asarray(lhs, np.float64)[mine].T @ np.asarray(rhs, np.float64)[mine]
            expected[e] += partial.astype(np.float32)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(out)[1], 0)
    again = run(put(lhs, m, P("data")), put(rhs, m, P("data")), group_sizes)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_moe_mlp_value_and_grad_rows_sharded(axis_type):
    rng = np.random.default_rng(43)
    x, w1, w2, prob, b1 = make_layer_inputs(rng, NUM_ROWS, 32, 64, SIZES, jnp.bfloat16)
    group_sizes = jnp.asarray(SIZES, jnp.int32)
    m = mesh((NUM_DEVICES,), ("data",), axis_type)

    def loss(x, w1, w2, prob, b1, group_sizes):
        y = jax_dsrelu.moe_mlp(x, w1, w2, prob, group_sizes, b1=b1, deterministic=True)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    args = (put(x, m, P("data")), put(w1, m, P()), put(w2, m, P()), put(prob, m, P("data")), put(b1, m, P()), put(group_sizes, m, P()))
    assert gathered_operands(step.lower(*args).compile().as_text()) == []
    value, (dx, dw1, dw2, dprob, db1) = step(*args)
    assert dx.sharding.is_equivalent_to(NamedSharding(m, P("data")), 2)
    assert dprob.sharding.is_equivalent_to(NamedSharding(m, P("data")), 1)
    assert dw1.sharding.is_equivalent_to(NamedSharding(m, P()), 3)
    single_value, single_grads = step(*one_device((x, w1, w2, prob, b1, group_sizes)))
    assert_same_values((value, dx, dw1, dw2, dprob, db1), (single_value, *single_grads))
    again = step(*args)
    assert_same_values((value, dx, dw1, dw2, dprob, db1), (again[0], *again[1]), exact=True)


@pytest.mark.parametrize(
    "mesh_shape, names, rows, cols",
    [((8,), ("data",), "data", None), ((2, 4), ("data", "model"), "data", "model")],
    ids=["rows", "rows_and_cols"],
)
def test_grouped_gemm_dsrelu_over_explicit_axes(mesh_shape, names, rows, cols):
    grad, weight, preact, prob, group_sizes = make_inputs(
        np.random.default_rng(44), NUM_ROWS, 64, 96, SIZES, jnp.bfloat16
    )
    m = mesh(mesh_shape, names, AxisType.Explicit)
    args = (
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
    assert gathered_operands(run.lower(*args).compile().as_text()) == []
    dh, dprob, dbias, act, amax = run(*args)
    assert dh.sharding.is_equivalent_to(NamedSharding(m, P(rows, cols)), 2)
    assert act.sharding.is_equivalent_to(NamedSharding(m, P(rows, cols)), 2)
    assert dprob.sharding.is_equivalent_to(NamedSharding(m, P(rows)), 1)
    sharded = jax_dsrelu.DsreluOutputs(dh, dprob, dbias, act, amax)
    assert_matches_contract(sharded, (grad, weight, preact, prob, group_sizes))
    single = jax_dsrelu.DsreluOutputs(*run(*one_device((grad, weight, preact, prob, group_sizes))))
    # act reads no GEMM; dh's GEMM has another output width under the column split, which
    # XLA:CPU may sum in another blocking of K.
    assert_same_values(act, single.act, exact=True)
    assert_agree_within_the_contract(sharded, single, (grad, weight, preact, prob, group_sizes), ("dh", "amax"))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_operand_split_along_the_contraction_is_gathered_and_its_gradient_typed_like_it(axis_type):
    # k is kept whole (see jax_dsrelu.primitives.sharding): lhs split along it is gathered; over
    # Explicit axes its cotangent has lhs's own sharding, as its type must.
    lhs, rhs, group_sizes, cotangent = ragged_dot_inputs(45)
    m = mesh((NUM_DEVICES,), ("data",), axis_type)
    args = (put(lhs, m, P(None, "data")), put(rhs, m, P()), group_sizes, put(cotangent, m, P()))
    out, d_lhs, d_rhs = jax.jit(ragged_dot_step)(*args)
    if axis_type == AxisType.Explicit:
        assert d_lhs.sharding.is_equivalent_to(NamedSharding(m, P(None, "data")), 2)
    single = jax.jit(ragged_dot_step)(*one_device((lhs, rhs, group_sizes, cotangent)))
    # lhs is gathered, so out and d_lhs are the one-device GEMMs'; d_rhs is a contraction
    # whose side a stays split, an output of another width, which XLA:CPU may sum in
    # another blocking of K.
    assert_same_values((out, d_lhs), single[:2], exact=True)
    assert_same_values(d_rhs, single[2])


def test_ragged_dot_gradients_under_shard_map_with_shared_rhs():
    # Each device holds its own rows and group sizes and the same rhs: d lhs is each
    # device's own, d rhs is the sum over devices of their contributions.
    rng = np.random.default_rng(46)
    local_sizes = [[20, 30, 0], [0, 64, 0], [64, 0, 0], [1, 2, 3], [33, 31, 0], [0, 0, 0], [50, 10, 4], [7, 50, 7]]
    lhs = jnp.asarray(rng.standard_normal((NUM_DEVICES * 64, 16)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((3, 16, 24)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((NUM_DEVICES * 64, 24)), jnp.float32)
    group_sizes = jnp.asarray(np.concatenate(local_sizes), jnp.int32)
    m = mesh((NUM_DEVICES,), ("expert",), AxisType.Explicit)

    def loss(lhs, rhs, group_sizes, cotangent):
        return jnp.sum(jax_dsrelu.ragged_dot(lhs, rhs, group_sizes) * cotangent)

    d_lhs, d_rhs = jax.jit(
        jax.shard_map(
            lambda l, r, g, c: jax.grad(loss, argnums=(0, 1))(l, r, g, c),
            mesh=m,
            in_specs=(P("expert"), P(), P("expert"), P("expert")),
            out_specs=(P("expert"), P()),
        )
    )(put(lhs, m, P("expert")), put(rhs, m, P()), put(group_sizes, m, P("expert")), put(cotangent, m, P("expert")))
    d_lhs = np.asarray(d_lhs)
    want_rhs = np.zeros(rhs.shape)
    for d, sizes in enumerate(local_sizes):
        rows = slice(64 * d, 64 * (d + 1))
        alone = jax.grad(loss, argnums=(0, 1))(lhs[rows], rhs, jnp.asarray(sizes, jnp.int32), cotangent[rows])
        np.testing.assert_array_equal(d_lhs[rows], np.asarray(alone[0]))
        want_rhs += np.asarray(alone[1], np.float64)
    np.testing.assert_allclose(np.asarray(d_rhs), want_rhs, rtol=1e-5, atol=1e-4)
