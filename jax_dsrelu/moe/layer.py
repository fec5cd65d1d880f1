"""`moe_layer`: a top-k MoE feed-forward block on one device, dropless unless round_to.

The values of route -> dispatch -> `moe_mlp` -> combine, with the options of the models
that train squared-ReLU experts (Nemotron-H, Nemotron 3): sigmoid scores with a selection
bias, group-limited selection, renormalized and scaled weights, a shared expert on every
token and latent projections around the routed experts. Routing, dispatch and combine are
bitwise reproducible by construction (see `jax_dsrelu.moe.routing`); the experts, the shared
one included, run on the kernels of `moe_mlp` with `deterministic` passed on, and the
router and the latent projections are plain matmuls, whose gradients are GEMMs (a fixed
summation order, no scatter). So with deterministic=True every gradient of the block, the
router's included, is bitwise reproducible from run to run.

What the block keeps for its backward is x (or the latent z), the pre-activations, the
router's logits and the routing (docs/moe.md, "What the block keeps"): the routed experts
run as one custom VJP that reads their rows through the routing's indices
(`jax_dsrelu.ops.block_experts`), the shared expert keeps its weights as given, and the
products of x with the router and latent_in cast x again in their backward.

The block's steps (`route_tokens`, `expert_tokens`, `block_output`) are functions of the
checked weights (`MoEWeights`) and options (`MoEOptions`), so that
`moe_layer_expert_parallel` runs these same steps around its exchanged experts
(`jax_dsrelu.ops.exchanged_experts`), and `jax_dsrelu.flax.MoE` calls `apply` with the
options it checked once, when it was built.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_dsrelu.kernels import registry
from jax_dsrelu.moe import routing
from jax_dsrelu.moe.entry_points import UNSET, entry_point
from jax_dsrelu.moe.options import MoEOptions
from jax_dsrelu.moe.routing import RoutingPlan
from jax_dsrelu.moe.weights import MoEWeights
from jax_dsrelu.ops import block_experts, quantized_expert_mlp
from jax_dsrelu.ops.quantized_expert_mlp import QuantizedExpertWeights
from jax_dsrelu.primitives import validation
from jax_dsrelu.quantization.schema import Recipe


class MoEAux(NamedTuple):
    """What `moe_layer(..., return_aux=True)` returns beside the output.

    Add the losses to the training loss with small weights (for example 1e-2 and 1e-3)
    to keep the experts evenly loaded and the router's logits small. With
    score="sigmoid", load_balancing_loss is DeepSeek-V3's complementary balance loss
    over the call's tokens (see `route`; DeepSeek-V3 weighs it by 1e-4), and the expert
    load is group_sizes, or group_sizes / (T * top_k) as fractions; group_sizes is what
    `update_expert_bias` takes. dropped is 0 but under `moe_layer_expert_parallel` with
    a capacity_factor: the (token, slot) rows its send buffers had no room for.
    """

    load_balancing_loss: jax.Array  # () float32, E * sum_e f_e * P_e (see `route`)
    router_z_loss: jax.Array  # () float32, mean over tokens of logsumexp(logits)**2
    group_sizes: jax.Array  # (E,) int32, (token, slot) assignments routed to each expert (before round_to)
    dropped: jax.Array  # () int32, assignments the capacity_factor of expert parallelism dropped (0 when dropless)


@entry_point
def moe_layer(
    x: jax.Array,  # (T, d) tokens
    router: jax.Array | None = None,  # (d, E) router weights
    w1: jax.Array | None = None,  # (E, l, f) first expert weights; l = d without latent projections
    w2: jax.Array | None = None,  # (E, f, l) second expert weights
    *,
    weights: MoEWeights | None = None,  # all of the block's weights, instead of the arrays
    options: MoEOptions | None = None,  # all of its options, instead of the option keywords
    b1: jax.Array | None = None,  # (E, f) first expert bias
    top_k: int = UNSET,
    score: str = UNSET,
    expert_bias: jax.Array | None = None,  # (E,) selection bias, no gradient
    num_groups: int = UNSET,
    top_groups: int | None = UNSET,
    normalize: bool = UNSET,
    scale: float = UNSET,
    round_to: int | None = UNSET,
    capacity_factor: float | None = UNSET,  # None only: see check_one_device
    recompute_exchanged: bool = UNSET,  # False only: see check_one_device
    shared_w1: jax.Array | None = None,  # (d, fs) shared expert, first weights
    shared_w2: jax.Array | None = None,  # (fs, d) shared expert, second weights
    latent_in: jax.Array | None = None,  # (d, l) projection into the experts' width
    latent_out: jax.Array | None = None,  # (l, d) projection back
    deterministic: bool = UNSET,
    backend: str = UNSET,
    precision: Recipe | None = UNSET,
    return_aux: bool = False,
    quantized_weights: QuantizedExpertWeights | None = None,  # quantize_expert_weights(w1, w2, precision)
) -> jax.Array | tuple[jax.Array, MoEAux]:  # (T, d) x.dtype [, MoEAux]
    """The MoE block:

        weight = route(x @ router, top_k, score=..., expert_bias=..., num_groups=...,
                       top_groups=..., normalize=..., scale=..., round_to=...)  (see `route`)
        z      = x @ latent_in                     (x without latent projections)
        routed = sum over token t's top_k experts e of weight[t, e] * relu(z @ w1[e] + b1[e])**2 @ w2[e]
        out    = routed @ latent_out (or routed)  +  relu(x @ shared_w1)**2 @ shared_w2 (if given)

    The logits are computed in float32; ties in the selection go to the lower expert
    index, and no token is dropped unless round_to is given (token rounding: each
    expert's assignments cut to a multiple of round_to, see `route`). The routed experts
    run in w1.dtype (z is cast to it), their top_k outputs are added in float32; the shared expert runs in
    shared_w1.dtype on `moe_mlp` as one expert that owns every token; the latent
    projections multiply in their weights' dtype and accumulate in float32. The sum is
    cast to x.dtype. With return_aux=True, returns (out, MoEAux). With a precision
    (FP8_BLOCKWISE) the experts' GEMMs, the shared expert's included, read FP8 operands as
    `moe_mlp` does; the router and the latent projections stay in their weights' dtype.
    quantized_weights: the routed experts' w1 and w2 quantized once by the precision
    (`quantize_expert_weights(w1, w2, precision)`), read instead of quantizing them again,
    as `moe_mlp` takes them (gradient accumulation); the gradients are the same bits.

    The weights are the arrays above, or one `MoEWeights` as weights= (not both).
    Gradients reach x, router, w1, b1, w2, shared_w1, shared_w2, latent_in and latent_out;
    expert_bias gets none. `jax_dsrelu.params_from_hf_nemotron_h` turns a Hugging Face
    NemotronHMoE block's tensors into the weight arguments.

    {MoEOptions}
    """
    weights.check(x)
    options.check_experts(weights.num_experts)
    check_one_device(options)
    quantized_expert_mlp.check_quantized_weights(quantized_weights, weights.w1, weights.w2, options.precision)
    return apply(x, weights, options, return_aux, quantized_weights)


def check_one_device(options: MoEOptions) -> None:
    """Raises unless the options have a meaning on one device: capacity_factor bounds the
    rows a device sends to each other device under expert parallelism, and
    recompute_exchanged says what the backward keeps of the rows received; one device
    sends and receives none (its experts run every row it routes)."""
    if options.capacity_factor is not None:
        raise ValueError(
            f"capacity_factor must be None on one device (it bounds the rows each device sends to another "
            f"under moe_layer_expert_parallel; here every routed row runs), got "
            f"capacity_factor={options.capacity_factor!r}"
        )
    if options.recompute_exchanged:
        raise ValueError(
            "recompute_exchanged must be False on one device (it says what moe_layer_expert_parallel's backward "
            "keeps of the rows other devices send; here none are sent), got recompute_exchanged=True"
        )


def apply(
    x: jax.Array,  # (T, d) tokens
    weights: MoEWeights,
    options: MoEOptions,
    return_aux: bool,
    quantized_weights: QuantizedExpertWeights | None = None,  # checked against weights and options
) -> jax.Array | tuple[jax.Array, MoEAux]:  # (T, d) x.dtype [, MoEAux]
    """`moe_layer` on weights checked against x and options checked against the weights:
    the block's steps on one device. `jax_dsrelu.flax.MoE` calls it with the options it
    checked when built."""
    validation.require_bool("return_aux", return_aux)
    plan = route_tokens(x, weights, options)
    routed = block_experts.routed_experts(
        expert_tokens(x, weights), weights.w1, weights.w2, weights.b1, plan.row_prob, plan.group_sizes,
        plan.order, plan.inverse, top_k=plan.top_k, deterministic=options.deterministic,
        backends=registry.layer_backends(options.backend, options.precision), precision=options.precision,
        quantized=None if quantized_weights is None else jax.lax.stop_gradient(quantized_weights),
    )
    out = block_output(routed, x, weights, options)
    if not return_aux:
        return out
    return out, MoEAux(plan.load_balancing_loss, plan.router_z_loss, plan.chosen_sizes, jnp.zeros((), jnp.int32))


# The block's steps. `moe_layer` runs route_tokens, expert_tokens, the routed experts
# (`block_experts.routed_experts`: dispatch, experts and combine in one custom VJP that
# reads the rows through the routing) and block_output. `moe_layer_expert_parallel` runs
# the same steps with `exchanged_experts` in place of the routed experts: the same custom
# VJP's steps, with an all-to-all on each side of the experts.


def route_tokens(x: jax.Array, weights: MoEWeights, options: MoEOptions) -> RoutingPlan:
    """(T, d) tokens -> their plan. The logits x @ router are computed in float32 whatever
    the dtypes of x and the router: rounding them to bfloat16 would turn near ties into
    ties and change the experts chosen."""
    return routing.plan_routes(_router_logits(x, weights.router), options, weights.expert_bias)


def expert_tokens(x: jax.Array, weights: MoEWeights) -> jax.Array:
    """(T, d) tokens -> (T, l), the routed experts' input before its cast to w1.dtype: x,
    or x @ latent_in rounded to w1.dtype (the experts' backward keeps it, so it is kept
    in their width and dtype rather than in float32)."""
    if weights.latent_in is None:
        return x
    return _project_tokens(x, weights.latent_in).astype(weights.w1.dtype)


def block_output(routed: jax.Array, x: jax.Array, weights: MoEWeights, options: MoEOptions) -> jax.Array:
    """(T, l) combined expert outputs (float32) -> (T, d) in x.dtype: projected back
    through latent_out if given, plus the shared expert on x if given.

    The shared expert is one expert that owns all T rows with weight 1, so it runs on the
    same kernels as the routed experts, with the same determinism.
    """
    out = routed if weights.latent_out is None else _project(routed, weights.latent_out)
    if weights.shared_w1 is not None:
        shared = block_experts.shared_expert(
            x, weights.shared_w1, weights.shared_w2, deterministic=options.deterministic,
            backends=registry.layer_backends(options.backend, options.precision), precision=options.precision,
        )
        out = out + shared.astype(jnp.float32)
    return out.astype(x.dtype)


def _project(a: jax.Array, weight: jax.Array) -> jax.Array:
    """(T, n) @ (n, m) -> (T, m) float32, multiplied in weight.dtype. Its backward keeps a
    in weight.dtype: latent_out's gradient needs the rounded routed output."""
    return jnp.dot(a.astype(weight.dtype), weight, preferred_element_type=jnp.float32)


# The products of the tokens with a dense weight: their backward keeps x and the weight
# as given and casts x again (remat of the cast alone; the product itself is not needed),
# rather than keeping a float32 or weight-dtype copy of x.


@jax.checkpoint
def _router_logits(x: jax.Array, router: jax.Array) -> jax.Array:  # (T, E) float32
    return jnp.dot(x.astype(jnp.float32), router.astype(jnp.float32))


_project_tokens = jax.checkpoint(_project)
