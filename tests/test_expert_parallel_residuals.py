"""What moe_layer_expert_parallel keeps for its backward, per device: the one-device block's
minimum for the device's tokens, plus the rows its experts received, at most 1.15x.

Counted as in tests/test_residuals.py (the arrays `jax.vjp` keeps, read from its jaxpr:
tracing only), per device: an array made inside the shard_map is counted at its shape
there. The arguments are not counted, nor the device's share of a weight that the
shard_map passes out as it is (w1, w2 and b1 cast to vary over the data axes, which the
experts' custom VJP needs to return their gradients with their primal's type). With T_l
tokens per device, n = T_l * top_k routed rows and R = D * C rows in the receive buffer
(C = n when dropless, ceil(capacity_factor * n / D) otherwise), the minimum is:

    x                                         (T_l, d)    x.dtype
    the router's logits                       (T_l, E)    float32
    the routing: order, inverse               (n,)        int32
    the rows received, which dw1 reads        (R, l)      w1.dtype
    their pre-activations                     (R, f)      w1.dtype
    their weights                             (R,)        float32
    their local-expert order and its inverse  (R,)        int32, and the local group sizes
    the send slots: token and row of each, each token's slots   (R,), (R,), (n,)  int32
    whether each send slot holds a row        (R,)        bool
    with the shared expert: its pre-activation (T_l, fs); with latent projections: the
    combined output rounded to latent_out.dtype (T_l, l), which latent_out's gradient reads

The receive buffer holds R rows whatever the routing: dropless, R = D * n, since any one
device may be sent every row; a capacity_factor cuts R to about capacity_factor * n.
With recompute_exchanged=True neither the rows received nor their pre-activations are
kept (the backward makes both again): the experts' tokens (T_l, l) take their place, which
without latent projections are x itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_dsrelu

BOUND = 1.15
# Every size distinct, so that a shape names one array.
T, D_MODEL, F, E, TOP_K, FS, L = 640, 128, 96, 8, 2, 176, 48
MESH_SHAPE, MESH_AXES = (2, 4), ("data", "expert")
TOKEN_SHARDS, PEERS = 8, 4
T_LOCAL = T // TOKEN_SHARDS
N = T_LOCAL * TOP_K


@pytest.fixture(scope="module", autouse=True)
def eight_devices():
    assert len(jax.devices()) >= 8, "conftest.py asks XLA for 8 host devices"


def block_arguments(config):
    s = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    width = L if config.get("latent") else D_MODEL
    weights = dict(router=s((D_MODEL, E), jnp.float32), w1=s((E, width, F), bf16), w2=s((E, F, width), bf16))
    options = dict(top_k=TOP_K)
    if config.get("block"):
        weights.update(
            b1=s((E, F), jnp.float32), expert_bias=s((E,), jnp.float32),
            shared_w1=s((D_MODEL, FS), bf16), shared_w2=s((FS, D_MODEL), bf16),
            latent_in=s((D_MODEL, L), bf16), latent_out=s((L, D_MODEL), bf16),
        )
        options.update(score="sigmoid", normalize=True, scale=2.5, num_groups=4, top_groups=2)
    if config.get("fp8"):
        options.update(precision=jax_dsrelu.quantization.FP8_BLOCKWISE)
    return s((T, D_MODEL), bf16), weights, options


def kept_per_device(fn, x, weights):
    """(shape, dtype) per device of every array jax.vjp(fn, x, *weights)'s function holds,
    each once: x at its shard's shape, an array made inside the shard_map at its shape
    there, one made outside whole; the weights and their shares left out.

    An argument that reaches the kept arrays through a sharding constraint or through the
    shard_map unchanged (an input passed out as it came in) is that argument: the same
    value, not a copy."""
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(x, *weights.values())
    position = {var: i for i, var in enumerate(closed.jaxpr.invars)}
    producer = {var: (eqn, i) for eqn in closed.jaxpr.eqns for i, var in enumerate(eqn.outvars)}

    def source(var):
        """(the argument's position or None, the producing equation, the output index)."""
        while var not in position:
            eqn, i = producer[var]
            if eqn.primitive.name == "sharding_constraint":
                var = eqn.invars[0]
                continue
            if eqn.primitive.name == "shard_map":
                body = eqn.params["jaxpr"]
                inner = body.outvars[i]
                if inner in body.invars:
                    var = eqn.invars[body.invars.index(inner)]
                    continue
            return None, eqn, i
        return position[var], None, None

    # By shape and dtype: a copy of a weight in another dtype (a quantized one) is counted.
    weight_avals = {(tuple(w.shape), np.dtype(w.dtype)) for w in weights.values() if w.ndim > 1}
    weight_avals |= {
        ((weights[name].shape[0] // PEERS, *weights[name].shape[1:]), np.dtype(weights[name].dtype))
        for name in ("w1", "w2", "b1") if name in weights
    }
    seen, out = set(), []
    for var in closed.jaxpr.outvars:
        if isinstance(var, jax.extend.core.Literal):
            continue
        argument, eqn, i = source(var)
        key = ("argument", argument) if argument is not None else var
        if key in seen:
            continue
        seen.add(key)
        if argument == 0:
            out.append(((T_LOCAL, D_MODEL), np.dtype(x.dtype)))
        if argument is not None:
            continue
        # Made outside the shard_map (the auxiliary losses' statistics): counted whole.
        aval = eqn.params["jaxpr"].outvars[i].aval if eqn.primitive.name == "shard_map" else var.aval
        # A weight, or a device's share of w1, w2 or b1, cast to vary over the token axes
        # (a change of type, not of value), which the custom VJPs inside need to return
        # the weights' gradients with their primal's type.
        if (tuple(aval.shape), np.dtype(aval.dtype)) in weight_avals:
            continue
        out.append((tuple(aval.shape), np.dtype(aval.dtype)))
    return out


def nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def minimum_bytes(x, weights, received, recompute=False):
    """The docstring's minimum; with recompute (recompute_exchanged=True), the experts'
    tokens (T_l, l) in place of the rows received and their pre-activations."""
    width = weights["w1"].shape[1]
    total = nbytes((T_LOCAL, D_MODEL), x.dtype) + nbytes((T_LOCAL, E), np.float32) + 2 * nbytes((N,), np.int32)
    if not recompute:
        total += nbytes((received, width), weights["w1"].dtype) + nbytes((received, F), weights["w1"].dtype)
    elif "latent_in" in weights:  # without projections the tokens are x, counted above
        total += nbytes((T_LOCAL, L), weights["latent_in"].dtype)
    total += nbytes((received,), np.float32) + 4 * nbytes((received,), np.int32) + nbytes((E // PEERS,), np.int32)
    total += nbytes((received,), np.bool_)
    total += nbytes((N,), np.int32)
    if "shared_w1" in weights:
        total += nbytes((T_LOCAL, FS), weights["shared_w1"].dtype)
    if "latent_in" in weights:
        total += nbytes((T_LOCAL, L), weights["latent_out"].dtype)
    return total


def layer(names, options, capacity_factor, recompute=False):
    mesh = jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(AxisType.Auto,) * 2)

    def fn(x, *weights):
        return jax_dsrelu.moe_layer_expert_parallel(
            x, **dict(zip(names, weights)), mesh=mesh, data_axis="data", **options,
            capacity_factor=capacity_factor, recompute_exchanged=recompute, backend="xla", return_aux=True,
        )

    return fn


CAPACITIES = [(None, N), (1.0, N // PEERS), (1.5, -(-3 * N // (2 * PEERS)))]
CONFIGS = [{}, {"block": True, "latent": True}, {"fp8": True}]
CONFIG_IDS = ["plain", "shared_latent_b1_sigmoid", "fp8"]


@pytest.mark.parametrize("capacity_factor, per_peer", CAPACITIES)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_keeps_the_minimum_and_the_rows_received(config, capacity_factor, per_peer):
    x, weights, options = block_arguments(config)
    arrays = kept_per_device(layer(list(weights), options, capacity_factor), x, weights)
    received = PEERS * per_peer
    total, minimum = sum(nbytes(*a) for a in arrays), minimum_bytes(x, weights, received)
    assert total <= BOUND * minimum, f"kept {total} bytes, {total / minimum:.3f}x the minimum {minimum}: {arrays}"
    # Named one by one, for a clearer failure than the sum's: the rows received once, and
    # no send buffer, sorted copy or outputs beside them; no row copy of the tokens.
    width = weights["w1"].shape[1]
    assert arrays.count(((received, width), np.dtype(jnp.bfloat16))) == 1, arrays
    assert not [a for a in arrays if a[0] in {(N, width), (received, width)} and a[1] != np.dtype(jnp.bfloat16)], arrays
    if received != N:
        assert not [a for a in arrays if a[0] == (N, width)], f"rows of the tokens are kept: {arrays}"
    assert [a for a in arrays if a[0] == (T_LOCAL, D_MODEL)] == [((T_LOCAL, D_MODEL), np.dtype(x.dtype))], (
        f"x is kept other than once as given: {arrays}"
    )


def test_a_capacity_keeps_about_what_one_device_keeps_plus_the_rows():
    # At capacity_factor=1 the receive buffer holds n rows, as one device's block runs:
    # the device keeps the block's minimum plus those rows, not D-fold padded buffers.
    x, weights, options = block_arguments({})
    dropless = sum(nbytes(*a) for a in kept_per_device(layer(list(weights), options, None), x, weights))
    capped = sum(nbytes(*a) for a in kept_per_device(layer(list(weights), options, 1.0), x, weights))
    assert capped < dropless / 3
    assert capped <= BOUND * minimum_bytes(x, weights, N)


@pytest.mark.parametrize("capacity_factor, per_peer", CAPACITIES)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_recomputing_keeps_the_minimum_and_no_row_received(config, capacity_factor, per_peer):
    # recompute_exchanged=True: the backward sends the rows again and remakes their
    # pre-activations, so of the D * C rows received it keeps only their indices and weights.
    x, weights, options = block_arguments(config)
    arrays = kept_per_device(layer(list(weights), options, capacity_factor, recompute=True), x, weights)
    received = PEERS * per_peer
    total, minimum = sum(nbytes(*a) for a in arrays), minimum_bytes(x, weights, received, recompute=True)
    assert total <= BOUND * minimum, f"kept {total} bytes, {total / minimum:.3f}x the minimum {minimum}: {arrays}"
    width = weights["w1"].shape[1]
    assert not [a for a in arrays if a[0] in {(received, width), (received, F), (N, width), (N, F)}], arrays
    if capacity_factor is None:
        kept = sum(nbytes(*a) for a in kept_per_device(layer(list(weights), options, None), x, weights))
        assert total < kept / 3
