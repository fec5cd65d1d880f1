"""The ordered gather-and-sum (combine, and the input gradient of dispatch): each token adds
its rows in slot order, in float32, bit for bit as a sequential NumPy sum does."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_dsrelu
from jax_dsrelu.primitives.gather_sum import gather_sum

NUM_ROWS, NUM_TOKENS, WIDTH, SLOTS = 60, 24, 16, 4


def order_sensitive_rows(rng, dtype=np.float32) -> np.ndarray:
    """Rows whose sums round differently in another order: full mantissas over magnitudes
    2**-10 to 2**20, so that each addition rounds, and a small value added to a large one
    is lost unless the large ones cancel first."""
    magnitude = 2.0 ** rng.integers(-10, 20, (NUM_ROWS, WIDTH))
    return (rng.standard_normal((NUM_ROWS, WIDTH)) * magnitude).astype(dtype)


def token_rows(rng) -> np.ndarray:
    """(T, k) int32: each token's rows, distinct within a token, as the routing's are."""
    return np.stack([rng.permutation(NUM_ROWS)[:SLOTS] for _ in range(NUM_TOKENS)]).astype(np.int32)


def sequential_sum(rows: np.ndarray, index: np.ndarray, slots) -> np.ndarray:
    """NumPy, float32, one slot after another in the given order."""
    total = rows[index[:, slots[0]]].astype(np.float32)
    for slot in slots[1:]:
        total = total + rows[index[:, slot]].astype(np.float32)
    return total


def assert_bits_equal(got, want):
    np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_adds_each_tokens_rows_in_slot_order(dtype):
    rng = np.random.default_rng(0)
    rows, index = order_sensitive_rows(rng, dtype), token_rows(rng)
    forward = sequential_sum(rows, index, range(SLOTS))
    backward = sequential_sum(rows, index, range(SLOTS)[::-1])
    # The inputs tell the orders apart, so the comparison below sees the order.
    assert np.mean(forward != backward) > 0.05
    got = jax.jit(lambda r, i: gather_sum(r, i, backend="xla"))(jnp.asarray(rows), jnp.asarray(index))
    assert got.dtype == jnp.float32
    assert_bits_equal(got, forward)


def test_the_order_check_fails_for_the_reversed_order():
    rng = np.random.default_rng(1)
    rows, index = order_sensitive_rows(rng), token_rows(rng)
    got = gather_sum(jnp.asarray(rows), jnp.asarray(index), backend="xla")
    with pytest.raises(AssertionError):
        assert_bits_equal(got, sequential_sum(rows, index, range(SLOTS)[::-1]))


def test_combine_and_dispatch_gradient_are_the_ordered_sum():
    rng = np.random.default_rng(2)
    rows = order_sensitive_rows(rng)[: NUM_TOKENS * 2]
    plan = jax_dsrelu.route(jnp.asarray(rng.standard_normal((NUM_TOKENS, 6)), jnp.float32), 2)
    index = np.asarray(plan.inverse).reshape(NUM_TOKENS, 2)
    assert_bits_equal(jax_dsrelu.combine(jnp.asarray(rows), plan), sequential_sum(rows, index, range(2)))
    _, vjp = jax.vjp(lambda x: jax_dsrelu.dispatch(x, plan), jnp.zeros((NUM_TOKENS, WIDTH), jnp.float32))
    assert_bits_equal(vjp(jnp.asarray(rows))[0], sequential_sum(rows, index, range(2)))


def test_lowers_to_no_scatter_on_cpu_and_cuda():
    rows = jax.ShapeDtypeStruct((NUM_ROWS, WIDTH), jnp.bfloat16)
    index = jax.ShapeDtypeStruct((NUM_TOKENS, SLOTS), jnp.int32)
    for platform in ("cpu", "cuda"):
        traced = jax.jit(lambda r, i: gather_sum(r, i, backend="auto")).trace(rows, index)
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "gather" in text and "scatter" not in text, platform


def test_indices_past_the_rows_are_clamped():
    rows = jnp.arange(12.0, dtype=jnp.float32).reshape(6, 2)
    index = jnp.asarray([[0, 9], [-3, 5]], jnp.int32)
    np.testing.assert_array_equal(gather_sum(rows, index, backend="xla"), [[0 + 10, 1 + 11], [0 + 10, 1 + 11]])


def test_batched_equals_each_element():
    rng = np.random.default_rng(3)
    rows = jnp.asarray(np.stack([order_sensitive_rows(rng) for _ in range(3)]))
    index = jnp.asarray(np.stack([token_rows(rng) for _ in range(3)]))
    mapped = jax.jit(jax.vmap(lambda r, i: gather_sum(r, i, backend="xla")))(rows, index)
    for b in range(3):
        assert_bits_equal(mapped[b], sequential_sum(np.asarray(rows[b]), np.asarray(index[b]), range(SLOTS)))


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_tokens_split_over_devices_give_the_same_bits(axis_type):
    rng = np.random.default_rng(4)
    rows, index = order_sensitive_rows(rng), token_rows(rng)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type,) * 2)
    placed_rows = jax.device_put(jnp.asarray(rows), NamedSharding(mesh, P(None, "model")))
    placed_index = jax.device_put(jnp.asarray(index), NamedSharding(mesh, P("data", None)))
    got = jax.jit(lambda r, i: gather_sum(r, i, backend="xla"))(placed_rows, placed_index)
    assert got.sharding.spec[:2] == P("data", "model")[:2]
    assert_bits_equal(got, sequential_sum(rows, index, range(SLOTS)))


def test_a_backend_without_the_kernel_is_refused():
    rows, index = jnp.zeros((4, 2), jnp.float32), jnp.zeros((2, 2), jnp.int32)
    with pytest.raises(NotImplementedError, match="sm100"):
        gather_sum(rows, index, backend="sm100")
