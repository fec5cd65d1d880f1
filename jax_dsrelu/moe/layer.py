"""`moe_layer`: a dropless top-k MoE feed-forward layer on one device.

route -> dispatch -> `moe_mlp` -> combine. Routing, dispatch and combine are bitwise
reproducible by construction (see `jax_dsrelu.moe.routing`); `deterministic` is passed to
`moe_mlp`, so with deterministic=True every gradient of the layer, the router's
included, is bitwise reproducible from run to run.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jax_dsrelu.ops.moe_mlp import moe_mlp
from jax_dsrelu.moe import routing
from jax_dsrelu.primitives import validation


class MoEAux(NamedTuple):
    """What `moe_layer(..., return_aux=True)` returns beside the output.

    Add the losses to the training loss with small weights (for example 1e-2 and 1e-3)
    to keep the experts evenly loaded and the router's logits small.
    """

    load_balancing_loss: jax.Array  # () float32, E * sum_e f_e * P_e (see `route`)
    router_z_loss: jax.Array  # () float32, mean over tokens of logsumexp(logits)**2
    group_sizes: jax.Array  # (E,) int32, (token, slot) assignments routed to each expert


def moe_layer(
    x: jax.Array,  # (T, d) tokens
    router: jax.Array,  # (d, E) router weights
    w1: jax.Array,  # (E, d, f) first expert weights
    w2: jax.Array,  # (E, f, d) second expert weights
    *,
    b1: jax.Array | None = None,  # (E, f) first expert bias
    top_k: int = 2,
    normalize: bool = False,
    deterministic: bool = False,
    backend: str = "auto",
    return_aux: bool = False,
) -> jax.Array | tuple[jax.Array, MoEAux]:  # (T, d) x.dtype [, MoEAux]
    """out[t] = sum over token t's top_k experts e of p[t, e] * relu(x[t] @ w1[e] + b1[e])**2 @ w2[e].

    p is softmax(x @ router) in float32 (renormalized over the top_k when normalize=True),
    ties in the top_k go to the lower expert index, and no token is dropped. The experts
    run in w1.dtype (x is cast to it), the top_k outputs are added in float32 and the
    result is cast to x.dtype. With return_aux=True, returns (out, MoEAux).

    deterministic and backend are `moe_mlp`'s: deterministic=True makes every gradient
    bitwise reproducible; backend is "auto", "xla", "sm90" or "sm100".
    """
    validation.check_moe_layer(x, router, w1, w2, b1)
    check_layer_options(top_k, w1.shape[0], normalize, deterministic, backend, return_aux)
    plan = routing.route(router_logits(x, router), top_k, normalize=normalize)
    rows = routing.dispatch(x.astype(w1.dtype), plan)
    y = moe_mlp(
        rows, w1, w2, plan.row_prob, plan.group_sizes, b1=b1, deterministic=deterministic, backend=backend
    )
    out = routing.combine(y, plan).astype(x.dtype)
    if not return_aux:
        return out
    return out, MoEAux(plan.load_balancing_loss, plan.router_z_loss, plan.group_sizes)


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """(T, d) @ (d, E) -> (T, E), in float32 whatever the dtypes of x and router."""
    return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))


def check_layer_options(
    top_k: Any, num_experts: int, normalize: Any, deterministic: Any, backend: Any, return_aux: Any
) -> None:
    validation.require_top_k(top_k, num_experts)
    for name, flag in (("normalize", normalize), ("deterministic", deterministic), ("return_aux", return_aux)):
        validation.require_bool(name, flag)
    validation.backend_name(backend)
