"""`moe_layer`: a dropless top-k MoE feed-forward block on one device.

route -> dispatch -> `moe_mlp` -> combine, with the options of the models that train
squared-ReLU experts (Nemotron-H, Nemotron 3): sigmoid scores with a selection bias,
group-limited selection, renormalized and scaled weights, a shared expert on every token
and latent projections around the routed experts. Routing, dispatch and combine are
bitwise reproducible by construction (see `jax_dsrelu.moe.routing`); the experts, the shared
one included, run on `moe_mlp` with `deterministic` passed on, and the router and the
latent projections are plain matmuls, whose gradients are GEMMs (a fixed summation
order, no scatter). So with deterministic=True every gradient of the block, the router's
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
    to keep the experts evenly loaded and the router's logits small. With
    score="sigmoid", load_balancing_loss is DeepSeek-V3's complementary balance loss
    over the call's tokens (see `route`; DeepSeek-V3 weighs it by 1e-4), and the expert
    load is group_sizes, or group_sizes / (T * top_k) as fractions; group_sizes is what
    `update_expert_bias` takes.
    """

    load_balancing_loss: jax.Array  # () float32, E * sum_e f_e * P_e (see `route`)
    router_z_loss: jax.Array  # () float32, mean over tokens of logsumexp(logits)**2
    group_sizes: jax.Array  # (E,) int32, (token, slot) assignments routed to each expert


def moe_layer(
    x: jax.Array,  # (T, d) tokens
    router: jax.Array,  # (d, E) router weights
    w1: jax.Array,  # (E, l, f) first expert weights; l = d without latent projections
    w2: jax.Array,  # (E, f, l) second expert weights
    *,
    b1: jax.Array | None = None,  # (E, f) first expert bias
    top_k: int = 2,
    score: str = "softmax",
    expert_bias: jax.Array | None = None,  # (E,) selection bias, no gradient
    num_groups: int = 1,
    top_groups: int | None = None,
    normalize: bool = False,
    scale: float = 1.0,
    shared_w1: jax.Array | None = None,  # (d, fs) shared expert, first weights
    shared_w2: jax.Array | None = None,  # (fs, d) shared expert, second weights
    latent_in: jax.Array | None = None,  # (d, l) projection into the experts' width
    latent_out: jax.Array | None = None,  # (l, d) projection back
    deterministic: bool = False,
    backend: str = "auto",
    return_aux: bool = False,
) -> jax.Array | tuple[jax.Array, MoEAux]:  # (T, d) x.dtype [, MoEAux]
    """The MoE block:

        weight = route(x @ router, top_k, score=..., expert_bias=..., num_groups=...,
                       top_groups=..., normalize=..., scale=...)        (see `route`)
        z      = x @ latent_in                     (x without latent projections)
        routed = sum over token t's top_k experts e of weight[t, e] * relu(z @ w1[e] + b1[e])**2 @ w2[e]
        out    = routed @ latent_out (or routed)  +  relu(x @ shared_w1)**2 @ shared_w2 (if given)

    The logits are computed in float32; ties in the selection go to the lower expert
    index, and no token is dropped. The routed experts run in w1.dtype (z is cast to
    it), their top_k outputs are added in float32; the shared expert runs in
    shared_w1.dtype on `moe_mlp` as one expert that owns every token; the latent
    projections multiply in their weights' dtype and accumulate in float32. The sum is
    cast to x.dtype. With return_aux=True, returns (out, MoEAux).

    Gradients reach x, router, w1, b1, w2, shared_w1, shared_w2, latent_in and latent_out;
    expert_bias gets none. deterministic and backend are `moe_mlp`'s: deterministic=True
    makes every gradient bitwise reproducible; backend is "auto", "xla", "sm90" or "sm100".
    `jax_dsrelu.params_from_hf_nemotron_h` turns a Hugging Face NemotronHMoE block's
    tensors into the weight arguments.
    """
    validation.check_moe_layer(x, router, w1, w2, b1, latent_in, latent_out, shared_w1, shared_w2)
    check_layer_options(
        top_k, w1.shape[0], normalize, deterministic, backend, return_aux,
        score, expert_bias, num_groups, top_groups, scale,
    )
    plan = routing.route(
        router_logits(x, router), top_k, score=score, expert_bias=expert_bias, num_groups=num_groups,
        top_groups=top_groups, normalize=normalize, scale=scale,
    )
    out = routed_experts(x, plan, w1, w2, b1, latent_in, latent_out, deterministic, backend)
    if shared_w1 is not None:
        out = out + shared_expert(x, shared_w1, shared_w2, deterministic, backend)
    out = out.astype(x.dtype)
    if not return_aux:
        return out
    return out, MoEAux(plan.load_balancing_loss, plan.router_z_loss, plan.group_sizes)


def routed_experts(x, plan, w1, w2, b1, latent_in, latent_out, deterministic, backend) -> jax.Array:
    """(T, d) tokens -> (T, d) float32: the plan's experts, in the latent width if given."""
    z = x if latent_in is None else project(x, latent_in)
    rows = routing.dispatch(z.astype(w1.dtype), plan)
    y = moe_mlp(
        rows, w1, w2, plan.row_prob, plan.group_sizes, b1=b1, deterministic=deterministic, backend=backend
    )
    routed = routing.combine(y, plan)
    return routed if latent_out is None else project(routed, latent_out)


def shared_expert(x, shared_w1, shared_w2, deterministic, backend) -> jax.Array:
    """(T, d) -> (T, d) float32: relu(x @ shared_w1)**2 @ shared_w2 on every token.

    One expert that owns all T rows with weight 1, so it runs on the same kernels as the
    routed experts, with the same determinism.
    """
    num_tokens = x.shape[0]
    y = moe_mlp(
        x.astype(shared_w1.dtype),
        shared_w1[None],
        shared_w2[None],
        jnp.ones((num_tokens,), jnp.float32),
        jnp.full((1,), num_tokens, jnp.int32),
        deterministic=deterministic,
        backend=backend,
    )
    return y.astype(jnp.float32)


def project(a: jax.Array, weight: jax.Array) -> jax.Array:
    """(T, n) @ (n, m) -> (T, m) float32, multiplied in weight.dtype."""
    return jnp.dot(a.astype(weight.dtype), weight, preferred_element_type=jnp.float32)


def router_logits(x: jax.Array, router: jax.Array) -> jax.Array:
    """(T, d) @ (d, E) -> (T, E), in float32 whatever the dtypes of x and router."""
    return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))


def check_layer_options(
    top_k: Any, num_experts: int, normalize: Any, deterministic: Any, backend: Any, return_aux: Any,
    score: Any = "softmax", expert_bias: Any = None, num_groups: Any = 1, top_groups: Any = None, scale: Any = 1.0,
) -> None:
    validation.check_routing(top_k, num_experts, score, expert_bias, num_groups, top_groups, normalize, scale)
    for name, flag in (("deterministic", deterministic), ("return_aux", return_aux)):
        validation.require_bool(name, flag)
    validation.backend_name(backend)
