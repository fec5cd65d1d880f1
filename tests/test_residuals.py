"""What the MoE block keeps for its backward: at most 1.15x of what the backward needs.

The count is of the arrays the function returned by `jax.vjp(moe_layer, ...)` holds, each
once, read from its jaxpr (tracing only: nothing runs, so the kernel backends are counted on a
machine without a GPU; the primitives choose their backend when lowered). The weight
arguments themselves are not counted (the caller holds them anyway); any other array is,
a copy of a weight included. The minimum (docs/moe.md, "What the block keeps"):

    x                                  (T, d)      x.dtype
    the experts' pre-activations       (T*k, f)    w1.dtype
    the shared expert's one            (T, fs)     shared_w1.dtype
    the router's scores (the logits)   (T, E)      float32
    the routing                        order, inverse (T*k,) int32, row weights (T*k,)
                                       float32, group sizes (E,) int32
    with latent projections: z = x @ latent_in (T, l) in w1.dtype, which the experts
    read, and the combined output rounded to latent_out.dtype (T, l), which latent_out's
    gradient reads (neither can be made again without the experts' forward or a GEMM)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_dsrelu

BOUND = 1.15
# Nemotron-3-Nano's proportions, made small: the shared expert twice as wide as a routed
# one, the latent width half of d. Every size distinct, so that a shape names one array.
T, D, F, E, TOP_K = 80, 128, 96, 8, 2
FS, L = 2 * F, D // 2

CONFIGS = {
    "plain": {},
    "shared": {"shared": True},
    "shared_latent_b1_groups": {"shared": True, "latent": True, "b1": True, "groups": True},
}


def block_arguments(score, config, x_dtype, w_dtype):
    """(x, weights by name, options) as abstract arrays: only their shapes are read."""
    s = jax.ShapeDtypeStruct
    width = L if config.get("latent") else D
    weights = dict(router=s((D, E), jnp.float32), w1=s((E, width, F), w_dtype), w2=s((E, F, width), w_dtype))
    if config.get("b1"):
        weights["b1"] = s((E, F), jnp.float32)
    if config.get("shared"):
        weights.update(shared_w1=s((D, FS), w_dtype), shared_w2=s((FS, D), w_dtype))
    if config.get("latent"):
        weights.update(latent_in=s((D, L), w_dtype), latent_out=s((L, D), w_dtype))
    options = dict(top_k=TOP_K, score=score)
    if score == "sigmoid":
        weights["expert_bias"] = s((E,), jnp.float32)
        options.update(normalize=True, scale=2.5)
    if config.get("groups"):
        options.update(num_groups=4, top_groups=2)
    return s((T, D), x_dtype), weights, options


def kept(fn, *args) -> list[tuple[jax.core.ShapedArray, int | None]]:
    """(aval, the argument's position if it is one) of every array jax.vjp(fn, *args)'s
    function holds, each once."""
    closed = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a)[1])(*args)
    arguments = {var: i for i, var in enumerate(closed.jaxpr.invars)}
    seen, out = set(), []
    for var in closed.jaxpr.outvars:
        if isinstance(var, jax.extend.core.Literal) or var in seen:
            continue
        seen.add(var)
        out.append((var.aval, arguments.get(var)))
    return out


def nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def minimum_bytes(x, weights) -> int:
    rows = T * TOP_K
    total = nbytes(x.shape, x.dtype) + nbytes((rows, F), weights["w1"].dtype)
    total += nbytes((T, E), np.float32) + 2 * nbytes((rows,), np.int32) + nbytes((rows,), np.float32)
    total += nbytes((E,), np.int32)
    if "shared_w1" in weights:
        total += nbytes((T, FS), weights["shared_w1"].dtype)
    if "latent_in" in weights:
        total += nbytes((T, L), weights["w1"].dtype) + nbytes((T, L), weights["latent_out"].dtype)
    return total


def kept_beyond_weights(fn, x, weights):
    """(the arrays kept, x and every array made by the block, as (shape, dtype)), their
    bytes: the weight arguments, which the caller holds anyway, left out."""
    arrays = [
        (tuple(aval.shape), np.dtype(aval.dtype))
        for aval, argument in kept(fn, x, *weights.values())
        if argument is None or argument == 0
    ]
    return arrays, sum(nbytes(shape, dtype) for shape, dtype in arrays)


def layer(names, options, backend, return_aux):
    def fn(x, *weights):
        return jax_dsrelu.moe_layer(
            x, **dict(zip(names, weights)), **options, backend=backend, return_aux=return_aux
        )

    return fn


@pytest.mark.parametrize("return_aux", [False, True], ids=["out", "out_and_aux"])
@pytest.mark.parametrize("dtypes", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.bfloat16)], ids=["bf16", "f32_x"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("backend", ["xla", "sm90", "sm100", "auto"])
def test_block_keeps_at_most_the_bound_over_the_minimum(backend, score, config, dtypes, return_aux):
    x, weights, options = block_arguments(score, CONFIGS[config], *dtypes)
    arrays, total = kept_beyond_weights(layer(list(weights), options, backend, return_aux), x, weights)
    minimum = minimum_bytes(x, weights)
    assert total <= BOUND * minimum, (
        f"kept {total} bytes, {total / minimum:.3f}x the minimum {minimum}: {arrays}"
    )
    # Named one by one, for a clearer failure than the sum's.
    width = L if "latent_in" in weights else D
    assert not [a for a in arrays if a[0] == (T * TOP_K, width)], f"rows of the tokens are kept: {arrays}"
    weight_shapes = {tuple(w.shape) for name, w in weights.items() if w.ndim > 1}
    weight_shapes |= {(1, *shape) for shape in weight_shapes}
    assert not [a for a in arrays if a[0] in weight_shapes], f"a copy of a weight is kept: {arrays}"
    x_copies = [a for a in arrays if a[0] == (T, D)]
    assert x_copies == [((T, D), np.dtype(x.dtype))], f"x is kept other than once as given: {arrays}"


def composed_block(names, options):
    """docs/moe.md's steps by hand: route, dispatch, moe_mlp, combine, the shared expert
    on moe_mlp with its weights given an expert axis. Each public step keeps what its own
    backward needs, so the composition keeps the dispatched rows and the copies."""

    def fn(x, *weights):
        w = dict(zip(names, weights))
        logits = x.astype(jnp.float32) @ w["router"]
        plan = jax_dsrelu.route(logits, options["top_k"], score=options["score"])
        rows = jax_dsrelu.dispatch(x.astype(w["w1"].dtype), plan)
        y = jax_dsrelu.moe_mlp(rows, w["w1"], w["w2"], plan.row_prob, plan.group_sizes, backend="xla")
        out = jax_dsrelu.combine(y, plan)
        shared = jax_dsrelu.moe_mlp(
            x.astype(w["shared_w1"].dtype), w["shared_w1"][None], w["shared_w2"][None],
            jnp.ones((x.shape[0],), jnp.float32), jnp.full((1,), x.shape[0], jnp.int32), backend="xla",
        )
        return (out + shared.astype(jnp.float32)).astype(x.dtype)

    return fn


def test_the_count_sees_rows_and_copies_kept():
    # The same block composed from the public steps keeps x[perm], a float32 copy of x
    # and the shared weights with an expert axis: the count must refuse it.
    x, weights, options = block_arguments("softmax", CONFIGS["shared"], jnp.bfloat16, jnp.bfloat16)
    arrays, total = kept_beyond_weights(composed_block(list(weights), options), x, weights)
    assert ((T * TOP_K, D), np.dtype(jnp.bfloat16)) in arrays
    assert ((1, D, FS), np.dtype(jnp.bfloat16)) in arrays
    assert total > BOUND * minimum_bytes(x, weights)
