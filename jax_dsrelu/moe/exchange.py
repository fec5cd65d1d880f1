"""Where each routed row goes under expert parallelism: its slot in the all-to-all send buffer.

A device's n = T_local * top_k rows, sorted by expert (the `RoutingPlan`'s rows), are
sorted by destination device too, since device j holds experts [j * E_local, (j + 1) *
E_local). `lax.all_to_all` moves equal blocks, so the send buffer has D blocks of C rows,
block j for device j: C = n when dropless (device j may own every expert a token chose),
or ceil(capacity_factor * n / D) (`MoEOptions.per_peer_capacity`). The slots of a block
past the rows sent there are padding: they carry expert index E_local, which sorts after
every local expert on the receiver, so they belong to no expert and come back 0.

With a capacity, a destination offered more than C rows takes the C with the largest
routing weight (row_prob), ties to the lower assignment t * top_k + s (the lower token,
then the earlier slot): a sort with unique keys, so the choice is fully determined. The
rows kept keep their expert-sorted order in the block, so that with nothing dropped the
buffer is the dropless one. A dropped row is sent nowhere: it adds nothing to its token's
output, and its weight and its token get no gradient through it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jax_dsrelu import groups
from jax_dsrelu.moe.routing import RoutingPlan


class ExchangePlan(NamedTuple):
    """One device's send buffer of D * C slots, and its n expert-sorted rows' slots."""

    slot_row: jax.Array  # (D*C,) int32, the expert-sorted row in each slot (clamped where empty)
    slot_token: jax.Array  # (D*C,) int32, that row's token
    slot_expert: jax.Array  # (D*C,) int32, its expert on the destination, 0..E_local-1; E_local where empty
    slot_full: jax.Array  # (D*C,) bool, whether the slot holds a row
    row_slot: jax.Array  # (n,) int32, each expert-sorted row's slot; D*C where dropped
    row_sent: jax.Array  # (n,) bool, whether the row is sent (not dropped)
    token_slots: jax.Array  # (T_local, top_k) int32, each token's slots in slot order; D*C where dropped
    dropped: jax.Array  # () int32, rows dropped: n - sum(row_sent)


def plan_exchange(plan: RoutingPlan, num_peers: int, capacity: int) -> ExchangePlan:
    """The send buffer of a device routing by `plan` (rows sorted by global expert, none
    cut: round_to is refused under expert parallelism) to num_peers devices that hold
    E / num_peers experts each, `capacity` rows per device (n when dropless)."""
    num_rows = plan.order.shape[0]
    local_experts = plan.num_experts // num_peers
    row_expert, _ = groups.row_experts(plan.group_sizes, num_rows)
    destination = row_expert // local_experts
    offered = jnp.sum(plan.group_sizes.reshape(num_peers, local_experts), axis=1)  # (D,) rows for each device
    offered_starts = jnp.cumsum(offered) - offered
    rows = lax.iota(jnp.int32, num_rows)

    if capacity >= num_rows:
        sent = jnp.ones((num_rows,), bool)
    else:
        # Rank each destination's rows by weight (highest first), ties to the lower assignment.
        weight = lax.stop_gradient(plan.row_prob)
        _, _, _, ranked = lax.sort((destination, -weight, plan.order, rows), num_keys=3)
        _, place = lax.sort((ranked, rows), num_keys=1)  # each row's place in `ranked`
        sent = place - offered_starts[destination] < capacity
    sent_sizes = jnp.minimum(offered, capacity)
    sent_starts = jnp.cumsum(sent_sizes) - sent_sizes
    sent_through = jnp.cumsum(sent.astype(jnp.int32))  # rows sent up to and including each row
    position = sent_through - 1 - sent_starts[destination]  # among the rows sent to the same device
    buffer_size = num_peers * capacity
    row_slot = jnp.where(sent, destination * capacity + position, buffer_size).astype(jnp.int32)

    # Slot i of block j holds the i-th row sent to device j: the row at which the count
    # of rows sent reaches sent_starts[j] + i + 1.
    block, within = jnp.divmod(lax.iota(jnp.int32, buffer_size), capacity)
    slot_full = within < sent_sizes[block]
    slot_row = jnp.searchsorted(sent_through, sent_starts[block] + within + 1, side="left").astype(jnp.int32)
    slot_row = jnp.minimum(slot_row, max(num_rows - 1, 0))
    slot_token = plan.order[slot_row] // plan.top_k
    slot_expert = jnp.where(slot_full, row_expert[slot_row] % local_experts, local_experts)
    token_slots = row_slot[plan.inverse].reshape(-1, plan.top_k)
    dropped = num_rows - jnp.sum(sent_sizes)
    return ExchangePlan(slot_row, slot_token, slot_expert, slot_full, row_slot, sent, token_slots, dropped)
