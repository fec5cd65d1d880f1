"""plan_exchange: where each routed row goes in the all-to-all send buffer, checked against
a plain Python walk over the rows, dropless and with a capacity."""

from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu
from jax_dsrelu.moe import exchange

T, E, TOP_K, PEERS = 24, 8, 3, 4


def routed(seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    logits[:, 1] += 2.0  # device 0 is offered more than its share
    logits[3:7] = logits[0]  # equal weights, for the ties
    return jax_dsrelu.route(jnp.asarray(logits), TOP_K)


def expected_slots(plan, capacity):
    """{assignment t * top_k + s: its slot} by walking the rows: each device takes its
    `capacity` heaviest rows (ties to the lower assignment), in expert-sorted order."""
    order, row_prob = np.asarray(plan.order), np.asarray(plan.row_prob)
    row_expert = np.repeat(np.arange(E), np.asarray(plan.group_sizes))
    slots = {}
    for device in range(PEERS):
        rows = [r for r in range(len(order)) if row_expert[r] // (E // PEERS) == device]
        kept = set(sorted(rows, key=lambda r: (-row_prob[r], order[r]))[:capacity])
        for position, row in enumerate(r for r in rows if r in kept):
            slots[int(order[row])] = device * capacity + position
    return slots


@pytest.mark.parametrize("capacity_factor", [None, 1.0, 0.5])
def test_every_row_goes_to_its_slot_and_each_token_reads_its_slots_in_slot_order(capacity_factor):
    plan = routed(0)
    n = T * TOP_K
    capacity = jax_dsrelu.MoEOptions(capacity_factor=capacity_factor).per_peer_capacity(n, PEERS)
    assert capacity == (n if capacity_factor is None else math.ceil(fractions.Fraction(repr(float(capacity_factor))) * n / PEERS))
    sends = jax.jit(exchange.plan_exchange, static_argnums=(1, 2))(plan, PEERS, capacity)
    want = expected_slots(plan, capacity)
    buffer_size = PEERS * capacity
    token_slots = np.asarray(sends.token_slots)
    for assignment in range(n):
        token, slot = divmod(assignment, TOP_K)
        got = int(token_slots[token, slot])
        assert got == want.get(assignment, buffer_size), (assignment, got)
        if got < buffer_size:
            assert int(sends.slot_token[got]) == token and bool(sends.slot_full[got])
            row = int(sends.slot_row[got])
            assert int(plan.order[row]) == assignment and int(sends.row_slot[row]) == got
            assert int(sends.slot_expert[got]) == int(np.repeat(np.arange(E), plan.group_sizes)[row]) % (E // PEERS)
    full = np.asarray(sends.slot_full)
    assert full.sum() == len(want) == n - int(sends.dropped)
    assert (np.asarray(sends.slot_expert)[~full] == E // PEERS).all()
    if capacity_factor == 0.5:
        assert int(sends.dropped) > 0


def test_dropless_is_the_expert_sorted_rows_block_by_block():
    plan = routed(1)
    n = T * TOP_K
    sends = exchange.plan_exchange(plan, PEERS, n)
    sizes = np.asarray(plan.group_sizes).reshape(PEERS, -1).sum(1)
    starts = np.cumsum(sizes) - sizes
    for device in range(PEERS):
        block = np.asarray(sends.slot_row)[device * n: device * n + sizes[device]]
        np.testing.assert_array_equal(block, starts[device] + np.arange(sizes[device]))
    assert int(sends.dropped) == 0


def test_the_capacity_is_exact_for_the_factor_as_written():
    # 1.1 * 200 / 4 is 55 exactly; in floating point a hair above it, which ceil would make 56.
    assert 1.1 * 200 / 4 > 55
    assert jax_dsrelu.MoEOptions(capacity_factor=1.1).per_peer_capacity(200, 4) == 55
    assert jax_dsrelu.MoEOptions(capacity_factor=0.3).per_peer_capacity(10, 3) == 1
    assert jax_dsrelu.MoEOptions(capacity_factor=1.25).per_peer_capacity(100, 8) == 16
